"""The overlapped FFN boundary inside SGLang (``NSA_CP_SGLANG_OVERLAP=1``): a DeepSeek decoder layer's MoE
runs on each rank's rows as they land (``nsa_cp.cp_overlapped_boundary``) instead of on one gathered tensor.

SGLang 0.5.23's ``DeepseekV2DecoderLayer.forward`` calls the FFN stage's gather (``ffn_boundary.prepare`` ->
``cp_moves.gather``), then ``self.mlp(rows, forward_batch, ...)``, then the exit (``ffn_exit.finish`` ->
``cp_moves.reduce_scatter``). Three steps (hooks on roles of ``contract.OVERLAP_KNOWN``) make it one call, none copied:

* :func:`decoder_forward_hook` (AROUND ``DeepseekV2DecoderLayer.forward``) decides, before the layer runs,
  whether its FFN section can run overlapped (:func:`layer_reason`: a configuration SGLang would pick
  differently for a chunked call keeps the serialized path, counted in ``status()["overlap"]["serialized"]``
  by reason) and, if so, marks the call (a context variable) for the two moves and the MoE hook;
* :func:`defer_gather` (the FFN stage's gather move, in a marked call): SGLang's read step (residual add +
  RMSNorm) on this rank's rows only, as the serialized plugin runs it (``adapter.read_local``); no rows move.
  It returns a placeholder of the gathered shape (``[M * cp, H]`` padded or ``[sum(n), H]`` compact, a
  zero-stride view: no memory) that only :func:`moe_forward_hook` takes;
* :func:`moe_forward_hook` (AROUND ``DeepseekV2MoE.forward``), handed that placeholder: the overlapped
  boundary, its consumer SGLang's own ``DeepseekV2MoE.forward(rows, forward_batch,
  skip_shared_experts=<replicated>, leave_output_sum=True)`` per chunk (router + routed experts; a
  TP-sharded shared expert too, its partial completed by the sum like the routed one), its ``shared=`` a
  replicated (TP1) shared expert run once on this rank's rows. Returns this rank's ``[physical, H]`` (zeros
  past its real rows), which :func:`take_result` hands to the FFN exit's reduce-scatter move unchanged.

Per chunk SGLang's own choices are kept: the router's kernel (``MoEGate.tiny_router_gemm_max_tokens``, picked
by row count) is pinned to the whole call's; an in-place MoE gets a copy of the chunk's rows (it writes its
output into its input, and the rows may still be on their way to a peer). Everything else that depends on the
whole call (mega-MoE, the dual-stream paths, an A2A backend, ``moe_output_buffer_ctx``, CUDA graph capture,
the AMX CPU path, hash or vision routing) is a :func:`layer_reason`: serialized, said in ``status()``.

Rank agreement: every input to the decision (SGLang's configuration, the batch's CP metadata, the
NSA_CP_SGLANG_OVERLAP_MIN_ROWS threshold on its max_rank_len) is the same on every rank; ``chunk_rows``
(NSA_CP_SGLANG_OVERLAP_CHUNK_ROWS) is in the boundary's call fingerprint.
"""

from __future__ import annotations

import contextvars
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional

import torch

from ... import envs
from ...api.boundary import cp_overlapped_boundary
from ...geometry.layout import ShardLayout
from .. import core, state as shared
from . import contract
from .metadata import layout_from_cp_metadata

logger = logging.getLogger("nsa_cp")

__all__ = ["OverlapState", "STATE", "LayerCall", "Pending", "current", "decoder_forward_hook", "moe_forward_hook",
           "defer_gather", "gather", "switch", "take_result", "layer_reason", "as_status", "decline", "reset",
           "TABLE", "HOOKS", "hooks"]


@dataclass
class OverlapState:
    """What the overlap did in this process, for ``status()["overlap"]``.

    * ``contract``: the overlap contract verified at load (``Verdict.as_status()``), None before;
    * ``declined``: why the overlap is off as a whole (a contract role that does not hold), None when on;
    * ``layers``: FFN sections run overlapped; ``serialized``: layer calls kept serialized, by reason.
    """

    contract: Optional[dict] = None
    declined: Optional[str] = None
    layers: int = 0
    serialized: Dict[str, int] = field(default_factory=dict)

    def reset(self) -> None:
        self.__dict__.update(OverlapState().__dict__)


STATE = OverlapState()


