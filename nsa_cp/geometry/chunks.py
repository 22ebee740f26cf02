"""The overlapped boundary's schedule as data: which rows each consumer call gets, in which order.

Rank ``r`` of ``P`` computes on its own rows first (step 0), then on rank ``(r - k) % P``'s rows at step
``k = 1 .. P-1`` (a ring: each rank takes a different peer first). A slot (rank q's ``n_q`` real rows) is one
chunk, or with ``chunk_rows`` ``ceil(n_q / chunk_rows)`` chunks of at most ``chunk_rows`` rows in row order.
A rank with no rows has no chunk. Every rank derives every rank's schedule from the layout alone, which is
why the ranks must agree on ``chunk_rows`` (the call fingerprint covers it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

from .layout import ShardLayout

__all__ = ["Chunk", "pieces", "schedule"]


@dataclass(frozen=True)
class Chunk:
    """The rows a consumer call gets: ``rows`` real rows of rank ``source`` from its row ``first`` on,
    which sit at ``padded_offset = source * M + first`` in the padded gather and ``compact_offset =
    offsets[source] + first`` in the compact one; ``step``: 0 for the local rows, k for the rows of
    ``(rank - k) % P``."""

    source: int
    rows: int
    padded_offset: int
    compact_offset: int
    step: int
    first: int = 0


def pieces(rows: int, chunk_rows: Optional[int]) -> List[Tuple[int, int]]:
    """``[(start, stop), ...]``: ``rows`` rows in chunks of at most ``chunk_rows`` (None: one chunk; no
    rows: none)."""
    if rows == 0:
        return []
    step = rows if not chunk_rows else chunk_rows
    return [(a, min(a + step, rows)) for a in range(0, rows, step)]


def schedule(layout: ShardLayout, rank: int, chunk_rows: Optional[int] = None) -> List[Chunk]:
    """``rank``'s consumer calls in order: its own rows (step 0), then ``(rank - k) % P``'s for
    k = 1 .. P-1, each slot as its chunks (:func:`pieces`); a rank with no rows has none."""
    size, m = layout.cp_size, layout.max_rank_len
    return [Chunk(q, b - a, q * m + a, layout.offsets[q] + a, k, a)
            for k, q in ((k, (rank - k) % size) for k in range(size))
            for a, b in pieces(layout.per_rank_actual_token[q], chunk_rows)]
