"""The transport seam: what the planner asks of a transport, and the ordered list it asks.

A *transport* moves one process group's rows for the calls it accepts. The planner (nsa_cp/plan.py) asks
the registered transports in order for a request and takes the first whose verdict is yes; the
torch.distributed transport (NCCL / gloo, nsa_cp/transport/dist.py) is last and serves every call. A
verdict's reason feeds the fallback log and, when the caller insisted on that transport with
``backend=<name>``, the ValueError.

Registering one (a module of its own, then one line)::

    nsa_cp.transport.register(MyTransports())      # asked before the others; unregister(name) removes it

where ``MyTransports`` has a ``name`` (what ``backend=`` insists on) and ``open(req, group)`` returning the
group's ``Transport`` (or a ``Support.no`` saying why there is none). Registering or unregistering
drops every cached plan (the registry generation).
"""

from __future__ import annotations

from typing import Callable, List, NamedTuple, Protocol, Union

import torch

from ..support import Support
from . import registry

__all__ = ["Transport", "Provider", "Route", "register", "unregister", "providers", "names"]


class Route(NamedTuple):
    """What a transport hands the planner for one request.

    ``run``: a gather's ``run(x, outs, device_counts, positions, norm_args) -> tuple of results`` (one per
    result stream; ``outs`` the caller's tensors or None), a reduce-scatter's ``run(y, out, device_counts,
    positions) -> [n_r, ...]`` or, when ``norm`` is True, ``run(y, out, device_counts, positions, norm_args)
    -> (normed, residual)``; ``backend`` and ``algo``: the plan's signature words; ``norm``: whether the run
    includes the request's add + RMSNorm (False: the planner runs the norm itself)."""

    run: Callable
    backend: str
    algo: str
    norm: bool = False


class Transport(Protocol):
    """One process group's transport. ``stage``: the gather's source stage (nsa_cp/stage.py), or for a
    reduce-scatter whether it ends with the add + RMSNorm (``stage.norm``)."""

    def support(self, req, stage) -> Support:
        """Whether this transport serves ``req`` (an nsa_cp.request.Request) with ``stage``; a no says why."""

    def gather(self, req, stage) -> Route:
        """The gather's route (called after a yes)."""

    def scatter(self, req, stage) -> Route:
        """The reduce-scatter's route; ``stage.norm``: fuse the add + RMSNorm where it can (Route.norm)."""

    def buffer(self, req) -> torch.Tensor:
        """Where the reduce-scatter of ``req`` wants its partials ``[rows, *row]`` (a fresh tensor where any
        tensor serves)."""


class Provider(Protocol):
    """A registered kind of transport: ``name`` (what ``backend=`` insists on) and ``open(req, group)``:
    the group's Transport for ``req``, or a ``Support.no`` saying why there is none."""

    name: str

    def open(self, req, group) -> Union[Transport, Support]:
        ...


_PROVIDERS: List[Provider] = []


def register(provider: Provider, *, last: bool = False) -> None:
    """Ask ``provider`` before the registered ones (``last``: after them; the torch.distributed transport
    registers so, and stays last). A provider of the same name is replaced."""
    if not isinstance(getattr(provider, "name", None), str) or not callable(getattr(provider, "open", None)):
        raise ValueError(f"provider: expected an object with a str 'name' and an 'open(req, group)' method, got "
                         f"{provider!r}")
    unregister(provider.name)
    _PROVIDERS.insert(len(_PROVIDERS) if last else 0, provider)


def unregister(name: str) -> None:
    """Remove the provider named ``name`` (nothing when there is none)."""
    _PROVIDERS[:] = [p for p in _PROVIDERS if p.name != name]
    registry.advance()


def providers() -> List[Provider]:
    """The providers in the order the planner asks them (the torch.distributed transport last)."""
    return list(_PROVIDERS)


def names() -> tuple:
    """What ``backend=`` accepts: "auto" and every provider's name."""
    return ("auto", *sorted(p.name for p in _PROVIDERS))