@dataclass
class Pending:
    """A deferred FFN gather: ``token`` (the placeholder the gather move returned), ``x`` (this rank's
    normed real rows ``[n, H]``), the batch's ``layout``, ``rank``, ``physical`` rows, the ``adapter`` whose
    group and backend the boundary runs on; ``result`` (``[physical, H]``) once the MoE ran."""

    token: torch.Tensor
    x: torch.Tensor
    layout: ShardLayout
    rank: int
    physical: int
    adapter: Any
    result: Optional[torch.Tensor] = None


@dataclass
class LayerCall:
    """One ``DeepseekV2DecoderLayer.forward`` the overlap serves: its ``layer`` and ``forward_batch``, and
    the FFN gather it deferred (``pending``)."""

    layer: Any
    forward_batch: Any
    pending: Optional[Pending] = None


_CALL: contextvars.ContextVar[Optional[LayerCall]] = contextvars.ContextVar("nsa_cp_sglang_overlap", default=None)


def current() -> Optional[LayerCall]:
    """The decoder layer call the overlap serves now, or None."""
    return _CALL.get()


def reset() -> None:  # a fresh state, in place (tests)
    STATE.reset()


def decline(problem: str) -> None:
    """The overlap contract does not hold: the overlap stays off, said in one warning and in ``status()``."""
    STATE.declined = problem
    logger.warning("nsa_cp: SGLang overlapped boundary declined (NSA_CP_SGLANG_OVERLAP=1): %s; the serialized "
                   "moves are used", problem)


def as_status() -> dict:
    """``status()["overlap"]``: the switch, whether it is served, why not, and what ran."""
    return {"on": bool(envs.NSA_CP_SGLANG_OVERLAP), "declined": STATE.declined,
            "chunk_rows": envs.NSA_CP_SGLANG_OVERLAP_CHUNK_ROWS or None,
            "contract": dict(STATE.contract) if STATE.contract is not None else None,
            "layers": STATE.layers, "serialized": dict(STATE.serialized)}


def _serialized(reason: str) -> None:
    shared.record(STATE.serialized, reason, "nsa_cp: overlapped boundary not used for such layer calls (%s); the "
                "serialized moves run")


# --------------------------------------------------------------------------- SGLang's pieces, looked up lazily
def _sglang():
    from sglang.srt.layers.moe.mega_moe import should_use_mega_moe
    from sglang.srt.models.deepseek_v2 import DeepseekV2MoE, MoEOutput
    return DeepseekV2MoE, MoEOutput, should_use_mega_moe


def _deepseek_v2():
    from sglang.srt.models import deepseek_v2
    return deepseek_v2


def _capturing() -> bool:
    """SGLang's capture mode (the helper DeepseekV2MoE.forward reads), or a stream capturing a CUDA graph."""
    return bool(_deepseek_v2().get_is_capture_mode()) or (torch.cuda.is_available()
                                                          and torch.cuda.is_current_stream_capturing())


def _amx(mlp) -> bool:
    """Whether forward_normal would take the AMX CPU path (its own test, on the shared expert)."""
    shared = getattr(mlp, "shared_experts", None)
    return shared is not None and bool(_deepseek_v2().use_intel_amx_backend(shared.gate_up_proj))


