"""Argument checks of the row kernels (``norm_rows``): a ValueError naming the tensor, the expected and the
actual shape (or dtype, device, stride), raised before anything is written."""

from __future__ import annotations

from typing import Optional

import torch

from ...geometry.wire import FORMATS

QUANT_MODES = tuple(FORMATS)
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_ROW = 65536  # elements a program holds in registers; longer rows are refused


def shape_of(t: torch.Tensor) -> list:
    return list(t.shape)


def check_x(x: torch.Tensor, name: str = "x") -> int:
    if x.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D [rows, H] tensor, got shape {shape_of(x)}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name}: expected dtype bfloat16, float16 or float32, got {x.dtype} (shape {shape_of(x)})")
    h = x.shape[1]
    if h > MAX_ROW:
        raise ValueError(f"{name}: rows of at most {MAX_ROW} elements, got shape {shape_of(x)}")
    return h


def check_dense(t: torch.Tensor, name: str) -> None:
    if t.dim() == 2 and t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{name}: rows must have unit inner stride, got shape {shape_of(t)} strides {tuple(t.stride())}")


def check_like(t: torch.Tensor, name: str, shape, dtype: torch.dtype, device: torch.device) -> None:
    if list(t.shape) != list(shape):
        raise ValueError(f"{name}: expected shape {list(shape)}, got {shape_of(t)}")
    if t.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype}, got {t.dtype} (shape {shape_of(t)})")
    if t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device} (shape {shape_of(t)})")
    check_dense(t, name)


def check_norm_args(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor) -> int:
    h = check_x(x)
    if residual is not None:
        check_like(residual, "residual", x.shape, x.dtype, x.device)
    if weight.dim() != 1 or weight.shape[0] != h:
        raise ValueError(f"weight: expected shape [{h}] (x's last dim), got {shape_of(weight)}")
    if not weight.dtype.is_floating_point or weight.dtype.itemsize == 1:
        raise ValueError(f"weight: expected a bf16/fp16/fp32 tensor of shape [{h}], got {weight.dtype}")
    if weight.device != x.device:
        raise ValueError(f"weight: expected device {x.device}, got {weight.device} (shape {shape_of(weight)})")
    return h


def check_quant(quant: Optional[str], h: int, x: torch.Tensor) -> None:
    if quant is not None and quant not in QUANT_MODES:
        raise ValueError(f"quant: expected None or one of {QUANT_MODES}, got {quant!r}")
    if quant is not None and h % FORMATS[quant].group:
        raise ValueError(f"x: {quant} needs H a multiple of {FORMATS[quant].group}, got shape {shape_of(x)}")


def check_count(count: torch.Tensor, device: torch.device) -> None:
    if count.dtype != torch.int32 or count.numel() != 1 or count.device != device:
        raise ValueError(
            f"count: expected one int32 element on {device}, got {count.dtype} {shape_of(count)} on {count.device}"
        )
