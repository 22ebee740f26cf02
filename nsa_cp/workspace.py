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

__all__ = ["Allocation", "workspace_plan", "workspace_bytes", "check_budget", "allocate", "SIGNAL_WORDS", "NUM_CHANNELS"]

logger = logging.getLogger("nsa_cp")

SIGNAL_WORDS = 256  # >= channels * 2 phases * max world 8; the symmetric signal area
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


def workspace_plan(
    cp_size: int, max_tokens_per_rank: int, hidden_size: int, dtype: torch.dtype
) -> Tuple[Allocation, ...]:
    """Every device allocation of one rank's P2P transport, in allocation order."""
    for name, value in (("cp_size", cp_size), ("max_tokens_per_rank", max_tokens_per_rank), ("hidden_size", hidden_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
    rows = cp_size * max_tokens_per_rank  # the padded layout at capacity; compact always fits inside
    return (
        Allocation("gather", (rows, hidden_size), dtype, True),
        Allocation("reduce", (rows, hidden_size), dtype, True),
        Allocation("signals", (SIGNAL_WORDS,), torch.int32, True),
        Allocation("gather_ptrs", (cp_size,), torch.int64, False),
        Allocation("reduce_ptrs", (cp_size,), torch.int64, False),
        Allocation("pad_ptrs", (cp_size,), torch.int64, False),
        Allocation("seq", (NUM_CHANNELS,), torch.int32, False),
        Allocation("arrive", (NUM_CHANNELS,), torch.int32, False),
    )


def workspace_bytes(cp_size: int, max_tokens_per_rank: int, hidden_size: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Exact device bytes one rank's P2P transport (and so the communicator) allocates.

    >>> workspace_bytes(2, 32768, 7168, torch.bfloat16)  # 2 buffers of 2*32768 rows of 14336 B
    1879049280
    """
    return sum(a.nbytes for a in workspace_plan(cp_size, max_tokens_per_rank, hidden_size, dtype))


def check_budget(
    budget: Optional[int], cp_size: int, max_tokens_per_rank: int, hidden_size: int, dtype: torch.dtype
) -> int:
    """The bytes required; logs a warning when an explicit ``budget`` is smaller (the transport still
    allocates what it needs: a short workspace would be overrun, never silently used)."""
    required = workspace_bytes(cp_size, max_tokens_per_rank, hidden_size, dtype)
    if budget is not None and budget < required:
        logger.warning(
            "nsa_cp workspace: workspace_bytes=%d is smaller than the %d bytes required for cp_size %d x "
            "%d tokens/rank x hidden %d x %s; allocating %d. Set workspace_bytes=%d "
            "(nsa_cp.workspace_bytes(...)) or lower max_tokens_per_rank.",
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