def layer_reason(layer, forward_batch, hidden_states) -> Optional[str]:
    """Why this decoder layer call keeps the serialized FFN boundary, or None (the overlap serves it). The
    same answer on every rank: SGLang's configuration and the batch's CP metadata only."""
    md = getattr(forward_batch, "attn_cp_metadata", None)
    if md is None:
        return ""  # not a prefill-CP batch: nothing to overlap, nothing to say
    DeepseekV2MoE, _, should_use_mega_moe = _sglang()
    mlp = getattr(layer, "mlp", None)
    if not isinstance(mlp, DeepseekV2MoE):
        return f"not a MoE layer ({type(mlp).__name__})"
    if getattr(md, "graph_num_tokens", None) is not None or _capturing():
        return "CUDA graph capture (the boundary waits per chunk)"
    if getattr(mlp, "_enable_a2a_moe", False):
        return "an A2A MoE backend (DeepEP and the like dispatch the whole call)"
    if not mlp.experts.moe_runner_config.inplace:
        return "a MoE that is not in place (the layer opens moe_output_buffer_ctx for the whole call)"
    if _amx(mlp):
        return "the AMX CPU MoE path (forward_cpu returns no MoEOutput)"
    if getattr(mlp, "_fuse_shared_experts_inside_sbo", False):
        return "shared experts inside single-batch overlap"
    if getattr(mlp, "is_hash", False) or getattr(mlp.gate, "e_score_correction_bias_vl", None) is not None:
        return "hash or vision routing (reads per-row ids in the gathered order)"
    try:
        layout = layout_from_cp_metadata(md)
    except ValueError as e:
        return f"metadata nsa_cp cannot read ({e})"
    if layout.total_len == 0:
        return "an empty batch"
    if layout.max_rank_len < envs.NSA_CP_SGLANG_OVERLAP_MIN_ROWS:  # the layout's: the same on every rank
        return f"fewer rows per rank than NSA_CP_SGLANG_OVERLAP_MIN_ROWS ({envs.NSA_CP_SGLANG_OVERLAP_MIN_ROWS})"
    whole = hidden_states.new_empty((1, 1)).expand(layout.padded_len, getattr(layer, "hidden_size", 1))
    if should_use_mega_moe(mlp, whole):
        return "mega-MoE (one fused kernel for the whole call)"
    if mlp._can_dual_stream_graph(whole) or (mlp.alt_stream is not None and mlp.num_fused_shared_experts == 0
                                             and _capturing()):
        return "the dual-stream MoE path"
    boundary = getattr(layer, "ffn_boundary", None)
    if boundary is None or getattr(boundary.declaration, "row_transport", None) is not None:
        return "an FFN stage with its own row transport"
    if boundary.plan.fusions is not None:
        return "an FFN boundary with fusions (a MoE finalize handoff)"
    steps = boundary.plan.path_for(forward_batch)
    if steps.returns_over_dp or steps.output.transform is not None:
        return "an FFN exit that transforms its output or returns over attention DP"
    if not getattr(steps.output_move, "_nsa_cp_moves", False):
        return "the FFN exit's move is not nsa_cp's CP reduce-scatter"
    return None


# --------------------------------------------------------------------------- the hooks
def decoder_forward_hook(original: Callable, layer, *args, **kwargs):
    """AROUND ``DeepseekV2DecoderLayer.forward(self, positions, hidden_states, forward_batch, ...)``: the
    layer runs as SGLang wrote it; where :func:`layer_reason` admits the call, its FFN gather is deferred and
    its MoE runs as the overlapped boundary (module docstring)."""
    if not envs.NSA_CP_SGLANG_OVERLAP or STATE.declined is not None or current() is not None:
        return original(layer, *args, **kwargs)
    forward_batch = kwargs["forward_batch"] if "forward_batch" in kwargs else args[2]
    hidden_states = kwargs["hidden_states"] if "hidden_states" in kwargs else args[1]
    reason = layer_reason(layer, forward_batch, hidden_states)
    if reason is not None:
        if reason:
            _serialized(reason)
        return original(layer, *args, **kwargs)
    call = LayerCall(layer, forward_batch)
    token = _CALL.set(call)
    try:
        out = original(layer, *args, **kwargs)
    finally:
        _CALL.reset(token)
    if call.pending is not None:
        raise RuntimeError("nsa_cp: a deferred FFN gather was not consumed as its contract says (the MoE was not "
                           "handed its rows, or its output did not reach the FFN exit's reduce-scatter)")
    return out


def defer_gather(adapter, call: LayerCall, hidden_states, residual, forward_batch, norm, *, geometry, **kwargs):
    """The FFN stage's gather move in a call the overlap serves: SGLang's read step on this rank's rows
    (``adapter.read_local``), nothing moved; returns ``(placeholder [rows, H], residual)``, the placeholder
    of the gathered shape (padded ``[M * cp, H]``, compact ``[sum(n), H]``) that the MoE hook takes."""
    md, layout, rank, physical = geometry
    x, residual, compact = adapter.read_local(hidden_states, residual, forward_batch, norm, geometry=geometry,
                                              **kwargs)
    rows = layout.total_len if compact else layout.padded_len
    token = x.new_empty((1, 1)).expand(rows, x.shape[1])
    call.pending = Pending(token, x, layout, rank, physical, adapter)
    return token, residual


def gather(adapter, compact_ok: bool, hidden_states, residual, forward_batch, *args, geometry, **kwargs):
    """The gather move for a batch the adapter admitted: :func:`defer_gather` for the FFN stage (``compact_ok``)
    of a layer call the overlap serves, else the adapter's gather (``CpMovesAdapter.gather_rows``)."""
    call = current() if compact_ok else None
    if call is not None and call.pending is None:
        return defer_gather(adapter, call, hidden_states, residual, forward_batch, *args, geometry=geometry, **kwargs)
    return adapter.gather_rows(hidden_states, residual, forward_batch, *args, compact_ok=compact_ok,
                               geometry=geometry, **kwargs)


