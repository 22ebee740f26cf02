"""Sizing up front: every persistent buffer of the P2P transport, derived from its capacity alone.

``workspace_plan`` lists the allocations (name, shape, dtype, symmetric or local); the transport
allocates exactly that list through ``allocate`` and nothing else on the device, so
``workspace_bytes`` is the exact number of device bytes it requests per rank. (The allocator may round
each request up to its own granularity; the host-mapped 16-byte error record is host memory and not
counted.) The NCCL path keeps no workspace: its outputs are allocated per call.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Callable, Dict, Optional, Tuple

import torch

from .. import envs

__all__ = ["Allocation", "workspace_plan", "workspace_bytes", "double_buffer_rows", "check_budget", "allocate", "SIGNAL_WORDS", "NUM_CHANNELS"]

logger = logging.getLogger("nsa_cp")

SIGNAL_WORDS = 256  # the symmetric signal pad: nsa_cp._C.SIGNAL_WORDS (epoch slots, then done counters)
NUM_CHANNELS = 2  # gather, reduce-scatter


@dataclasses.dataclass(frozen=True)
class Allocation:
    name: str
    shape: Tuple[int, ...]
    dtype: torch.dtype
    symmetric: bool  # symmetric memory, mapped into every peer; else ordinary local device memory

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def double_buffer_rows(max_tokens_per_rank: int, double_buffer_tokens: Optional[int] = None) -> int:
    """Tokens per rank of the second gather buffer: ``double_buffer_tokens`` (None:
    NSA_CP_P2P_DOUBLE_BUFFER_TOKENS) capped at the capacity; 0 when there is none."""
    if double_buffer_tokens is None:
        double_buffer_tokens = envs.NSA_CP_P2P_DOUBLE_BUFFER_TOKENS
    if isinstance(double_buffer_tokens, bool) or not isinstance(double_buffer_tokens, int) or double_buffer_tokens < 0:
        raise ValueError(f"double_buffer_tokens: expected an int >= 0, got {double_buffer_tokens!r}")
    return min(max_tokens_per_rank, double_buffer_tokens)


def workspace_plan(
    cp_size: int,
    max_tokens_per_rank: int,
    hidden_size: int,
    dtype: torch.dtype,
    double_buffer_tokens: Optional[int] = None,
) -> Tuple[Allocation, ...]:
    """Every device allocation of one rank's P2P transport, in allocation order.

    ``gather_alt`` (absent when ``double_buffer_rows`` is 0) is the second gather buffer, for
    ``cp_size * double_buffer_rows`` rows; ``gather_ptrs`` row 1 holds its peers' addresses (row 0 again
    when it is absent). ``gather_state`` is the gather kernel's own: the tag of the buffer the last
    gather wrote, and the done-counter total consumed (csrc/p2p_gather.cu).
    """
    for name, value in (("cp_size", cp_size), ("max_tokens_per_rank", max_tokens_per_rank), ("hidden_size", hidden_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
    rows = cp_size * max_tokens_per_rank  # the padded layout at capacity; compact always fits inside
    alt_rows = cp_size * double_buffer_rows(max_tokens_per_rank, double_buffer_tokens)
    alt = (Allocation("gather_alt", (alt_rows, hidden_size), dtype, True),) if alt_rows else ()
    return (
        Allocation("gather", (rows, hidden_size), dtype, True),
        *alt,
        Allocation("reduce", (rows, hidden_size), dtype, True),
        Allocation("signals", (SIGNAL_WORDS,), torch.int32, True),
        Allocation("gather_ptrs", (2, cp_size), torch.int64, False),
        Allocation("reduce_ptrs", (cp_size,), torch.int64, False),
        Allocation("pad_ptrs", (cp_size,), torch.int64, False),
        Allocation("seq", (NUM_CHANNELS,), torch.int32, False),
        Allocation("arrive", (NUM_CHANNELS,), torch.int32, False),
        Allocation("gather_state", (2,), torch.int32, False),
    )


def workspace_bytes(
    cp_size: int,
    max_tokens_per_rank: int,
    hidden_size: int,
    dtype: torch.dtype = torch.bfloat16,
    double_buffer_tokens: Optional[int] = None,
) -> int:
    """Exact device bytes one rank's P2P transport (and so the communicator) allocates.

    ``double_buffer_tokens``: as given to the transport (None: NSA_CP_P2P_DOUBLE_BUFFER_TOKENS).

    >>> workspace_bytes(2, 32768, 7168, torch.bfloat16, double_buffer_tokens=0)  # 2 buffers of 2*32768 rows of 14336 B
    1879049304
    >>> workspace_bytes(2, 32768, 7168, torch.bfloat16, double_buffer_tokens=1024)  # + 2*1024 rows
    1908409432
    """
    plan = workspace_plan(cp_size, max_tokens_per_rank, hidden_size, dtype, double_buffer_tokens)
    return sum(a.nbytes for a in plan)


def check_budget(
    budget: Optional[int],
    cp_size: int,
    max_tokens_per_rank: int,
    hidden_size: int,
    dtype: torch.dtype,
    double_buffer_tokens: Optional[int] = None,
) -> int:
    """The bytes required; logs a warning when an explicit ``budget`` is smaller (the transport still
    allocates what it needs: a short workspace would be overrun, never silently used)."""
    required = workspace_bytes(cp_size, max_tokens_per_rank, hidden_size, dtype, double_buffer_tokens)
    if budget is not None and budget < required:
        logger.warning(
            "nsa_cp workspace: workspace_bytes=%d is smaller than the %d bytes required for cp_size %d x "
            "%d tokens/rank x hidden %d x %s; allocating %d. Set workspace_bytes=%d "
            "(nsa_cp.transport.workspace_bytes(...)) or lower max_tokens_per_rank.",
            budget, required, cp_size, max_tokens_per_rank, hidden_size, dtype, required, required,
        )
    return required


def allocate(
    plan: Tuple[Allocation, ...],
    symmetric: Callable[[Allocation], torch.Tensor],
    local: Callable[[Allocation], torch.Tensor],
) -> Dict[str, torch.Tensor]:
    """Allocate every entry of ``plan`` with the matching allocator; returns name -> tensor."""
    tensors = {}
    for entry in plan:
        tensor = (symmetric if entry.symmetric else local)(entry)
        if tuple(tensor.shape) != entry.shape or tensor.dtype != entry.dtype:
            raise RuntimeError(f"allocator returned {tuple(tensor.shape)} {tensor.dtype} for {entry}")
        tensors[entry.name] = tensor
    return tensors
