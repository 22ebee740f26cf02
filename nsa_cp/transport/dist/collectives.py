"""Moving bytes through torch.distributed (NCCL on GPUs, gloo on CPU).

``Collectives(group)`` is bound once per process group (the plan keeps it) and calls the process group's
own methods, ``_allgather_base`` / ``_reduce_scatter_base``, with option objects built once. That is the
collective ``dist.all_gather_into_tensor`` / ``reduce_scatter_tensor`` (torch 2.13: ``all_gather_single`` /
``reduce_scatter_single``) runs, without the Python around it: argument checks the plan already made,
the default-group lookup, torch-function dispatch and two decorators. Inside a coalescing manager
(``torch.distributed._coalescing_manager``) it defers to the public function, which records the call
instead. ``NSA_CP_NCCL_CALL=public`` makes every call take the public functions.

A plan of an uneven movement passes ``native``: the group's ``NativeNccl`` (nsa_cp/transport/
dist/nccl.py, made by ``nsa_cp.init_nccl``). Its calls then go to NCCL from C++, without c10d's op
around them; the even layout never gets one (torch's collective is its contract).

The uneven collectives (``all_gather_rows`` / ``reduce_scatter_rows``: grouped broadcasts / reduces
on NCCL) go through the public list functions without a native communicator.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as _c10d

from ... import envs

__all__ = ["Collectives"]

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Collectives:
    """The equal-shard and uneven collectives of one process group, bound once (per plan)."""

    def __init__(self, group: dist.ProcessGroup, native=None):
        self.group = group
        # (table, words): the agreement's fingerprint all-gather, to go in the same NCCL group as the next
        # equal-shard collective (nsa_cp/transport/dist/agreement.py); taken by it
        self.rider = None
        self.native = native if envs.NSA_CP_NCCL_CALL == "auto" else None
        self._gather_opts = _c10d.AllgatherOptions()
        self._scatter_opts = _c10d.ReduceScatterOptions()
        self._scatter_opts.reduceOp = dist.ReduceOp.SUM
        # as the public functions with async_op=False: NCCL then runs on the current stream, with no
        # event handshake with its internal stream (less host work per call)
        for opts in (self._gather_opts, self._scatter_opts):
            if hasattr(opts, "asyncOp"):
                opts.asyncOp = False
        self._direct = (
            hasattr(group, "_allgather_base") and hasattr(group, "_reduce_scatter_base")
            and envs.NSA_CP_NCCL_CALL != "public"
        )

    def _coalescing(self) -> bool:
        return self.group in _c10d._world.pg_coalesce_state

    def all_gather_equal(self, out: torch.Tensor, shard: torch.Tensor) -> None:
        """Equal-shard all-gather of ``shard [m, ...]`` into ``out [P*m, ...]``; ``shard`` may be ``out``'s
        own slot (in place)."""
        self._equal(out, shard, gather=True)

    def reduce_scatter_equal(self, out: torch.Tensor, full: torch.Tensor) -> None:
        """Sum ``full [P*m, ...]`` over ranks; this rank's ``[m, ...]`` chunk lands in ``out``."""
        self._equal(out, full, gather=False)

    def _equal(self, out: torch.Tensor, inp: torch.Tensor, gather: bool) -> None:
        """One equal-shard collective (all-gather or reduce-scatter), by the first route that serves: with
        the rider, both in one NCCL group; the native communicator; the process group's own method; inside
        a coalescing manager (or with ``NSA_CP_NCCL_CALL=public``), the public function."""
        if self.rider is not None:
            self._grouped(out, inp, gather)
            return
        if not self._coalescing():
            if self.native is not None:
                (self.native.all_gather if gather else self.native.reduce_scatter)(out, inp)
                return
            if self._direct:
                work = self._base(out, inp, gather)
                if work is not None:
                    work.wait()
                return
        (_all_gather_single if gather else _reduce_scatter_single)(out, inp, group=self.group)

    def _base(self, out: torch.Tensor, inp: torch.Tensor, gather: bool):
        """The process group's own collective (its work, or None)."""
        if gather:
            return self.group._allgather_base(out, inp, self._gather_opts)
        return self.group._reduce_scatter_base(out, inp, self._scatter_opts)

    def _grouped(self, out: torch.Tensor, inp: torch.Tensor, gather: bool) -> None:
        """The rider's all-gather and this equal-shard collective in one NCCL group (one launch), through
        the process group's coalescing (what ``torch.distributed._coalescing_manager`` does for mixed ops)."""
        (table, words), self.rider = self.rider, None
        pg = self.group
        if not hasattr(pg, "_start_coalescing") or self._coalescing():
            self.all_gather_equal(table, words)  # no group to join: the words go just before
            self._equal(out, inp, gather)
            return
        pg._start_coalescing(out.device)
        try:
            pg._allgather_base(table, words, self._gather_opts)
            self._base(out, inp, gather)
        finally:
            work = pg._end_coalescing(out.device)
        if work is not None:
            work.wait()

    def all_gather_rows(self, out: torch.Tensor, shard: torch.Tensor, rows) -> None:
        """Uneven all-gather into ``out [T, ...]`` (contiguous): rank q's rows land at rows
        ``rows[q] = (start, stop)``; ``shard [n_r, ...]`` (contiguous) holds this rank's. Native: grouped
        broadcasts in one host call; else torch's uneven-list all-gather (grouped broadcasts on NCCL)
        into views of ``out``."""
        if self.native is not None and not self._coalescing():
            row_bytes = out.numel() // out.shape[0] * out.element_size() if out.shape[0] else 0
            counts = [(stop - start) * row_bytes for start, stop in rows]
            self.native.all_gather_rows(out, shard, counts, [start * row_bytes for start, _ in rows], row_bytes)
            return
        dist.all_gather([out[start:stop] for start, stop in rows], shard, group=self.group)

    def reduce_scatter_rows(self, out: torch.Tensor, full: torch.Tensor, rows) -> None:
        """Uneven reduce-scatter: ``out [n_r, ...]`` <- the sum over ranks of rows ``rows[rank]`` of their
        ``full [T, ...]`` (contiguous). Native: grouped reduces in one host call; else torch's
        uneven-list reduce-scatter (grouped reduces, rank q the root of its rows)."""
        if self.native is not None and not self._coalescing():
            row_len = full.numel() // full.shape[0] if full.shape[0] else 0
            counts = [(stop - start) * row_len for start, stop in rows]
            self.native.reduce_scatter_rows(out, full, counts, [start * row_len for start, _ in rows])
            return
        dist.reduce_scatter(out, [full[start:stop] for start, stop in rows], group=self.group)
