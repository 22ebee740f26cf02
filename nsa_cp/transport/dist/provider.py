"""The torch.distributed transport: NCCL on GPUs (with the group's native NCCL communicator where
``init_nccl`` made one), gloo on CPU. It serves every call, so the planner asks it last.

Its movements (even, padded, padded+compact, coalesced, ordered) are nsa_cp/transport/dist/moves.py's;
this module picks one per request (``algo``) and binds it to the group's ``Collectives``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ... import envs
from ...support import Support
from . import moves, pipeline, nccl
from .collectives import Collectives
from ..base import Route

__all__ = ["DistTransport", "DistProvider"]


def _algo(req, min_bytes: int) -> str:
    """The movement: even, padded, padded+compact or coalesced (nsa_cp/transport/dist/moves.py)."""
    layout = req.layout
    if layout.is_even and not req.has_device_counts:
        return "even"
    if not (req.compact or req.ordered):
        return "padded"
    algo = envs.NSA_CP_COMPACT_ALGO if req.algo == "auto" else req.algo
    if req.device.type != "cuda":
        return "padded+compact"  # gloo has no uneven-list collectives
    if algo == "auto":
        slot_bytes = layout.max_rank_len * math.prod(req.row_shape) * req.dtype.itemsize
        algo = "coalesced" if slot_bytes >= min_bytes else "padded"
    return "coalesced" if algo == "coalesced" else "padded+compact"


class DistTransport:
    """The torch.distributed transport of one process group (nsa_cp/transport/base.py's protocol)."""

    def __init__(self, group):
        self.group = group

    def serves(self, req, stage) -> Support:
        return Support.yes()

    def _collectives(self, req, algo: str):
        """``(Collectives, backend word)``: with the group's native NCCL communicator for an uneven movement
        on its device; the even movement always keeps torch's collective (the contract)."""
        native = nccl.get_nccl(self.group) if req.device.type == "cuda" and algo != "even" else None
        if native is not None and (native.device != req.device or native.closed):
            native = None
        coll = Collectives(self.group, native)
        backend = "nccl+native" if coll.native is not None else ("nccl" if req.device.type == "cuda" else "gloo")
        return coll, backend

    def gather(self, req, stage) -> Route:
        algo = _algo(req, envs.NSA_CP_COALESCED_GATHER_MIN_BYTES)
        coll, backend = self._collectives(req, algo)
        source = moves.Source(stage, tuple(req.row_shape), req.dtype)
        return Route(moves.gather_runner(coll, req, self.group.rank(), source, algo), backend, algo, stage.norm)

    def scatter(self, req, stage) -> Route:
        algo = _algo(req, envs.NSA_CP_COALESCED_SCATTER_MIN_BYTES)
        coll, backend = self._collectives(req, algo)
        return Route(moves.scatter_runner(coll, req, self.group.rank(), algo), backend, algo, False)

    def buffer(self, req) -> torch.Tensor:
        return torch.empty((req.result_rows, *req.row_shape), dtype=req.dtype, device=req.device)

    def serves_overlap(self, req) -> Support:
        return Support.yes()

    def overlap(self, req):
        """``(start, mechanism)``: ``start(x, timeout_ms)`` posts every chunk's rows and returns the
        :class:`~nsa_cp.transport.dist.pipeline.DistPipeline` (nsa_cp/planning/overlap.py's contract)."""
        call, group, rank = req.call, self.group, self.group.rank()

        def start(x, timeout_ms):
            return pipeline.DistPipeline(x, call.layout, rank, group, quant=call.quant,
                                              out_row_shape=req.out_row_shape, out_dtype=req.out_dtype,
                                              timeout_ms=timeout_ms, chunk_rows=req.chunk_rows,
                                              fields=None if envs.NSA_CP_AGREEMENT == "off" else req.fields())

        return start, pipeline.MECHANISM


class DistProvider:
    """Every group has one: torch.distributed serves every call (nsa_cp/transports.py: its row is asked last).

    Its lifecycle (nsa_cp/transport/base.py's ``Lifecycle``) is nsa_cp's own NCCL communicator for the
    group (``dist/nccl.py``: ``init_nccl`` / ``get_nccl`` / ``destroy_nccl``), which the uneven movements
    take where it exists; it holds no rows, so any live one fits."""

    name = "nccl"

    def open(self, req, group):
        return DistTransport(group)

    def unavailable_reason(self, group, device=None) -> Optional[str]:
        if not torch.cuda.is_available():
            return "no CUDA device"
        return nccl.nccl_unavailable_reason(group)

    def current(self, group):
        return nccl.get_nccl(group)

    def fits(self, comm, sizes) -> bool:
        return not comm.closed and (sizes.device is None or comm.device == torch.device(sizes.device))

    def create(self, group, sizes):
        return nccl.init_nccl(group, sizes.device)

    def close(self, group) -> None:
        nccl.destroy_nccl(group)

    def describe(self, comm, reason: Optional[str] = None) -> dict:
        """``nccl``: what the torch.distributed path's uneven calls run through."""
        return {"nccl": "nsa_cp's NCCL communicator" if comm is not None else f"torch's process group ({reason})"}


PROVIDER = DistProvider()  # its row in nsa_cp/transports.py
