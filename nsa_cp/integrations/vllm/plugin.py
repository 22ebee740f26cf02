"""Getting nsa_cp's moves into vLLM: the plugin entry point, :func:`install` / :func:`uninstall`, :func:`status`.

Contract:

* :func:`vllm_plugin` is the entry point ``nsa_cp`` of the group ``vllm.general_plugins``
  (``nsa_cp.integrations.vllm:vllm_plugin``), which vLLM loads in every process it starts, workers
  included, before distributed init and model load (``VLLM_PLUGINS``, where set, must name ``nsa_cp``).
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
* :func:`status` reads the live bindings (is each target nsa_cp's wrapper now?) and what ran.
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

_PATCHES = core.Patches()  # what install() wrapped, for uninstall()


def install() -> contracts.Verdict:
    """Check vLLM's code against the known contracts, then wrap every target of :data:`TARGETS` in this
    process (what :func:`vllm_plugin` does). All or nothing: a contract that does not hold raises
    :class:`~..contracts.ContractMismatch`, a target that does not import ImportError / AttributeError, and nothing is
    wrapped. A second call is a no-op. Returns the verdict (``verdict.contract``: the contract served)."""
    verdict = contract.verify()
    if verdict.contract is None:
        raise contracts.ContractMismatch(verdict)
    core.wrap(_PATCHES, TARGETS)
    moe.CONTRACT[0] = verdict.contract
    moe.STATE.contract = verdict.as_status()
    moe.STATE.handed = moe.STATE.registered = True
    moe.STATE.register_error = None
    check.CHECKS.reset()  # a fresh process's checks: every kind is checked again on its first calls
    return verdict


def uninstall() -> None:
    """Put vLLM's functions back (tests; a process that wants vLLM's own moves again)."""
    _PATCHES.undo()
    moe.STATE.handed = moe.STATE.registered = False
    moe.CONTRACT[0] = None
    moe.PENDING.clear()
    step.set_current(None)


def vllm_plugin() -> None:
    """vLLM's entry point (group ``vllm.general_plugins``, name ``nsa_cp``): route the PCP MoE gather and
    reduce-scatter through nsa_cp and create the PCP transport, in every process that loads plugins, where
    vLLM's code meets a contract nsa_cp knows. Never raises into vLLM: a contract that does not hold or a
    target that does not import is logged with its cause (nothing wrapped)."""
    if not envs.NSA_CP_VLLM:
        logger.info("nsa_cp: NSA_CP_VLLM=0, vLLM plugin off: %s are used", OWN_MOVES)
        return
    if moe.STATE.registered:
        return
    version = runtime.vllm_version()
    try:
        verdict = install()
    except contracts.ContractMismatch as e:
        core.decline_contract(moe.STATE, "vLLM", version, e.verdict, OWN_MOVES)
        return
    except Exception as e:  # noqa: BLE001  any failure: vLLM's own moves, said with its cause
        moe.STATE.register_error = f"{type(e).__name__}: {e}"
        logger.error("nsa_cp: vLLM plugin NOT registered, %s are used: %s", OWN_MOVES, moe.STATE.register_error)
        return
    logger.info("nsa_cp: vLLM plugin registered (%d methods wrapped; vLLM %s meets the contract %r; compact MoE "
                "gather %s, P2P %s)", len(_PATCHES), version, verdict.contract.name,
                "on" if envs.NSA_CP_VLLM_COMPACT else "off", "on" if envs.NSA_CP_VLLM_P2P else "off")


def status() -> dict:
    """Where nsa_cp stands in this process (call it in a worker, e.g. through ``collective_rpc``, or a test).
    The keys every engine plugin reports (``core.status_fields``):

    * ``engine``, ``version``; ``contract``: the contract served (``served``) or what differs
      (``problem``), and where each function was found; ``plugin_registered``; ``register_error``: why not;
    * ``p2p``: the worker's transport decision (``on``, ``bytes``, ``max_tokens_per_rank``, ``reason``,
      ``nccl``), None before the model loaded; ``declined``: calls vLLM's own moves took, by reason;
      ``nccl_batches``: too large for P2P;

    and vLLM's own: ``patched``: each target of :data:`TARGETS` -> whether it is nsa_cp's wrapper now;
    ``active``: all are; ``compact``: NSA_CP_VLLM_COMPACT; ``gathers`` / ``reduce_scatters``: nsa_cp's moves
    that ran, by layout (and wire format); ``fusions``: none inside vLLM (docs/vllm.md says what blocks them);
    ``vllm``: the version; ``first_use``: the first-use checks (``check``): calls checked and kinds declined,
    by kind, with what differed.
    """
    patched = {target: core.is_wrapped(target) for target in TARGETS}
    s = moe.STATE
    version = runtime.vllm_version()
    return {
        **core.status_fields(s, "vLLM", version),
        "active": all(patched.values()),
        "patched": patched,
        "compact": envs.NSA_CP_VLLM_COMPACT,
        "gathers": dict(s.gathers),
        "reduce_scatters": dict(s.scatters),
        "first_use": check.CHECKS.as_status(),
        "fusions": "none: the norm runs in the decoder layer, the moves inside the MoE's custom op (docs/vllm.md)",
        "vllm": version,
    }
