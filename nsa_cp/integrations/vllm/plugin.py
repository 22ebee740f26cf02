"""Getting nsa_cp's moves into vLLM: the plugin entry point, :func:`install` / :func:`uninstall`, :func:`status`.

Contract:

* :func:`vllm_plugin` is the entry point ``nsa_cp`` of the group ``vllm.general_plugins``
  (``nsa_cp.integrations.vllm:vllm_plugin``), which vLLM loads in every process it starts, workers
  included, before distributed init and model load (``VLLM_PLUGINS``, where set, must name ``nsa_cp``).
  It wraps the methods of :data:`TARGETS` in place (no file of vLLM's is changed):
  ``PCPManager._build_batch_layout`` / ``partition_batch`` (the step's counts: ``step``),
  ``MoERunner._maybe_dispatch`` / ``_maybe_combine`` (the moves: ``moe``) and ``Worker.load_model`` (the
  transport, once per worker, before vLLM profiles the KV cache's memory: ``worker``).
  ``NSA_CP_VLLM=0``: nothing is wrapped. Loading twice is a no-op.
* The log says what happened: "registered" only when every target was wrapped; otherwise which target did
  not import, with the cause, and nothing is wrapped.
* :func:`status` reads the live bindings (is each target nsa_cp's wrapper now?) and what ran.
"""

from __future__ import annotations

import functools
import importlib
import logging
from typing import Callable, Dict, List, Tuple

from ... import envs
from .. import core
from . import moe, runtime, step, worker

logger = logging.getLogger("nsa_cp")

PCP_MANAGER = "vllm.v1.worker.gpu.pcp_manager.PCPManager"
MOE_RUNNER = "vllm.model_executor.layers.fused_moe.runner.moe_runner.MoERunner"
WORKER = "vllm.v1.worker.gpu_worker.Worker"


def _after_load_model(original: Callable, self, *args, **kwargs):
    return core.then_setup(original, worker.setup_transport, self, *args, **kwargs)


# "module.Class.method" -> the wrapper body, called as body(original, self, *args, **kwargs)
TARGETS: Dict[str, Callable] = {
    f"{PCP_MANAGER}._build_batch_layout": step.build_batch_layout,
    f"{PCP_MANAGER}.partition_batch": step.partition_batch,
    f"{MOE_RUNNER}._maybe_dispatch": moe.dispatch,
    f"{MOE_RUNNER}._maybe_combine": moe.combine,
    f"{WORKER}.load_model": _after_load_model,
}

_PATCHED: List[Tuple[type, str, Callable]] = []  # (class, name, vLLM's function), for uninstall()


def _resolve(target: str) -> Tuple[type, str]:
    path, name = target.rsplit(".", 1)
    module_name, class_name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module_name), class_name), name


def _wrap(body: Callable, original: Callable) -> Callable:
    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        return body(original, self, *args, **kwargs)

    wrapper._nsa_cp_original = original  # the marker status() and a second load read
    return wrapper


def install() -> None:
    """Wrap every target of :data:`TARGETS` in this process (what :func:`vllm_plugin` does). All or
    nothing: a target that does not import raises ImportError / AttributeError and nothing is wrapped.
    A second call is a no-op."""
    resolved = [(_resolve(target), body) for target, body in TARGETS.items()]
    for (cls, name), body in resolved:
        current = cls.__dict__.get(name) or getattr(cls, name)
        if getattr(current, "_nsa_cp_original", None) is not None:
            continue
        setattr(cls, name, _wrap(body, current))
        _PATCHED.append((cls, name, current))
    moe.STATE.handed = moe.STATE.registered = True
    moe.STATE.register_error = None


def uninstall() -> None:
    """Put vLLM's functions back (tests; a process that wants vLLM's own moves again)."""
    while _PATCHED:
        cls, name, original = _PATCHED.pop()
        setattr(cls, name, original)
    moe.STATE.registered = False
    step.set_current(None)


def vllm_plugin() -> None:
    """vLLM's entry point (group ``vllm.general_plugins``, name ``nsa_cp``): route the PCP MoE gather and
    reduce-scatter through nsa_cp and create the PCP transport, in every process that loads plugins.
    Never raises into vLLM: a target that does not import is logged with its cause (nothing wrapped)."""
    if not envs.NSA_CP_VLLM:
        logger.info("nsa_cp: NSA_CP_VLLM=0, vLLM plugin off: vLLM's own PCP MoE moves are used")
        return
    if moe.STATE.registered:
        return
    try:
        install()
    except Exception as e:  # noqa: BLE001  any failure: vLLM's own moves, said with its cause
        moe.STATE.register_error = f"{type(e).__name__}: {e}"
        logger.error("nsa_cp: vLLM plugin NOT registered, vLLM's own PCP MoE moves are used: %s",
                     moe.STATE.register_error)
        return
    version = runtime.vllm_version()
    logger.info("nsa_cp: vLLM plugin registered (%d methods wrapped; vLLM %s, tested %s; compact MoE gather %s, "
                "P2P %s)", len(_PATCHED), version, runtime.TESTED_VLLM, "on" if envs.NSA_CP_VLLM_COMPACT else "off",
                "on" if envs.NSA_CP_VLLM_P2P else "off")
    runtime.warn_if_untested(version)


def status() -> dict:
    """Where nsa_cp stands in this process (call it in a worker, e.g. through ``collective_rpc``, or a test):

    * ``patched``: each target of :data:`TARGETS` -> whether it is nsa_cp's wrapper now; ``active``: all
      are; ``plugin_registered``; ``register_error``: why not;
    * ``compact``: NSA_CP_VLLM_COMPACT; ``p2p``: the worker's transport decision (``on``, ``bytes``,
      ``max_tokens_per_rank``, ``reason``, ``nccl``), None before the model loaded;
    * ``gathers`` / ``reduce_scatters``: nsa_cp's moves that ran, by layout; ``declined``: calls vLLM's own
      moves took, by reason; ``nccl_batches``: too large for P2P;
    * ``fusions``: none inside vLLM (docs/vllm.md says what blocks them).
    """
    patched = {}
    for target in TARGETS:
        try:
            cls, name = _resolve(target)
            patched[target] = getattr(cls.__dict__.get(name), "_nsa_cp_original", None) is not None
        except Exception:  # noqa: BLE001  not importable here
            patched[target] = False
    s = moe.STATE
    return {
        "active": all(patched.values()),
        "patched": patched,
        "plugin_registered": s.registered,
        "register_error": s.register_error,
        "compact": envs.NSA_CP_VLLM_COMPACT,
        "p2p": dict(s.p2p) if s.p2p is not None else None,
        "gathers": dict(s.gathers),
        "reduce_scatters": dict(s.scatters),
        "declined": dict(s.declined),
        "nccl_batches": s.nccl_batches,
        "fusions": "none: the norm runs in the decoder layer, the moves inside the MoE's custom op (docs/vllm.md)",
        "vllm": runtime.vllm_version(),
    }
