"""The page-aligned zigzag in-seq split, and the index maps that go with it.

Each request of length ``L`` is cut into ``2 * cp_size`` consecutive blocks; rank ``r`` owns blocks
``r`` and ``2 * cp_size - 1 - r`` (zigzag, so every rank gets one early and one late block and causal
attention work is balanced). The request is first cut into ``ceil(L / page_size)`` pages (the last may
be partial) and the *pages* are dealt to the blocks: every block gets ``pages // (2 cp)`` pages and the
first ``pages % (2 cp)`` blocks get one more. A block's length is the number of tokens in its pages,
so every block boundary is a page boundary, except where it meets the end of the request. With
``page_size=1`` this is SGLang's token split (block lengths ``L // (2 cp)``, the first ``L % (2 cp)``
blocks one longer). Per-rank counts are sums over the requests of the batch.

Worked example: ``cp_size=2`` (4 blocks), ``page_size=2``, one request of ``L=7`` tokens::

    tokens   0 1 | 2 3 | 4 5 | 6        4 pages: [0,1] [2,3] [4,5] [6]
    blocks   b0  | b1  | b2  | b3       4 pages over 4 blocks: one page each
    ranks    r0  | r1  | r1  | r0       rank r owns blocks r and 3 - r

    in_seq_split([7], 2, page_size=2)     -> [3, 4]
    in_seq_positions([7], 2, page_size=2) -> [tensor([0, 1, 6]), tensor([2, 3, 4, 5])]

With two requests ``[7, 3]`` (same cp_size / page_size), the second request's tokens are global
positions 7, 8, 9; it has 2 pages ([7, 8] and [9]) dealt to blocks b0 and b1, so b2 and b3 are empty.
A rank's local order is block ``r`` of every request in request order, then block ``2 cp - 1 - r`` of
every request in request order::

    rank 0: b0(req0) b0(req1) b3(req0) b3(req1) = [0, 1, 7, 8, 6]
    rank 1: b1(req0) b1(req1) b2(req0) b2(req1) = [2, 3, 9, 4, 5]

``in_seq_restore_index`` is the inverse of ``torch.cat(in_seq_positions(...))``: after the ranks'
shards are gathered in compact layout (rank-major, no padding), ``compact[restore]`` is back in the
batch's original token order.

All three functions share one private helper, :func:`_block_bounds`, that computes every request's
block starts and lengths at once with a few vectorised torch ops (CPU, int64).
"""

from __future__ import annotations

import operator
from typing import List, Sequence, Tuple, Union

import torch

from .layout import int_list

__all__ = ["in_seq_split", "in_seq_positions", "in_seq_restore_index"]

SeqLens = Union[Sequence[int], torch.Tensor]


# ----------------------------------------------------------------- validation
def _check_positive_int(name: str, value) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
    try:
        v = operator.index(value)
    except TypeError:
        raise ValueError(f"{name}: expected an int >= 1, got {value!r}") from None
    if v < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {v}")
    return v


def _check_seq_lens(seq_lens) -> torch.Tensor:
    """Validate ``seq_lens`` and return it as a 1-D int64 CPU tensor."""
    if isinstance(seq_lens, torch.Tensor):
        if seq_lens.dim() != 1:
            raise ValueError(
                f"seq_lens: expected a 1-D tensor of ints >= 0, got a tensor of shape {tuple(seq_lens.shape)}"
            )
        if seq_lens.dtype == torch.bool or seq_lens.dtype.is_floating_point or seq_lens.dtype.is_complex:
            raise ValueError(f"seq_lens: expected an integer tensor of ints >= 0, got dtype {seq_lens.dtype}")
        lens = seq_lens.detach().to(device="cpu", dtype=torch.int64)
    else:
        if isinstance(seq_lens, (str, bytes)) or not isinstance(seq_lens, Sequence):
            raise ValueError(f"seq_lens: expected a sequence or 1-D tensor of ints >= 0, got {seq_lens!r}")
        lens = torch.tensor(int_list(seq_lens, "seq_lens", "an int >= 0"), dtype=torch.int64)
    if lens.numel() and bool((lens < 0).any()):
        i = int(torch.nonzero(lens < 0)[0])
        raise ValueError(f"seq_lens[{i}]: expected an int >= 0, got {int(lens[i])}")
    return lens


