"""First-use checks of the vLLM plugin (``integrations.firstuse``): vLLM's own ``_maybe_dispatch`` /
``_maybe_combine`` beside nsa_cp's on the first ``NSA_CP_FIRST_USE_CHECKS`` calls of each kind.

Kinds: ``"dispatch <padded|compact>[ <wire format>][ (scales column-major at quantization)]"`` and
``"combine <padded|compact>"``. What is compared (``P`` ranks, ``M`` rows per rank, ``n_q`` real):

* dispatch: vLLM's own ``_maybe_dispatch`` runs on a copy of this rank's hidden states whose padding rows
  (``[n_r, M)``) are zero (nsa_cp does not move padding rows: it writes what vLLM's quantizer gives a zero row),
  with the same router logits. Padded: nsa_cp's ``(hidden, logits[, scale])`` must be bitwise vLLM's, every
  row; compact: bitwise vLLM's real rows in compact order. Also vLLM's padding mask
  (``forward_context.is_padding``, ``[P * M]``) must mark exactly rows ``[q * M + n_q, (q + 1) * M)``, the
  rows nsa_cp takes for padding (one device-to-host read of the mask, on checked calls only).
* combine: vLLM's own ``_maybe_combine`` on the same partials (compact partials placed rank-major first, zero
  padding rows), then this rank's real rows compared within ``2 * P * u * S`` elementwise, where ``u`` is the
  partials' unit roundoff and ``S`` the sum over ranks of ``|partial|`` (vLLM's reduce-scatter of the
  absolute partials, in fp32): the bound of two summation orders of ``P`` terms, each rounded in the dtype.
  What else vLLM returns (the shared experts' output) must be the same object.

On a difference the ranks agree (``Checks.settle``), the kind is declined for the process, and the call returns
vLLM's own result: for a dispatch, vLLM's ``_maybe_dispatch`` run again on the unmodified inputs.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from .. import firstuse
from . import runtime

OWN = "vLLM's own PCP MoE moves"
CHECKS = firstuse.Checks("vLLM", OWN)


def dispatch_kind(compact: bool, quant: Optional[str], transposed: bool) -> str:
    return "dispatch " + ("compact" if compact else "padded") + (f" {quant}" if quant else "") + \
        (" (scales column-major at quantization)" if transposed else "")


def combine_kind(compact: bool) -> str:
    return "combine " + ("compact" if compact else "padded")


def _expected_padding(layout) -> torch.Tensor:
    mask = torch.ones(layout.padded_len, dtype=torch.bool)
    for q, n in enumerate(layout.per_rank_actual_token):
        mask[q * layout.max_rank_len: q * layout.max_rank_len + n] = False
    return mask


def dispatch_difference(ours: tuple, original: Callable, runner: Any, hidden_states: torch.Tensor,
                        router_logits: torch.Tensor, layout, rank: int, compact: bool, context: Any):
    """``(difference or None, vLLM's result)``: vLLM's own dispatch on the same rows (its padding rows zero),
    compared with nsa_cp's result ``ours`` (module docstring). Collective, as vLLM's dispatch is."""
    zeroed = hidden_states.clone()
    zeroed[layout.count(rank):] = 0
    theirs = original(runner, zeroed, router_logits)
    mask = getattr(context, "is_padding", None)
    if isinstance(mask, torch.Tensor):
        problem = firstuse.exact("forward_context.is_padding", mask.detach().cpu(), _expected_padding(layout))
        if problem is not None:
            return f"{problem} (vLLM's padding rows are not the last of each rank's)", theirs
    want = theirs
    if compact and isinstance(theirs, tuple) and all(isinstance(t, torch.Tensor) or t is None for t in theirs):
        want = tuple(t if t is None or t.dim() < 1 or t.shape[0] != layout.padded_len
                     else firstuse.real_rows(t, layout) for t in theirs)
    return firstuse.exact("_maybe_dispatch", ours, want), theirs


def combine_difference(ours: Any, original: Callable, runner: Any, shared_output, partials: torch.Tensor,
                       layout, rank: int, compact: bool):
    """``(difference or None, vLLM's result)``: vLLM's own combine of the same partials, this rank's real rows
    within the bound of the module docstring. Collective (two reduce-scatters of vLLM's)."""
    if compact:  # vLLM's reduce-scatter takes the rank-major rows: place them there, zero padding rows
        padded = partials.new_zeros((layout.padded_len, *partials.shape[1:]))
        for q, n in enumerate(layout.per_rank_actual_token):
            off, m = layout.offsets[q], layout.max_rank_len
            padded[q * m: q * m + n] = partials[off: off + n]
        partials = padded
    theirs = original(runner, shared_output, partials)
    spread = runtime.pcp_group().reduce_scatter(partials.detach().abs().float(), dim=0)
    n = layout.count(rank)
    unit = torch.finfo(partials.dtype).eps / 2 if partials.dtype.is_floating_point else 0.0
    bound = 2 * layout.cp_size * unit * spread[:n] + torch.finfo(torch.float32).tiny
    ours_t, theirs_t = ours, theirs
    if isinstance(ours, tuple) and isinstance(theirs, tuple) and len(ours) == len(theirs) == 2:
        if ours[0] is not theirs[0]:
            return "_maybe_combine[0]: the shared experts' output is not passed through", theirs
        ours_t, theirs_t = ours[1], theirs[1]
    problem = firstuse.structure("_maybe_combine", ours_t, theirs_t)
    if problem is not None:
        return problem, theirs
    return firstuse.within("_maybe_combine (real rows)", ours_t[:n], theirs_t[:n], bound), theirs
