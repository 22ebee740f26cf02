"""Intranode P2P transport: move only real rows over NVLink, straight into the peers' buffers.

Design record
-------------
Buffers. At construction every rank allocates peer-mapped tensors and exchanges their addresses
(p2p_memory: symmetric memory, or CUDA IPC when the ranks share one GPU): a gather buffer and a reduce
buffer of ``cp_size * max_tokens_per_rank`` rows of ``hidden_size`` elements each, a second gather
buffer of ``cp_size * double_buffer_tokens`` rows (see "Reuse safety"), and a small signal area. All
sizes are fixed up front (before any CUDA-graph capture) and never regrown: a layout that needs more
gets a ``Support.no`` naming both numbers and the setting to raise.

Native state, bound once. Every fixed address and size (peers' buffers and pads, epochs, the
host-mapped error record, timeout, row geometry, block policy, double-buffer rows) goes once into a
``nsa_cp._C.P2PState`` (csrc/p2p_state.cu), DeepEP's ``Buffer`` idea. The plan layer asks
``support(...)`` once and builds *runners* once per (layout, compact, row shape, options):
``gather_runner``, ``norm_gather_runner``, ``reduce_scatter_runner``. A runner call trusts its caller
(shapes, dtype, device checked by the plan) and does the minimum: a few pointers, the current raw
stream, ONE call into ``P2PState`` (which chooses the double buffer and returns it), and returns a view
built when the runner was built. Per-call tensors (``device_counts`` for CUDA graphs, ``positions``) are
arguments, never baked in. A launch first reads the error record; after a device-side error it enqueues
nothing and the runner raises P2PError / P2PTimeoutError (p2p_errors).

Gather. Every rank writes its ``n_r`` rows into every rank's gather buffer at its slot (padded:
``r*M``; compact: ``offsets[r]``) and zeroes the padding rows of its own buffer locally, so no padding
crosses the link. Two engines:
  * "sm": one kernel (csrc/p2p_gather.cu): entry barrier (see "Reuse safety"), local zeroing, 16-byte
    stores to all ranks, then each block adds its share to a done counter in every rank's signal pad
    and the last block waits for every rank's (no block funnels the others' completion: measured 1.5 us
    faster at M = 256 than a grid barrier). Small calls are a single launch.
  * "ce": the copy engine (cudaMemcpyAsync through ``Tensor.copy_`` onto the peer's mapped buffer), so no
    SM is busy moving bytes; two one-block barrier kernels around the copies. Host counts only.
The result is a view of this rank's gather buffer (either one), valid until the next gather.

Norm stage (``norm_gather_runner``). The same kernel with another source stage: one block per row
computes ``s = x + residual`` in fp32, writes ``residual <- s`` (rounded) in place, ``y = s * rsqrt(mean
(s^2) + eps) * weight`` in fp32 and pushes y, rounded once, to every rank. With
``quant="fp8_e4m3_g128"`` (also ``gather_runner(quant=...)`` without the norm) y is rounded to the
dtype and pushed as float8_e4m3fn groups of 128 columns with one fp32 scale each (SGLang's
``per_token_group_quant_fp8``), half the bytes on the link.

FP8 layout. Gather buffer b holds ``C_b = cp_size * rows_per_rank_b`` rows of ``hidden * element size``
bytes. An fp8 call reinterprets it as bytes: ``[0, C_b * H)`` is q ``[C_b, H]`` float8_e4m3fn (row i at
``i * H``), ``[S_b, S_b + C_b * H/128 * 4)`` the scales ``[C_b, H/128]`` float32, ``S_b = C_b * H``
rounded up to 16 (``P2PState.scale_offset``). The runner returns ``q[:rows]`` and ``scale[:rows]``, both
contiguous. Padding rows: q = 0, scale = 1e-10/448. Scales are row-major ``[rows, H/128]``, the layout
``per_token_group_quant_fp8`` produces; a consumer that wants them column-major (some block-scale MoE
kernels) transposes the small scale tensor.

Ordered destination (``ordered=True``). ``positions`` (int64 ``[T]``, the same on every rank): compact
row i goes to output row ``positions[i]`` of a ``[T, ...]`` result. The push kernel's destination index
is all that changes. The ordered reduce-scatter reads its rows from ``positions[offsets[r] + i]`` of a
``[T, ...]`` reduce buffer in batch order. A position outside ``[0, T)`` is clamped (nothing outside the
buffers is touched) and recorded as bad device geometry: the next call raises P2PError.

Reduce-scatter. The MoE writes its partials straight into this rank's reduce buffer (``reduce_buffer``
hands it out, the same view object the runner holds; anything else is copied in first). One kernel
(csrc/p2p_reduce_scatter.cu) waits until every rank's partials are complete, pulls this rank's ``n_r``
rows from every rank, sums them in fp32 in rank order 0..P-1 and writes ``[n_r, ...]``; a done barrier
keeps every rank from overwriting its reduce buffer while a peer still reads it. With ``norm=True`` the
same kernel family pulls one row per block and fuses the next layer's add + RMSNorm: the rounded sum
plus the residual (updated in place), normed into the output (``postprocess_layer`` + ``prepare_attn``).

Reuse safety. A rank writes into a peer's gather buffer only when no reader of that buffer's previous
contents can still run on the peer. Two ways, chosen per call on the device:
  * entry barrier: wait until the peer has entered the same call, i.e. all earlier work on the peer's
    stream is done. Always for the reduce-scatter and the copy engine;
  * double buffering (sm gathers): gathers of at most ``double_buffer_tokens`` rows per rank alternate
    between the two gather buffers (``P2PState`` picks, the same on every rank). When the previous
    gather wrote the other buffer, its done phase already proved that every peer had entered it, so the
    readers of anything older are done and the kernel waits for nobody at entry: a small call costs one
    signal latency instead of two. The kernel compares with the buffer the previous gather wrote
    (device memory), so eager calls interleaved with CUDA-graph replays, which the host never sees,
    still wait whenever two gathers in a row use the same buffer.
Epochs live on the device, so CUDA-graph replays stay in step. All of this is ordered on the calling
stream: readers of a result (or writers of the reduce buffer) on other streams must be joined into it
before the next call on the transport is enqueued (docs/streams_and_graphs.md).

Faults. Every wait has a timeout (NSA_CP_P2P_TIMEOUT_MS). A kernel that times out records which call
and which peer into host-mapped memory and gives up; the next call on the transport (or
``check_error()``) raises P2PTimeoutError naming them, and the transport stays unusable. A new
transport (``destroy_p2p`` + ``init_p2p``, on every rank) starts from zeroed signals and works again.

Rank agreement (``check_layout``, on by default). Every kernel launch carries a fingerprint of what its
call assumes (every rank's count, max_rank_len, the positions count, row bytes, compact / ordered /
norm / fp8, the call number) in the signal exchange it makes anyway, and compares every peer's with
its own (csrc/common.cuh): no extra collective, no extra wait, no host sync. The reduce-scatter
compares before it reads a row; the gather before it pushes when it has an entry exchange, otherwise
once the rows have landed, and then overwrites its result with NaN. The next call (or
``check_error()``) raises LayoutMismatchError on every rank, naming both sides. The copy engine's
gather (host-driven copies) carries none.
"""

