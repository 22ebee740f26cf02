"""Is SGLang's read step into the MoE the plain residual add + RMSNorm that nsa_cp's fused gather computes?

Contract: :func:`plain_add_rmsnorm` ``(step, hidden_states, residual, norm, update, call) -> (weight, eps)``
when running ``step`` would be exactly ``residual <- hidden_states + residual; y = RMSNorm(residual)`` with
SGLang's ``RMSNorm`` (the convention of ``nsa_cp.fused_add_rmsnorm_all_gather``: the sum in fp32, the
residual rounded once, the norm in fp32 rounded once), else a :class:`NotFusable` whose text says why.

The step is the ``gather=`` SGLang's boundary binds into ``CpMoves.gather`` (layer_boundary/boundary.py
``_select_entry_step``): ``partial(_update_read, pre_move=None, read=NORM_READOUT, ...)``, or, where the
attention owes a sum over attention TP, ``partial(_reduce_update_read, group=ATTN_TP, ...)``, which is the
same add + norm when attention TP is 1 (the sum over one rank is the value). Anything else (a bound or
transformed read, a quantizing read, a post-residual addition, a residual gathered first, an update that
is not a plain add, a norm with options that change its arithmetic) is not fusable: SGLang's step runs.
Imports SGLang only when called.
"""

from __future__ import annotations

import functools
from typing import Any, Tuple

import torch

from . import runtime

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class NotFusable(str):
    """Why the read step is not nsa_cp's fused add + RMSNorm (a str: the reason, ``"<kind> (<details>)"``
    where it has details of the batch; the kind is what is logged once and counted)."""


@functools.lru_cache(maxsize=1)  # on every gather: import once (a failed import is not cached)
def _sglang():
    from sglang.srt.layers.layer_boundary import prepare
    from sglang.srt.layers.layer_boundary.contracts import SumGroup
    from sglang.srt.layers.layer_boundary.residual.add_norm import NormReadout, PlainAdd
    from sglang.srt.layers.layernorm import RMSNorm

    return prepare, SumGroup, NormReadout, PlainAdd, RMSNorm


def _step_reason(step: Any, prepare, SumGroup, NormReadout) -> str:
    """Why ``step`` is not SGLang's plain read (add + norm, nothing else), or ''."""
    if not isinstance(step, functools.partial) or step.args:
        return f"read step {getattr(step, '__name__', type(step).__name__)} is not one nsa_cp knows"
    kw = step.keywords
    if type(kw.get("read")) is not NormReadout:
        return f"read {type(kw.get('read')).__name__} is not SGLang's plain norm readout"
    if step.func is prepare._update_read:
        if kw.get("pre_move") is not None or kw.get("read_gathers") or kw.get("read_gather_indices"):
            return "the read step moves rows or gathers itself"
        return ""
    if step.func is prepare._reduce_update_read:
        if kw.get("gathers_residual") or kw.get("read_fusions") or kw.get("read_fusion_indices"):
            return "the read step gathers the residual or runs a read fusion"
        if kw.get("group", SumGroup.ATTN_TP) is not SumGroup.ATTN_TP:
            return f"the read step completes a sum over {kw.get('group')}"
        if runtime.attn_tp_size() != 1:
            return f"attention TP {runtime.attn_tp_size()} (the read step completes a sum over it)"
        return ""
    return f"read step {getattr(step.func, '__name__', step.func)} is not one nsa_cp knows"


def _norm_reason(norm: Any, RMSNorm, hidden: int) -> str:
    if type(norm) is not RMSNorm:
        return f"norm {type(norm).__name__} is not SGLang's RMSNorm"
    changed = [name for name in ("cast_x_before_out_mul", "fp32_residual", "override_orig_dtype",
                                 "variance_size_override", "_quant_linear") if getattr(norm, name, None)]
    if changed or not getattr(norm, "has_weight", True):
        return f"RMSNorm with {', '.join(changed) or 'has_weight=False'}"
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.shape != (hidden,):
        return f"RMSNorm weight not [H] ({getattr(weight, 'shape', None)} for rows of {hidden})"
    return ""


def plain_add_rmsnorm(step, hidden_states, residual, norm, update, call) -> Tuple[torch.Tensor, float] | NotFusable:
    """``(weight, eps)`` when ``step(hidden_states, residual, fb, norm, update=update, **call)`` is exactly
    a plain add + SGLang RMSNorm on 2-D contiguous rows, else a :class:`NotFusable` reason."""
    try:
        prepare, SumGroup, NormReadout, PlainAdd, RMSNorm = _sglang()
    except Exception as e:  # noqa: BLE001  SGLang's modules missing: nothing to fuse with
        return NotFusable(f"SGLang's read-step modules do not import ({type(e).__name__}: {e})")
    if residual is None:
        return NotFusable("no residual (the stack's first read)")
    if not isinstance(hidden_states, torch.Tensor) or not isinstance(residual, torch.Tensor):
        return NotFusable("the input is not a tensor (a sum still owed)")
    if hidden_states.dim() != 2 or residual.shape != hidden_states.shape or residual.dtype != hidden_states.dtype:
        return NotFusable(f"rows and residual not alike 2-D tensors ({list(hidden_states.shape)}, "
                          f"{list(residual.shape)})")
    if hidden_states.dtype not in _DTYPES or not (hidden_states.is_contiguous() and residual.is_contiguous()):
        return NotFusable(f"rows not contiguous bf16 / fp16 / fp32 ({hidden_states.dtype})")
    if update is not None and type(update) is not PlainAdd:
        return NotFusable(f"update {type(update).__name__} is not a plain add")
    extra = sorted(k for k, v in call.items() if v is not None and v != "" and k != "cache")
    if extra:
        return NotFusable(f"the read takes {', '.join(extra)}")
    reason = _step_reason(step, prepare, SumGroup, NormReadout) or _norm_reason(norm, RMSNorm, hidden_states.shape[1])
    if reason:
        return NotFusable(reason)
    return norm.weight, float(norm.variance_epsilon)
