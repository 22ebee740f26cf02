"""The moves both engine plugins make on a rank's physical rows (``rows`` local rows, of which the layout's
``n`` are real, padding last), on nsa_cp's public collectives:

* :func:`gather_rows`: ``[rows, H]`` -> padded ``[M * cp, H]`` with the padding rows zero, or compact ``[T, H]``;
* :func:`reduce_scatter_rows`: either layout -> a fresh ``[rows, H]``, zeros past ``n``;
* :func:`take_back_rows`: this rank's ``[rows, H]`` of a complete output;
* :func:`which_layout`: a tensor's row count -> compact or padded;
* :func:`over_capacity`: a batch larger than the group's transport serves (it takes the NCCL path, logged once).

Shapes: ``M = layout.max_rank_len`` (the engine's physical length: ``align`` is set so), ``T =
layout.total_len``; rank q's rows sit at ``q * M`` (padded) or ``layout.offsets[q]`` (compact).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.distributed as dist

from ..api.collectives import cp_all_gather, cp_reduce_scatter
from ..geometry.layout import ShardLayout
from ..transport.policy import capacity, holds_rows
from .state import IntegrationState, once

__all__ = ["gather_rows", "reduce_scatter_rows", "take_back_rows", "which_layout", "over_capacity"]


def over_capacity(state: IntegrationState, group: Optional[dist.ProcessGroup], layout: ShardLayout) -> bool:
    """Whether this batch is larger than ``group``'s transport (one with buffers of its own) serves: it then
    takes the NCCL path, counted in ``state.nccl_batches``, logged once per process."""
    rows = capacity(group)
    if rows is None or layout.is_even or layout.max_rank_len <= rows:
        return False
    state.nccl_batches += 1
    once("p2p-capacity", logging.INFO, "nsa_cp: a batch of %d rows per rank exceeds the group's transport's %d: "
         "such batches take the NCCL path", layout.max_rank_len, rows)
    return True


def which_layout(name: str, t: torch.Tensor, layout: ShardLayout) -> bool:
    """True for the compact ``[total_len, ...]`` rows, False for the padded ``[padded_len, ...]`` (the same
    when there is no padding); ValueError naming ``name`` for anything else."""
    if isinstance(t, torch.Tensor) and t.dim() >= 1:
        if t.shape[0] == layout.padded_len:
            return False
        if t.shape[0] == layout.total_len:
            return True
    got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
    raise ValueError(
        f"{name}: expected [{layout.padded_len}, ...] (padded: max_rank_len {layout.max_rank_len} * cp_size "
        f"{layout.cp_size}, rank-major) or [{layout.total_len}, ...] (compact: the real rows), got {got}"
    )


def gather_rows(x: torch.Tensor, layout: ShardLayout, rank: int, group, *, compact: bool, **kw) -> torch.Tensor:
    """``x [rows, ...]`` (this rank's physical rows, the first ``layout.count(rank)`` real) -> every rank's
    real rows: padded ``[M * cp, ...]`` (padding rows zero) or compact ``[T, ...]``. ``kw``: ``backend``,
    ``validate`` as for ``cp_all_gather``."""
    return cp_all_gather(x[: layout.count(rank)], layout, group, compact=compact, **kw)


def reduce_scatter_rows(partials: torch.Tensor, layout: ShardLayout, rank: int, rows: int, group, *,
                        name: str = "hidden_states", **kw) -> torch.Tensor:
    """Sum the ranks' partials (padded ``[M * cp, ...]`` or compact ``[T, ...]``, told apart by the row count)
    and return this rank's ``[rows, ...]`` (zeros past its real count) in a fresh tensor."""
    compact = which_layout(name, partials, layout)
    n = layout.count(rank)
    out = partials.new_empty((rows, *partials.shape[1:]))
    out[n:].zero_()
    cp_reduce_scatter(partials, layout, group, compact=compact, out=out[:n], **kw)
    return out


def take_back_rows(full: torch.Tensor, layout: ShardLayout, rank: int, rows: int, group, *,
                   name: str = "hidden_states") -> torch.Tensor:
    """This rank's ``[rows, ...]`` of a complete output, padded ``[M * cp, ...]`` (a view, or a copy where a
    transport with buffers of its own serves the group: its gathered rows live in a buffer the next gathers
    reuse) or compact ``[T, ...]`` (a copy, the rows past the real count zero)."""
    if which_layout(name, full, layout):
        n, start = layout.count(rank), layout.offsets[rank]
        out = full.new_zeros((rows, *full.shape[1:]))
        out[:n].copy_(full[start : start + n])
        return out
    start = rank * layout.max_rank_len
    back = full[start : start + rows]
    return back.clone() if holds_rows(group) else back
