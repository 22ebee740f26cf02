"""The SGLang contracts nsa_cp's plugin serves: which of SGLang's functions it hooks, replaces or reads, and
how each must look (``integrations.contracts``). A new SGLang version that keeps a known contract is served
as it is; one that changes any of these is served by adding a :class:`Contract` here and running the SGLang
tests against it (docs/development.md, "A new engine version").

Roles: ``cp_moves`` (``boundary._cp_moves``, hooked: it must still pick the DSA/MLA moves by
``_cp_gathers_over_attn_cp`` and build a ``CpMoves``), ``moves_type`` (``CpMoves``' fields), the three
DSA/MLA moves nsa_cp replaces with the same call shape (``gather`` / ``take_back`` / ``reduce_scatter``),
``bind_stage`` and ``initialize`` (hooked), and the helpers nsa_cp reads (the CP
predicate, the padding alignment, the parallel context, the read step's residual add and norm).
"""

from __future__ import annotations

from .. import contracts
from ..contracts import Contract, Spec

__all__ = ["KNOWN", "OVERLAP_KNOWN", "verify", "verify_overlap"]

LB = "sglang.srt.layers.layer_boundary"
MORE = contracts.ANY_MORE

V0_5_23 = Contract("SGLang 0.5.23 layer boundary", {
    "cp_moves": Spec((f"{LB}.boundary._cp_moves",), (), frozenset({1}),
                     ("_cp_gathers_over_attn_cp", "CpMoves", "reduce_scatter", "reduce_scatter_group")),
    "moves_type": Spec((f"{LB}.contracts.CpMoves",), ("gather", "take_back", "reduce_scatter", "reduce_scatter_group")),
    "gather": Spec((f"{LB}.prepare._then_attn_cp_gather",),
                   ("hidden_states", "residual", "forward_batch", "norm", "cache", "gather", "update", "call"),
                   frozenset({2}), ("gather",)),
    "take_back": Spec((f"{LB}.ops.attn_cp_take_back_output",), ("hidden_states", "residual", "forward_batch"),
                      frozenset({2})),
    "reduce_scatter": Spec((f"{LB}.ops.attn_cp_reduce_scatter_output",), ("hidden_states", "residual", "forward_batch"),
                           frozenset({2})),
    "bind_stage": Spec((f"{LB}.construction._bind_stage",), ("declaration", MORE)),
    "initialize": Spec(("sglang.srt.model_executor.model_runner.ModelRunner.initialize",), ("self", MORE)),
    "cp_predicate": Spec((f"{LB}.layout._cp_gathers_over_attn_cp",), (), frozenset({1})),
    "cp_align": Spec(("sglang.srt.layers.cp.padding.get_cp_padding_align_size",), (), frozenset({1})),
    "parallel": Spec(("sglang.srt.runtime_context.get_parallel",), ()),
    "plain_add": Spec((f"{LB}.residual.add_norm.PlainAdd",)),
    "norm_readout": Spec((f"{LB}.residual.add_norm.NormReadout",)),
})

KNOWN = (V0_5_23,)

DS = "sglang.srt.models.deepseek_v2"
# The overlapped FFN boundary (NSA_CP_SGLANG_OVERLAP=1, ``overlap``): the decoder layer's forward and the
# MoE's are hooked (AROUND); the rest is read or called per chunk. Checked apart from V0_5_23: where it does
# not hold, only the overlap is declined and the serialized moves stay on.
OVERLAP_V0_5_23 = Contract("SGLang 0.5.23 DeepSeek MoE layer", {
    # prepare (the gather), then self.mlp(...) inside ffn_boundary.exit, then finish (the reduce-scatter);
    # the moe_output_buffer_ctx it opens for a MoE that is not in place
    "decoder_forward": Spec((f"{DS}.DeepseekV2DecoderLayer.forward",),
                            ("self", "positions", "hidden_states", "forward_batch", "zero_allocator", MORE),
                            frozenset({2}), ("ffn_boundary", "prepare", "exit", "finish", "mlp",
                                             "moe_output_buffer_ctx", "inplace")),
    # its path picked from the call: mega-MoE, the dual-stream paths, A2A, else forward_normal
    "moe_forward": Spec((f"{DS}.DeepseekV2MoE.forward",),
                        ("self", "hidden_states", "forward_batch", "gemm_output_zero_allocator", "input_ids",
                         "input_ids_global", "skip_shared_experts", "return_moe_output", "leave_output_sum"),
                        None, ("should_use_mega_moe", "_can_dual_stream_graph", "get_is_capture_mode",
                               "alt_stream", "_enable_a2a_moe", "forward_normal", "forward_deepep"),
                        (("skip_shared_experts", False), ("leave_output_sum", False))),
    # leave_output_sum: the routed rows and the shared output apart, as MoEOutput
    "forward_normal": Spec((f"{DS}.DeepseekV2MoE.forward_normal",),
                           ("self", "hidden_states", "gemm_output_zero_allocator", "input_ids", "input_ids_global",
                            "skip_shared_experts", "use_vision_topk", "return_moe_output", "leave_output_sum"),
                           None, ("MoEOutput", "leave_output_sum", "skip_shared_experts", "_forward_shared_experts",
                                  "use_intel_amx_backend", "_fuse_shared_experts_inside_sbo", "gate", "topk",
                                  "experts")),
    "moe_output": Spec((f"{DS}.MoEOutput",), ("routed", "shared", "experts", "routed_scaling_factor",
                                              "shared_is_replicated")),
    "merged": Spec((f"{DS}.MoEOutput.get_merged",), ("self",), frozenset({1}), ("shared_is_replicated",)),
    "shared_experts": Spec((f"{DS}.DeepseekV2MoE._forward_shared_experts",),
                           ("self", "hidden_states", "gemm_output_zero_allocator", MORE)),
    "mega_moe": Spec(("sglang.srt.layers.moe.mega_moe.should_use_mega_moe",), ("moe", "hidden_states"),
                     frozenset({1})),
    "dual_stream": Spec((f"{DS}.DeepseekV2MoE._can_dual_stream_graph",), ("self", "hidden_states"), frozenset({1})),
    # the router's kernel is picked by row count (a chunk must take the whole call's)
    "gate": Spec((f"{DS}.MoEGate.forward",), ("self", "hidden_states", MORE), None,
                 ("tiny_router_gemm_max_tokens",)),
    # the FFN exit: the output goes to its output move (the CP reduce-scatter) untransformed
    "path_for": Spec((f"{LB}.construction.StagePlan.path_for",), ("self", "forward_batch")),
    "exit_complete": Spec((f"{LB}.exit.ExitPolicy._complete_now",), ("self", "hidden_states", "residual", MORE),
                          frozenset({2}), ("output_move", "transform", "returns_over_dp", "owes_sum")),
})

OVERLAP_KNOWN = (OVERLAP_V0_5_23,)


def verify() -> contracts.Verdict:
    """The known contract SGLang's code in this process meets, or why none (``contracts.verify``)."""
    return contracts.verify(KNOWN)


def verify_overlap() -> contracts.Verdict:
    """The known overlap contract (``OVERLAP_KNOWN``) SGLang's code meets, or why none."""
    return contracts.verify(OVERLAP_KNOWN)
