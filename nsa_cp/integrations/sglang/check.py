"""First-use checks of the SGLang plugin (``integrations.firstuse``): SGLang's own CP move beside nsa_cp's on the
first ``NSA_CP_FIRST_USE_CHECKS`` calls of each kind (``"<gather|take_back|reduce_scatter> <padded|compact>"``).

What is compared (``cp`` ranks, ``M`` physical rows per rank, ``n_q`` real, padding last):

* gather: SGLang's own gather (its read step included) on copies of the hidden states and the residual. The
  residual must be bitwise SGLang's (every row); the gathered real rows bitwise SGLang's, rank by rank (padded)
  or in compact order, where SGLang's read step ran; where nsa_cp's fused add + RMSNorm ran instead (arithmetic,
  not movement: its rsqrt may round apart from SGLang's norm by an ulp or two) within ``4 * eps * |SGLang's|``
  elementwise (``eps`` of the dtype). nsa_cp's padding rows are zero where SGLang's carry what its read step
  computed on padding rows, which the MoE's padding rows' outputs alone depend on: they are not compared.
* take_back: SGLang's own take_back of the same complete output (compact rows placed rank-major first, zero
  padding rows); this rank's rows bitwise (padded: all ``M``; compact: the real ``n_r``).
* reduce_scatter: SGLang's own on a copy of the partials (it writes its result into its input) placed the same
  way; this rank's real rows within ``2 * cp * u * S`` elementwise (``u`` the unit roundoff of the partials'
  dtype, ``S`` the sum over ranks of ``|partial|``, one more reduce-scatter in fp32): two summation orders.

On a difference the ranks agree (``Checks.settle``), the kind is declined for the process (a compact kind
declines the compact gather, so no compact rows reach SGLang's moves), and the call returns SGLang's own result.
Calls the overlapped boundary takes are not checked here (``overlap`` has its own contract).
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
import torch.distributed as dist

from .. import firstuse
from ..moves import which_layout
from ..state import declined
from . import overlap, state

CHECKS = state.CHECKS
MOVES = ("gather", "take_back", "reduce_scatter")


def _padded(rows: torch.Tensor, layout) -> torch.Tensor:
    """Compact ``[T, ...]`` rows placed rank-major ``[cp * M, ...]``, zero padding rows (padded rows: as they are)."""
    if not which_layout("hidden_states", rows, layout) or layout.is_even:
        return rows
    out = rows.new_zeros((layout.padded_len, *rows.shape[1:]))
    for q, n in enumerate(layout.per_rank_actual_token):
        out[q * layout.max_rank_len: q * layout.max_rank_len + n] = rows[layout.offsets[q]: layout.offsets[q] + n]
    return out


def _kind(name: str, compact: bool) -> str:
    return f"{name} {'compact' if compact else 'padded'}"


def refused(name: str, compact: bool) -> Optional[str]:
    """Why SGLang's own move takes this call: a check declined its kind (for a compact gather: any compact kind)."""
    if name == "gather" and compact:
        return next((r for r in (CHECKS.refused(_kind(m, True)) for m in MOVES) if r), None)
    return CHECKS.refused(_kind(name, compact))


