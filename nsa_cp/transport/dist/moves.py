"""The torch.distributed path's movements (NCCL on GPUs, gloo on CPU); nsa_cp/transport/dist/provider.py picks one
per request and hands it to the planner.

Every gather is one *source stage* then one *movement*:

* source stage (``Source``, over the request's ``Stage``: nsa_cp/geometry/stage.py): what this rank contributes,
  written straight into its slot of the collective's buffer, padding rows included: a copy of ``x``, its
  quantization to a wire format, the fused add + RMSNorm, or both. One kernel on CUDA (nsa_cp.rows.kernels),
  the pure-torch reference on CPU (nsa_cp.rows.reference). A wire format produces two streams (FP8: ``q
  [rows, H]`` float8_e4m3fn carried as uint8, ``scale [rows, H/128]`` fp32, padding rows ``1e-10/448``,
  what quantizing a zero row gives); the others one.
* movement, chosen once per plan (``algo``; the gathers' table ``_MOVES``):
  - "even": every rank fills its slot; one equal-shard all-gather, in place. A plain copy of an even
    layout skips the source stage: one all-gather on the caller's tensor, bitwise the plain equal-shard
    collective (the even layout's contract).
  - "padded": the source stage writes this rank's slot of the padded output, then an in-place
    equal-shard all-gather. No F.pad, no temporary.
  - "padded+compact": the padded movement into a workspace, then one kernel compacts.
  - "coalesced": the source stage writes a local ``[n_r, ...]`` tensor, then torch's uneven-list
    all-gather (grouped broadcasts on NCCL) writes straight into views of the compact output.
  - ordered (``positions``): the compact result, then ``index_copy_`` into batch order. The plan hands
    over a permutation (nsa_cp's ordered_rows check), so every output row is written exactly once; the
    clamp below only keeps a direct caller's bad value inside the output.

Reduce-scatters: "even" (one ``reduce_scatter_tensor`` on the caller's tensor), "padded" (into an
``[M, ...]`` buffer, the result is a view of its first ``n_r`` rows; with nsa_cp's own NCCL
communicator, grouped reduces of each rank's real rows straight into the result), "padded+compact"
(expand, then padded), "coalesced" (grouped reduces straight from views of the compact input), ordered
(one ``index_select`` into rank-major order first); then optionally the fused add + RMSNorm on the
result.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Optional, Sequence, Tuple

import torch

from ...rows import reference
from ...geometry.wire import FP8_DTYPES
from ...geometry.layout import ShardLayout
from ...geometry.stage import Stage
from .agreement import agreement_for, checked as _checked
from .collectives import Collectives

__all__ = ["Source", "gather_runner", "scatter_runner"]


class Source:
    """What a rank contributes to a gather: its ``stage`` (nsa_cp/geometry/stage.py) and the result ``streams``
    ``(row shape, result dtype, dtype on the wire)``."""

    __slots__ = ("stage", "streams", "plain")

    def __init__(self, stage: Stage, row_shape: Tuple[int, ...], dtype: torch.dtype):
        self.stage = stage
        self.streams = stage.streams(row_shape, dtype)
        self.plain = not stage.norm and stage.fmt is None  # the rows themselves move

    def fill(self, slots: Sequence[torch.Tensor], x: torch.Tensor, n: int, count: Optional[torch.Tensor], norm_args,
             host_n: bool = False) -> None:
        """Write this rank's rows into ``slots`` (one ``[m, ...]`` tensor per stream, in the result dtype):
        rows ``[0, n)`` real, the rest padding. ``count``: the scalar tensor holding n when it is read
        on the device (CUDA; under CUDA graphs it may differ from the host's n) or given as device counts;
        None on CPU without device counts."""
        stage = self.stage
        if self.plain and x.dtype in FP8_DTYPES:  # a copy moves bits: fp8 as uint8
            x, slots = x.view(torch.uint8), [slots[0].view(torch.uint8)]
        if x.is_cuda and host_n and stage.norm and stage.fmt is None:  # n on the host: flashinfer's norm may serve
            _norm_rows(slots[0], x, n, norm_args)
        elif x.is_cuda:
            _fill_cuda(stage, slots, x, count, norm_args)
        else:  # device counts on CPU: read them (no device to keep them on)
            _fill_reference(stage, slots, x, n if count is None else int(count), norm_args)


def _fill_reference(stage: Stage, slots, x: torch.Tensor, n: int, norm_args) -> None:
    fmt = stage.fmt
    if fmt is None:
        if stage.norm:
            reference.fused_add_rmsnorm_into_slot(x, *norm_args, slots[0], n)
        else:
            reference.pack_into_slot(x[:n], slots[0])
    elif stage.norm:
        reference.fused_add_rmsnorm_quant_into_slot(x, *norm_args, slots[0], slots[1], n, fmt)
    else:
        reference.quant_into_slot(x, slots[0], slots[1], n, fmt)


def _norm_rows(slot: torch.Tensor, x: torch.Tensor, n: int, norm_args) -> None:
    """slot[:n] = add + RMSNorm of x's n rows (residual in place), slot[n:] = 0, with the local norm of
    nsa_cp.rows.norm (flashinfer where it suits: a cheaper launch than the Triton kernel's)."""
    from ...rows.norm import fused_add_rmsnorm_into

    if n:
        fused_add_rmsnorm_into(x, *norm_args, out=slot if n == slot.shape[0] else slot[:n])
    if slot.shape[0] > n:
        slot[n:].zero_()


def _fill_cuda(stage: Stage, slots, x: torch.Tensor, count: torch.Tensor, norm_args) -> None:
    fmt = stage.fmt
    if not stage.norm and fmt is None:
        from ...rows.kernels import pack

        pack.pack_into_slot(x, slots[0], count)
        return
    from ...rows.kernels import norm_rows as kernels  # the fused source stages: one Triton kernel each

    if not stage.norm:
        kernels.quant_into(x, slots[0], slots[1], count, fmt.name)
    elif fmt is None:
        kernels.fused_add_rmsnorm_into(x, *norm_args, slots[0], count)
    else:
        kernels.fused_add_rmsnorm_into(x, *norm_args, slots[0], count, quant=fmt.name, dst_scale=slots[1])


def _padded_to_compact(padded: torch.Tensor, layout: ShardLayout, compact: torch.Tensor) -> None:
    if padded.is_cuda:
        from ...rows.kernels import compact as kernels

        kernels.padded_to_compact(padded, layout, compact)
    else:
        reference.padded_to_compact(padded, layout, compact)


def _compact_to_padded(compact: torch.Tensor, layout: ShardLayout, padded: torch.Tensor) -> None:
    if compact.is_cuda:
        from ...rows.kernels import compact as kernels

        kernels.compact_to_padded(compact, layout, padded)
    else:
        reference.compact_to_padded(compact, layout, padded)


def _wire(t: torch.Tensor, wire: torch.dtype) -> torch.Tensor:
    return t if t.dtype == wire else t.view(wire)


def _rows(x: torch.Tensor, row_len: int) -> torch.Tensor:
    """``x [n, ...]`` as ``[n, row_len]`` with unit inner stride (a view where it can be)."""
    if x.dim() != 2:
        x = x.reshape(x.shape[0], row_len)
    return x if x.stride(1) == 1 or row_len <= 1 else x.contiguous()


# --------------------------------------------------------------------------- gathers
class _Gather:
    """One gather plan's fixed facts (bound once); its movements are the ``_MOVES`` below, each
    ``move(g) -> fn(x, bufs, device_counts, norm_args)`` writing the result rows into ``bufs`` (one per
    stream, the result's shape)."""

    def __init__(self, coll: Collectives, req, rank: int, source: Source):
        layout = self.layout = req.layout
        self.coll, self.rank, self.source, self.streams = coll, rank, source, source.streams
        self.m, self.n, self.size = layout.max_rank_len, layout.count(rank), layout.cp_size
        self.padded_len, self.total = layout.padded_len, layout.total_len
        # this rank's count on the device (read by the kernels, so CUDA graphs replay with new counts): once
        self.count0 = layout.device_tensors(req.device)[0][rank] if req.device.type == "cuda" else None
        self.row_len, self.pack, self.pack_gather = 0, None, None
        if source.plain and self.count0 is not None:  # the plain copy: one bound launch (with NCCL's: one call)
            shape, _, wire = self.streams[0]
            self.row_len = math.prod(shape)
            element_size = torch.empty((), dtype=wire).element_size()
            if coll.native is not None:
                self.pack_gather = coll.native.pack_gather_launcher(self.m, self.row_len * element_size, self.count0)
            else:
                from ...rows.kernels import pack as kernels

                self.pack = kernels.launcher(req.device, self.row_len, element_size, self.count0)

    def count(self, device_counts):
        return device_counts[0][self.rank] if device_counts is not None else self.count0

    def new(self, x, rows: int):
        return [x.new_empty((rows, *shape), dtype=dtype) for shape, dtype, _ in self.streams]


def _padded(g: _Gather):
    """The source stage into this rank's slot of each ``[P*M, ...]`` buffer, then in-place equal-shard gathers."""
    coll, streams, source, m, rank, n = g.coll, g.streams, g.source, g.m, g.rank, g.n
    pack, pack_gather, row_len, count = g.pack, g.pack_gather, g.row_len, g.count
    wire0 = streams[0][2]

    def move(x, bufs, device_counts, norm_args):
        if pack_gather is not None and device_counts is None:
            pack_gather(_rows(_wire(x, wire0), row_len), _wire(bufs[0], wire0))
            return
        slots = [b.narrow(0, rank * m, m) for b in bufs]
        if pack is not None and device_counts is None:
            slot = _wire(slots[0], wire0)
            pack(_rows(_wire(x, wire0), row_len), slot if slot.dim() == 2 else slot.view(m, row_len))
        else:
            source.fill(slots, x, n, count(device_counts), norm_args, host_n=device_counts is None)
        for (_, _, wire), buf, slot in zip(streams, bufs, slots):
            coll.all_gather_equal(_wire(buf, wire), _wire(slot, wire))
    return move


def _even_plain(g: _Gather):
    """The even layout's plain copy: one all-gather of the caller's tensor (bitwise torch's own)."""
    coll, wire = g.coll, g.streams[0][2]

    def move(x, bufs, device_counts, norm_args):
        coll.all_gather_equal(_wire(bufs[0], wire), _wire(x if x.is_contiguous() else x.contiguous(), wire))
    return move


def _coalesced(g: _Gather):
    """The source stage into a local ``[n_r, ...]``, then the uneven all-gather into the compact result."""
    coll, streams, source, n, count = g.coll, g.streams, g.source, g.n, g.count
    compact_rows = [g.layout.rows(q, compact=True) for q in range(g.size)]

    def move(x, bufs, device_counts, norm_args):
        if source.plain:  # the rows themselves move: no staging copy
            local = [x if x.is_contiguous() else x.contiguous()]
        else:
            local = g.new(x, n)
            if n:
                source.fill(local, x, n, count(device_counts), norm_args, host_n=True)
        for (_, _, wire), buf, mine in zip(streams, bufs, local):
            coll.all_gather_rows(_wire(buf, wire), _wire(mine, wire), compact_rows)
    return move


def _padded_then_compact(g: _Gather):
    """The padded movement into a workspace, then one kernel compacts."""
    padded, layout, streams, padded_len = _padded(g), g.layout, g.streams, g.padded_len

    def move(x, bufs, device_counts, norm_args):
        work = g.new(x, padded_len)
        padded(x, work, device_counts, norm_args)
        for (_, _, wire), w, buf in zip(streams, work, bufs):
            _padded_to_compact(_wire(w, wire), layout, _wire(buf, wire))
    return move


# algo -> the movement (plan._algo picks; "even" of a plain copy without device counts: _even_plain)
_MOVES = {"even": _padded, "padded": _padded, "coalesced": _coalesced, "padded+compact": _padded_then_compact}


def gather_runner(coll: Collectives, req, rank: int, source: Source, algo: str) -> Callable:
    """``run(x, outs, device_counts, positions, norm_args) -> [results]`` for the gather ``req`` (an
    nsa_cp.planning.request.Request): one result per stream, each ``[global_len or T, *row]``; ``outs`` (or None)
    are the caller's output tensors (checked)."""
    g = _Gather(coll, req, rank, source)
    rows = g.total if (req.compact or req.ordered) else g.padded_len
    # the result checked for the ranks' agreement (poisoned on a device-side mismatch): FP8's scales
    checked = functools.partial(_checked, agreement_for(coll, req, rank, g.size, algo), len(g.streams) - 1)
    if g.total == 0:
        def empty(x, outs, device_counts, positions, norm_args):
            return outs if outs is not None else g.new(x, rows)
        return checked(empty)
    even_plain = algo == "even" and source.plain and not req.has_device_counts
    move = (_even_plain if even_plain else _MOVES[algo])(g)
    if not req.ordered:
        def run(x, outs, device_counts, positions, norm_args):
            outs = outs if outs is not None else g.new(x, rows)
            move(x, outs, device_counts, norm_args)
            return outs
        return checked(run)
    streams, total = g.streams, g.total

    def run_ordered(x, outs, device_counts, positions, norm_args):
        outs = outs if outs is not None else g.new(x, rows)
        staged = g.new(x, total)
        move(x, staged, device_counts, norm_args)
        rows_ = positions.clamp(0, total - 1)  # a bad value lands inside the output, never outside
        for (_, _, wire), out, s in zip(streams, outs, staged):
            _wire(out, wire).index_copy_(0, rows_, _wire(s, wire))
        return outs
    return checked(run_ordered)



# --------------------------------------------------------------------------- reduce-scatters
def scatter_runner(coll: Collectives, req, rank: int, algo: str) -> Callable:
    """``run(y, out, device_counts, positions) -> [n_r, ...]`` for the reduce-scatter ``req`` (an
    nsa_cp.planning.request.Request; device_counts unused: padded rows past them are summed and ignored), a view of
    a private ``[M, ...]`` buffer on the padded uneven path without ``out``."""
    layout, compact, ordered = req.layout, req.compact, req.ordered
    m, n = layout.max_rank_len, layout.count(rank)
    total = layout.total_len
    checked = functools.partial(_checked, agreement_for(coll, req, rank, layout.cp_size, algo), None)

    def new_out(y, out):
        return out if out is not None else y.new_empty((n, *y.shape[1:]))

    if total == 0:
        def run(y, out, device_counts, positions):
            return new_out(y, out)
        return checked(run)

    if algo == "even":
        def reduce(y, out):
            out = new_out(y, out)
            coll.reduce_scatter_equal(out, y if y.is_contiguous() else y.contiguous())
            return out
    elif algo == "coalesced":
        compact_rows = [layout.rows(q, compact=True) for q in range(layout.cp_size)]

        def reduce(y, out):
            out = new_out(y, out)
            coll.reduce_scatter_rows(out, y if y.is_contiguous() else y.contiguous(), compact_rows)
            return out
    elif coll.native is not None and not (compact or ordered):
        # grouped reduces straight from each rank's real rows of the padded input into the result:
        # no [M, ...] slot, no copy out of it, no padding rows summed
        padded_rows = [(q * m, q * m + layout.count(q)) for q in range(layout.cp_size)]

        def reduce(y, out):
            out = new_out(y, out)
            coll.reduce_scatter_rows(out, y if y.is_contiguous() else y.contiguous(), padded_rows)
            return out
    else:
        def reduce(y, out):
            if compact or ordered:
                padded = y.new_empty((layout.padded_len, *y.shape[1:]))
                _compact_to_padded(y, layout, padded)
                y = padded
            slot = y.new_empty((m, *y.shape[1:]))
            coll.reduce_scatter_equal(slot, y if y.is_contiguous() else y.contiguous())
            if out is None:
                return slot[:n]
            out.copy_(slot[:n])
            return out

    if not ordered:
        def run(y, out, device_counts, positions):
            return reduce(y, out)
    else:
        def run(y, out, device_counts, positions):
            # batch order -> rank-major compact order, one gather of rows; then the compact path
            return reduce(y.index_select(0, positions.clamp(0, total - 1)), out)
    return checked(run)
