"""The vLLM contracts nsa_cp's plugin serves: which of vLLM's functions it wraps or reads, and how each
must look (``integrations.contracts``). A new vLLM version that keeps a known contract is served as it is;
one that changes any of these is served by adding a :class:`Contract` here and running the vLLM tests
against it (docs/development.md, "A new engine version").

Roles: ``dispatch`` / ``combine`` (``MoERunner._maybe_dispatch`` / ``_maybe_combine``: the moves),
``forward`` (``MoERunner._forward_impl``, which calls both: what a step changed is put back when it ends),
``layout`` / ``partition`` (``PCPManager._build_batch_layout`` / ``partition_batch``: the step's counts),
``load_model`` (``Worker.load_model``: the transport), ``padding_mask`` (the routers' read of
``forward_context.is_padding``, which the compact layout swaps), and in 0.34 the quantizer chain the
FP8 wire must equal (``quantize``: ``no_dp_ep._quantize_input`` -> ``utils._fp8_quantize`` ->
``fp8_utils.per_token_group_quant_fp8`` with its eps and UE8M0 choice).

Features the serving code reads: ``dispatch_scale`` (``_maybe_dispatch`` returns ``(hidden, logits,
scale)`` and vLLM may quantize before the PCP gather).
"""

from __future__ import annotations

from .. import contracts
from ..contracts import Contract, Spec

__all__ = ["KNOWN", "PCP_MANAGER", "MOE_RUNNER", "WORKER", "verify"]

PCP_MANAGER = "vllm.v1.worker.gpu.pcp_manager.PCPManager"
MOE_RUNNER = "vllm.model_executor.layers.fused_moe.runner.moe_runner.MoERunner"
WORKER = "vllm.v1.worker.gpu_worker.Worker"
FUSED_MOE = "vllm.model_executor.layers.fused_moe"

# what the moves mirror of vLLM's own dispatch: when it gathers over PCP, and with what
_DISPATCH_READS = ("do_naive_dispatch_combine", "pcp_size", "use_all2all_kernels", "get_pcp_group", "all_gather")
_COMMON = {
    "forward": Spec((f"{MOE_RUNNER}._forward_impl",),
                    ("self", "hidden_states", "router_logits", "shared_experts_input", "input_ids"),
                    reads=("_maybe_dispatch", "_maybe_combine")),
    "combine": Spec((f"{MOE_RUNNER}._maybe_combine",), ("self", "shared_output", "hidden_states"),
                    frozenset({1, 2}), ("pcp_size", "use_all2all_kernels", "reduce_scatter", "shared_experts")),
    "layout": Spec((f"{PCP_MANAGER}._build_batch_layout",),
                   ("self", "num_scheduled_tokens", "num_computed_tokens", "is_prefilling", "query_start_loc_np",
                    "padded_num_tokens"), frozenset({2})),
    "partition": Spec((f"{PCP_MANAGER}.partition_batch",), ("self", "input_batch", "batch_desc"), reads=("is_padding",)),
    "load_model": Spec((f"{WORKER}.load_model",), ("self", contracts.ANY_MORE)),
}

V0_33 = Contract("vLLM 0.33 PCP MoE", {
    "dispatch": Spec((f"{MOE_RUNNER}._maybe_dispatch",), ("self", "hidden_states", "router_logits"), frozenset({2}),
                     _DISPATCH_READS),
    **_COMMON,
    "padding_mask": Spec((f"{FUSED_MOE}.router.fused_topk_router._get_padding_mask",), ("num_tokens",),
                         reads=("is_padding",)),
}, {"dispatch_scale": False})

V0_34 = Contract("vLLM 0.34 PCP MoE (quantizes before the gather)", {
    "dispatch": Spec((f"{MOE_RUNNER}._maybe_dispatch",), ("self", "hidden_states", "router_logits"), frozenset({3}),
                     _DISPATCH_READS + ("_quantizes_before_pcp_gather", "_quantize_input")),
    **_COMMON,
    "padding_mask": Spec((f"{FUSED_MOE}.router.base_router.get_moe_padding_mask",), ("num_tokens",),
                         reads=("is_padding",)),
    "quantizes_first": Spec((f"{MOE_RUNNER}._quantizes_before_pcp_gather",), ("self",), frozenset({1})),
    "quantize": Spec((f"{FUSED_MOE}.prepare_finalize.no_dp_ep._quantize_input",),
                     ("a1", "quant_config", "defer_input_quant"), reads=("moe_kernel_quantize_input",)),
    "fp8_quantize": Spec((f"{FUSED_MOE}.utils._fp8_quantize",),
                         ("A", "A_scale", "per_act_token", "block_shape", "is_scale_transposed"),
                         reads=("per_token_group_quant_fp8",)),
    "group_quant": Spec(("vllm.model_executor.layers.quantization.utils.fp8_utils.per_token_group_quant_fp8",),
                        ("x", "group_size", "eps", "dtype", "column_major_scales", "tma_aligned_scales", "out_q",
                         "use_ue8m0"), reads=("is_deep_gemm_e8m0_used", "get_fp8_min_max"),
                        defaults=(("eps", 1e-10),)),
}, {"dispatch_scale": True})

KNOWN = (V0_33, V0_34)

def verify() -> contracts.Verdict:
    """The known contract vLLM's code in this process meets, or why none (``contracts.verify``)."""
    return contracts.verify(KNOWN)