def run(name: str, adapter, theirs: Callable, compact_ok: bool, hidden_states, residual, forward_batch, args,
        kwargs, geometry) -> Tuple[Optional[tuple], Optional[str]]:
    """``(result, None)``: nsa_cp's move ``name`` for an admitted batch, checked on its kind's first calls
    (SGLang's own result where that check finds a difference); ``(None, reason)`` where a check declined the
    kind before (the caller then runs SGLang's own move)."""
    md, layout, rank, rows = geometry
    if name == "gather":
        if overlap.current() is not None and compact_ok:  # the overlapped boundary's calls: its own contract
            return overlap.gather(adapter, compact_ok, hidden_states, residual, forward_batch, *args,
                                  geometry=geometry, **kwargs), None
        compact = compact_ok and adapter._use_compact(md)
    else:
        compact = which_layout("hidden_states", hidden_states, layout) and not layout.is_even
    kind = _kind(name, compact)
    if refused(name, compact) is not None:
        return None, refused(name, compact)
    due = CHECKS.due(kind)
    if due:  # SGLang's moves write into their inputs (the read step, the reduce-scatter): theirs get copies
        copies = (hidden_states.clone(), residual.clone() if name == "gather" and residual is not None else residual)
    fused = state.STATE.gathers.get("fused_add_rmsnorm_all_gather", 0)
    if name == "gather":
        ours = overlap.gather(adapter, compact_ok, hidden_states, residual, forward_batch, *args, geometry=geometry,
                              **kwargs)
    else:
        ours = getattr(adapter, name)(hidden_states, residual, forward_batch, *args, geometry=geometry, **kwargs)
    if not due:
        return ours, None
    given = copies[0] if name == "gather" else _padded(copies[0], layout)  # a gather's input: the local rows
    spread = _spread(given, layout, adapter.group) if name == "reduce_scatter" else None  # before SGLang's writes
    theirs_out = theirs(given, copies[1], forward_batch, *args, **kwargs)
    fused = state.STATE.gathers.get("fused_add_rmsnorm_all_gather", 0) > fused  # nsa_cp's norm ran, not SGLang's
    difference = _compare(name, ours, theirs_out, layout, rank, rows, compact, spread if not fused else "norm")
    if CHECKS.settle(kind, difference, adapter.group):
        declined(state.STATE, CHECKS.refused(kind), CHECKS.own)
        return theirs_out, None
    return ours, None


def _compare(name, ours, theirs, layout, rank, rows, compact, spread) -> Optional[str]:
    problem = firstuse.structure(name, ours, theirs)
    if problem is not None or not isinstance(ours, tuple) or len(ours) != 2:
        return problem or f"{name}: not a (rows, residual) pair"
    (mine, res_mine), (their, res_their) = ours, theirs
    if name == "gather":
        problem = firstuse.exact("gather residual", res_mine, res_their)
        if problem is None:
            want = firstuse.real_rows(their, layout) if compact else their
            got = mine if compact else mine.clone()
            if not compact:  # nsa_cp's padding rows are zero; SGLang's carry computed values: not compared
                for q, n in enumerate(layout.per_rank_actual_token):
                    got[q * layout.max_rank_len + n: (q + 1) * layout.max_rank_len] = \
                        their[q * layout.max_rank_len + n: (q + 1) * layout.max_rank_len]
            if spread == "norm":  # arithmetic: nsa_cp's fused add + RMSNorm and SGLang's may round rsqrt apart
                bound = 4 * torch.finfo(got.dtype).eps * want.detach().abs().double() + torch.finfo(torch.float32).tiny
                return firstuse.within("fused gather (real rows)", got, want, bound)
            problem = firstuse.exact("gather (real rows)", got, want if compact else their)
        return problem
    if res_mine is not res_their:
        return f"{name}: the residual is not passed through"
    n = layout.count(rank)
    if name == "take_back":
        keep = n if compact else rows
        problem = firstuse.structure("take_back", mine, their)
        return problem or firstuse.exact("take_back (this rank's rows)", mine[:keep], their[:keep])
    bound = 2 * layout.cp_size * torch.finfo(mine.dtype).eps / 2 * spread[:n] + torch.finfo(torch.float32).tiny
    return firstuse.within("reduce_scatter (this rank's real rows)", mine[:n], their[:n], bound)


def _spread(partials: torch.Tensor, layout, group) -> torch.Tensor:
    """``[M, ...]`` fp32: this rank's rows of the sum over ranks of ``|partials|`` (the scale of the bound)."""
    out = torch.empty((layout.max_rank_len, *partials.shape[1:]), dtype=torch.float32, device=partials.device)
    dist.reduce_scatter_tensor(out, partials.detach().abs().float(), group=group)
    return out
