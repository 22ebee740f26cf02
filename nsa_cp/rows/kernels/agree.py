"""The device half of the torch.distributed transport's agreement check: compare the ranks' call fingerprints
(gathered beside the rows) and, where they differ, overwrite the call's result with NaN and set the group's
error record (nsa_cp/transport/dist/agreement.py). One launch per call; it reads ``P * F`` int32 words and,
when every rank agrees, writes nothing. No host sync: a record it sets is also written to ``host`` (the
record's pinned host copy, mapped into the device's address space), where the host reads it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .exact_fp32 import COMPILED

__all__ = ["check_and_poison", "POISON_BITS", "SET_BIT"]

SET_BIT = 1 << 30  # the record's "a mismatch was seen" bit; bits 0..F-1 name the fields that differed

# the word type and bit pattern that poisons each result dtype: NaN for the floating ones (fp8: 0xFF is
# NaN in e4m3fn and e5m2), all ones for the integer ones
POISON_BITS = {
    torch.float32: (torch.int32, 0x7FC00000), torch.float64: (torch.int64, 0x7FF8000000000000),
    torch.bfloat16: (torch.int16, 0x7FC0), torch.float16: (torch.int16, 0x7E00),
    torch.float8_e4m3fn: (torch.int8, -1), torch.float8_e5m2: (torch.int8, -1), torch.uint8: (torch.int8, -1),
    torch.int8: (torch.int8, -1), torch.int32: (torch.int32, -1), torch.int64: (torch.int64, -1),
    # the fnuz formats' one NaN is 0x80
    **{getattr(torch, n): (torch.int8, -128) for n in ("float8_e4m3fnuz", "float8_e5m2fnuz") if hasattr(torch, n)},
}

_WORDS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_TL_WORDS = {torch.int8: tl.int8, torch.int16: tl.int16, torch.int32: tl.int32, torch.int64: tl.int64}
# result dtypes the kernel writes through their own pointer (the poison word bitcast to them); the others
# (fp8, bool, ...) through a view as their integer word
_AS_IS = frozenset((torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
                    torch.int16, torch.int32, torch.int64))
_BLOCK = 1024
_MAX_PROGRAMS = 32  # poisoning runs only on a mismatch: a few programs, grid-stride


@triton.jit
def _check_and_poison_kernel(table_ptr, rank, record_ptr, host_ptr, out_ptr, numel, value, step,
                             P: tl.constexpr, F: tl.constexpr, PB: tl.constexpr, FB: tl.constexpr,
                             WORD: tl.constexpr, BLOCK: tl.constexpr, STRIDE: tl.constexpr):
    ranks = tl.arange(0, PB)[:, None]
    fields = tl.arange(0, FB)
    inside = (ranks < P) & (fields[None, :] < F)
    words = tl.load(table_ptr + ranks * F + fields[None, :], mask=inside, other=0)
    own = tl.load(table_ptr + rank * F + fields, mask=fields < F, other=0)
    differs = tl.max(tl.where(inside & (words != own[None, :]), 1, 0), axis=0)  # per field
    mask = tl.sum(differs << fields)  # distinct bits: the sum is their OR
    before = tl.load(record_ptr)  # set by an earlier call the host has not raised for: poison again
    if (mask != 0) | (before != 0):
        pid = tl.program_id(0)
        if pid == 0:
            now = before | mask | (1 << 30)
            tl.store(record_ptr, now)
            tl.store(host_ptr, now)
        # the poison word (truncated from int64), its bits as the result's element type
        poison = (tl.zeros((BLOCK,), tl.int64) + value).to(WORD).to(out_ptr.dtype.element_ty, bitcast=True)
        if STRIDE:  # compiled: a few programs, grid-stride (step = programs * BLOCK)
            for start in range(0, numel, step):
                offs = start + pid * BLOCK + tl.arange(0, BLOCK)
                tl.store(out_ptr + offs, poison, mask=offs < numel)
        else:  # Triton 3.6's interpreter takes no runtime argument as a loop bound: a program per block
            offs = pid * BLOCK + tl.arange(0, BLOCK)
            tl.store(out_ptr + offs, poison, mask=offs < numel)


def check_and_poison(table: torch.Tensor, rank: int, record: torch.Tensor, out: torch.Tensor,
                     host: torch.Tensor = None) -> None:
    """Compare row ``rank`` of ``table [P, F]`` (int32, every rank's fingerprint words) with every row; where
    any differs (or ``record`` is already set), ``record[0] |= SET_BIT | (bit f per differing field f)``, the
    same value is written to ``host[0]`` (default: ``record``; a pinned CPU tensor is written through its
    device mapping), and every element of ``out`` (contiguous, any dtype of POISON_BITS) is overwritten with
    its poison (NaN). Nothing is allocated."""
    size, nfields = table.shape
    word, value = POISON_BITS.get(out.dtype) or (_WORDS[out.element_size()], -1)
    numel = out.numel() if out.is_contiguous() else 0  # a strided result (never nsa_cp's own) keeps its values
    if not numel:  # nothing to poison; the record is set all the same
        out, word, value = table, torch.int32, 0
    elif out.dtype not in _AS_IS:
        out = out.view(-1).view(word)
    # compiled: a few programs, grid-stride; Triton's interpreter (TRITON_INTERPRET=1): a program per block
    programs = max(1, triton.cdiv(numel, _BLOCK))  # one at least: the record is set with nothing to poison
    if COMPILED:
        programs = min(_MAX_PROGRAMS, programs)
    _check_and_poison_kernel[(programs,)](
        table, rank, record, record if host is None else host, out, numel, value, programs * _BLOCK, P=size,
        F=nfields, PB=triton.next_power_of_2(size), FB=triton.next_power_of_2(nfields), WORD=_TL_WORDS[word],
        BLOCK=_BLOCK, STRIDE=COMPILED)
