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


# the overlapped boundary's contract (contract.OVERLAP_KNOWN): SGLang's MoE made to drift, each in one way,
# still running SGLang's own code underneath (so its forward stays exact)
DS = "sglang.srt.models.deepseek_v2"


def forward_normal_with_a_renamed_flag(self, hidden_states, gemm_output_zero_allocator=None, input_ids=None,
                                       input_ids_global=None, skip_shared_experts=False, use_vision_topk=False,
                                       return_moe_output=False, leave_moe_pieces=False, **kwargs):
    """A changed signature: leave_output_sum renamed."""
    return ORIGINAL["forward_normal"](self, hidden_states, gemm_output_zero_allocator, input_ids, input_ids_global,
                                      skip_shared_experts, use_vision_topk, return_moe_output,
                                      kwargs.pop("leave_output_sum", leave_moe_pieces))


OVERLAP_DRIFTS = {
    "signature": ("DeepseekV2MoE", "forward_normal", "forward_normal", forward_normal_with_a_renamed_flag,
                  "DeepseekV2MoE.forward_normal takes ("),
    "renamed": ("MoEOutput", "get_merged", "merge", None, "MoEOutput.get_merged not found"),
}


def apply_overlap(kind: str) -> str:
    """Bind the overlap drift ``kind`` on SGLang's class (a new signature, or a method under a new name);
    returns the text nsa_cp's warning must hold. :func:`undo_overlap` puts SGLang's back."""
    import importlib

    cls_name, name, new_name, fn, says = OVERLAP_DRIFTS[kind]
    cls = getattr(importlib.import_module(DS), cls_name)
    ORIGINAL[name] = cls.__dict__[name]
    ORIGINAL["_undo"] = (cls, name, new_name)
    if fn is None:
        delattr(cls, name)
        setattr(cls, new_name, ORIGINAL[name])
    else:
        setattr(cls, name, fn)
    return says


def undo_overlap() -> None:
    cls, name, new_name = ORIGINAL.pop("_undo")
    if new_name != name:
        delattr(cls, new_name)
    setattr(cls, name, ORIGINAL[name])