# ----------------------------------------------------------------- core
def _block_bounds(seq_lens: SeqLens, cp_size: int, page_size: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
    """Validate the arguments and compute every request's block geometry.

    Returns ``(starts, lens)``, both int64 CPU tensors of shape ``[num_requests, 2 * cp_size]``:
    ``starts[i, b]`` is the global position (index into the batch's concatenated tokens) of the first
    token of block ``b`` of request ``i`` and ``lens[i, b]`` its token count (0 allowed).
    """
    cp_size = _check_positive_int("cp_size", cp_size)
    page_size = _check_positive_int("page_size", page_size)
    L = _check_seq_lens(seq_lens)                                    # [R]
    nb = 2 * cp_size
    pages = (L + (page_size - 1)) // page_size                       # [R]
    extra = torch.arange(nb, dtype=torch.int64) < (pages % nb).unsqueeze(1)   # [R, nb]
    block_pages = (pages // nb).unsqueeze(1) + extra                 # [R, nb]
    ends = torch.minimum(torch.cumsum(block_pages, dim=1) * page_size, L.unsqueeze(1))  # [R, nb]
    local_starts = torch.cat([torch.zeros_like(ends[:, :1]), ends[:, :-1]], dim=1)
    lens = ends - local_starts
    req_offsets = torch.cumsum(L, dim=0) - L                         # exclusive prefix sum, [R]
    starts = local_starts + req_offsets.unsqueeze(1)
    return starts, lens


def _rank_order(cp_size: int) -> torch.Tensor:
    """``[cp_size, 2]`` block ids of each rank in local order: ``(r, 2 * cp_size - 1 - r)``."""
    r = torch.arange(cp_size, dtype=torch.int64)
    return torch.stack([r, 2 * cp_size - 1 - r], dim=1)


def _all_positions(seq_lens: SeqLens, cp_size: int, page_size: int) -> Tuple[torch.Tensor, List[int]]:
    """Concatenated positions of all ranks (rank-major, local order) and the per-rank counts."""
    starts, lens = _block_bounds(seq_lens, cp_size, page_size)
    cp_size = operator.index(cp_size)
    order = _rank_order(cp_size)                                     # [cp, 2]
    # segments in output order: rank, then which of its two blocks, then request -> [cp, 2, R]
    seg_starts = starts.t()[order]
    seg_lens = lens.t()[order]
    counts = seg_lens.sum(dim=(1, 2)).tolist()
    seg_starts = seg_starts.reshape(-1)
    seg_lens = seg_lens.reshape(-1)
    total = int(sum(counts))
    out_starts = torch.cumsum(seg_lens, dim=0) - seg_lens            # where each segment lands
    shift = torch.repeat_interleave(seg_starts - out_starts, seg_lens, output_size=total)
    positions = torch.arange(total, dtype=torch.int64) + shift
    return positions, [int(c) for c in counts]


# ----------------------------------------------------------------- public API
def in_seq_split(seq_lens: SeqLens, cp_size: int, page_size: int = 1) -> List[int]:
    """Per-rank token counts of the page-aligned zigzag in-seq split.

    Args:
        seq_lens: ``[num_requests]`` request lengths, ints >= 0 (a sequence or a 1-D integer tensor).
        cp_size: number of CP ranks, int >= 1.
        page_size: KV-cache page size in tokens, int >= 1; blocks are whole pages.

    Returns:
        ``list[int]`` of length ``cp_size``: ``counts[r]`` tokens held by rank ``r`` (sum = sum(seq_lens)).

    Example: ``in_seq_split([9, 10], 4) == [6, 5, 4, 4]``.
    """
    _, lens = _block_bounds(seq_lens, cp_size, page_size)
    per_block = lens.sum(dim=0)                                      # [2cp]
    order = _rank_order(operator.index(cp_size))
    return [int(c) for c in per_block[order].sum(dim=1).tolist()]


def in_seq_positions(seq_lens: SeqLens, cp_size: int, page_size: int = 1) -> List[torch.Tensor]:
    """Global positions each rank holds, in the rank's local (zigzag) order.

    Rank ``r``'s local order is block ``r`` of every request in request order, then block
    ``2 * cp_size - 1 - r`` of every request in request order.

    Returns:
        ``cp_size`` int64 CPU tensors; tensor ``r`` has shape ``[in_seq_split(...)[r]]`` and holds
        indices into the batch's concatenated tokens ``[0, sum(seq_lens))``. Together they are a
        permutation of ``range(sum(seq_lens))``.
    """
    positions, counts = _all_positions(seq_lens, cp_size, page_size)
    return list(torch.split(positions, counts))


def in_seq_restore_index(seq_lens: SeqLens, cp_size: int, page_size: int = 1) -> torch.Tensor:
    """Index that puts compact-gathered shards back into the batch's original token order.

    If ``compact = torch.cat([shard_0, ..., shard_{cp-1}])`` where ``shard_r`` is rank ``r``'s tokens in
    local order (i.e. ``x[in_seq_positions(...)[r]]``), then ``compact[restore] == x``.

    Returns:
        int64 CPU tensor of shape ``[sum(seq_lens)]``: the inverse permutation of
        ``torch.cat(in_seq_positions(seq_lens, cp_size, page_size))``.
    """
    positions, _ = _all_positions(seq_lens, cp_size, page_size)
    restore = torch.empty_like(positions)
    restore[positions] = torch.arange(positions.numel(), dtype=torch.int64)
    return restore
