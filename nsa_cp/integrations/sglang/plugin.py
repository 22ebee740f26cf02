"""Getting nsa_cp's moves into SGLang: :data:`PLUGIN`, the plugin record (``integrations.core.Plugin``), and
its module-level names: :func:`sglang_plugin`, :func:`install` / :func:`uninstall`, :func:`status`.

Contract:

* :func:`sglang_plugin` is the entry point ``nsa_cp`` of the group ``sglang.srt.plugins``
  (``nsa_cp.integrations.sglang:sglang_plugin``), which every scheduler's ``load_plugins()`` calls. It runs
  the one install path (:func:`install`) where ``NSA_CP_SGLANG`` is on, and never raises into SGLang.
* :func:`install` checks SGLang's code against the contracts nsa_cp knows (``contract.KNOWN``: the
  signature, the number of values returned and the helpers read of every function it wraps, replaces or
  reads), then wraps the target table (:data:`TABLE`: a contract role and its body; :data:`HOOKS`, the same
  by path) in place, all or nothing: ``_cp_moves`` (nsa_cp's moves) in every module of
  :data:`BOUNDARY_MODULES` (each binds it by name), ``construction._bind_stage`` (which stage the moves are
  bound for: compact only for FFN stages; in ``factories`` too) and ``ModelRunner.initialize`` (the
  transport, once per scheduler, before the KV cache is sized: ``scheduler``); with
  ``NSA_CP_SGLANG_OVERLAP=1`` the overlapped boundary's two, under a contract of their own (``overlap``).
  Anything else: nothing is patched, one warning names what differs, ``status()["contract"]`` says why, and
  SGLang's own moves run. A second install (the entry point after :func:`install`, or the reverse) patches
  nothing and returns the first handle; ``uninstall()`` (the handle's, or this module's) undoes it.
* The log says what happened: "registered" once every binding is patched; else the cause.
* The patched ``_cp_moves`` asks SGLang's for its choice and replaces only the DSA/MLA kind (the one with
  a ``reduce_scatter``); GQA's moves keep SGLang's. Every batch nsa_cp declines (graph capture, attention
  DP, geometry: ``CpMovesAdapter.admit``) runs SGLang's own move, logged once per reason.
* :func:`status`: the keys both plugins report (``integrations.state.status``), from the live bindings.

How SGLang loads plugins and why these bindings: docs/sglang.md.
"""


from __future__ import annotations

import contextvars
import importlib
import logging
import sys
from typing import Callable, Optional

import torch.distributed as dist

from ... import envs
from .. import contracts, core
from . import check, contract, overlap, scheduler, state
from . import moves as _moves
from .adapter import CpMovesAdapter, Declined
from .runtime import sglang_version

logger = logging.getLogger("nsa_cp")
OWN_MOVES = "SGLang's own CP moves"

# every module of SGLang 0.5.23 that binds ``_cp_moves`` by name
BOUNDARY_MODULES = (
    "sglang.srt.layers.layer_boundary.boundary",
    "sglang.srt.layers.layer_boundary.construction",
    "sglang.srt.layers.layer_boundary.factories",
)
# the stage whose boundary SGLang is binding (its declaration's kind name), while _bind_stage runs
_STAGE_KIND: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("nsa_cp_stage_kind", default=None)


def _is_ours(moves) -> bool:
    return getattr(moves.gather, "_nsa_cp_moves", False)


def _passthrough(rows, residual):  # a read step that was already run: SGLang's gather then only moves ``rows``
    def done(*args, **kwargs):
        return rows, residual

    return done


def _declined(reason: str) -> None:
    state.declined(state.STATE, reason, OWN_MOVES)


