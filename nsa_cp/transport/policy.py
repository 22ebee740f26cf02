"""The one transport-creation policy: which transport a CP group gets, decided once, collectively.

:func:`ensure_transport` is what the communicator and both engine plugins call (``NSACPLayerCommunicator``
with ``p2p_max_tokens_per_rank``; ``integrations.core.create_transport`` for SGLang's scheduler and vLLM's
worker): keep a registered P2P transport that fits the sizes; else create one where P2P can serve the group
(one node, ``nsa_cp._C``, CUDA), unless P2P is switched off; else, where asked (``nccl=True``), nsa_cp's NCCL
communicator where the group can take one. Every rank of the group calls it and reaches the same decision.

The decision is a dict (:func:`transport_decision`): ``on`` (P2P is on), ``bytes`` (its workspace on this GPU),
``max_tokens_per_rank``, ``reason`` (why P2P is not on), ``nccl`` (what the NCCL path is).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .dist.nccl import init_nccl, nccl_unavailable_reason
from .p2p import get_p2p, init_p2p, p2p_unavailable_reason

__all__ = ["ensure_transport", "transport_decision", "fits"]


def transport_decision(*, on: bool = False, bytes: Optional[int] = None, max_tokens_per_rank: Optional[int] = None,
                       reason: Optional[str] = None, nccl: Optional[str] = None) -> dict:
    """A group's transport decision (also what the engine plugins' ``status()["p2p"]`` reports)."""
    return {"on": on, "bytes": bytes, "max_tokens_per_rank": max_tokens_per_rank, "reason": reason, "nccl": nccl}


def fits(transport, max_tokens_per_rank: int, hidden_size: int, dtype: torch.dtype) -> bool:
    """Whether a registered P2P transport serves rows of these sizes (a larger one serves smaller batches)."""
    return transport is not None and transport.max_tokens_per_rank >= max_tokens_per_rank \
        and transport.hidden_size == hidden_size and transport.dtype == dtype


def ensure_transport(group: Optional[dist.ProcessGroup], max_tokens_per_rank: int, hidden_size: int,
                     dtype: torch.dtype, device=None, *, p2p: bool = True, insist: bool = False, nccl: bool = False,
                     off_reason: str = "P2P off", workspace_bytes: Optional[int] = None) -> dict:
    """Collective: ``group``'s transport for rows of ``hidden_size`` ``dtype`` elements, up to
    ``max_tokens_per_rank`` a rank (module docstring). ``p2p=False``: no P2P, ``off_reason`` recorded;
    ``insist``: create P2P without asking whether it can serve (its creation raises where it cannot);
    ``nccl``: where P2P is not on, create nsa_cp's NCCL communicator where the group can take one."""
    existing = get_p2p(group) if p2p else None
    reason = None
    if not fits(existing, max_tokens_per_rank, hidden_size, dtype):
        reason = off_reason if not p2p else (None if insist else p2p_unavailable_reason(group, device))
        if reason is None:
            existing = init_p2p(group, max_tokens_per_rank, hidden_size, dtype, device,
                                workspace_bytes=workspace_bytes)
    if reason is None:
        return transport_decision(on=True, bytes=existing.workspace_bytes,
                                  max_tokens_per_rank=existing.max_tokens_per_rank)
    decision = transport_decision(reason=reason, max_tokens_per_rank=int(max_tokens_per_rank))
    if nccl:
        nccl_reason = nccl_unavailable_reason(group) if torch.cuda.is_available() else "no CUDA device"
        if nccl_reason is None:
            init_nccl(group, device)
            decision["nccl"] = "nsa_cp's NCCL communicator"
        else:
            decision["nccl"] = f"torch's process group ({nccl_reason})"
    return decision
