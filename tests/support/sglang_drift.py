"""SGLang functions made to drift from every contract nsa_cp knows, each in one way, for the plugin's contract
tests (their source must be readable, so they live in a module). :func:`apply` binds one in place of SGLang's
own in the module nsa_cp reads it from; each still runs SGLang's own function underneath."""

from __future__ import annotations

ORIGINAL: dict = {}
LB = "sglang.srt.layers.layer_boundary"


def take_back_returning_three(hidden_states, residual, forward_batch):
    """Another arity: a third value nsa_cp has never seen."""
    shard, residual = ORIGINAL["attn_cp_take_back_output"](hidden_states, residual, forward_batch)
    return shard, residual, None


def cp_moves_through_a_renamed_predicate():
    """A renamed helper: the DSA/MLA choice no longer asks _cp_gathers_over_attn_cp."""
    _cp_uses_attn_cp_group = ORIGINAL["_cp_moves"]
    return _cp_uses_attn_cp_group()


def gather_with_another_parameter(hidden_states, residual, forward_batch, norm, layer_id, *, cache=None, gather,
                                  update=None, **call):
    """A changed signature: a new positional parameter."""
    return ORIGINAL["_then_attn_cp_gather"](hidden_states, residual, forward_batch, norm, cache=cache,
                                            gather=gather, update=update, **call)


DRIFTS = {
    "arity": (f"{LB}.ops", "attn_cp_take_back_output", take_back_returning_three,
              "attn_cp_take_back_output returns 3 values; nsa_cp knows 2"),
    "helper": (f"{LB}.boundary", "_cp_moves", cp_moves_through_a_renamed_predicate,
               "no longer refers to _cp_gathers_over_attn_cp"),
    "signature": (f"{LB}.prepare", "_then_attn_cp_gather", gather_with_another_parameter,
                  "_then_attn_cp_gather takes (hidden_states, residual, forward_batch, norm, layer_id"),
}


def apply(kind: str) -> str:
    """Bind the drift ``kind`` in SGLang's module; returns the text nsa_cp's log line must hold."""
    import importlib

    module_name, name, fn, says = DRIFTS[kind]
    module = importlib.import_module(module_name)
    ORIGINAL[name] = getattr(module, name)
    for other in (module_name, f"{LB}.construction", f"{LB}.factories"):  # as a new version would: every
        other = importlib.import_module(other)  # module that imports the function by name sees the new one
        if getattr(other, name, None) is ORIGINAL[name]:
            setattr(other, name, fn)
    return says
