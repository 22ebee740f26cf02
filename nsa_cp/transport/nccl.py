"""Moving bytes through torch.distributed (NCCL on GPUs, gloo on CPU).

Thin wrappers that pick the collective names the installed torch has: torch 2.13 renamed
``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to ``all_gather_single`` /
``reduce_scatter_single`` and deprecates the old names; torch 2.11 has only the old ones.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist

__all__ = [
    "all_gather_equal",
    "reduce_scatter_equal",
    "all_gather_uneven",
    "reduce_scatter_uneven",
    "group_rank_and_size",
]

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_rank_and_size(group: Optional[dist.ProcessGroup]):
    """``(rank, size)`` of this process in ``group`` (None: the default group)."""
    if group is None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("nsa_cp collectives need torch.distributed to be initialized")
        group = dist.group.WORLD
    # ProcessGroup.rank()/size() are plain C++ getters: dist.get_rank() costs microseconds of checks
    # on every call, and this runs on every collective.
    return group.rank(), group.size()


def all_gather_equal(out: torch.Tensor, shard: torch.Tensor, group) -> None:
    """NCCL-style equal-shard all-gather; ``shard`` may be ``out``'s own slot (in place)."""
    _all_gather_single(out, shard, group=group)


def reduce_scatter_equal(out: torch.Tensor, full: torch.Tensor, group) -> None:
    """Sum ``full [P*m, ...]`` over ranks; this rank's ``[m, ...]`` chunk lands in ``out``."""
    _reduce_scatter_single(out, full, group=group)


def all_gather_uneven(outs: List[torch.Tensor], shard: torch.Tensor, group) -> None:
    """torch's uneven-list all-gather: on NCCL, grouped broadcasts straight into ``outs`` (views)."""
    dist.all_gather(outs, shard, group=group)


def reduce_scatter_uneven(out: torch.Tensor, inputs: List[torch.Tensor], group) -> None:
    """torch's uneven-list reduce-scatter: on NCCL, grouped reduces with rank q as root of ``inputs[q]``."""
    dist.reduce_scatter(out, inputs, group=group)
