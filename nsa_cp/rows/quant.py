"""FP8 per-token-group quantization (float8_e4m3fn, groups of 128 columns): the wire format of
``cp_all_gather(..., quant="fp8_e4m3_g128")`` and ``fused_add_rmsnorm_all_gather(..., quant=...)``.

The convention is SGLang's ``per_token_group_quant_fp8`` (group_size=128, no column-major or UE8M0
scales): per row and group of 128 columns, ``amax = max |x|`` in fp32 clamped to >= 1e-10,
``scale = amax / 448``, ``q = clamp(x / scale, -448, 448)`` rounded to nearest even as float8_e4m3fn;
``scale`` is fp32 ``[rows, H/128]``, row-major. Padding rows of a gathered buffer hold ``q = 0`` and
``scale = 1e-10/448`` (``reference.FP8_PAD_SCALE``), which is what quantizing a zero row gives. The
quantization is per row, so quantizing before the gather equals quantizing the gathered rows.

Exactness: on CPU, and on GPUs through ``nsa_cp.rows.kernels.norm_rows`` (``div_rn``: correctly rounded fp32
division; bf16 rows: the group's reciprocal and a remainder correction, the same bytes), the result is
bitwise that of ``nsa_cp.rows.reference.quant_fp8_g128``. SGLang's Triton quantizer
writes ``y / y_s`` and ``amax / 448``, which Triton lowers to the approximate ``div.full.f32`` on NVIDIA
GPUs: its ``scale`` can differ from ours in the last fp32 bit, and its ``q`` by one FP8 ulp where
``x / scale`` lies within an fp32 ulp or two of an FP8 rounding boundary.

One wire row: ``fp8_wire_views`` splits a uint8 ``[rows, H + H/32]`` buffer into ``q [rows, H]`` and
``scale [rows, H/128]`` views (7168 + 224 bytes per row at H = 7168, against 14336 in bf16), so one
collective or one peer copy moves both; the kernels write into such views directly.

Handing (q, scale) to flashinfer's FP8 block-scale MoE
    ``flashinfer.fused_moe.trtllm_fp8_block_scale_moe(routing_logits, routing_bias, hidden_states,
    hidden_states_scale, gemm1_weights, gemm1_weights_scale, gemm2_weights, gemm2_weights_scale, ...)``
    takes ``hidden_states = q`` (float8_e4m3fn ``[T, H]``) and ``hidden_states_scale`` as fp32
    ``[H/128, T]``: the TRANSPOSE of our ``scale [T, H/128]``, made contiguous. SGLang's flashinfer
    runner does exactly ``a_q, a_sf = per_token_group_quant_fp8(x, 128); a_sf_t = a_sf.t().contiguous()``
    and passes ``hidden_states_scale=a_sf_t``; so with a gathered ``(q, scale)``:
    ``trtllm_fp8_block_scale_moe(..., hidden_states=q, hidden_states_scale=scale.t().contiguous(), ...)``.
    The weights' scales (``w13_weight_scale_inv`` / ``w2_weight_scale_inv``, 128x128 blocks) are the
    checkpoint's, untouched. Padding rows (``q = 0``) contribute zeros; mask their routed ids with
    ``nsa_cp.mask_padding_topk_ids`` so no expert computes them.

SGLang's DP-gather FP8 wire, for comparison
    ``SGLANG_ENABLE_DP_GATHER_FP8`` quantizes each rank's rows (``scaled_fp8_quant``, per-token or
    per-tensor scales), gathers the FP8 payload and the scales with two gatherv calls, then
    dequantizes the gathered rows as ``q.to(dtype) * scales`` before the MoE, which re-quantizes them
    for its FP8 GEMMs. ``dequant_fp8_g128(q, scale, dtype)`` is that last step for this format
    (``q * scale`` in fp32, one rounding to ``dtype``), for consumers that want bf16 rows after an
    FP8 wire; an FP8 MoE should take ``(q, scale)`` directly instead.
"""

from __future__ import annotations

from typing import Tuple

import torch

from . import reference

__all__ = [
    "quantize",
    "quant_fp8_g128",
    "dequant_fp8_g128",
    "check_fp8_g128_input",
    "fp8_wire_row_bytes",
    "fp8_wire_views",
    "FP8_GROUP",
    "FP8_PAD_SCALE",
]

