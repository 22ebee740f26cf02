"""vLLM's PCP MoE boundary on nsa_cp: ``MoERunner._maybe_dispatch`` / ``_maybe_combine``.

Contract (per rank; ``M`` = the step's padded rows per rank, ``n`` = this rank's real rows, padding last,
``T`` = the real rows of all ranks, ``P`` = the PCP size, ``G = H / 128``):

* :func:`dispatch` ``(original, runner, hidden_states [M, H], router_logits [M, E])`` returns what the
  running vLLM's ``_maybe_dispatch`` returns (its contract, ``contract.py``): ``(hidden, logits)`` in 0.33,
  ``(hidden, logits, scale)`` in 0.34, ``scale`` None unless vLLM quantizes before the gather.
  - padded (``NSA_CP_VLLM_COMPACT=0``): ``[P * M, ...]`` rank-major as vLLM's all-gather lays them out.
    The hidden states go through nsa_cp (only the real rows move; the padding rows are zero, where
    vLLM's carry computed values the routers mask); the router logits through vLLM's own all-gather
    (small; their padding rows are the ones ``forward_context.is_padding`` masks);
  - compact (``NSA_CP_VLLM_COMPACT=1``): ``[T, ...]``, rank q's rows at ``offsets[q]``, hidden and logits
    through nsa_cp's compact gather; ``forward_context.is_padding`` is swapped for the compact rows' mask
    (all real) while the MoE runs, and put back by :func:`combine`;
  - where vLLM 0.34 quantizes before the gather (``runner._quantizes_before_pcp_gather()``) with dynamic
    per-token-group FP8 that nsa_cp's wire equals (``fp8_wire``: e4m3, groups of 128, fp32 row-major
    scales: ``fp8_e4m3_g128``, or with vLLM's UE8M0 (power-of-two) scales ``fp8_e4m3_g128_ue8m0``),
    nsa_cp quantizes this rank's real rows inside its gather and returns ``(q [.., H] float8_e4m3fn,
    logits, scale [.., G] float32)``: on the real rows the bytes and scales of vLLM's own quantizer (bf16
    and fp16 rows; nsa_cp/geometry/wire.py on fp32 rows); padding rows ``q = 0`` and the format's zero-group scale
    (vLLM's carry its padding rows' values, which only padding rows' outputs depend on). Any other
    quantized input (column-major scales, NVFP4, another group) takes vLLM's own moves, logged once.
* :func:`combine` ``(original, runner, shared_output, routed [P * M, H] | [T, H])``: the sum over ranks of
  this rank's real rows, ``[M, H]`` with zeros past ``n`` (vLLM's reduce-scatter leaves padding partials
  there; nothing reads them), returned as vLLM returns it (with ``shared_output`` where the runner has
  shared experts).
* :func:`admit` says why vLLM's own moves take a call, and such calls run vLLM's functions untouched:
  naive DP/EP dispatch first (``do_naive_dispatch_combine``), CUDA-graph capture (vLLM's collectives are
  what the graph replays), a forward that is not a partitioned step's (dummy, profile, micro-batched), rows
  that are not the step's, inputs nsa_cp's checks refuse (they run before anything moves, and every rank
  sees the same shapes). Logged once per reason, counted in ``status()["declined"]``; never a raise.
  PCP size 1 and the all2all (EP) kernels are not this boundary: vLLM's functions run, nothing is counted.
* What a served dispatch hands its combine is kept by nsa_cp (``PENDING``, by runner), not on vLLM's
  objects. :func:`forward` (around ``MoERunner._forward_impl``, which calls both) drops it and puts the
  compact mask back when the forward ends, returned or raised: nothing of a step outlives it.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ... import envs
from .. import moves, state
from ...geometry.wire import FP8_E4M3_G128, FP8_E4M3_G128_UE8M0
from . import check, runtime, step

STATE = state.IntegrationState()
PENDING: Dict[int, "_Pending"] = {}  # id(runner) -> what its served dispatch hands its combine
CONTRACT: List[Optional[Any]] = [None]  # the verified contract (plugin.install sets it)
_WIRE: Dict[int, tuple] = {}  # id(quant config) -> (the config, fp8_wire's verdict on it)


class _Pending:
    """What a dispatch nsa_cp served hands its combine: the step, the layout used, the mask to restore."""

    __slots__ = ("step", "compact", "context", "saved_mask")

    def __init__(self, step_layout, compact, context, saved_mask):
        self.step, self.compact, self.context, self.saved_mask = step_layout, compact, context, saved_mask

    def restore(self) -> None:
        if self.compact and self.context is not None:
            self.context.is_padding = self.saved_mask


def _this_boundary(runner: Any) -> bool:
    config = runner.moe_config
    return config.pcp_size > 1 and not config.moe_parallel_config.use_all2all_kernels


def admit(runner: Any, hidden_states: Any) -> Tuple[Optional[str], Optional[Any], Any]:
    """``(reason, None, context)``: why vLLM's own moves take this call; else ``(None, step, context)``."""
    context = runtime.forward_context()
    if runner.do_naive_dispatch_combine:
        return "naive DP/EP dispatch before the PCP gather (vLLM's moves keep its order)", None, context
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return "a CUDA graph capture (the graph replays vLLM's own collectives)", None, context
    current = step.for_forward(context)
    if current is None:
        return "a forward that is not a PCP step's (dummy, profile or micro-batched run)", None, context
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() < 1:
        return f"hidden states of type {type(hidden_states).__name__}", None, context
    rows = hidden_states.shape[0]
    if rows != current.rows or current.layout.max_rank_len != current.rows:
        return f"rows not the step's ({rows}; M {current.rows}, counts {list(current.layout.per_rank_actual_token)})", \
            None, context
    size = runtime.pcp_size()
    if current.layout.cp_size != size:
        return f"a layout of another group size ({current.layout.cp_size} ranks, PCP {size})", None, context
    return None, current, context


