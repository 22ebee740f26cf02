"""Pack one rank's shard into its slot of the padded gather buffer, zeroing the slot's padding.

Mirrors ``reference.pack_into_slot``. The row count is read from a device tensor (``counts[rank]``), so a
CUDA graph captured once replays correctly when the counts change; the grid covers the whole slot.
Two kernels do it: the Triton one here and ``nsa_cp._C.pack_rows`` (csrc/row_copy.cu), which costs far
less host time per launch; ``impl`` / NSA_CP_ROW_KERNELS choose (see ``_rows.native_module``).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .. import _native
from ._rows import as_rows, block_shape, byte_strides, native_module

__all__ = ["pack_into_slot", "launcher"]


@triton.jit
def _pack_into_slot_kernel(
    x_ptr,
    slot_ptr,
    count_ptr,
    slot_rows,
    row_len,
    x_row_stride,
    slot_row_stride,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    n_rows = tl.load(count_ptr)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < row_len
    real = (rows < n_rows)[:, None] & col_ok[None, :]
    values = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=real, other=0.0)
    in_slot = (rows < slot_rows)[:, None] & col_ok[None, :]
    tl.store(slot_ptr + rows[:, None] * slot_row_stride + cols[None, :], values, mask=in_slot)


def pack_into_slot(x: torch.Tensor, slot: torch.Tensor, count: torch.Tensor, impl: Optional[str] = None) -> None:
    """``slot[:n] = x``, ``slot[n:] = 0`` where ``n = count.item()`` (read on device, never synced).

    Args:
        x: ``[n, ...]`` (at least n rows; rows past n are not read), trailing dims dense.
        slot: ``[M, ...]`` with the same trailing shape and dtype, a view into the gather buffer.
        count: int32 scalar tensor on x's device holding n (e.g. ``layout.device_tensors(dev)[0][rank]``).
            The native kernel clamps n to x's and the slot's rows; the Triton one reads n rows of x.
        impl: "native", "triton", "auto" or None (NSA_CP_ROW_KERNELS).
    """
    x_rows = as_rows(x, "x", writable=False)
    slot_rows = as_rows(slot, "slot", writable=True)
    m, row_len = slot_rows.shape
    if m == 0 or row_len == 0:
        return
    native = native_module(slot, impl)
    if native is not None:
        if count.dtype != torch.int32 or count.numel() != 1:
            raise ValueError(f"count: expected one int32 element, got {count.dtype} {list(count.shape)}")
        with _native.launch_device(slot.device):
            native.pack_rows(*byte_strides(x_rows), *byte_strides(slot_rows), row_len * slot.element_size(),
                             count.data_ptr(), _native.current_stream(slot.device))
        return
    block_m, block_n, warps = block_shape(row_len, slot.element_size())
    grid = (triton.cdiv(m, block_m), triton.cdiv(row_len, block_n))
    _pack_into_slot_kernel[grid](
        x_rows,
        slot_rows,
        count,
        m,
        row_len,
        x_rows.stride(0),
        slot_rows.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=warps,
    )


def launcher(device: torch.device, row_len: int, element_size: int, count: torch.Tensor, impl: Optional[str] = None):
    """``launch(x, slot)``: ``pack_into_slot(x, slot, count)`` with everything that does not change from
    call to call (the kernel choice, the row width, the count's address) resolved once, for a plan.

    ``x [n, row_len]`` and ``slot [M, row_len]`` are 2-D with unit inner stride (the plan's call checks
    and ``as_rows`` views make them so); ``count`` stays alive as long as the launcher.
    """
    native = native_module(count, impl) if count.is_cuda else None
    if native is None:
        return lambda x, slot: pack_into_slot(x, slot, count, impl="triton" if count.is_cuda else impl)
    if count.dtype != torch.int32 or count.numel() != 1:
        raise ValueError(f"count: expected one int32 element, got {count.dtype} {list(count.shape)}")
    row_bytes, count_ptr, index = row_len * element_size, count.data_ptr(), count.device.index
    pack_rows, stream, place = native.pack_rows, _native.current_stream, _native.launch_device

    def launch(x: torch.Tensor, slot: torch.Tensor) -> None:
        if slot.shape[0] == 0 or row_bytes == 0:
            return
        with place(slot.device):
            pack_rows(x.data_ptr(), x.stride(0) * element_size, x.shape[0], slot.data_ptr(),
                      slot.stride(0) * element_size, slot.shape[0], row_bytes, count_ptr, stream(slot.device))

    launch.keep = count
    return launch
