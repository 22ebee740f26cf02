"""SGLang adapter: its CP metadata as a ShardLayout, and its per-layer CP moves on nsa_cp.

Nothing here imports ``sglang`` at load; SGLang is touched only when the plugin registers, by
:func:`install`, and by the group / attention-DP lookups when the moves run without a configured group.

Contract:

* :func:`layout_from_cp_metadata` ``(forward_batch.attn_cp_metadata) -> ShardLayout`` of the real tokens;
  with SGLang's up-front padding, ``max_rank_len`` is the physical length (``metadata``).
* :class:`CpMovesAdapter` holds SGLang's ``CpMoves`` fields (``gather``, ``take_back``,
  ``reduce_scatter``, ``reduce_scatter_group``) on nsa_cp's collectives, in SGLang's padded layout or,
  with ``NSA_CP_SGLANG_COMPACT=1``, the compact one (``adapter``, with the shapes).
* :func:`configure` and the module-level ``gather`` / ``take_back`` / ``reduce_scatter`` /
  ``reduce_scatter_group`` run on the process's configured adapter (``moves``).
* :data:`PLUGIN` (the plugin record, the same shape as vLLM's: ``integrations.core.Plugin``), with
  :func:`sglang_plugin` (the entry point ``nsa_cp`` of the group ``sglang.srt.plugins``), :func:`install`
  (the one install path the entry point runs), :func:`uninstall` and :func:`status`, binds those moves into
  SGLang's ``_cp_moves`` (``plugin``); in every scheduler the plugin also creates the attention-CP
  transport after the model loads (``scheduler``). Whether SGLang's
  read step fuses with the gather: ``readstep``; what ran, for ``status()``: ``state``.

Only the DSA/MLA kind of CP moves is replaced; GQA's MoE-CP moves, and batches the adapter declines
(graph capture, attention DP, geometry), keep SGLang's own functions. What SGLang does at this boundary, how the plugin
gets in and what the adapter changes: docs/sglang.md.
"""

from .adapter import CpMovesAdapter
from .metadata import layout_from_cp_metadata
from .moves import configure, gather, mask_padding_topk_ids_for_batch, reduce_scatter, reduce_scatter_group, take_back
from .plugin import BINDINGS, BOUNDARY_MODULES, HOOK_TARGET, HOOKS, PLUGIN, TABLE, install, sglang_plugin, status, uninstall
from .contract import KNOWN

__all__ = [
    "layout_from_cp_metadata",
    "CpMovesAdapter",
    "configure",
    "gather",
    "take_back",
    "reduce_scatter",
    "reduce_scatter_group",
    "mask_padding_topk_ids_for_batch",
    "install",
    "uninstall",
    "PLUGIN",
    "BINDINGS",
    "BOUNDARY_MODULES",
    "HOOK_TARGET",
    "HOOKS",
    "TABLE",
    "sglang_plugin",
    "status",
    "KNOWN",
]