def _returns_scale() -> bool:
    contract = CONTRACT[0]
    return bool(contract is not None and contract.features.get("dispatch_scale"))


def fp8_wire(runner: Any) -> Tuple[Optional[str], Optional[str]]:
    """``(quant, None)``: the nsa_cp wire format equal to the quantization vLLM applies before this runner's
    PCP gather (None: vLLM does not quantize first); ``(None, reason)``: vLLM does, in a format nsa_cp's
    wire does not carry. Reads vLLM's quant config and platform only: no device work, the same on every rank."""
    if not _returns_scale() or not runner._quantizes_before_pcp_gather():
        return None, None
    qc = runner._quant_method.moe_quant_config
    known = _WIRE.get(id(qc))
    if known is not None and known[0] is qc:  # a layer's quant config is fixed: decide once per config
        return known[1]
    _WIRE[id(qc)] = (qc, _fp8_wire(qc))
    return _WIRE[id(qc)][1]


def _fp8_wire(qc: Any) -> Tuple[Optional[str], Optional[str]]:
    fmt = FP8_E4M3_G128_UE8M0 if runtime.fp8_scales_ue8m0() else FP8_E4M3_G128
    block = getattr(qc, "block_shape", None)
    differs = []
    if getattr(qc, "use_nvfp4_w4a4", False):
        differs.append("NVFP4")
    elif getattr(qc, "quant_dtype", None) == "mxfp8":
        differs.append("MXFP8 (e4m3, groups of 32, UE8M0 uint8 scales)")
    else:
        if getattr(qc, "quant_dtype", None) != fmt.dtype:
            differs.append(f"dtype {getattr(qc, 'quant_dtype', None)}")
        if not block or int(block[-1]) != fmt.group:
            differs.append(f"block {block}")
        # column-major scales at quantization (TRTLLM's 128x128 blocks) are served: vLLM's CUDA all-gather makes
        # its input contiguous, so the experts receive row-major [P * M, G] scales, as nsa_cp's gather returns
        if runtime.fp8_max() != fmt.max:
            differs.append(f"fp8 max {runtime.fp8_max()}")
    if differs:
        return None, f"vLLM quantizes before the PCP gather with {', '.join(differs)}, a format nsa_cp's wire " \
                     "does not carry"
    return fmt.name, None


OWN_MOVES = check.OWN


def _declined(reason: str, original: Callable, runner, hidden_states, router_logits):
    """vLLM's own dispatch for this call; the reason counted, and logged once per kind."""
    state.declined(STATE, reason, OWN_MOVES)
    return original(runner, hidden_states, router_logits)


