"""The one transport-creation policy: which transport a CP group gets, decided once, collectively.

:func:`ensure_transport` is what the communicator and both engine plugins call (``NSACPLayerCommunicator``
with ``p2p_max_tokens_per_rank``; the plugins' transport setup for SGLang's scheduler and vLLM's worker). It
names no transport: it asks the providers in the planner's order (nsa_cp/transport/base.py: the registered
ones, then the rows of nsa_cp/transports.py) that own a lifecycle (``base.Lifecycle``):

* every such row but the one that serves every call holds rows of its own (P2P's buffers): the first that
  already has a transport for the group that fits the sizes keeps it; else the first that can serve the
  group (its ``unavailable_reason`` is None) creates one. ``create=False`` (an engine's off switch) asks
  none of them, and records ``off_reason``;
* where none is on and ``communicator`` is asked for (the engine plugins), the row that serves every call
  (torch.distributed) creates its own communicator where it can (nsa_cp's NCCL communicator).

Every rank of the group calls it, in the same order, and reaches the same decision (each verdict is one
for the group). The decision is a dict (:func:`transport_decision`): ``on`` (a transport with buffers of its
own serves the group), ``transport`` (its row's name), ``bytes`` (its workspace on this GPU),
``max_tokens_per_rank``, ``reason`` (why none is on), ``nccl`` (what the torch.distributed path runs
through, where ``communicator`` was asked for).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from . import base
from .base import Sizes

__all__ = ["ensure_transport", "transport_decision", "current", "holds_rows", "capacity", "close_transports", "Sizes"]


def transport_decision(*, on: bool = False, transport: Optional[str] = None, bytes: Optional[int] = None,
                       max_tokens_per_rank: Optional[int] = None, reason: Optional[str] = None,
                       nccl: Optional[str] = None) -> dict:
    """A group's transport decision (also what the engine plugins' ``status()["p2p"]`` reports)."""
    return {"on": on, "transport": transport, "bytes": bytes, "max_tokens_per_rank": max_tokens_per_rank,
            "reason": reason, "nccl": nccl}


def _sized() -> List[Tuple[str, base.Lifecycle]]:
    """The rows with a lifecycle that hold rows of their own, in order (the fallback row excluded)."""
    fallback = base.fallback()
    return [(p.name, life) for p in base.providers() if p is not fallback
            for life in (base.lifecycle(p),) if life is not None]


def current(group: Optional[dist.ProcessGroup]) -> Optional[Tuple[str, object, dict]]:
    """``(name, transport, described)``: the group's transport with buffers of its own (the first row that has
    one; ``described``: its lifecycle's ``describe``), or None."""
    for name, life in _sized():
        transport = life.current(group)
        if transport is not None:
            return name, transport, life.describe(transport)
    return None


def holds_rows(group: Optional[dist.ProcessGroup]) -> bool:
    """Whether a transport with buffers of its own serves ``group`` (a gather's result may live in them)."""
    return current(group) is not None


def capacity(group: Optional[dist.ProcessGroup]) -> Optional[int]:
    """The rows per rank the group's transport with buffers of its own serves, or None where there is none."""
    found = current(group)
    return None if found is None else found[2].get("max_tokens_per_rank")


def close_transports(group: Optional[dist.ProcessGroup] = None) -> None:
    """Collective: close every transport the lifecycles made for ``group`` (the fallback's communicator last)."""
    for name, life in _sized():
        life.close(group)
    fallback = base.lifecycle(base.fallback())
    if fallback is not None:
        fallback.close(group)


def ensure_transport(group: Optional[dist.ProcessGroup], max_tokens_per_rank: int, hidden_size: int,
                     dtype: torch.dtype, device=None, *, create: bool = True, insist: Optional[str] = None,
                     communicator: bool = False, off_reason: str = "off",
                     workspace_bytes: Optional[int] = None) -> dict:
    """Collective: ``group``'s transport for rows of ``hidden_size`` ``dtype`` elements, up to
    ``max_tokens_per_rank`` a rank (module docstring). ``create=False``: none with buffers of its own,
    ``off_reason`` recorded; ``insist``: a row's name (``backend=``): where it is one with buffers of its
    own, only it is asked, and it is created without asking whether it can serve (its creation raises where
    it cannot); ``communicator``: where none is on, the fallback row's communicator too."""
    sizes = Sizes(int(max_tokens_per_rank), int(hidden_size), dtype, device, workspace_bytes)
    rows = _sized()
    if insist is not None and any(name == insist for name, _ in rows):
        rows = [(name, life) for name, life in rows if name == insist]
    else:
        insist = None
    reasons = []
    if not create:
        reasons.append(off_reason)
    else:
        for name, life in rows:  # one that exists and fits is kept before any is made
            transport = life.current(group)
            if transport is not None and life.fits(transport, sizes):
                return transport_decision(on=True, transport=name, **life.describe(transport))
        for name, life in rows:
            reason = None if insist else life.unavailable_reason(group, device)
            if reason is None:
                transport = life.create(group, sizes)
                return transport_decision(on=True, transport=name, **life.describe(transport))
            reasons.append(reason if len(rows) == 1 else f"{name}: {reason}")
    decision = transport_decision(reason="; ".join(reasons) or "no transport of the table makes one",
                                  max_tokens_per_rank=sizes.max_tokens_per_rank)
    fallback = base.lifecycle(base.fallback())
    if communicator and fallback is not None:
        comm = fallback.current(group)
        reason = None
        if comm is None or not fallback.fits(comm, sizes):
            reason = fallback.unavailable_reason(group, device)
            comm = fallback.create(group, sizes) if reason is None else None
        decision.update(fallback.describe(comm, reason))
    return decision