from __future__ import annotations

import logging
import math
from typing import Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .. import _native, envs, workspace
from ..layout import ShardLayout
from ..support import Support
from .p2p_errors import error_from_record
from .p2p_memory import memory_kind, share_function, survey

logger = logging.getLogger("nsa_cp")

__all__ = ["P2PTransport", "QUANT_FP8"]

QUANT_FP8 = "fp8_e4m3_g128"
_DTYPE_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
_ENGINES = ("auto", "sm", "ce")
_NORM_MAX_WORDS = 4 * 512  # 16-byte words of one row the norm stage holds (csrc: 4 per thread, 512 threads)
_FP8_GROUP = 128
_VIEW_CACHE_LIMIT = 256


class P2PTransport:
    """Peer-mapped buffers of one CP group (symmetric memory or CUDA IPC), their native state, and the
    runners that move rows through them.

    Args:
        group: the CP process group (None: default group). All ranks on one node.
        max_tokens_per_rank: capacity, the largest ``max_rank_len`` any call may use.
        hidden_size: row length in elements (trailing dims flattened).
        dtype: bf16, fp16 or fp32.
        device: this rank's CUDA device (default: the current one).
        timeout_ms: per-wait timeout (default NSA_CP_P2P_TIMEOUT_MS; 0 waits forever).
        workspace_bytes: optional budget; the transport always allocates exactly
            ``nsa_cp.workspace_bytes(cp_size, max_tokens_per_rank, hidden_size, dtype,
            double_buffer_tokens)`` and logs a warning (with both numbers and the value to set) when the
            budget is smaller.
        double_buffer_tokens: tokens per rank of the second gather buffer (capped at
            ``max_tokens_per_rank``; 0: none; default NSA_CP_P2P_DOUBLE_BUFFER_TOKENS, 1024). Costs
            ``cp_size * tokens * hidden * element size`` bytes; gathers up to that size skip the entry
            barrier (module docstring, "Reuse safety"). The same on every rank.
        check_layout: carry and compare the call fingerprint on every launch (module docstring, "Rank
            agreement"); False only to measure what it costs.
    """

    def __init__(
        self,
        group: Optional[dist.ProcessGroup],
        max_tokens_per_rank: int,
        hidden_size: int,
        dtype: torch.dtype = torch.bfloat16,
        device=None,
        *,
        timeout_ms: Optional[int] = None,
        workspace_bytes: Optional[int] = None,
        double_buffer_tokens: Optional[int] = None,
        check_layout: bool = True,
    ):
        if max_tokens_per_rank < 1:
            raise ValueError(f"max_tokens_per_rank: expected an int >= 1, got {max_tokens_per_rank}")
        if hidden_size < 1:
            raise ValueError(f"hidden_size: expected an int >= 1, got {hidden_size}")
        if dtype not in _DTYPE_CODES:
            raise ValueError(f"dtype: expected one of {list(_DTYPE_CODES)}, got {dtype}")
        double_buffer_rows = workspace.double_buffer_rows(int(max_tokens_per_rank), double_buffer_tokens)
        config = {"max_tokens_per_rank": int(max_tokens_per_rank), "hidden_size": int(hidden_size),
                  "dtype": str(dtype), "double_buffer_tokens": double_buffer_rows}
        reason, indices = survey(group, device, config)
        if reason is not None:
            raise RuntimeError(f"nsa_cp P2P transport unavailable: {reason}")
        self._C = _native.load()
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.device = torch.device(device if device is not None else "cuda")
        if self.device.index is None:  # "cuda": the current device, so that tensors' devices compare equal
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.max_tokens_per_rank = int(max_tokens_per_rank)
        self.hidden_size = int(hidden_size)
        self.dtype = dtype
        self.timeout_ns = (envs.NSA_CP_P2P_TIMEOUT_MS if timeout_ms is None else int(timeout_ms)) * 1_000_000
        self.capacity_rows = self.world * self.max_tokens_per_rank
        self._elem = torch.empty((), dtype=dtype).element_size()
        self._row_bytes = self.hidden_size * self._elem
        self._broken = None  # (exception class, message) once a call failed on the device
        self._state = None
        self._err_host = None

        # every device buffer comes from the plan, so nsa_cp.workspace_bytes() is exact
        self.double_buffer_tokens = double_buffer_rows
        plan = workspace.workspace_plan(
            self.world, self.max_tokens_per_rank, self.hidden_size, dtype, self.double_buffer_tokens
        )
        required = workspace.check_budget(
            workspace_bytes, self.world, self.max_tokens_per_rank, self.hidden_size, dtype, self.double_buffer_tokens
        )
        handles = {}
        self.memory = memory_kind(indices)
        share = share_function(self.memory)

        def symmetric(entry):
            tensor, handles[entry.name] = share(entry.shape, entry.dtype, self.device, group)
            return tensor

        def local(entry):
            return torch.zeros(entry.shape, dtype=entry.dtype, device=self.device)

        buffers = workspace.allocate(plan, symmetric, local)
        self.workspace_bytes = required
        self._gather, self._reduce, self._signals = buffers["gather"], buffers["reduce"], buffers["signals"]
        # gather buffer 0 and 1 (1 is 0 again without double buffering: then never chosen)
        self._gathers = (self._gather, buffers.get("gather_alt", self._gather))
        self._signals.zero_()
        alt = "gather_alt" if "gather_alt" in handles else "gather"
        buffers["gather_ptrs"].copy_(
            torch.tensor([handles["gather"].buffer_ptrs, handles[alt].buffer_ptrs], dtype=torch.int64)
        )
        for name, handle in (("reduce_ptrs", "reduce"), ("pad_ptrs", "signals")):
            buffers[name].copy_(torch.tensor(handles[handle].buffer_ptrs, dtype=torch.int64))
        self._local = buffers  # the native state points into these: keep them for its lifetime
        # the copy engine writes into peers' gather buffer 0 through these mapped views
        shape = list(self._gather.shape)
        self._peer_gather = [handles["gather"].get_buffer(peer, shape, dtype, 0) for peer in range(self.world)]
        self._err_host, err_dev = self._C.alloc_host_mapped_u32(self._C.ERR_RECORD_WORDS)
        self._handles = handles  # keep the mappings alive
        self._state = self._C.P2PState(
            self.device.index, self.rank, self.world, buffers["gather_ptrs"].data_ptr(),
            buffers["reduce_ptrs"].data_ptr(), buffers["pad_ptrs"].data_ptr(), buffers["seq"].data_ptr(),
            buffers["arrive"].data_ptr(), buffers["gather_state"].data_ptr(), self._err_host, err_dev,
            self.timeout_ns, self.hidden_size, _DTYPE_CODES[dtype],
            torch.cuda.get_device_properties(self.device).multi_processor_count,
            self.max_tokens_per_rank, self.double_buffer_tokens, bool(check_layout),
        )
        self._stream = _native.stream_getter()
        self._reduce_views = {}
        self._compat_runners = {}
        torch.cuda.synchronize(self.device)
        dist.barrier(group=group)  # every rank's signal area is zero before anyone signals
        logger.info(
            "nsa_cp P2P transport: rank %d/%d, %d tokens/rank x %d x %s, %.1f MiB per buffer, second "
            "gather buffer for %d tokens/rank (%s)",
            self.rank, self.world, self.max_tokens_per_rank, self.hidden_size, dtype,
            self._gather.numel() * self._gather.element_size() / 2**20, self.double_buffer_tokens, self.memory,
        )

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
            if quant != QUANT_FP8:
                return Support.no(f"quant {quant!r}: the P2P transport knows None and {QUANT_FP8!r}")
            if self.hidden_size % _FP8_GROUP:
                return Support.no(f"{QUANT_FP8} needs hidden_size to be a multiple of 128, got {self.hidden_size}")
        if norm or quant is not None:
            if self._row_bytes % 16:
                return Support.no(f"the fused norm/quant stage needs rows of a multiple of 16 bytes, got {self._row_bytes}")
            if self._row_bytes // 16 > _NORM_MAX_WORDS:
                return Support.no(
                    f"the fused norm/quant stage holds rows of up to {_NORM_MAX_WORDS * 16} bytes, got {self._row_bytes}"
                )
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

    # ------------------------------------------------------------------ views
    def _rows_view(self, buffer: torch.Tensor, rows: int, row_shape: Tuple[int, ...]) -> torch.Tensor:
        head = buffer[:rows]
        return head if row_shape == (self.hidden_size,) else head.view(rows, *row_shape)

    def _fp8_views(self, buffer: int, rows: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(q [rows, H] float8_e4m3fn, scale [rows, H/128] float32)`` over gather buffer ``buffer``
        (the byte layout of the module docstring)."""
        raw = self._gathers[buffer].view(-1).view(torch.uint8)
        h, groups = self.hidden_size, self.hidden_size // _FP8_GROUP
        q = raw[: rows * h].view(torch.float8_e4m3fn).view(rows, h)
        start = self._state.scale_offset(buffer)
        scale = raw[start: start + rows * groups * 4].view(torch.float32).view(rows, groups)
        return q, scale

    def _buffers(self, layout: ShardLayout) -> Tuple[int, int]:
        """The gather buffers a call in ``layout`` may write, as the indices the native state returns:
        (0, 1) when the layout fits the second (smaller) buffer, else (0, 0) (buffer 1 is never chosen;
        a view of it would not hold the rows)."""
        return (0, 1) if layout.max_rank_len <= self.double_buffer_tokens else (0, 0)

    def _output_rows(self, layout: ShardLayout, compact: bool, ordered: bool) -> int:
        return layout.total_len if ordered else layout.global_len(compact)

    def choose_engine(self, engine: str, layout: ShardLayout, *, kernel_only: bool = False) -> str:
        """'sm' or 'ce' for an engine request ("auto": NSA_CP_P2P_ENGINE, then by slot size).
        ``kernel_only``: the call needs the kernel (fp8, ordered): 'auto' means 'sm', 'ce' is refused."""
        if engine not in _ENGINES:
            raise ValueError(f"engine: expected one of {_ENGINES}, got {engine!r}")
        if kernel_only:
            if engine == "ce":
                raise ValueError("engine: 'ce' (the copy engine) cannot quantize or reorder rows; use 'sm' or 'auto'")
            return "sm"
        if engine == "auto":
            engine = envs.NSA_CP_P2P_ENGINE
        if engine == "auto":
            slot_bytes = layout.max_rank_len * self._row_bytes
            engine = "ce" if slot_bytes >= envs.NSA_CP_P2P_CE_MIN_BYTES else "sm"
        return engine

    # ------------------------------------------------------------------ runners
    def gather_runner(self, layout: ShardLayout, compact: bool, row_shape: Sequence[int], *, engine: str = "auto",
                      quant: Optional[str] = None, ordered: bool = False):
        """A callable ``run(x, device_counts=None, positions=None)`` for gathers in ``layout``.

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
        self.support(layout, row_shape, self.dtype, self.device, quant=quant).require("x")
        engine = self.choose_engine(engine, layout, kernel_only=quant is not None or ordered)
        if quant is not None:
            return self._fused_runner(layout, compact, row_shape, norm=False, quant=quant, ordered=ordered)
        rows = self._output_rows(layout, compact, ordered)
        if engine == "ce":
            return self._copy_engine_runner(layout, compact, row_shape, rows)
        views = tuple(self._rows_view(self._gathers[b], rows, row_shape) for b in self._buffers(layout))
        counts, offsets = layout.device_tensors(self.device)
        c0, o0 = counts.data_ptr(), offsets.data_ptr()
        m, kernel_compact, npos = layout.max_rank_len, bool(compact or ordered), rows if ordered else -1
        launch, stream, index, elem = self._state.gather, self._stream, self.device.index, self._elem
        device_error, native_error = self._device_error, self._C.P2PDeviceError

        if ordered:
            def run(x, device_counts=None, positions=None):
                if positions is None:
                    raise ValueError("positions: an ordered gather needs the int64 [T] positions tensor, got None")
                if device_counts is None:
                    c, o = c0, o0
                else:
                    c, o = device_counts[0].data_ptr(), device_counts[1].data_ptr()
                try:
                    b = launch(x.data_ptr(), x.stride(0) * elem, c, o, m, True, stream(index), positions.data_ptr(), npos)
                except native_error:
                    device_error()
                return views[b]
        else:
            def run(x, device_counts=None, positions=None):
                if device_counts is None:
                    c, o = c0, o0
                else:
                    c, o = device_counts[0].data_ptr(), device_counts[1].data_ptr()
                try:
                    b = launch(x.data_ptr(), x.stride(0) * elem, c, o, m, kernel_compact, stream(index))
                except native_error:
                    device_error()
                return views[b]

        run.keep = (counts, offsets)  # the device tensors whose addresses the runner holds
        return run

    def norm_gather_runner(self, layout: ShardLayout, compact: bool, row_shape: Sequence[int], *,
                           quant: Optional[str] = None, ordered: bool = False):
        """A callable ``run(x, residual, weight, eps, device_counts=None, positions=None)``: add + RMSNorm of
        this rank's rows fused with the gather (module docstring, "Norm stage").

        ``x``, ``residual``: ``[n_r, *row_shape]`` of the transport's dtype, 16-byte aligned rows (each
        dense); ``residual`` is updated in place (``None``: ``y = rmsnorm(x)``, x untouched). ``weight``:
        ``[H]`` bf16 / fp16 / fp32 on the device. ``eps``: float. Returns the gathered y as
        ``gather_runner`` does, or ``(q, scale)`` with ``quant="fp8_e4m3_g128"``.
        """
        row_shape = tuple(int(d) for d in row_shape)
        self.support(layout, row_shape, self.dtype, self.device, quant=quant, norm=True).require("x")
        return self._fused_runner(layout, compact, row_shape, norm=True, quant=quant, ordered=ordered)

    def _fused_runner(self, layout, compact, row_shape, *, norm: bool, quant: Optional[str], ordered: bool):
        rows = self._output_rows(layout, compact, ordered)
        if quant is not None:
            views = tuple(self._fp8_views(b, rows) for b in self._buffers(layout))
        else:
            views = tuple(self._rows_view(self._gathers[b], rows, row_shape) for b in self._buffers(layout))
        counts, offsets = layout.device_tensors(self.device)
        c0, o0 = counts.data_ptr(), offsets.data_ptr()
        m, kernel_compact, npos = layout.max_rank_len, bool(compact or ordered), rows if ordered else -1
        qcode = 0 if quant is None else self._C.QUANT_FP8_E4M3_G128
        launch, stream, index, elem = self._state.norm_gather, self._stream, self.device.index, self._elem
        device_error, native_error, codes = self._device_error, self._C.P2PDeviceError, _DTYPE_CODES

        def launch_rows(x, residual, weight, eps, device_counts, positions):
            if device_counts is None:
                c, o = c0, o0
            else:
                c, o = device_counts[0].data_ptr(), device_counts[1].data_ptr()
            if positions is None:
                if ordered:
                    raise ValueError("positions: an ordered gather needs the int64 [T] positions tensor, got None")
                p = 0
            else:
                p = positions.data_ptr()
            if residual is None:
                r = rs = 0
            else:
                r, rs = residual.data_ptr(), residual.stride(0) * elem
            if weight is None:
                w = wcode = 0
            else:
                w, wcode = weight.data_ptr(), codes[weight.dtype]
            try:
                b = launch(x.data_ptr(), x.stride(0) * elem, r, rs, w, wcode, eps, norm, qcode, c, o, m,
                           kernel_compact, stream(index), p, npos)
            except native_error:
                device_error()
            return views[b]

        if norm:
            def run(x, residual, weight, eps, device_counts=None, positions=None):
                return launch_rows(x, residual, weight, eps, device_counts, positions)
        else:
            def run(x, device_counts=None, positions=None):
                return launch_rows(x, None, None, 0.0, device_counts, positions)

        run.keep = (counts, offsets)
        return run

    def _copy_engine_runner(self, layout: ShardLayout, compact: bool, row_shape, rows: int):
        """The copy engine's gather into buffer 0: entry barrier, one copy per rank, local zeroing of
        padding, done barrier (host counts only)."""
        start, stop = layout.rows(self.rank, compact)
        n = stop - start
        result = self._rows_view(self._gather, rows, row_shape)
        targets = [peer[start:stop].view(n, *row_shape) for peer in self._peer_gather] if n else []
        padding = []
        if not compact:
            m, flat = layout.max_rank_len, self._gather.view(-1)
            for q, count in enumerate(layout.per_rank_actual_token):
                if count < m:
                    padding.append(flat[(q * m + count) * self.hidden_size: (q + 1) * m * self.hidden_size])
        begin, end = self._state.copy_engine_begin, self._state.copy_engine_end
        stream, index = self._stream, self.device.index
        device_error, native_error = self._device_error, self._C.P2PDeviceError

        def run(x, device_counts=None, positions=None):
            if device_counts is not None:
                raise ValueError("engine: device_counts needs the 'sm' engine (the copy engine reads host counts), got 'ce'")
            try:
                begin(stream(index))
            except native_error:
                device_error()
            for target in targets:
                target.copy_(x)
            for rows_ in padding:
                rows_.zero_()
            end(stream(index))
            return result

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
            view = self._rows_view(self._reduce, layout.global_len(compact), rest)
            if len(self._reduce_views) >= _VIEW_CACHE_LIMIT:
                self._reduce_views.clear()
            self._reduce_views[key] = view
        return view

    def reduce_scatter_runner(self, layout: ShardLayout, compact: bool, row_shape: Sequence[int], *,
                              ordered: bool = False, norm: bool = False):
        """A callable ``run(y, out=None, device_counts=None, positions=None) -> [n_r, *row_shape]``; with
        ``norm=True``, ``run(y, residual, weight, eps, out=None, device_counts=None, positions=None) ->
        (out, residual)``: the reduce-scatter fused with the next add + RMSNorm (the sum over ranks rounded
        to the dtype, as the plain call returns it, then ``s = that + residual`` in fp32, ``residual <- s``
        rounded in place, ``out = s * rsqrt(mean(s^2) + eps) * weight`` rounded once; ``residual`` and
        ``out`` 16-byte aligned rows, ``weight`` ``[H]`` bf16 / fp16 / fp32).

        ``y``: every rank's partials ``[rows, *row_shape]`` (rows = ``layout.global_len(compact)``;
        ``ordered``: ``[T, ...]`` in batch order). Copied into the reduce buffer unless it is the view
        ``reduce_buffer(layout, compact or ordered, row_shape)`` handed out (or the same memory). The
        sum over ranks (fp32, rank order) of this rank's rows lands in ``out`` (allocated when None;
        rows dense, any row stride). ``device_counts``, ``positions``: as for ``gather_runner``; with
        device counts, rows past this replay's count are left untouched.
        """
        row_shape = tuple(int(d) for d in row_shape)
        self.support(layout, row_shape, self.dtype, self.device, norm=norm).require("y")
        view = self.reduce_buffer(layout, compact or ordered, row_shape)
        view_ptr, view_stride = view.data_ptr(), view.stride()
        out_shape = (layout.count(self.rank), *row_shape)
        counts, offsets = layout.device_tensors(self.device)
        c0, o0 = counts.data_ptr(), offsets.data_ptr()
        m, kernel_compact = layout.max_rank_len, bool(compact or ordered)
        npos = layout.total_len if ordered else -1
        launch, stream, index, elem = self._state.reduce_scatter, self._stream, self.device.index, self._elem
        dtype, device = self.dtype, self.device
        device_error, native_error = self._device_error, self._C.P2PDeviceError

        if norm:
            return self._reduce_scatter_norm_run(layout, view, out_shape, counts, offsets, m, kernel_compact, npos,
                                                 ordered)

        def run(y, out=None, device_counts=None, positions=None):
            if y is not view and (y.data_ptr() != view_ptr or y.stride() != view_stride):
                view.copy_(y)
            if out is None:
                out = torch.empty(out_shape, dtype=dtype, device=device)
            if device_counts is None:
                c, o = c0, o0
            else:
                c, o = device_counts[0].data_ptr(), device_counts[1].data_ptr()
            if positions is None:
                if ordered:
                    raise ValueError("positions: an ordered reduce-scatter needs the int64 [T] positions tensor, got None")
                p = 0
            else:
                p = positions.data_ptr()
            try:
                launch(out.data_ptr(), out.stride(0) * elem, c, o, m, kernel_compact, stream(index), p, npos)
            except native_error:
                device_error()
            return out

        run.keep = (counts, offsets, view)
        return run

    def _reduce_scatter_norm_run(self, layout, view, out_shape, counts, offsets, m, kernel_compact, npos, ordered):
        """``run(y, residual, weight, eps, out=None, device_counts=None, positions=None) -> (out, residual)``:
        the reduce-scatter fused with the next add + RMSNorm (``reduce_scatter_runner(norm=True)``)."""
        view_ptr, view_stride = view.data_ptr(), view.stride()
        c0, o0 = counts.data_ptr(), offsets.data_ptr()
        launch, stream, index, elem = self._state.reduce_scatter_norm, self._stream, self.device.index, self._elem
        dtype, device, codes = self.dtype, self.device, _DTYPE_CODES
        device_error, native_error = self._device_error, self._C.P2PDeviceError

        def run(y, residual, weight, eps, out=None, device_counts=None, positions=None):
            if y is not view and (y.data_ptr() != view_ptr or y.stride() != view_stride):
                view.copy_(y)
            if out is None:
                out = torch.empty(out_shape, dtype=dtype, device=device)
            if device_counts is None:
                c, o = c0, o0
            else:
                c, o = device_counts[0].data_ptr(), device_counts[1].data_ptr()
            if positions is None:
                if ordered:
                    raise ValueError("positions: an ordered reduce-scatter needs the int64 [T] positions tensor, got None")
                p = 0
            else:
                p = positions.data_ptr()
            try:
                launch(out.data_ptr(), out.stride(0) * elem, residual.data_ptr(), residual.stride(0) * elem,
                       weight.data_ptr(), codes[weight.dtype], eps, c, o, m, kernel_compact, stream(index), p, npos)
            except native_error:
                device_error()
            return out, residual

        run.keep = (counts, offsets, view)
        return run

    # ------------------------------------------------------------------ group-wide
    def barrier(self) -> None:
        """Enqueue a barrier of the group on the current stream (one small kernel; the host does not
        wait): the work after it starts on every rank within one signal latency of the others. Collective:
        every rank must call it at the same point of its call sequence. Benchmarks use it to release the
        ranks together before a timed call."""
        if self._broken is not None:
            self.check_error()
        try:
            self._state.barrier(self._stream(self.device.index))
        except self._C.P2PDeviceError:
            self._device_error()

    def close(self) -> None:
        """Refuse every later call (runners included), then free the host-mapped error record."""
        if self._state is not None:
            self._state.close()
        if self._err_host:
            self._C.free_host_mapped(self._err_host)
            self._err_host = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: nothing useful to do
            pass

    # ------------------------------------------------------------------ direct entry points
    # For benchmarks and diagnostics that pick the engine themselves: the same runners, cached per
    # layout, with the call checks a plan would make. Library calls go through nsa_cp/plan.py.
    def _validated_counts(self, device_counts):
        if device_counts is None:
            return None
        counts, offsets = device_counts
        for name, t in (("device_counts[0]", counts), ("device_counts[1]", offsets)):
            if t.dtype != torch.int32 or t.device != self.device or tuple(t.shape) != (self.world,):
                raise ValueError(
                    f"{name}: expected int32 [{self.world}] on {self.device}, got {t.dtype} {list(t.shape)} on {t.device}"
                )
        return counts, offsets

    def _compat_runner(self, key, build):
        run = self._compat_runners.get(key)
        if run is None:
            if len(self._compat_runners) >= _VIEW_CACHE_LIMIT:
                self._compat_runners.clear()
            run = self._compat_runners[key] = build()
        return run

    def all_gather(self, x: torch.Tensor, layout: ShardLayout, *, compact: bool, engine: str = "auto",
                   device_counts=None) -> torch.Tensor:
        """Gather into this rank's gather buffer; returns its ``[global_len, *x.shape[1:]]`` view (see
        ``gather_runner``)."""
        self.check_error()
        self.support(layout, tuple(x.shape[1:]), x.dtype, x.device).require("x")
        device_counts = self._validated_counts(device_counts)
        chosen = self.choose_engine(engine, layout)
        if device_counts is not None and chosen != "sm":
            raise ValueError(f"engine: device_counts needs the 'sm' engine (the copy engine reads host counts), got {chosen!r}")
        if x.dim() > 1 and x.shape[0] and not x[0].is_contiguous():
            x = x.contiguous()
        rest = tuple(x.shape[1:])
        run = self._compat_runner(("gather", layout, compact, rest, chosen),
                                  lambda: self.gather_runner(layout, compact, rest, engine=chosen))
        return run(x, device_counts)

    def reduce_scatter(self, y: torch.Tensor, layout: ShardLayout, *, compact: bool,
                       out: Optional[torch.Tensor] = None, device_counts=None) -> torch.Tensor:
        """Sum every rank's partials for this rank's rows; returns ``[n_r, *y.shape[1:]]`` (see
        ``reduce_scatter_runner``)."""
        self.check_error()
        self.support(layout, tuple(y.shape[1:]), y.dtype, y.device).require("y")
        device_counts = self._validated_counts(device_counts)
        rest = tuple(y.shape[1:])
        run = self._compat_runner(("scatter", layout, compact, rest),
                                  lambda: self.reduce_scatter_runner(layout, compact, rest))
        return run(y, out, device_counts)