def _moves_on(theirs, adapter_of: Callable[[], CpMovesAdapter], compact_ok: bool = False):
    """SGLang's ``CpMoves`` -> nsa_cp's for the DSA/MLA kind (the one with a ``reduce_scatter``); GQA's
    moves and nsa_cp's own (a second install or the plugin on top of install) come back as they are.
    ``compact_ok``: the stage's consumer is per row (an FFN), so its gather may be compact."""
    if theirs.reduce_scatter is None or _is_ours(theirs):
        return theirs
    from sglang.srt.layers.layer_boundary.contracts import CpMoves

    def routed(name: str) -> Callable:
        """The move ``name``: the adapter's, or SGLang's own for a batch the adapter declines."""
        def move(hidden_states, residual, forward_batch, *args, **kwargs):
            overlapped = overlap.take_result(hidden_states) if name == "reduce_scatter" else None
            if overlapped is not None:  # the overlapped boundary summed it already
                return overlapped, residual
            adapter = adapter_of()
            reason, geometry = adapter.admit(name, hidden_states, forward_batch)
            if reason is None:
                try:  # checked on a kind's first calls; an FFN gather the overlap serves is deferred (``check``)
                    done, reason = check.run(name, adapter, getattr(theirs, name), compact_ok, hidden_states, residual,
                                             forward_batch, args, kwargs, geometry)
                except Declined as declined:  # SGLang's read step ran: its gather moves what it returned
                    _declined(declined.reason)
                    kwargs["gather"] = _passthrough(declined.rows, declined.residual)
                    return theirs.gather(declined.rows, declined.residual, forward_batch, *args, **kwargs)
                if reason is None:
                    return done
            _declined(reason)
            return getattr(theirs, name)(hidden_states, residual, forward_batch, *args, **kwargs)

        move.__name__, move._nsa_cp_moves = f"{name}_", True
        return move

    return CpMoves(
        gather=routed("gather"),
        take_back=routed("take_back"),
        reduce_scatter=routed("reduce_scatter"),
        reduce_scatter_group=theirs.reduce_scatter_group or adapter_of().reduce_scatter_group,
    )


def _cp_moves_hook(original_fn: Callable, *args, **kwargs):
    """The plugin's ``AROUND`` hook on SGLang's ``_cp_moves``: nsa_cp's moves on the module-level adapter
    (:func:`configure`), resolved when the moves run (after SGLang's distributed init); compact allowed
    only for an FFN stage's boundary."""
    theirs = original_fn(*args, **kwargs)
    try:
        return _moves_on(theirs, _moves.configured, compact_ok=_STAGE_KIND.get() == "FFN")
    except Exception:  # noqa: BLE001  never break model construction: SGLang's own moves, said loudly
        logger.exception("nsa_cp: could not build nsa_cp's CP moves; SGLang's own are used")
        return theirs


def _bind_stage_hook(original_fn: Callable, declaration, *args, **kwargs):
    """The plugin's ``AROUND`` hook on SGLang's ``construction._bind_stage``: the stage's kind is known to
    ``_cp_moves`` while its boundary binds."""
    token = _STAGE_KIND.set(getattr(getattr(declaration, "kind", None), "name", None))
    try:
        return original_fn(declaration, *args, **kwargs)
    finally:
        _STAGE_KIND.reset(token)


def _initialize_hook(original_fn: Callable, runner, *args, **kwargs):
    """The plugin's ``AROUND`` hook on ``ModelRunner.initialize``: the model loads, then this scheduler's
    attention-CP transport is created (before SGLang sizes the KV cache)."""
    return core.then_setup(original_fn, scheduler.setup_transport, runner, *args, **kwargs)


# the target table: each contract role nsa_cp hooks -> its AROUND hook (core.Target)
TABLE = (
    core.Target("cp_moves", _cp_moves_hook),
    core.Target("bind_stage", _bind_stage_hook),
    core.Target("initialize", _initialize_hook),
)
# "module.function" -> the AROUND hook the plugin registers on it, the paths from the known contracts
HOOKS = core.targets(TABLE, contract.KNOWN)
HOOK_TARGET = next(path for path, hook in HOOKS.items() if hook is _cp_moves_hook)


# every binding install() patches: the hooked targets and the modules that bind them by name
BINDINGS = (*(f"{m}._cp_moves" for m in BOUNDARY_MODULES), *(f"{m}._bind_stage" for m in BOUNDARY_MODULES[1:]),
            *(path for path in HOOKS if not path.endswith(("._cp_moves", "._bind_stage"))))