def dispatch(original: Callable, runner: Any, hidden_states: torch.Tensor, router_logits: torch.Tensor):
    """Around ``MoERunner._maybe_dispatch`` (module docstring)."""
    if not _this_boundary(runner):
        return original(runner, hidden_states, router_logits)
    reason, current, context = admit(runner, hidden_states)
    quant = None
    if reason is None:
        quant, reason = fp8_wire(runner)
    compact = bool(envs.NSA_CP_VLLM_COMPACT)
    kind = check.dispatch_kind(compact, quant, quant is not None and bool(
        getattr(runner._quant_method.moe_quant_config, "is_scale_transposed", False)))
    if reason is None:  # a kind a first-use check declined: its dispatch, or the combine it leads to
        reason = check.CHECKS.refused(kind) or check.CHECKS.refused(check.combine_kind(compact))
    if reason is not None:
        return _declined(reason, original, runner, hidden_states, router_logits)
    layout, group, rank = current.layout, runtime.pcp_device_group(), runtime.pcp_rank()
    moves.over_capacity(STATE, group, layout)
    try:  # nsa_cp checks before it moves anything; every rank sees the same shapes, so all refuse alike
        hidden = moves.gather_rows(hidden_states, layout, rank, group, compact=compact, quant=quant)
        logits = moves.gather_rows(router_logits, layout, rank, group, compact=True) if compact else None
    except ValueError as e:
        return _declined(f"nsa_cp refused the call ({e})", original, runner, hidden_states, router_logits)
    scale = None
    if quant is not None:
        hidden, scale = hidden
    if not compact:
        logits = runtime.pcp_group().all_gather(router_logits, dim=0)
    ours = (hidden, logits, scale) if _returns_scale() else (hidden, logits)
    if check.CHECKS.due(kind):  # the first calls of a kind: vLLM's own dispatch beside it (``check``)
        difference, _ = check.dispatch_difference(ours, original, runner, hidden_states, router_logits, layout, rank,
                                                  compact, context)
        if check.CHECKS.settle(kind, difference, group):
            return _declined(check.CHECKS.refused(kind), original, runner, hidden_states, router_logits)
    saved = None
    if compact:
        saved = context.is_padding
        context.is_padding = current.compact_padding(hidden)
    state.count(STATE.gathers, kind[len("dispatch "):])
    STATE.used = True
    PENDING[id(runner)] = _Pending(current, compact, context, saved)
    return ours


def forward(original: Callable, runner: Any, *args, **kwargs):
    """Around ``MoERunner._forward_impl``: vLLM's forward; whatever its dispatch left for a combine that did
    not run (the MoE raised) is dropped and the forward context's mask put back, in ``finally``."""
    try:
        return original(runner, *args, **kwargs)
    finally:
        pending = PENDING.pop(id(runner), None)
        if pending is not None:
            pending.restore()


def combine(original: Callable, runner: Any, shared_output, hidden_states):
    """Around ``MoERunner._maybe_combine`` (module docstring)."""
    pending = PENDING.pop(id(runner), None)
    if pending is None:
        return original(runner, shared_output, hidden_states)
    pending.restore()
    if not isinstance(hidden_states, torch.Tensor):  # vLLM raises the same for a deferred output
        raise RuntimeError("PCP reduce-scatter cannot consume a deferred MoE output.")
    current, kind = pending.step, check.combine_kind(pending.compact)
    out = moves.reduce_scatter_rows(hidden_states, current.layout, runtime.pcp_rank(), current.rows,
                                   runtime.pcp_device_group())
    ours = out
    if runner.shared_experts is not None:
        assert shared_output is not None
        ours = (shared_output, out)
    if check.CHECKS.due(kind):  # the first calls of a kind: vLLM's own combine beside it (``check``)
        difference, theirs = check.combine_difference(ours, original, runner, shared_output, hidden_states,
                                                      current.layout, runtime.pcp_rank(), pending.compact)
        if check.CHECKS.settle(kind, difference, runtime.pcp_device_group()):
            state.declined(STATE, check.CHECKS.refused(kind), OWN_MOVES)
            return theirs
    state.count(STATE.scatters, kind[len("combine "):])
    return ours
