"""``cp_overlapped_boundary``: a FULL-mode MoE boundary (gather, per-row consumer, reduce-scatter) with the
consumer running on each rank's rows as they land and each finished slot's partials travelling back while
the next slot computes.

It computes what the serialized boundary computes::

    full = cp_all_gather(x, layout, group, quant=quant)      # every rank's rows
    out = cp_reduce_scatter(consumer(full), layout, group)   # this rank's rows, summed over ranks

for a consumer that is a per-row function (row i's output depends on row i only), without the padding
rows and without waiting for the whole gather. The call goes the way every call goes: a request, its plan
(nsa_cp/planning/overlap.py: the transport chosen once, validation), the transport's pipeline (P2P:
copy-engine pulls, nsa_cp/transport/p2p/pulls.py; else torch.distributed point-to-point,
nsa_cp/transport/dist/pipeline.py). The pipeline hands this module each chunk's rows as they land and takes
each chunk's partials; it never calls the consumer. docs/design.md, "The overlapped boundary".
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from .. import envs
from ..geometry.chunks import Chunk
from ..geometry.layout import ShardLayout
from ..geometry.wire import QUANTS
from ..planning import overlap as overlap_plan
from ..planning.checks import shape_str
from ..planning.request import OverlapRequest, Request
from ..rows.quant import check_fp8_g128_input
from ..rows.topk import topk_reduce
from ..transport import groups

__all__ = ["cp_overlapped_boundary", "explain", "Chunk", "TopK"]


class TopK(NamedTuple):
    """A consumer output nsa_cp reduces before it travels: the routed experts' outputs ``out [rows, k,
    *out_row_shape]`` (any float dtype) and their top-k ``weights [rows, k]`` (None: already applied), the
    partial being ``scale * sum_j weights[:, j] * out[:, j]`` in fp32, rounded once to the output dtype
    (one pass over ``out`` on CUDA; ``scale``: e.g. DeepSeek's routed_scaling_factor)."""

    out: torch.Tensor
    weights: Optional[torch.Tensor] = None
    scale: float = 1.0


def cp_overlapped_boundary(
    x: torch.Tensor,
    layout: ShardLayout,
    consumer: Callable,
    group: Optional[dist.ProcessGroup] = None,
    *,
    quant: Optional[str] = None,
    out_row_shape: Optional[Sequence[int]] = None,
    out_dtype: Optional[torch.dtype] = None,
    timeout_ms: Optional[int] = None,
    chunk_rows: Optional[int] = None,
    shared: Optional[torch.Tensor] = None,
    backend: str = "auto",
    validate: Optional[bool] = None,
) -> torch.Tensor:
    """Gather every rank's rows slot by slot, run ``consumer`` on each slot as it lands, and return the sum
    over ranks of the consumer's outputs for this rank's rows.

    Args:
        x: this rank's rows ``[n_r, ...]``, or ``[max_rank_len, ...]`` with padding rows last (ignored).
        layout: the group's ShardLayout (the same on every rank).
        consumer: ``consumer(rows, chunk) -> [chunk.rows, *out_row_shape]`` (or a :class:`TopK` of the
            routed experts' outputs and weights, which nsa_cp reduces before they travel), a per-row function. ``rows``
            is ``[chunk.rows, ...]`` of rank ``chunk.source`` (``(q, scale)``, float8_e4m3fn ``[k, H]`` and
            fp32 ``[k, H / group]``, with ``quant``); ``chunk`` (:class:`Chunk`) says whose rows and where
            they sit in the padded (``padded_offset``) and compact (``compact_offset``) gathers, for a
            consumer that reads side inputs by row. Called per chunk, this rank's own rows first, then
            ``(rank - 1) % P``'s, ``(rank - 2) % P``'s, ...: each rank takes a different peer first; a
            rank's rows are one chunk, or with ``chunk_rows`` several, in row order.
        group: the CP group (None: the default group); its size must be ``layout.cp_size``.
        quant: None or a wire format (``"fp8_e4m3_g128"``, ``"fp8_e4m3_g128_ue8m0"``): the rows move
            quantized, as ``cp_all_gather(..., quant=quant)`` moves them (the same bytes and scales).
        out_row_shape: the consumer's output row shape (default ``x.shape[1:]``).
        out_dtype: the consumer's output dtype and the result's (default x's; bf16 with ``quant``).
        timeout_ms: how long a wait for a peer lasts on gloo before ``P2PTimeoutError`` (None:
            NSA_CP_P2P_TIMEOUT_MS). On NCCL the process group's own timeout governs. (gloo moves host memory:
            CUDA tensors there are staged through it, a fallback and the test path of ranks sharing a GPU.)
        chunk_rows: None (each rank's rows one chunk) or a positive int: a rank's rows move, compute and
            go back in chunks of at most ``chunk_rows`` rows, so a large slot's first rows compute while
            the rest are on the link (more, smaller transfers: each costs a launch). The same on every rank.
        shared: None or this rank's shared-expert output ``[n_r, *out_row_shape]`` (any float dtype), added in
            fp32 to the sum before its one rounding (the serialized path rounds the reduce-scatter, then adds).
        backend: "auto" (the P2P transport's copy-engine pulls where ``init_p2p`` made one for the group and it
            serves the call, else torch.distributed point-to-point; NSA_CP_BACKEND), "p2p" or "nccl" (insist:
            ValueError saying why it cannot serve). ``nsa_cp.explain`` says which was chosen and why.
        validate: None (NSA_CP_VALIDATE) or a bool: before anything moves, one small all-reduce that makes every
            rank raise LayoutMismatchError naming the argument the ranks disagree on (layout, quant,
            chunk_rows, out_row_shape, out_dtype, shared, backend), and one more at the end on whether the
            consumer returned TopK. Without it the P2P pulls still compare a call fingerprint in their entry
            barrier: a disagreement makes the result NaN and the next call raise LayoutMismatchError.

    Returns:
        ``[n_r, *out_row_shape]`` in ``out_dtype``: every rank's partials of this rank's rows summed in fp32
        in rank order (the P2P reduce-scatter's order), plus ``shared``, rounded once.

    Streams. P2P: this rank's rows are staged on the current stream, every chunk is pulled by the copy
    engine on the transport's pull stream (an event per chunk), each chunk's partials pushed on its push
    stream after the consumer's call; the consumer runs on the current stream, each call after a wait for
    its own chunk only; no SM moves a byte (two 32-thread barrier blocks per call). torch.distributed (NCCL):
    the transfers run on the process group's stream; on a non-gloo group the first call runs one all-reduce
    (NCCL creates a communicator lazily, and its first point-to-point batch must include every rank). Not
    capturable in a CUDA graph (its schedule waits per chunk): RuntimeError inside a capture.

    Raises:
        ValueError naming the argument, the expected and the actual value before anything moves (with
        validation on every rank together). A consumer output of the wrong shape, dtype or device raises
        ValueError on that rank after the pipeline began; its peers then stop at a timeout, never hang
        (gloo: P2PTimeoutError from the call; P2P: a NaN result and P2PTimeoutError at the next call, the
        failing rank's transport unusable: re-create it).
    """
    if isinstance(x, torch.Tensor) and x.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("cp_overlapped_boundary cannot be captured in a CUDA graph (it waits per slot); "
                               "capture the serialized boundary (cp_all_gather, the MoE, cp_reduce_scatter)")
    pg = groups.resolve_group(group)
    rank = pg.rank()
    row_shape, dtype, error = (), None, None
    try:
        row_shape, dtype = _check(x, layout, consumer, pg, rank, quant, chunk_rows, out_row_shape, out_dtype, shared)
    except ValueError as err:
        error = err
    req = OverlapRequest(Request.of(overlap_plan.CALL, x, layout, group, backend=backend, quant=quant), chunk_rows,
                         row_shape, dtype, shared is not None)
    timeout = envs.NSA_CP_P2P_TIMEOUT_MS if timeout_ms is None else int(timeout_ms)
    _, pipeline = overlap_plan.start(req, x.detach() if error is None else x, error, validate, timeout)
    topk = False
    try:
        for chunk in pipeline.chunks:
            y = consumer(pipeline.rows(chunk), chunk)
            topk = topk or isinstance(y, TopK)
            pipeline.put(chunk, as_partial(y, chunk, row_shape, dtype, x.device))
    except BaseException:
        pipeline.abort()
        raise
    return overlap_plan.finish(req, pipeline, shared, topk, validate)


def explain(x: torch.Tensor, layout: ShardLayout, group: Optional[dist.ProcessGroup] = None, *,
            quant: Optional[str] = None, out_row_shape: Optional[Sequence[int]] = None,
            out_dtype: Optional[torch.dtype] = None, chunk_rows: Optional[int] = None, shared: bool = False,
            backend: str = "auto") -> str:
    """How ``cp_overlapped_boundary`` with these arguments would run on this rank, without moving anything:
    the transport chosen and its mechanism, and every transport asked before it with the reason it
    declined (e.g. "the P2P pulls need CUDA tensors"). ``shared``: whether a shared output is passed.
    ValueError for arguments the call would refuse. Local: no collective."""
    pg = groups.resolve_group(group)
    row_shape, dtype = _check(x, layout, lambda rows, chunk: None, pg, pg.rank(), quant, chunk_rows, out_row_shape,
                              out_dtype, None)
    req = OverlapRequest(Request.of(overlap_plan.CALL, x, layout, group, backend=backend, quant=quant), chunk_rows,
                         row_shape, dtype, bool(shared))
    return overlap_plan.lookup(req).explain()


def _check(x, layout, consumer, pg, rank: int, quant, chunk_rows, out_row_shape, out_dtype, shared):
    """The argument checks (ValueError naming the argument, before anything moves): ``(out_row_shape,
    out_dtype)`` as resolved."""
    if not isinstance(layout, ShardLayout):
        raise ValueError(f"layout: expected an nsa_cp.ShardLayout, got {type(layout).__name__}")
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        raise ValueError(f"x: expected a tensor [rows, ...] of 2 or more dims, got "
                         f"{_described(x) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if not callable(consumer):
        raise ValueError(f"consumer: expected a callable consumer(rows, chunk), got {type(consumer).__name__}")
    if pg.size() != layout.cp_size:
        raise ValueError(f"group: expected {layout.cp_size} ranks (layout.cp_size), got {pg.size()}")
    n, m = layout.per_rank_actual_token[rank], layout.max_rank_len
    if x.shape[0] not in (n, m):
        raise ValueError(f"x: expected [{n}, ...] (rank {rank}'s rows) or [{m}, ...] (max_rank_len), "
                         f"got {shape_str(x.shape)}")
    if quant not in QUANTS:
        raise ValueError(f"quant: expected one of {list(QUANTS)}, got {quant!r}")
    if quant is not None:
        check_fp8_g128_input(x, quant=quant)
    if chunk_rows is not None and (isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1):
        raise ValueError(f"chunk_rows: expected None or a positive int, got {chunk_rows!r}")
    row_shape = tuple(int(s) for s in (x.shape[1:] if out_row_shape is None else out_row_shape))
    dtype = out_dtype or (torch.bfloat16 if quant else x.dtype)
    if shared is not None:
        check_shared(shared, (n, *row_shape), x.device, rank)
    return row_shape, dtype


def check_shared(shared, want, device, rank: int) -> None:
    """ValueError unless ``shared`` is a float tensor of shape ``want`` on ``device`` (rank's rows)."""
    if not isinstance(shared, torch.Tensor) or tuple(shared.shape) != tuple(want) or shared.device != device \
            or not shared.is_floating_point():
        raise ValueError(f"shared: expected a float tensor {shape_str(want)} on {device} (rank {rank}'s rows), "
                         f"got {_described(shared)}")


def as_partial(y, chunk: Chunk, row_shape, dtype: torch.dtype, device) -> torch.Tensor:
    """A consumer's output as the partial that travels, ``[chunk.rows, *row_shape]`` in ``dtype`` on
    ``device``: a tensor checked, a :class:`TopK` checked and reduced; ValueError naming what differs."""
    if isinstance(y, TopK):
        return _reduced(y, chunk, tuple(row_shape), dtype, device)
    want = (chunk.rows, *row_shape)
    if not isinstance(y, torch.Tensor) or tuple(y.shape) != want or y.dtype != dtype or y.device != device:
        raise ValueError(f"consumer output for rank {chunk.source}'s rows: expected {shape_str(want)} {dtype} "
                         f"on {device}, got {_described(y)}")
    return y


def _reduced(y: TopK, chunk: Chunk, row_shape, dtype: torch.dtype, device) -> torch.Tensor:
    """A consumer's TopK, checked, as ``[chunk.rows, *row_shape]`` in ``dtype``."""
    out, w = y.out, y.weights
    where = f"consumer output for rank {chunk.source}'s rows"
    if not isinstance(out, torch.Tensor) or out.dim() != 2 + len(row_shape) or out.shape[0] != chunk.rows \
            or tuple(out.shape[2:]) != row_shape or out.device != device or not out.is_floating_point():
        raise ValueError(f"{where}: TopK.out expected a float tensor [{', '.join(map(str, (chunk.rows, 'k', *row_shape)))}] "
                         f"on {device}, got {_described(out)}")
    if w is not None and (not isinstance(w, torch.Tensor) or tuple(w.shape) != tuple(out.shape[:2])
                          or w.device != device or not w.is_floating_point()):
        raise ValueError(f"{where}: TopK.weights expected a float tensor {shape_str(out.shape[:2])} on {device}, "
                         f"got {_described(w)}")
    return topk_reduce(out, w, float(y.scale), dtype)


def _described(t) -> str:
    """What an argument is, for an error: ``[shape] dtype on device`` for a tensor, else its type's name."""
    return f"{shape_str(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