def switch() -> str:
    """The overlap's state for the registration log: "on", "off" or "declined"."""
    return "declined" if STATE.declined else "on" if envs.NSA_CP_SGLANG_OVERLAP else "off"


def moe_forward_hook(original: Callable, mlp, hidden_states, *args, **kwargs):
    """AROUND ``DeepseekV2MoE.forward``: SGLang's forward, except on the placeholder of a deferred gather,
    where the MoE runs as the overlapped boundary and this rank's ``[physical, H]`` comes back."""
    call = current()
    pending = call.pending if call is not None else None
    if pending is None or hidden_states is not pending.token:
        return original(mlp, hidden_states, *args, **kwargs)
    forward_batch = kwargs.pop("forward_batch", args[0] if args else None)
    extra = {k: v for k, v in kwargs.items() if v not in (None, False) and k != "gemm_output_zero_allocator"}
    if len(args) > 2 or extra:
        raise RuntimeError(f"nsa_cp: the overlapped MoE was called with {sorted(extra) or args[2:]}, which its "
                           "contract does not know")
    pending.result = _run(original, mlp, pending, forward_batch)
    STATE.layers += 1
    return pending.result


def take_result(hidden_states) -> Optional[torch.Tensor]:
    """The overlapped MoE's ``[physical, H]`` when ``hidden_states`` is it (the FFN exit's reduce-scatter
    then returns it as it is: the boundary already summed it), else None."""
    call = current()
    pending = call.pending if call is not None else None
    if pending is None or pending.result is None or hidden_states is not pending.result:
        return None
    result, pending.result = pending.result, None
    call.pending = None
    return result


def _run(original: Callable, mlp, p: Pending, forward_batch) -> torch.Tensor:
    """The boundary, SGLang's MoE its consumer (the layer's zero allocator, sized for one call, not passed)."""
    _, MoEOutput, _ = _sglang()
    replicated = bool(getattr(mlp, "_shared_expert_tp1", False)) and mlp.shared_experts is not None
    shared = None
    if replicated:
        shared = mlp._forward_shared_experts(p.x, None) if p.x.shape[0] else None
        shared = shared if shared is not None else p.x.new_zeros(p.x.shape)
    inplace, gate, whole = mlp.experts.moe_runner_config.inplace, mlp.gate, p.token.shape[0]
    tiny = getattr(gate, "tiny_router_gemm_max_tokens", None)

    def consumer(rows, chunk):
        rows = rows.clone() if inplace else rows  # SGLang's in-place MoE writes its output into its input
        out = original(mlp, rows, forward_batch, None, skip_shared_experts=replicated, leave_output_sum=True)
        if not isinstance(out, MoEOutput):
            raise RuntimeError(f"nsa_cp: DeepseekV2MoE.forward(leave_output_sum=True) returned "
                               f"{type(out).__name__}, not a MoEOutput")
        return out.get_merged()

    pinned = tiny is not None and whole > tiny  # the whole call's router kernel for every chunk
    if pinned:
        gate.tiny_router_gemm_max_tokens = -1
    try:
        out = cp_overlapped_boundary(p.x, p.layout, consumer, p.adapter.group, out_dtype=p.x.dtype,
                                     chunk_rows=envs.NSA_CP_SGLANG_OVERLAP_CHUNK_ROWS or None, shared=shared,
                                     backend=p.adapter.backend, validate=p.adapter.validate)
    finally:
        if pinned:
            gate.tiny_router_gemm_max_tokens = tiny
    n = p.x.shape[0]
    if n == p.physical:
        return out
    result = out.new_zeros((p.physical, *out.shape[1:]))
    result[:n].copy_(out)
    return result


# the target table (``core.Target``: a contract role and its AROUND hook) and the same by path
TABLE = (
    core.Target("decoder_forward", decoder_forward_hook),
    core.Target("moe_forward", moe_forward_hook),
)
HOOKS = core.targets(TABLE, contract.OVERLAP_KNOWN)


def hooks() -> dict:
    """The hooks to register (the plugin) or patch (``install()``): :data:`HOOKS` where
    NSA_CP_SGLANG_OVERLAP=1 and SGLang's code meets the overlap contract; else none, the contract's problem
    said once (:func:`decline`)."""
    if not envs.NSA_CP_SGLANG_OVERLAP:
        return {}
    verdict = contract.verify_overlap()
    STATE.contract = verdict.as_status()
    if verdict.contract is None:
        decline(verdict.problem)
        return {}
    STATE.declined = None
    return dict(HOOKS)