from ..geometry.wire import FP8_G128, FP8_GROUP, FP8_PAD_SCALE, format_of  # noqa: E402  re-exported
_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_fp8_g128_input(x: torch.Tensor, name: str = "x", quant: str = FP8_G128) -> None:
    """ValueError naming ``name`` with its shape unless x is ``[rows, H]``, H a multiple of the format's group
    (128), dtype bf16/fp16/fp32."""
    group = format_of(quant).group
    if x.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D [rows, H] tensor for {quant}, got shape {list(x.shape)}")
    if x.shape[1] % group:
        raise ValueError(f"{name}: {quant} needs H a multiple of {group}, got shape {list(x.shape)}")
    if x.dtype not in _INPUT_DTYPES:
        raise ValueError(f"{name}: {quant} expects bfloat16, float16 or float32, got {x.dtype} (shape {list(x.shape)})")


def _triton_on(x: torch.Tensor) -> bool:
    if not x.is_cuda:
        return False
    from .kernels import triton_available

    return triton_available()


def quantize(x: torch.Tensor, quant: str = FP8_G128) -> Tuple[torch.Tensor, torch.Tensor]:
    """``x [rows, H]`` -> ``(q float8_e4m3fn [rows, H], scale fp32 [rows, H/group])`` in the wire format ``quant``
    (``nsa_cp.geometry.wire.FORMATS``: "fp8_e4m3_g128", SGLang's; "fp8_e4m3_g128_ue8m0", vLLM's power-of-two scales), on
    x's device: CUDA tensors through the Triton kernel (one launch, bitwise equal to the reference), others
    through the format's torch reference. Works on values (autograd history is ignored). ValueError naming
    x and its shape when H is not a multiple of the group or the dtype is not bf16/fp16/fp32, naming quant
    for an unknown format."""
    check_fp8_g128_input(x, quant=quant)
    if _triton_on(x):
        from .kernels import norm_rows as norm_kernels

        return norm_kernels.quantize(x.detach(), quant)
    return format_of(quant).quantize_reference(x)


def quant_fp8_g128(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``quantize(x, "fp8_e4m3_g128")``: ``x [rows, H]`` -> ``(q float8_e4m3fn [rows, H], scale fp32 [rows, H/128])``
    (SGLang's convention, module docstring)."""
    return quantize(x, FP8_G128)


def dequant_fp8_g128(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``q [rows, H]`` float8_e4m3fn, ``scale [rows, H/128]`` fp32 -> ``q * scale`` as ``dtype [rows, H]``
    (computed in fp32, rounded once). Padding rows (q = 0) come back as zeros."""
    if q.dim() != 2 or q.dtype != torch.float8_e4m3fn or q.shape[1] % FP8_GROUP:
        raise ValueError(
            f"q: expected float8_e4m3fn [rows, H] with H a multiple of {FP8_GROUP}, got {q.dtype} {list(q.shape)}"
        )
    want = [q.shape[0], q.shape[1] // FP8_GROUP]
    if list(scale.shape) != want or scale.dtype != torch.float32:
        raise ValueError(f"scale: expected float32 {want} (q's groups), got {scale.dtype} {list(scale.shape)}")
    if scale.device != q.device:
        raise ValueError(f"scale: expected device {q.device}, got {scale.device} (shape {list(scale.shape)})")
    return reference.dequant_fp8_g128(q, scale, dtype)


def fp8_wire_row_bytes(h: int) -> int:
    """Bytes of one FP8 wire row: H of q, then H/128 fp32 scales."""
    if h % FP8_GROUP:
        raise ValueError(f"h: fp8_e4m3_g128 needs H a multiple of {FP8_GROUP}, got {h}")
    return h + 4 * (h // FP8_GROUP)


def fp8_wire_views(wire: torch.Tensor, h: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``wire`` uint8 ``[rows, >= H + H/32]`` -> ``(q float8_e4m3fn [rows, H], scale fp32 [rows, H/128])`` views
    of it (q in bytes ``[0, H)`` of each row, the scales in ``[H, H + H/32)``). The row stride must be a
    multiple of 4 bytes and the buffer 4-byte aligned (true of any allocation and of whole rows of it)."""
    row = fp8_wire_row_bytes(h)
    if wire.dtype != torch.uint8 or wire.dim() != 2 or wire.shape[1] < row:
        raise ValueError(f"wire: expected uint8 [rows, {row}] for H={h}, got {wire.dtype} {list(wire.shape)}")
    if wire.shape[0] > 1 and wire.stride(0) % 4 or wire.stride(1) != 1 or wire.data_ptr() % 4:
        raise ValueError(
            f"wire: rows must start on 4-byte boundaries with unit inner stride, got strides {tuple(wire.stride())}"
        )
    q = wire[:, :h].view(torch.float8_e4m3fn)
    scale = wire[:, h:row].view(torch.float32)
    return q, scale
