"""vLLM adapter: vLLM's prefill-context-parallel (PCP) MoE gather and reduce-scatter on nsa_cp.

Nothing here imports ``vllm`` at load; vLLM is touched when the plugin registers (:func:`vllm_plugin`,
:func:`install`) and when the wrapped methods run.

* :data:`PLUGIN`: the plugin record, the same shape as SGLang's (``integrations.core.Plugin``): the one
  install path :func:`install`, the undo :func:`uninstall` (the handle's), :func:`status`.
* :func:`vllm_plugin`: the entry point ``nsa_cp`` of the group ``vllm.general_plugins``; with it, every
  worker's ``MoERunner._maybe_dispatch`` / ``_maybe_combine`` move the PCP group's rows through nsa_cp
  (``moe``), with the per-step counts kept from vLLM's own ``PCPManager`` (``step``), and the PCP
  group's transport created after the model loads (``worker``). The shared, engine-independent parts
  are ``nsa_cp.integrations.core`` (the skeleton), ``state`` and ``moves``.
* :data:`TABLE` / :data:`TARGETS`: what the plugin wraps (a contract role and the body run around it).
* :data:`KNOWN`: the vLLM contracts served (0.33's and 0.34's PCP MoE boundary: ``contract``); vLLM's code
  is checked against them before anything is wrapped.
* ``NSA_CP_VLLM`` (on), ``NSA_CP_VLLM_COMPACT`` (off), ``NSA_CP_VLLM_P2P`` (on): ``nsa_cp/envs.py``.

What vLLM does at this boundary and what the plugin changes: docs/vllm.md.
"""

from .moe import admit, combine, dispatch
from .contract import KNOWN
from .plugin import PLUGIN, TABLE, TARGETS, install, status, uninstall, vllm_plugin
from .step import StepLayout

__all__ = ["PLUGIN", "vllm_plugin", "install", "uninstall", "status", "TABLE", "TARGETS", "KNOWN", "StepLayout", "admit",
           "dispatch", "combine"]
