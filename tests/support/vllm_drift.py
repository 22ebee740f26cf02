"""vLLM functions made to drift from every contract nsa_cp knows, each in one way, for the plugin's
contract tests (their source must be readable, so they live in a module). :func:`apply` binds one in place of
vLLM's own on its class; every one still runs vLLM's own function underneath, so a drifted vLLM still serves
its forward with its own moves."""

from __future__ import annotations

ORIGINAL: dict = {}


def dispatch_returning_four(self, hidden_states, router_logits):
    """Another arity: a fourth value nsa_cp has never seen."""
    out = ORIGINAL["_maybe_dispatch"](self, hidden_states, router_logits)
    return out[0], out[1], None, None


def dispatch_through_a_renamed_helper(self, hidden_states, router_logits):
    """A renamed helper: the gather is no longer reached through get_pcp_group."""
    get_prefill_cp_group = ORIGINAL["_maybe_dispatch"]
    if self.do_naive_dispatch_combine or self.moe_config.pcp_size < 1 or \
            self.moe_config.moe_parallel_config.use_all2all_kernels:
        pass
    return get_prefill_cp_group(self, hidden_states, router_logits).all_gather


def combine_with_another_parameter(self, shared_output, hidden_states, finalize=None):
    """A changed signature: a new parameter (the moves it makes are vLLM's own)."""
    return ORIGINAL["_maybe_combine"](self, shared_output, hidden_states)


def forward_with_its_moves_inlined(self, hidden_states, router_logits, shared_experts_input, input_ids=None):
    """A forward that no longer calls its moves as methods (nsa_cp could not tell where a step ends)."""
    return ORIGINAL["_forward_impl"](self, hidden_states, router_logits, shared_experts_input, input_ids)


DRIFTS = {
    "arity": ("_maybe_dispatch", dispatch_returning_four, "_maybe_dispatch returns 4 values; nsa_cp knows 2 and 3"),
    "helper": ("_maybe_dispatch", dispatch_through_a_renamed_helper, "no longer refers to get_pcp_group"),
    "signature": ("_maybe_combine", combine_with_another_parameter,
                  "_maybe_combine takes (self, shared_output, hidden_states, finalize)"),
    "forward": ("_forward_impl", forward_with_its_moves_inlined,
                "_forward_impl no longer refers to _maybe_dispatch, _maybe_combine"),
}


def apply(kind: str):
    """Bind the drift ``kind`` on vLLM's MoERunner; returns the text nsa_cp's log line must hold and an undo."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    name, fn, says = DRIFTS[kind]
    ORIGINAL[name] = MoERunner.__dict__[name]
    setattr(MoERunner, name, fn)

    def undo():
        setattr(MoERunner, name, ORIGINAL.pop(name))

    return says, undo


# Value drifts: each keeps every contract nsa_cp knows (its code refers to the same names, returns as many
# values), so the plugin installs; only what the values mean changed. The first-use checks must catch each
# (tests/integrations/vllm/test_vllm_first_use.py). Each runs vLLM's own function underneath.

def dispatch_returning_scale_second(self, hidden_states, router_logits):
    """``_maybe_dispatch`` returning ``(hidden, scale, logits)``: the same arity, another order (a vLLM whose
    ``_forward_impl`` unpacks it so would run; the plugin's result would be read in the wrong order)."""
    if self.do_naive_dispatch_combine or self.moe_config.pcp_size < 1 or \
            self.moe_config.moe_parallel_config.use_all2all_kernels:
        pass
    get_pcp_group = all_gather = _quantizes_before_pcp_gather = _quantize_input = None  # noqa: F841
    hidden, logits, scale = ORIGINAL["_maybe_dispatch"](self, hidden_states, router_logits)
    return hidden, scale, logits


def partition_with_padding_first(self, input_batch, batch_desc):
    """``PCPManager.partition_batch`` whose padding rows come first on each rank (its ``is_padding`` says so):
    the counts are the same, the rows they name are not the ones nsa_cp takes for padding."""
    import torch

    local = ORIGINAL["partition_batch"](self, input_batch, batch_desc)
    is_padding = local.is_padding
    if is_padding is not None:
        m = is_padding.shape[0] // self.pcp_world_size
        flipped = is_padding.view(self.pcp_world_size, m).flip(1).reshape(-1).clone()
        is_padding.copy_(flipped.to(torch.bool))
    return local


VALUE_DRIFTS = {
    "reordered": ("MoERunner", "_maybe_dispatch", dispatch_returning_scale_second),
    "padding-first": ("PCPManager", "partition_batch", partition_with_padding_first),
}


def apply_value(kind: str):
    """Bind the value drift ``kind`` on vLLM's class; returns an undo."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
    from vllm.v1.worker.gpu.pcp_manager import PCPManager

    cls_name, name, fn = VALUE_DRIFTS[kind]
    cls = {"MoERunner": MoERunner, "PCPManager": PCPManager}[cls_name]
    ORIGINAL[name] = cls.__dict__[name]
    setattr(cls, name, fn)

    def undo():
        setattr(cls, name, ORIGINAL.pop(name))

    return undo
