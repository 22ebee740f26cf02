"""The public collectives: ``cp_all_gather``, ``cp_reduce_scatter``, the fused layer boundary
(``fused_add_rmsnorm_all_gather``, ``reduce_scatter_fused_add_rmsnorm``) and ``cp_reduce_scatter_buffer``.

Each builds the call's ``Request`` (nsa_cp/planning/request.py) once and hands it to ``_dispatch``: while
torch.compile traces, the call becomes one ``torch.ops.nsa_cp.*`` node (nsa_cp/api/ops.py); otherwise it
goes straight to ``plan.call`` (nsa_cp/planning/plan.py), which the op also runs when a compiled graph executes.
One path: ``public function -> plan -> transport -> kernel``.

Even layouts (every rank holds ``max_rank_len`` rows): ``cp_all_gather`` / ``cp_reduce_scatter`` run
exactly one ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` on the caller's tensors, nothing else,
so results are bitwise those of the plain even path.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist

from ..planning import plan
from ..geometry.layout import ShardLayout
from ..planning.request import Request

__all__ = ["cp_all_gather", "cp_reduce_scatter", "fused_add_rmsnorm_all_gather", "reduce_scatter_fused_add_rmsnorm",
           "cp_reduce_scatter_buffer"]

DeviceCounts = Tuple[torch.Tensor, torch.Tensor]


def _dispatch(req: Request, t, out, device_counts, positions, norm_args, validate):
    """The compile / eager branch, written once (QuACK's eager bypass): a traced call is one op node,
    an eager one never pays the dispatcher."""
    if torch.compiler.is_compiling():
        from . import ops

        return ops.call(req, t, out, device_counts, positions, norm_args, validate)
    return plan.call(req, t, out, device_counts, positions, norm_args, validate)


def cp_all_gather(
    x: torch.Tensor,
    layout: ShardLayout,
    group: Optional[dist.ProcessGroup] = None,
    *,
    compact: bool = False,
    out=None,
    algo: str = "auto",
    backend: str = "auto",
    validate: Optional[bool] = None,
    device_counts: Optional[DeviceCounts] = None,
    positions: Optional[torch.Tensor] = None,
    quant: Optional[str] = None,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Gather every rank's shard.

    Args:
        x: this rank's shard ``[n_r, ...]`` (``n_r = layout.per_rank_actual_token[rank]``). Tensors with
            autograd history are used by value: the result has none (the collectives are not
            differentiable).
        layout: the group's ShardLayout (the same on every rank).
        group: process group (None: the default group); NCCL for CUDA tensors, gloo for CPU.
        compact: False: padded ``[max_rank_len * cp_size, ...]`` with zero padding rows;
            True: compact ``[total_len, ...]``.
        out: optional contiguous output of exactly the result's shape, dtype and device (a ``(q, scale)``
            pair with ``quant``).
        algo: compact only, NCCL only: "auto", "padded" or "coalesced" (nsa_cp/transport/dist/moves.py).
        backend: "auto" (P2P for uneven layouts when ``nsa_cp.init_p2p`` registered a transport that
            serves the call, else NCCL/gloo; NSA_CP_BACKEND overrides), "nccl" or "p2p".
        validate: check with one small all-reduce that every rank passed the same layout and valid
            input, raising on every rank otherwise (None: NSA_CP_VALIDATE, default off). With
            ``positions`` it also checks that they are a permutation.
        device_counts: ``(counts, offsets)``, int32 ``[cp_size]`` tensors on x's device, for CUDA graphs
            captured once per bucket: ``layout`` is then the bucket (its ``max_rank_len`` fixed, ``x``
            has this rank's bucket rows) and the real per-rank counts are read from ``counts`` on the
            device at run time (update them before a replay; each <= max_rank_len). Padded layout only;
            rows of ``x`` past the real count are ignored and the padding is zeroed accordingly.
        positions: the ordered gather: an int64 ``[total_len]`` tensor on x's device, the same on every
            rank (``torch.cat(nsa_cp.in_seq_positions(...))``); compact row i (rank-major) lands in batch
            row ``positions[i]`` and the result is ``[total_len, ...]`` in batch order. Positions that
            are not a permutation still give a defined result, the same on every rank and backend, with
            every row written (no host sync, no collective): the first entry holding a value in range
            keeps it, the others (repeats, values out of range) take the rows no entry holds, in order
            (nsa_cp.planning.checks.ordered_rows). ``validate=True`` raises on them instead.
        quant: None, or "fp8_e4m3_g128": every rank's rows quantized before they move (SGLang's
            ``per_token_group_quant_fp8`` convention, nsa_cp.quant_fp8_g128); returns ``(q, scale)``:
            float8_e4m3fn ``[rows, H]`` and float32 ``[rows, H/128]``, padding rows q = 0 and scale =
            1e-10/448. Equal to quantizing the gathered rows (the quantization is per row). H must be a
            multiple of 128.

    Returns:
        The gathered tensor (``out`` when given), or ``(q, scale)``. On the P2P backend without ``out``
        it is a view of the transport's gather buffer, valid until the next gather on that group.

    Raises:
        ValueError (LayoutMismatchError with validation) on bad input; nothing is written to ``out``.
    """
    req = Request.of("cp_all_gather", x, layout, group, compact, algo, backend, quant, out, device_counts, positions)
    return _dispatch(req, x, out, device_counts, positions, None, validate)


def cp_reduce_scatter(
    y: torch.Tensor,
    layout: ShardLayout,
    group: Optional[dist.ProcessGroup] = None,
    *,
    compact: bool = False,
    out: Optional[torch.Tensor] = None,
    algo: str = "auto",
    backend: str = "auto",
    validate: Optional[bool] = None,
    device_counts: Optional[DeviceCounts] = None,
    positions: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Sum every rank's ``y`` and return this rank's rows ``[n_r, ...]``.

    Args:
        y: this rank's partials over all tokens: padded ``[max_rank_len * cp_size, ...]`` (values in
            padding rows are ignored), compact ``[total_len, ...]``, or with ``positions`` batch order
            ``[total_len, ...]``. On the P2P backend, write the partials into
            ``cp_reduce_scatter_buffer(...)`` to avoid a copy in; the sum is in fp32, in rank order.
        layout, group, compact, algo, backend, validate, device_counts: as for ``cp_all_gather`` (with
            device_counts, rows of the result past this rank's real count are meaningless).
        positions: ``y`` is in batch order; this rank's rows are ``y[positions[offsets[r] + i]]`` (the
            inverse of the ordered gather; positions that are not a permutation are mapped as there).
        out: optional contiguous ``[n_r, ...]`` output.

    Returns:
        ``[n_r, ...]``. Without ``out`` on an uneven padded layout this is a view of the first ``n_r``
        rows of an ``[max_rank_len, ...]`` buffer (no copy).
    """
    req = Request.of("cp_reduce_scatter", y, layout, group, compact, algo, backend, None, out, device_counts, positions)
    return _dispatch(req, y, out, device_counts, positions, None, validate)


def fused_add_rmsnorm_all_gather(
    x: torch.Tensor,
    residual: Optional[torch.Tensor],
    weight: torch.Tensor,
    eps: float,
    layout: ShardLayout,
    group: Optional[dist.ProcessGroup] = None,
    *,
    compact: bool = False,
    quant: Optional[str] = None,
    out=None,
    algo: str = "auto",
    backend: str = "auto",
    validate: Optional[bool] = None,
    device_counts: Optional[DeviceCounts] = None,
    positions: Optional[torch.Tensor] = None,
):
    """Add + RMSNorm this rank's rows and gather the normed rows of every rank: a layer's ``prepare_mlp``.

    Per real row (SGLang's ``RMSNorm.forward_native`` and flashinfer's convention): ``s = x + residual``
    in fp32; ``residual <- s`` rounded to the dtype, in place; ``y = s * rsqrt(mean(s^2) + eps) * weight``
    computed in fp32 and rounded once. With ``residual=None`` (a first layer): ``y = rmsnorm(x)`` and
    ``x`` is the residual. The normed rows go straight into the gather: on P2P one kernel normalises a
    row and pushes it to every peer; on NCCL one kernel writes it into this rank's slot of the output,
    then the in-place all-gather; on CPU the pure-torch reference.

    Args:
        x: ``[n_r, H]`` bf16, fp16 or fp32. residual: ``[n_r, H]`` like x (updated in place), or None.
        weight: ``[H]`` floating, on x's device. eps: the norm's epsilon.
        layout, group, compact, out, algo, backend, validate, device_counts, positions: as for
            ``cp_all_gather``.
        quant: None or "fp8_e4m3_g128": the normed rows are quantized in the same kernel and ``(q, scale)``
            moves instead of ``y`` (half the bytes); see ``cp_all_gather``.

    Returns:
        ``(gathered, residual)``: gathered as ``cp_all_gather`` returns it (padded, compact or batch order;
        padding rows zero; ``(q, scale)`` with quant), residual the updated ``[n_r, H]`` (x when None).
    """
    req = Request.of("fused_add_rmsnorm_all_gather", x, layout, group, compact, algo, backend, quant, out,
                     device_counts, positions, residual)
    gathered = _dispatch(req, x, out, device_counts, positions, (residual, weight, eps), validate)
    return gathered, (x if residual is None else residual)


def reduce_scatter_fused_add_rmsnorm(
    partials: torch.Tensor,
    residual: Optional[torch.Tensor],
    weight: torch.Tensor,
    eps: float,
    layout: ShardLayout,
    group: Optional[dist.ProcessGroup] = None,
    *,
    compact: bool = False,
    algo: str = "auto",
    backend: str = "auto",
    validate: Optional[bool] = None,
    device_counts: Optional[DeviceCounts] = None,
    positions: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Reduce-scatter the MoE partials, then the next layer's add + RMSNorm on this rank's rows: a layer's
    ``postprocess_layer`` fused with the next layer's ``prepare_attn``.

    ``h = cp_reduce_scatter(partials, ...)`` (``[n_r, H]``, in the dtype), then with ``s = h + residual``
    in fp32: ``residual <- s`` rounded, in place; ``y = s * rsqrt(mean(s^2) + eps) * weight`` rounded once
    (``residual=None``: ``y = rmsnorm(h)`` and ``h`` is the residual).

    Returns:
        ``(y, residual)``, both ``[n_r, H]``.
    """
    req = Request.of("reduce_scatter_fused_add_rmsnorm", partials, layout, group, compact, algo, backend, None, None,
                     device_counts, positions, residual)
    y, reduced = _dispatch(req, partials, None, device_counts, positions, (residual, weight, eps), validate)
    return y, (reduced if residual is None else residual)


def cp_reduce_scatter_buffer(
    like: torch.Tensor,
    layout: ShardLayout,
    group: Optional[dist.ProcessGroup] = None,
    *,
    compact: bool = False,
    backend: str = "auto",
    positions: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Where the MoE should write its partials for the next ``cp_reduce_scatter``: ``[rows, *like.shape[1:]]``
    of like's dtype and device (rows: padded, compact, or ``total_len`` with positions).

    When the reduce-scatter will take the P2P transport, this is the transport's symmetric reduce buffer
    (no copy before the pull; valid until the next reduce-scatter on that group); otherwise a fresh tensor.
    """
    return plan.buffer(Request.of("cp_reduce_scatter_buffer", like, layout, group, compact, "auto", backend, None, None,
                                  None, positions), like)
