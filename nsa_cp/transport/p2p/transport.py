"""``P2PTransport``: the intranode P2P transport's support verdicts and the runners the plan calls.

Contract. ``support(...)`` says once whether a call can be served (a ``Support``; a ``no`` says what to
change). A runner is built once per (layout, compact, row shape, options) and trusts its caller (shapes,
dtype and device checked by the plan): a call takes a few pointers and the current raw stream, makes
ONE call into the native ``P2PState`` (which picks the double buffer) and returns a view built with
the runner. Per-call tensors (``device_counts`` for CUDA graphs, ``positions``) are arguments, never
baked in. A launch refused because the error record is set raises P2PError / P2PTimeoutError /
LayoutMismatchError (``errors``), and the transport stays unusable. Results are ordered on the calling
stream (docs/streams_and_graphs.md). It is the planner's Transport itself (``serves``, ``gather``,
``scatter``, ``buffer`` from its base ``routes.P2PRoutes``: the planner's runners are built ``checked=True``,
after the one verdict); the copy engine's gather is ``copy_engine.py`` (docs/design.md, "The P2P transport").
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ...rows import _native
from ...geometry.layout import ShardLayout
from ...support import Support
from ...geometry.wire import FORMATS, native_mismatch
from . import copy_engine
from .buffers import P2PBuffers, dtype_codes
from .errors import error_from_record
from .routes import P2PRoutes

__all__ = ["P2PTransport"]

_NORM_MAX_WORDS = 4 * 512  # 16-byte words of one row the norm stage holds (csrc: 4 per thread, 512 threads)
_VIEW_CACHE_LIMIT = 256


class P2PTransport(P2PRoutes):
    """Peer-mapped buffers of one CP group (symmetric memory or CUDA IPC), their native state, and the
    runners that move rows through them.

    Args:
        group: the CP process group (None: default group). All ranks on one node.
        max_tokens_per_rank: capacity, the largest ``max_rank_len`` any call may use.
        hidden_size: row length in elements (trailing dims flattened).
        dtype: bf16, fp16 or fp32.
        device: this rank's CUDA device (default: the current one).
        timeout_ms: per-wait timeout (default NSA_CP_P2P_TIMEOUT_MS; 0 waits forever).
        workspace_bytes: optional budget; the transport allocates exactly ``nsa_cp.transport.workspace_bytes(
            cp_size, max_tokens_per_rank, hidden_size, dtype, double_buffer_tokens)`` and logs a warning
            (both numbers, the value to set) when the budget is smaller.
        double_buffer_tokens: tokens per rank of the second gather buffer (<= ``max_tokens_per_rank``; 0:
            none; default NSA_CP_P2P_DOUBLE_BUFFER_TOKENS, 1024), ``cp_size * tokens * hidden * element
            size`` bytes: gathers up to that size skip the entry barrier (docs/design.md, "Double buffering").
        check_layout: carry and compare the call fingerprint on every launch (docs/design.md, "Rank
            agreement"); False only to measure what it costs.
    """

    def __init__(self, group: Optional[dist.ProcessGroup], max_tokens_per_rank: int, hidden_size: int,
                 dtype: torch.dtype = torch.bfloat16, device=None, *, timeout_ms: Optional[int] = None,
                 workspace_bytes: Optional[int] = None, double_buffer_tokens: Optional[int] = None,
                 check_layout: bool = True):
        self._broken = None  # (exception class, message) once a call failed on the device
        b = self._buffers = P2PBuffers(
            group, max_tokens_per_rank, hidden_size, dtype, device, timeout_ms=timeout_ms,
            workspace_bytes=workspace_bytes, double_buffer_tokens=double_buffer_tokens, check_layout=check_layout,
        )
        self._C, self._state = b.C, b.state
        self.group, self.rank, self.world, self.device = b.group, b.rank, b.world, b.device
        self.max_tokens_per_rank, self.hidden_size, self.dtype = b.max_tokens_per_rank, b.hidden_size, dtype
        self.double_buffer_tokens, self.timeout_ns = b.double_buffer_tokens, b.timeout_ns
        self.workspace_bytes, self.memory = b.workspace_bytes, b.memory
        self._gathers = b.gathers  # gather buffer 0 and 1 (tests poison them)
        self._elem = torch.empty((), dtype=dtype).element_size()
        self._row_bytes = self.hidden_size * self._elem
        self._stream = _native.stream_getter()
        self._reduce_views = {}
        self._codes = dtype_codes(self._C)
        self._native_formats = {}  # per format: None when _C's kernels have nsa_cp.geometry.wire's traits, else why not

    # ------------------------------------------------------------------ support
    def support(self, layout: ShardLayout, row_shape: Sequence[int], dtype: torch.dtype, device, *,
                quant: Optional[str] = None, norm: bool = False) -> Support:
        """Whether this transport can serve a call on rows of ``row_shape`` / ``dtype`` / ``device`` in
        ``layout`` (and, with ``quant`` / ``norm``, the fused stages: the norm gather, the fp8 gather, the
        reduce-scatter's norm epilogue). A ``no`` says what to change."""
        if layout.cp_size != self.world:
            return Support.no(f"layout has cp_size {layout.cp_size}, the P2P transport's group has {self.world} ranks")
        if layout.max_rank_len > self.max_tokens_per_rank:
            return Support.no(
                f"max_rank_len {layout.max_rank_len} exceeds the P2P capacity of {self.max_tokens_per_rank} "
                f"tokens per rank; raise max_tokens_per_rank (nsa_cp.init_p2p / "
                f"NSACPLayerCommunicator(p2p_max_tokens_per_rank=...)) to at least {layout.max_rank_len}"
            )
        if dtype != self.dtype:
            return Support.no(f"dtype {dtype} is not the P2P transport's {self.dtype} (nsa_cp.init_p2p(..., dtype=...))")
        elements = math.prod(row_shape)
        if elements != self.hidden_size:
            return Support.no(
                f"rows of {elements} elements (row shape {list(row_shape)}) are not the P2P transport's "
                f"hidden_size {self.hidden_size} (nsa_cp.init_p2p(..., hidden_size=...))"
            )
        device = torch.device(device)
        if device.type != "cuda" or (device.index if device.index is not None else torch.cuda.current_device()) != self.device.index:
            return Support.no(f"device {device} is not the P2P transport's {self.device}")
        if quant is not None:
            fmt = FORMATS.get(quant)
            why = f"quant {quant!r}: nsa_cp knows None and {sorted(FORMATS)}" if fmt is None else \
                self._native_formats.setdefault(quant, native_mismatch(fmt, self._C))
            if why is not None:
                return Support.no(why)
            verdict = fmt.support(self.hidden_size)
            if not verdict:
                return Support.no(f"{verdict.reason}, got hidden_size {self.hidden_size}")
        if norm or quant is not None:
            if self._row_bytes % 16:
                return Support.no(f"the fused norm/quant stage needs rows of a multiple of 16 bytes, got {self._row_bytes}")
            if self._row_bytes // 16 > _NORM_MAX_WORDS:
                return Support.no(f"the fused norm/quant stage holds rows of up to {_NORM_MAX_WORDS * 16} bytes, "
                                  f"got {self._row_bytes}")
        return Support.yes()

    # ------------------------------------------------------------------ errors
    def check_error(self) -> None:
        """Raise if an earlier call failed on the device: P2PTimeoutError when a peer never arrived,
        LayoutMismatchError when the ranks disagreed on a call, P2PError for a rejected device-side
        geometry (reads host-mapped memory, no sync)."""
        if self._broken is not None:
            raise self._broken[0](self._broken[1])
        if self._state is None or self._state.closed:
            raise RuntimeError("nsa_cp P2P transport: closed")
        record = self._state.error()
        if record[0] == 0:
            return
        self._broken = error_from_record(record, self.rank, self.timeout_ns / 1e6)
        raise self._broken[0](self._broken[1])

    def _device_error(self):
        """A launch was refused because the error record is set: raise the error it describes."""
        self.check_error()
        raise RuntimeError("nsa_cp P2P transport: a launch saw an error record that is no longer set")

    # ------------------------------------------------------------------ runners
    def gather_runner(self, layout: ShardLayout, compact: bool, row_shape: Sequence[int], *, engine: str = "auto",
                      quant: Optional[str] = None, ordered: bool = False, checked: bool = False):
        """A callable ``run(x, device_counts=None, positions=None)`` for gathers in ``layout`` (``checked``:
        ``support`` already said yes to these arguments; every runner takes it).

        ``x``: this rank's ``[n_r, *row_shape]`` rows of the transport's dtype on its device (checked by
        the caller, not here); each row dense, any row stride. Returns a view of the gather buffer the
        call wrote, ``[rows, *row_shape]`` with rows = ``layout.global_len(compact)`` (``ordered``:
        ``layout.total_len``), valid until the next gather; with ``quant="fp8_e4m3_g128"`` the pair
        ``(q [rows, H] float8_e4m3fn, scale [rows, H/128] float32)``.
        ``device_counts``: ``(counts, offsets)`` int32 ``[cp_size]`` device tensors replacing the layout's
        counts on the device (CUDA graphs: every count <= ``layout.max_rank_len``; "sm" engine only).
        ``positions``: int64 ``[T]`` device tensor, the same on every rank, required when ``ordered``.
        """
        row_shape = tuple(int(d) for d in row_shape)
        if not checked:
            self.support(layout, row_shape, self.dtype, self.device, quant=quant).require("x")
        kernel_only = quant is not None or ordered  # the copy engine moves plain rows in rank order only
        if copy_engine.choose(engine, layout.max_rank_len * self._row_bytes, kernel_only=kernel_only) == "ce":
            return copy_engine.runner(self, layout, compact, row_shape)
        return self._gather_runner(layout, compact, row_shape, norm=False, quant=quant, ordered=ordered)

    def norm_gather_runner(self, layout: ShardLayout, compact: bool, row_shape: Sequence[int], *,
                           quant: Optional[str] = None, ordered: bool = False, checked: bool = False):
        """A callable ``run(x, residual, weight, eps, device_counts=None, positions=None)``: add + RMSNorm of
        this rank's rows fused with the gather (docs/design.md, "Norm stage").

        ``x``, ``residual``: ``[n_r, *row_shape]`` of the transport's dtype, 16-byte aligned rows (each
        dense); ``residual`` is updated in place (``None``: ``y = rmsnorm(x)``, x untouched). ``weight``:
        ``[H]`` bf16 / fp16 / fp32 on the device. ``eps``: float. Returns the gathered y as
        ``gather_runner`` does, or ``(q, scale)`` with ``quant="fp8_e4m3_g128"``.
        """
        row_shape = tuple(int(d) for d in row_shape)
        if not checked:
            self.support(layout, row_shape, self.dtype, self.device, quant=quant, norm=True).require("x")
        return self._gather_runner(layout, compact, row_shape, norm=True, quant=quant, ordered=ordered)

    def reduce_scatter_runner(self, layout: ShardLayout, compact: bool, row_shape: Sequence[int], *,
                              ordered: bool = False, norm: bool = False, checked: bool = False):
        """``run(y, out=None, device_counts=None, positions=None) -> [n_r, *row_shape]``: the sum over ranks
        (fp32, rank order, rounded once) of this rank's rows of every rank's partials ``y [rows, *row_shape]``
        (``layout.global_len(compact)`` rows; ``ordered``: ``[T, ...]`` in batch order), into ``out``
        (allocated when None; rows dense). ``y`` is copied into the reduce buffer unless it is the view
        ``reduce_buffer(layout, compact or ordered, row_shape)`` (or its memory). ``norm=True``: ``run(y,
        residual, weight, eps, out=None, ...) -> (out, residual)``, then ``s = sum + residual`` in fp32,
        ``residual <- s``, ``out = rmsnorm(s) * weight`` (16-byte aligned rows; docs/design.md, "Norm stage").
        ``device_counts``, ``positions``: as for ``gather_runner`` (rows past a replay's count untouched)."""
        row_shape = tuple(int(d) for d in row_shape)
        if not checked:
            self.support(layout, row_shape, self.dtype, self.device, norm=norm).require("y")
        view = self.reduce_buffer(layout, compact or ordered, row_shape)
        view_ptr, view_stride = view.data_ptr(), view.stride()
        out_shape, dtype, device, elem = (layout.count(self.rank), *row_shape), self.dtype, self.device, self._elem
        launch = self._state.reduce_scatter_norm if norm else self._state.reduce_scatter
        call = self._launcher(launch, layout, compact, ordered, "reduce-scatter")

        def stage(y, out):
            if y is not view and (y.data_ptr() != view_ptr or y.stride() != view_stride):
                view.copy_(y)
            return torch.empty(out_shape, dtype=dtype, device=device) if out is None else out

        if norm:
            codes = self._codes

            def run(y, residual, weight, eps, out=None, device_counts=None, positions=None):
                out = stage(y, out)
                call((out.data_ptr(), out.stride(0) * elem, residual.data_ptr(), residual.stride(0) * elem,
                      weight.data_ptr(), codes[weight.dtype], eps), device_counts, positions)
                return out, residual
        else:
            def run(y, out=None, device_counts=None, positions=None):
                out = stage(y, out)
                call((out.data_ptr(), out.stride(0) * elem), device_counts, positions)
                return out

        run.keep = (call.keep, view)  # the device tensors whose addresses the runner holds
        return run

    def reduce_buffer(self, layout: ShardLayout, compact: bool, row_shape: Optional[Sequence[int]] = None) -> torch.Tensor:
        """This rank's reduce buffer as ``[global_len, hidden]`` (or ``[global_len, *row_shape]``); for an
        ordered reduce-scatter use ``compact=True`` (``[T, ...]``, batch order).

        Write the MoE partials here and pass this tensor to the reduce-scatter runner: no copy in. The
        same object comes back for equal arguments (the runner recognises it by identity).
        """
        rest = (self.hidden_size,) if row_shape is None else tuple(int(d) for d in row_shape)
        key = (layout, bool(compact), rest)
        view = self._reduce_views.get(key)
        if view is None:
            self.support(layout, rest, self.dtype, self.device).require("reduce_buffer")
            view = self._buffers.rows_view(self._buffers.reduce, layout.global_len(compact), rest)
            if len(self._reduce_views) >= _VIEW_CACHE_LIMIT:
                self._reduce_views.clear()
            self._reduce_views[key] = view
        return view

    def _gather_runner(self, layout, compact, row_shape, *, norm: bool, quant: Optional[str], ordered: bool):
        """The SM-engine gather: plain, with the norm stage, and/or with the fp8 quantizer."""
        rows = layout.total_len if ordered else layout.global_len(compact)
        # the buffers P2PState may pick: 1 only when the layout fits it (a view of it would not hold the rows)
        buffers = (0, 1) if layout.max_rank_len <= self.double_buffer_tokens else (0, 0)
        fmt = FORMATS[quant] if quant is not None else None
        if fmt is not None:
            views = tuple(self._buffers.quant_views(fmt, b, rows) for b in buffers)
        else:
            views = tuple(self._buffers.rows_view(self._gathers[b], rows, row_shape) for b in buffers)
        elem = self._elem
        if not norm and quant is None:
            call = self._launcher(self._state.gather, layout, compact, ordered, "gather")

            def run(x, device_counts=None, positions=None):
                return views[call((x.data_ptr(), x.stride(0) * elem), device_counts, positions)]
        else:
            call = self._launcher(self._state.norm_gather, layout, compact, ordered, "gather")
            qcode, codes = (0 if fmt is None else fmt.code), self._codes
            if norm:
                def run(x, residual, weight, eps, device_counts=None, positions=None):
                    r, rs = (0, 0) if residual is None else (residual.data_ptr(), residual.stride(0) * elem)
                    w, wcode = (0, 0) if weight is None else (weight.data_ptr(), codes[weight.dtype])
                    head = (x.data_ptr(), x.stride(0) * elem, r, rs, w, wcode, eps, True, qcode)
                    return views[call(head, device_counts, positions)]
            else:
                def run(x, device_counts=None, positions=None):
                    head = (x.data_ptr(), x.stride(0) * elem, 0, 0, 0, 0, 0.0, False, qcode)
                    return views[call(head, device_counts, positions)]

        run.keep = call.keep  # the device tensors whose addresses the runner holds
        return run

    def _launcher(self, launch, layout: ShardLayout, compact: bool, ordered: bool, what: str):
        """``call(head, device_counts, positions)``: ``launch(*head, counts, offsets, max_rank_len, compact,
        stream, positions, num_positions)``, the tail of every launch's arguments in one place (the layout's
        device counts unless ``device_counts`` are given, the positions, required when ``ordered``, the raw
        stream); a launch refused by the error record raises its error (``_guard``'s rule, inlined)."""
        counts, offsets = layout.device_tensors(self.device)
        c0, o0 = counts.data_ptr(), offsets.data_ptr()
        m, kernel_compact = layout.max_rank_len, bool(compact or ordered)
        npos = layout.total_len if ordered else -1
        stream, index = self._stream, self.device.index
        native_error, device_error = self._C.P2PDeviceError, self._device_error
        missing = f"positions: an ordered {what} needs the int64 [T] positions tensor, got None"

        def call(head, device_counts, positions):
            if device_counts is None:
                c, o = c0, o0
            else:
                c, o = device_counts[0].data_ptr(), device_counts[1].data_ptr()
            if positions is None:
                if ordered:
                    raise ValueError(missing)
                p = 0
            else:
                p = positions.data_ptr()
            try:
                return launch(*head, c, o, m, kernel_compact, stream(index), p, npos)
            except native_error:
                device_error()

        call.keep = (counts, offsets)
        return call

    def _guard(self, launch):
        """``launch`` that turns a refusal by the native state (the error record is set: nothing was
        enqueued) into the error the record describes (the barrier, the copy engine's entry; the runners'
        launches do the same in ``_launcher``)."""
        native_error, device_error = self._C.P2PDeviceError, self._device_error

        def guarded(*args):
            try:
                return launch(*args)
            except native_error:
                device_error()

        return guarded

    # ------------------------------------------------------------------ group-wide
    def barrier(self) -> None:
        """Enqueue a barrier of the group on the current stream (one small kernel; the host does not
        wait): the work after it starts on every rank within one signal latency of the others. Collective:
        every rank must call it at the same point of its call sequence. Benchmarks use it to release the
        ranks together before a timed call."""
        if self._broken is not None:
            self.check_error()
        self._guard(self._state.barrier)(self._stream(self.device.index))

    def close(self) -> None:
        """Refuse every later call (runners included), then free the host-mapped error record."""
        if getattr(self, "_buffers", None) is not None:
            self._buffers.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: nothing useful to do
            pass
