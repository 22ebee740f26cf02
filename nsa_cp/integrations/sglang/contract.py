"""The SGLang contracts nsa_cp's plugin serves: which of SGLang's functions it hooks, replaces or reads, and
how each must look (``integrations.contracts``). A new SGLang version that keeps a known contract is served
as it is; one that changes any of these is served by adding a :class:`Contract` here and running the SGLang
tests against it (docs/development.md, "A new engine version").

Roles: ``cp_moves`` (``boundary._cp_moves``, hooked: it must still pick the DSA/MLA moves by
``_cp_gathers_over_attn_cp`` and build a ``CpMoves``), ``moves_type`` (``CpMoves``' fields), the three
DSA/MLA moves nsa_cp replaces with the same call shape (``gather`` / ``take_back`` / ``reduce_scatter``),
``bind_stage`` and ``initialize`` (hooked), the hook registry, and the helpers nsa_cp reads (the CP
predicate, the padding alignment, the parallel context, the read step's residual add and norm).
"""

from __future__ import annotations

from .. import contracts
from ..contracts import Contract, Spec

__all__ = ["KNOWN", "verify"]

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
    "hooks": Spec(("sglang.srt.plugins.hook_registry.HookRegistry.register",), ("cls", "target", "hook", "hook_type",
                                                                                 MORE)),
    "cp_predicate": Spec((f"{LB}.layout._cp_gathers_over_attn_cp",), (), frozenset({1})),
    "cp_align": Spec(("sglang.srt.layers.cp.padding.get_cp_padding_align_size",), (), frozenset({1})),
    "parallel": Spec(("sglang.srt.runtime_context.get_parallel",), ()),
    "plain_add": Spec((f"{LB}.residual.add_norm.PlainAdd",)),
    "norm_readout": Spec((f"{LB}.residual.add_norm.NormReadout",)),
})

KNOWN = (V0_5_23,)


def verify() -> contracts.Verdict:
    """The known contract SGLang's code in this process meets, or why none (``contracts.verify``)."""
    return contracts.verify(KNOWN)
