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
