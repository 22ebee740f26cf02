"""What the row-copy kernels share: tensors as ``[rows, row_len]`` with unit inner stride, the choice
between the native and the Triton kernel, and the Triton launch geometry."""

from __future__ import annotations

import math
from types import ModuleType
from typing import Optional

import torch
import triton

from .. import _native
from ... import envs

_IMPLS = ("auto", "native", "triton")

_CHUNK_BYTES = 4096  # one program's span along a row: 16-byte vectors for a whole warp group
_PROGRAM_BYTES = 16384  # bytes one program moves: enough loads in flight, small enough grids stay wide


def as_rows(t: torch.Tensor, name: str, writable: bool) -> torch.Tensor:
    """View ``t [rows, ...]`` as ``[rows, row_len]``; inputs may be copied, outputs must be views."""
    if t.dim() == 2 and (t.shape[1] <= 1 or t.stride(1) == 1):
        return t
    rows = t.reshape(t.shape[0], math.prod(t.shape[1:]))
    dense = rows.shape[1] <= 1 or rows.stride(1) == 1
    if not dense:
        rows = rows.contiguous()
    if writable and t.numel() > 0 and (rows.data_ptr() != t.data_ptr() or not dense):
        raise ValueError(f"{name}: trailing dims must be dense to write in place, got strides {tuple(t.stride())}")
    return rows


_ROW_KERNELS = envs.reader("NSA_CP_ROW_KERNELS")


def native_module(t: torch.Tensor, impl: Optional[str]) -> Optional[ModuleType]:
    """``nsa_cp._C`` when this call on ``t`` takes the native kernel, None for the Triton one.

    ``impl``: "native", "triton" or "auto" (native for CUDA tensors when ``nsa_cp._C`` is available and
    has kernels for their device: see ``_native.device_support``);
    None reads NSA_CP_ROW_KERNELS. "native" where it cannot run raises ValueError saying why.
    """
    if impl is None:
        impl = _ROW_KERNELS()
    if impl == "triton":
        return None
    if impl not in _IMPLS:
        raise ValueError(f"impl: expected one of {_IMPLS}, got {impl!r}")
    if t.is_cuda:
        verdict = _native.device_support(t.device.index)
        if verdict:
            return _native.load()
        why = verdict.reason
    else:
        why = "the tensors are not on a CUDA device"
    if impl == "native":
        raise ValueError(f"impl: 'native' row kernels cannot run here: {why}")
    return None


def byte_strides(t: torch.Tensor):
    """``(data_ptr, row stride in bytes, rows)`` of a ``[rows, row_len]`` tensor."""
    return t.data_ptr(), t.stride(0) * t.element_size(), t.shape[0]


def block_shape(row_len: int, element_size: int):
    """(BLOCK_M, BLOCK_N, num_warps) for a row-copy kernel."""
    block_n = max(16, min(triton.next_power_of_2(max(row_len, 1)), _CHUNK_BYTES // element_size))
    block_m = max(1, _PROGRAM_BYTES // (block_n * element_size))
    return block_m, block_n, 4
