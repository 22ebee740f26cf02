"""ShardLayout: the geometry of one uneven context-parallel shard set.

Rank r holds ``n_r = per_rank_actual_token[r]`` rows (0 allowed). Two global layouts exist:

* padded (rank-major) ``[max_rank_len * cp_size, *rest]``: rank r's rows at ``[r*M, r*M + n_r)``,
  rows ``[r*M + n_r, (r+1)*M)`` are zero (``M = max_rank_len``). This is what NCCL's equal-shard
  collectives and SGLang's communicator use.
* compact ``[sum(n), *rest]``: rank r's rows at ``[offsets[r], offsets[r] + n_r)``, no padding.

A layout is immutable and hashable (equal counts and align compare equal), so it can key caches of
compiled graphs or workspaces. It keeps small int32 device copies of the counts and offsets for kernels,
created once per device.
"""

from __future__ import annotations

import operator
from typing import Dict, Iterable, List, Sequence, Tuple

import torch

__all__ = ["ShardLayout"]


def int_list(values: Iterable, name: str, what: str) -> List[int]:
    """``values`` as a list of ints (``operator.index`` of each; a bool is not one here), or a ValueError
    ``"{name}[i]: expected {what}, got ..."`` naming the first that is not one."""
    ints = []
    for i, n in enumerate(values):
        try:
            if isinstance(n, bool):
                raise TypeError
            ints.append(operator.index(n))
        except TypeError:
            raise ValueError(f"{name}[{i}]: expected {what}, got {n!r}") from None
    return ints


class ShardLayout:
    """Per-rank token counts of a CP group, validated at construction.

    Args:
        per_rank_actual_token: one non-negative count per rank (``cp_size = len(...)``).
        align: ``max_rank_len`` is ``max(counts)`` rounded up to a multiple of ``align`` (>= 1).
    """

    __slots__ = (
        "_counts",
        "_align",
        "_max_rank_len",
        "_offsets",
        "_total_len",
        "_hash",
        "_device_cache",
    )

    def __init__(self, per_rank_actual_token: Sequence[int], align: int = 1):
        if isinstance(per_rank_actual_token, torch.Tensor):
            per_rank_actual_token = per_rank_actual_token.tolist()
        if isinstance(per_rank_actual_token, (str, bytes)) or not isinstance(per_rank_actual_token, Iterable):
            raise ValueError(
                "per_rank_actual_token: expected a sequence of ints, one count per rank (e.g. ShardLayout([4]) "
                f"for one rank of 4 tokens), got {type(per_rank_actual_token).__name__} {per_rank_actual_token!r}"
            )
        counts = tuple(int_list(per_rank_actual_token, "per_rank_actual_token", "a non-negative int"))
        if len(counts) == 0:
            raise ValueError("per_rank_actual_token: expected at least one rank, got an empty sequence")
        negative = [(r, n) for r, n in enumerate(counts) if n < 0]
        if negative:
            r, n = negative[0]
            raise ValueError(
                f"per_rank_actual_token[{r}]: expected a count >= 0, got {n} (counts {list(counts)})"
            )
        if isinstance(align, bool) or not isinstance(align, int) or align < 1:
            raise ValueError(f"align: expected an int >= 1, got {align!r}")
        biggest = max(counts)
        self._counts: Tuple[int, ...] = counts
        self._align = align
        self._max_rank_len = -(-biggest // align) * align
        offsets = []
        running = 0
        for n in counts:
            offsets.append(running)
            running += n
        self._offsets: Tuple[int, ...] = tuple(offsets)
        self._total_len = running
        self._hash = hash((counts, align))  # layouts key every plan lookup: hash once
        self._device_cache: Dict[torch.device, Tuple[torch.Tensor, torch.Tensor]] = {}

    # ----------------------------------------------------------------- attributes
    @property
    def per_rank_actual_token(self) -> Tuple[int, ...]:
        return self._counts

    @property
    def align(self) -> int:
        return self._align

    @property
    def cp_size(self) -> int:
        return len(self._counts)

    @property
    def max_rank_len(self) -> int:
        """``M``: rows per rank slot in the padded layout."""
        return self._max_rank_len

    @property
    def padded_len(self) -> int:
        """Rows of the padded layout: ``max_rank_len * cp_size``."""
        return self._max_rank_len * len(self._counts)

    @property
    def total_len(self) -> int:
        """Rows of the compact layout: ``sum(per_rank_actual_token)``."""
        return self._total_len

    @property
    def offsets(self) -> Tuple[int, ...]:
        """Exclusive prefix sum of the counts: rank r's first row in the compact layout."""
        return self._offsets

    @property
    def is_even(self) -> bool:
        """True when every rank fills its slot: padded == compact, the plain NCCL path applies."""
        return all(n == self._max_rank_len for n in self._counts)

    @property
    def padding_rows(self) -> int:
        return self.padded_len - self._total_len

    def count(self, rank: int) -> int:
        return self._counts[rank]

    def rows(self, rank: int, compact: bool) -> Tuple[int, int]:
        """``(start, stop)`` of rank's rows in the compact or padded layout."""
        start = self._offsets[rank] if compact else rank * self._max_rank_len
        return start, start + self._counts[rank]

    def global_len(self, compact: bool) -> int:
        return self._total_len if compact else self.padded_len

    # ----------------------------------------------------------------- device copies
    def device_tensors(self, device) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(counts, offsets)`` as int32 tensors of shape ``[cp_size]`` on ``device``, cached.

        The first call per device copies from the host (for CUDA: outside graph capture, please).
        """
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        cached = self._device_cache.get(device)
        if cached is None:
            counts = torch.tensor(self._counts, dtype=torch.int32, device=device)
            offsets = torch.tensor(self._offsets, dtype=torch.int32, device=device)
            cached = (counts, offsets)
            self._device_cache[device] = cached
        return cached

    # ----------------------------------------------------------------- value semantics
    def _key(self):
        return (self._counts, self._align)

    def __eq__(self, other):
        if not isinstance(other, ShardLayout):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self):
        return self._hash

    def __setattr__(self, name, value):
        if hasattr(self, "_device_cache"):
            raise AttributeError("ShardLayout is immutable")
        object.__setattr__(self, name, value)

    def __reduce__(self):
        return (ShardLayout, (self._counts, self._align))

    def __repr__(self):
        return (
            f"ShardLayout(per_rank_actual_token={list(self._counts)}, align={self._align}, "
            f"max_rank_len={self._max_rank_len})"
        )