def _verify() -> contracts.Verdict:
    """SGLang's boundary modules import (ImportError with the cause: SGLang itself then could not run the
    moves), then its code is checked against the known contracts."""
    for name in BOUNDARY_MODULES:
        importlib.import_module(name)
    return contract.verify()


def _bind(patches: core.Patches) -> None:
    """Wrap every hook in place; the modules that imported ``_cp_moves`` / ``_bind_stage`` by name get the
    wrapper too (all or nothing: the caller undoes ``patches`` on an error)."""
    core.wrap(patches, {**HOOKS, **overlap.hooks()})
    modules = [sys.modules[name] for name in BOUNDARY_MODULES]
    for attr, source, others in (("_cp_moves", modules[0], modules[1:]), ("_bind_stage", modules[1], modules[2:])):
        wrapper = getattr(source, attr)
        for module in others:
            if getattr(module, attr, None) is wrapper._nsa_cp_original:
                patches.set(module, attr, wrapper)


def _bindings():
    return (*BINDINGS, *(overlap.HOOKS if overlap.switch() == "on" else ()))


def _describe() -> dict:
    return {
        "compact": envs.NSA_CP_SGLANG_COMPACT,
        "fusions": {"gather": "add + RMSNorm fused into the gather where SGLang's read step is the plain one "
                              "(fused_add_rmsnorm_all_gather); any other step runs, then the gather",
                    "reduce_scatter": "not fused: the exit and the next layer's entry are separate stages "
                                      "(docs/sglang.md)"},
        "overlap": overlap.as_status(),
        "first_use": check.CHECKS.as_status(),
    }


PLUGIN = core.Plugin(
    engine="SGLang", contracts=contract.KNOWN, targets=TABLE, own_moves=OWN_MOVES, switch_name="NSA_CP_SGLANG",
    switch=lambda: bool(envs.NSA_CP_SGLANG), version=sglang_version, verify=_verify, bind=_bind,
    bindings=_bindings, describe=_describe,
    summary=lambda: (f"compact MoE gather {'on' if envs.NSA_CP_SGLANG_COMPACT else 'off'}, P2P "
                     f"{'on' if envs.NSA_CP_SGLANG_P2P else 'off'}, overlapped boundary {overlap.switch()}"),
    state=state.STATE)


def install(group: Optional[dist.ProcessGroup] = None, **kwargs) -> core.Installed:
    """Route SGLang's DSA/MLA prefill-CP moves through nsa_cp in THIS process (the one install path:
    :func:`sglang_plugin` runs it in every scheduler). ``group`` / ``kwargs``: the adapter's
    (:func:`configure`; None: SGLang's attention-CP group, found when the moves run).

    Where it is enough: a model built in the calling process (your own loop over SGLang's model classes, an
    in-process test). ``sglang.launch_server`` / ``sglang.Engine`` build the model in scheduler processes
    started with ``spawn``, where a patch made here is lost: there the entry point does it (on by default
    once nsa_cp is installed: docs/sglang.md).

    Returns the undo handle (``uninstall()``). A second call patches nothing and returns the first handle.

    Raises:
        ImportError when SGLang (its ``layer_boundary`` package) is not importable;
        ``contracts.ContractMismatch`` when SGLang's code meets no contract nsa_cp knows (nothing patched).
    """
    if group is not None or kwargs:
        _moves.configure(group, **kwargs)
    return PLUGIN.install()


# the record's names, as the module's (vLLM's plugin module has the same): uninstall(): the handle's;
# sglang_plugin(): SGLang's entry point (group sglang.srt.plugins, name nsa_cp), which runs install() where
# NSA_CP_SGLANG is on and never raises into SGLang; status(): integrations.state.status's keys, in a scheduler
# process (a debugger, a plugin of your own) or a test
uninstall, sglang_plugin, status = PLUGIN.uninstall, PLUGIN.entry_point, PLUGIN.status
