"""The transport seam: what the planner asks of a transport, and the ordered list it asks.

A *transport* moves one process group's rows for the calls it accepts. nsa_cp's transports are the rows of
a static table (nsa_cp/transports.py: name, provider module); the planner (nsa_cp/planning/plan.py) asks their
providers in order for a request and takes the first whose verdict is yes; the torch.distributed
transport (NCCL / gloo, nsa_cp/transport/dist/provider.py) is last and serves every call. A verdict's reason feeds
the fallback log and, when the caller insisted on that transport with ``backend=<name>``, the ValueError.

A provider has a ``name`` (what ``backend=`` insists on) and ``open(req, group)`` returning the group's
``Transport`` (or a ``Support.no`` saying why there is none). A provider that makes its transport (P2P's
buffers, nsa_cp's NCCL communicator) also owns that lifecycle (:class:`Lifecycle`: can it serve a group and
why not, create collectively for given :class:`Sizes`, fit, the current one, close); the one creation
policy (nsa_cp/transport/policy.py) asks the rows that have one, in order, and names none. A new transport
of nsa_cp's is a module and a row of the table; code outside nsa_cp may add one at run time::

    nsa_cp.transport.register(MyTransports())      # asked before the others; unregister(name) removes it

Registering or unregistering drops every cached plan (the group registries' generation, nsa_cp/transport/groups.py).
"""

from __future__ import annotations

import importlib
from typing import Callable, Dict, List, NamedTuple, Optional, Protocol, Union

import torch

from .. import transports
from ..support import Support
from ..transports import TransportRow
from . import groups

__all__ = ["Transport", "Provider", "Lifecycle", "Sizes", "Route", "register", "unregister", "providers", "fallback",
           "lifecycle", "names"]


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
    """One process group's transport. ``stage``: the gather's source stage (nsa_cp/geometry/stage.py), or for a
    reduce-scatter whether it ends with the add + RMSNorm (``stage.norm``)."""

    def serves(self, req, stage) -> Support:
        """Whether this transport serves ``req`` (an nsa_cp.planning.request.Request) with ``stage``; a no says why."""

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


class Sizes(NamedTuple):
    """What a transport is created for: up to ``max_tokens_per_rank`` rows a rank of ``hidden_size``
    ``dtype`` elements, on this rank's ``device`` (None: the current one), within ``workspace_bytes`` (None:
    no budget; a transport that needs more says so in its log)."""

    max_tokens_per_rank: int
    hidden_size: int
    dtype: torch.dtype
    device: Optional[torch.device] = None
    workspace_bytes: Optional[int] = None


class Lifecycle(Protocol):
    """The optional half of a provider: one transport object per process group, made by the provider.

    Every method but ``current`` / ``fits`` / ``describe`` is collective over ``group``: every rank calls
    it, in the same order, and every rank gets the same answer (a verdict reads values that agree across
    ranks, or exchanges them)."""

    def unavailable_reason(self, group, device=None) -> Optional[str]:
        """None where ``create`` can work for ``group`` here, else why not (a sentence)."""

    def current(self, group):
        """The group's transport this provider made, or None."""

    def fits(self, transport, sizes: Sizes) -> bool:
        """Whether ``transport`` (this provider's) serves rows of ``sizes``: kept instead of made again."""

    def create(self, group, sizes: Sizes):
        """Make (or remake, closing the old one) and register the group's transport for ``sizes``."""

    def close(self, group) -> None:
        """Unregister and release the group's transport (nothing when there is none)."""

    def describe(self, transport, reason: Optional[str] = None) -> dict:
        """What the creation decision reports of ``transport`` (None: there is none, ``reason`` says why):
        for a transport with buffers of its own ``bytes`` and ``max_tokens_per_rank``; for the row that
        serves every call, ``nccl`` (what its path runs through). nsa_cp/transport/policy.py says the keys."""


def lifecycle(provider: Provider) -> Optional[Lifecycle]:
    """``provider`` as a :class:`Lifecycle`, or None where it has none (it only opens what exists)."""
    needed = ("unavailable_reason", "current", "fits", "create", "close", "describe")
    return provider if all(callable(getattr(provider, name, None)) for name in needed) else None


_REGISTERED: List[Provider] = []  # providers registered at run time: asked before the table's
_TABLE: Dict[TransportRow, Provider] = {}  # the table's providers, imported when first asked


def _table_provider(row: TransportRow) -> Provider:
    provider = _TABLE.get(row)
    if provider is None:
        provider = _TABLE[row] = getattr(importlib.import_module(row.module), row.provider)
        if provider.name != row.name:
            raise ValueError(f"nsa_cp.transports: the row {row.name!r} names {row.module}.{row.provider}, whose name "
                             f"is {provider.name!r}")
    return provider


def register(provider: Provider) -> None:
    """Ask ``provider`` before the others (a run-time addition; nsa_cp's own transports are the rows of
    nsa_cp/transports.py). A provider of the same name is replaced."""
    if not isinstance(getattr(provider, "name", None), str) or not callable(getattr(provider, "open", None)):
        raise ValueError(f"provider: expected an object with a str 'name' and an 'open(req, group)' method, got "
                         f"{provider!r}")
    unregister(provider.name)
    _REGISTERED.insert(0, provider)


def unregister(name: str) -> None:
    """Remove the run-time provider named ``name`` (nothing when there is none)."""
    _REGISTERED[:] = [p for p in _REGISTERED if p.name != name]
    groups.advance()


def providers() -> List[Provider]:
    """The providers in the order the planner asks them: the registered ones, then the table's rows (the one
    that serves every call last)."""
    rows = sorted(transports.TRANSPORTS, key=lambda row: row.serves_every_call)
    return [*_REGISTERED, *(_table_provider(row) for row in rows)]


def fallback() -> Provider:
    """The provider of the row that serves every call (torch.distributed)."""
    return _table_provider(next(row for row in transports.TRANSPORTS if row.serves_every_call))


def names() -> tuple:
    """What ``backend=`` accepts: "auto" and every provider's name."""
    return ("auto", *sorted({*transports.names(), *(p.name for p in _REGISTERED)}))
