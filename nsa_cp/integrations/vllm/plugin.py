"""Getting nsa_cp's moves into vLLM: :data:`PLUGIN`, the plugin record (``integrations.core.Plugin``), and
its module-level names: :func:`vllm_plugin`, :func:`install` / :func:`uninstall`, :func:`status`.

Contract:

* :func:`vllm_plugin` is the entry point ``nsa_cp`` of the group ``vllm.general_plugins``
  (``nsa_cp.integrations.vllm:vllm_plugin``), which vLLM loads in every process it starts, workers
  included, before distributed init and model load (``VLLM_PLUGINS``, where set, must name ``nsa_cp``).
  It runs the one install path (:func:`install`) where ``NSA_CP_VLLM`` is on, and never raises into vLLM.
* Before anything is patched, vLLM's code is checked against the contracts nsa_cp knows
  (``contract.KNOWN``: the signature, the number of values returned and the helpers read of every function
  it wraps or reads). A known contract is served: the methods of the target table (:data:`TABLE`, a
  contract role and the body run around it; :data:`TARGETS`, the same by path) are wrapped in place (no
  file of vLLM's is changed): ``PCPManager._build_batch_layout`` / ``partition_batch`` (the step's
  counts: ``step``), ``MoERunner._maybe_dispatch`` / ``_maybe_combine`` (the moves, with the dispatch's
  return values as that contract defines them: ``moe``), ``MoERunner._forward_impl`` (what a step left
  is put back when it ends: ``moe``) and ``Worker.load_model`` (the transport, once per worker, before
  vLLM profiles the KV cache's memory: ``worker``). Anything else: nothing is wrapped,
  one warning names what differs, ``status()["contract"]`` says why, and vLLM's own moves run.
  ``NSA_CP_VLLM=0``: nothing is checked or wrapped. Loading twice is a no-op.
* The log says what happened: "registered" only when every target was wrapped; otherwise what differs
  or which target did not import, with the cause, and nothing is wrapped.
* :func:`status`: the keys both plugins report (``integrations.state.status``), from the live bindings.
"""

from __future__ import annotations

import logging
from typing import Callable, Dict

from ... import envs
from .. import contracts, core
from . import check, contract, moe, runtime, step, worker

logger = logging.getLogger("nsa_cp")
OWN_MOVES = "vLLM's own PCP MoE moves"


def _after_load_model(original: Callable, self, *args, **kwargs):
    return core.then_setup(original, worker.setup_transport, self, *args, **kwargs)


# the target table: each contract role nsa_cp wraps -> the body run around it (core.Target)
TABLE = (
    core.Target("layout", step.build_batch_layout),
    core.Target("partition", step.partition_batch),
    core.Target("forward", moe.forward),
    core.Target("dispatch", moe.dispatch),
    core.Target("combine", moe.combine),
    core.Target("load_model", _after_load_model),
)
# "module.Class.method" -> its body, the paths from the known contracts (which agree on them)
TARGETS: Dict[str, Callable] = core.targets(TABLE, contract.KNOWN)


def _describe() -> dict:
    return {
        "compact": envs.NSA_CP_VLLM_COMPACT,
        "fusions": {"gather": "not fused: the norm runs in the decoder layer, the moves inside the MoE's custom op "
                              "(docs/vllm.md)",
                    "reduce_scatter": "not fused: the next norm runs in the next decoder layer (docs/vllm.md)"},
        "overlap": {"on": False, "declined": "no overlapped boundary in vLLM's plugin", "chunk_rows": None,
                    "contract": None, "layers": 0, "serialized": {}},
        "first_use": check.CHECKS.as_status(),
    }


def _installed(verdict: contracts.Verdict) -> None:
    moe.CONTRACT[0] = verdict.contract
    check.CHECKS.reset()  # a fresh process's checks: every kind is checked again on its first calls


def _uninstalled() -> None:
    moe.CONTRACT[0] = None
    moe.PENDING.clear()
    step.set_current(None)


PLUGIN = core.Plugin(
    engine="vLLM", contracts=contract.KNOWN, targets=TABLE, own_moves=OWN_MOVES, switch_name="NSA_CP_VLLM",
    switch=lambda: bool(envs.NSA_CP_VLLM), version=runtime.vllm_version, verify=contract.verify,
    bind=lambda patches: core.wrap(patches, TARGETS), bindings=lambda: TARGETS, describe=_describe,
    summary=lambda: (f"compact MoE gather {'on' if envs.NSA_CP_VLLM_COMPACT else 'off'}, "
                     f"P2P {'on' if envs.NSA_CP_VLLM_P2P else 'off'}"),
    on_install=_installed, on_uninstall=_uninstalled, state=moe.STATE)


# the record's names, as the module's (SGLang's plugin module has the same):
# install(): verify vLLM's code against the known contracts, then wrap every target of TARGETS in this process,
#   all or nothing (ContractMismatch, or ImportError / AttributeError for a target that does not import, and
#   nothing is wrapped); returns the undo handle; a second call wraps nothing and returns the first handle
# uninstall(): the handle's; vllm_plugin(): vLLM's entry point (group vllm.general_plugins, name nsa_cp), which
#   runs install() where NSA_CP_VLLM is on and never raises into vLLM; status(): integrations.state.status's keys
install, uninstall, vllm_plugin, status = PLUGIN.install, PLUGIN.uninstall, PLUGIN.entry_point, PLUGIN.status
