"""One P2P transport per process group: ``init_p2p`` creates and registers it, ``get_p2p`` finds it,
``destroy_p2p`` releases it; ``PROVIDER`` hands the planner a group's transport (the P2P row of
nsa_cp/transports.py) and owns that lifecycle for the creation policy (nsa_cp/transport/base.py's
``Lifecycle``: a transport that fits the sizes is kept, else one is made for them).

``generation`` is ``nsa_cp.transport.groups.latest_generation``, the one generation of every group
registry (the plan-cache key): ``init_p2p`` and ``destroy_p2p`` change it.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.distributed as dist

from ...support import Support
from ..base import Sizes
from ..groups import GroupRegistry, latest_generation
from .memory import p2p_unavailable_reason
from .transport import P2PTransport

__all__ = ["init_p2p", "get_p2p", "destroy_p2p", "any_registered", "generation", "P2PProvider", "PROVIDER"]

_REGISTRY = GroupRegistry()
generation = latest_generation  # one generation for every registry (the plan-cache key)


def init_p2p(
    group: Optional[dist.ProcessGroup],
    max_tokens_per_rank: int,
    hidden_size: int,
    dtype: torch.dtype = torch.bfloat16,
    device=None,
    *,
    timeout_ms: Optional[int] = None,
    workspace_bytes: Optional[int] = None,
    double_buffer_tokens: Optional[int] = None,
) -> P2PTransport:
    """Create (collectively, on every rank of ``group``) and register the P2P transport of ``group``.

    Afterwards ``cp_all_gather`` / ``cp_reduce_scatter`` with ``backend="auto"`` use it for uneven
    layouts that fit. Creating it again for the same group replaces the old one.
    """
    transport = P2PTransport(
        group, max_tokens_per_rank, hidden_size, dtype, device, timeout_ms=timeout_ms,
        workspace_bytes=workspace_bytes, double_buffer_tokens=double_buffer_tokens,
    )
    old = _REGISTRY.put(group, transport)
    if old is not None:
        old.close()
    return transport


def any_registered() -> bool:
    return bool(_REGISTRY)


def get_p2p(group: Optional[dist.ProcessGroup]) -> Optional[P2PTransport]:
    """The registered transport of ``group``, or None."""
    return _REGISTRY.get(group)


def destroy_p2p(group: Optional[dist.ProcessGroup] = None) -> None:
    """Unregister and release the transport of ``group`` (no-op when there is none; the generation
    changes either way)."""
    transport = _REGISTRY.pop(group)
    if transport is not None:
        transport.close()


_MISSING = Support.no("'p2p' needs nsa_cp.init_p2p(group, max_tokens_per_rank, hidden_size, dtype) first")
# Said instead of _MISSING for tensors no init_p2p call can help (a registered transport judges its own).
_NOT_CUDA = ("'p2p' cannot serve {device} tensors: the P2P transport moves rows between GPUs' memory with "
             "nsa_cp._C's CUDA kernels (peer access over NVLink or PCIe), so it needs CUDA tensors on GPUs of one "
             "node; on CPU use backend='nccl' (the process group's collectives, gloo) or 'auto'")


class P2PProvider:
    """The group's P2P transport, where ``init_p2p`` made one (the transport is the planner's Transport),
    and its lifecycle (``init_p2p`` / ``get_p2p`` / ``destroy_p2p`` / ``p2p_unavailable_reason``)."""

    name = "p2p"

    def unavailable_reason(self, group, device=None) -> Optional[str]:
        return p2p_unavailable_reason(group, device)  # collective: one verdict for the group

    def current(self, group) -> Optional[P2PTransport]:
        return get_p2p(group)

    def fits(self, transport: P2PTransport, sizes: Sizes) -> bool:
        """A larger transport serves smaller batches; the row's elements and dtype must be its own."""
        return transport.max_tokens_per_rank >= sizes.max_tokens_per_rank \
            and transport.hidden_size == sizes.hidden_size and transport.dtype == sizes.dtype

    def create(self, group, sizes: Sizes) -> P2PTransport:
        return init_p2p(group, sizes.max_tokens_per_rank, sizes.hidden_size, sizes.dtype, sizes.device,
                        workspace_bytes=sizes.workspace_bytes)

    def close(self, group) -> None:
        destroy_p2p(group)

    def describe(self, transport: Optional[P2PTransport], reason: Optional[str] = None) -> dict:
        if transport is None:
            return {}
        return {"bytes": transport.workspace_bytes, "max_tokens_per_rank": transport.max_tokens_per_rank}

    def open(self, req, group) -> Union[P2PTransport, Support]:
        transport = get_p2p(req.group) if any_registered() else None
        if transport is None and req.device is not None and req.device.type != "cuda":
            return Support.no(_NOT_CUDA.format(device=req.device.type))
        return _MISSING if transport is None else transport


PROVIDER = P2PProvider()  # its row in nsa_cp/transports.py
