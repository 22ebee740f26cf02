"""Getting nsa_cp's moves into SGLang: the plugin entry point, :func:`install`, :func:`status`.

Contract:

* :func:`sglang_plugin` is the entry point ``nsa_cp`` of the group ``sglang.srt.plugins``
  (``nsa_cp.integrations.sglang:sglang_plugin``). It registers three ``AROUND`` hooks with SGLang's
  ``HookRegistry`` (the target table :data:`TABLE`: a contract role and its hook; :data:`HOOKS`, the same
  by path), which SGLang's ``load_plugins()`` then applies (in every module that imported a target by
  name): ``_cp_moves`` (nsa_cp's moves), ``construction._bind_stage`` (which stage the
  moves are bound for: compact only for FFN stages) and ``ModelRunner.initialize`` (the transport, once
  per scheduler, before the KV cache is sized: ``scheduler``). ``NSA_CP_SGLANG=0``: nothing registered.
  Registering twice is a no-op.
* Before anything is registered, SGLang's code is checked against the contracts nsa_cp knows
  (``contract.KNOWN``: the signature, the number of values returned and the helpers read of every function
  it hooks, replaces or reads). Anything else: nothing is registered, one warning names what differs,
  ``status()["contract"]`` says why, and SGLang's own moves run.
* The log says what happened: "hooks handed to SGLang" when registered; "registered" only once SGLang
  has applied them (checked from the first hook that runs); the cause when the target module does not
  import (the usual reason SGLang then fails to apply them).
* :func:`install` patches the same bindings by hand, in this process only; ``Installed.uninstall()``
  undoes it. Neither stacks on the other.
* The patched ``_cp_moves`` asks SGLang's for its choice and replaces only the DSA/MLA kind (the one with
  a ``reduce_scatter``); GQA's moves keep SGLang's. Every batch nsa_cp declines (graph capture, attention
  DP, geometry: ``CpMovesAdapter.admit``) runs SGLang's own move, logged once per reason.
* :func:`status` says what is bound and what ran in this process. ``NSA_CP_SGLANG_OVERLAP=1`` adds the
  overlapped boundary's two hooks, under a contract of their own (``overlap``).

How SGLang loads plugins and why these bindings: docs/sglang.md.
"""

from __future__ import annotations

import contextvars
import importlib
import logging
import sys
from typing import Any, Callable, List, Optional

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


class Installed:
    """What :func:`install` patched; ``uninstall()`` puts SGLang's functions back (``core.Patches``)."""

    def __init__(self, adapter: CpMovesAdapter, original: Callable, patches: core.Patches, patched: List[Any]):
        self.adapter, self.original, self.patched, self._patches = adapter, original, patched, patches

    def uninstall(self) -> None:
        self._patches.undo()
        self.patched = []


def _is_ours(moves) -> bool:
    return getattr(moves.gather, "_nsa_cp_moves", False)


def _passthrough(rows, residual):  # a read step that was already run: SGLang's gather then only moves ``rows``
    def done(*args, **kwargs):
        return rows, residual

    return done


def _declined(reason: str) -> None:
    core.declined(state.STATE, reason, OWN_MOVES)


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


def _confirm_applied(where: str) -> None:
    """The first of nsa_cp's hooks to run says what SGLang applied ("registered" only when it did)."""
    if not state.STATE.handed or state.STATE.registered or state.STATE.register_error:
        return
    bound = status()["bound"]
    if bound and all(bound.values()):
        state.STATE.registered = True
        logger.info("nsa_cp: SGLang plugin registered: SGLang applied its hooks (%s bound in %s; seen from %s)",
                    HOOK_TARGET.rsplit(".", 1)[1], ", ".join(m.rsplit(".", 1)[1] for m in bound), where)
    else:
        state.STATE.registered = False
        state.STATE.register_error = f"SGLang did not apply the _cp_moves hook in {bound}"
        logger.error("nsa_cp: SGLang plugin NOT active: SGLang did not apply its _cp_moves hook (%s); see SGLang's "
                     "'Failed to apply hooks' line for the cause", bound)


def _cp_moves_hook(original_fn: Callable, *args, **kwargs):
    """The plugin's ``AROUND`` hook on SGLang's ``_cp_moves``: nsa_cp's moves on the module-level adapter
    (:func:`configure`), resolved when the moves run (after SGLang's distributed init); compact allowed
    only for an FFN stage's boundary."""
    _confirm_applied("_cp_moves")
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
    _confirm_applied("ModelRunner.initialize")
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


def _binds_nsa_cp(fn: Any) -> bool:
    """Whether a ``_cp_moves`` binding is nsa_cp's, by its markers: install()'s function carries
    ``_nsa_cp_adapter``; SGLang's hook wrapper carries ``__wrapped__`` (functools' marker of a wrapper: the
    original is SGLang's bare function) and is nsa_cp's once the plugin handed its hook for this target to
    SGLang's registry (SGLang chains every hook of a target into that one wrapper)."""
    if fn is None:
        return False
    if getattr(fn, "_nsa_cp_adapter", None) is not None:
        return True
    return state.STATE.handed and getattr(fn, "__wrapped__", None) is not None


def _target_problem() -> Optional[str]:
    """Why SGLang will not be able to apply the hooks: its layer_boundary does not import here (SGLang
    only logs 'Failed to apply hooks ...', without the cause)."""
    try:
        importlib.import_module(HOOK_TARGET.rsplit(".", 1)[0])
    except Exception as e:  # noqa: BLE001  any import failure is the answer
        return f"{HOOK_TARGET.rsplit('.', 1)[0]} does not import: {type(e).__name__}: {e}"
    return None


def sglang_plugin() -> None:
    """SGLang's entry point (group ``sglang.srt.plugins``, name ``nsa_cp``): route SGLang's DSA/MLA
    prefill-CP moves through nsa_cp, and create the attention-CP transport, in every process that calls
    ``load_plugins()`` (every scheduler).

    Registers the ``AROUND`` hooks of :data:`HOOKS`; SGLang's ``apply_hooks`` then patches each target and
    every module that imported it by name. Imports SGLang's hook registry and the ``_cp_moves`` target's
    module (which SGLang imports to apply the hook anyway), so that a module that does not import is
    reported with its cause and nothing is registered. ``NSA_CP_SGLANG=0``: registers nothing.
    Registering twice in one process is a no-op. Logs one line either way.
    """
    if not envs.NSA_CP_SGLANG:
        logger.info("nsa_cp: NSA_CP_SGLANG=0, SGLang plugin off: SGLang's own CP moves are used")
        return
    if state.STATE.handed:
        return
    problem = _target_problem()
    if problem is not None:
        state.STATE.register_error = problem
        logger.error("nsa_cp: SGLang plugin NOT registered, SGLang's own CP moves are used: %s", problem)
        return
    version = sglang_version()
    verdict = contract.verify()
    if verdict.contract is None:
        core.decline_contract(state.STATE, "SGLang", version, verdict, OWN_MOVES)
        return
    state.STATE.contract = verdict.as_status()
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        hooks = {**HOOKS, **overlap.hooks()}
        for target, hook in hooks.items():
            HookRegistry.register(target, hook, HookType.AROUND)
    except Exception as e:
        state.STATE.register_error = f"{type(e).__name__}: {e}"
        logger.error("nsa_cp: SGLang plugin NOT registered, SGLang's own CP moves are used (%s: %s)",
                     type(e).__name__, e)
        raise
    state.STATE.handed = True
    logger.info("nsa_cp: SGLang plugin hooks handed to SGLang's HookRegistry (%s; SGLang %s meets the contract %r; "
                "compact MoE gather %s, P2P %s, overlapped boundary %s); 'registered' follows once SGLang has applied "
                "them", ", ".join(hooks), version, verdict.contract.name, "on" if envs.NSA_CP_SGLANG_COMPACT else "off",
                "on" if envs.NSA_CP_SGLANG_P2P else "off", overlap.switch())


def status() -> dict:
    """Where nsa_cp stands in this process, for a running SGLang server (call it in a scheduler process,
    e.g. from a plugin or a debugger) or a test:

    * ``bound``: every module of :data:`BOUNDARY_MODULES` that is imported -> whether its ``_cp_moves`` is
      nsa_cp's; ``active``: all three are;
    * ``plugin_registered``: the hooks were handed to SGLang; ``hooks_applied``: SGLang applied them (seen
      from a hook that ran); ``register_error``: why not;
    * ``used``: the moves have run; ``compact``: NSA_CP_SGLANG_COMPACT;
    * ``p2p``: the scheduler's transport decision (``on``, ``bytes``, ``max_tokens_per_rank``, ``reason``,
      ``nccl``), None before the model runner decided;
    * ``fusions``: what the MoE gathers ran as, by kind (``fused_add_rmsnorm_all_gather``,
      ``read_then_gather``), ``unfused``: why not fused, by reason, and ``reduce_scatter_norm`` (not fused
      inside SGLang: docs/sglang.md says why);
    * ``declined``: batches SGLang's own moves took, by reason; ``nccl_batches``: too large for P2P;
    * ``overlap``: NSA_CP_SGLANG_OVERLAP, whether its contract holds and what ran (``overlap.as_status``);
      ``first_use``: the first-use checks (``check``), calls checked and kinds declined, by kind.
    """
    bound = {}
    for name in BOUNDARY_MODULES:
        module = sys.modules.get(name)
        if module is not None:
            bound[name] = _binds_nsa_cp(getattr(module, "_cp_moves", None))
    s = state.STATE
    version = sglang_version()
    return {
        **core.status_fields(s, "SGLang", version),
        "active": len(bound) == len(BOUNDARY_MODULES) and all(bound.values()),
        "bound": bound,
        "hooks_applied": s.registered,
        "used": _moves.configured().used,
        "compact": envs.NSA_CP_SGLANG_COMPACT,
        "fusions": {"gather": dict(s.gathers), "unfused": dict(s.unfused),
                    "reduce_scatter_norm": "not fused: the exit and the next layer's entry are separate stages"},
        "sglang": version,
        "overlap": overlap.as_status(),
        "first_use": check.CHECKS.as_status(),
    }


def install(group: Optional[dist.ProcessGroup] = None, **kwargs) -> Installed:
    """Route SGLang's DSA/MLA prefill-CP moves through nsa_cp in THIS process, before the model is built.

    When it works: a model built in the calling process (your own loop over SGLang's model classes, an
    in-process test). When it does not: ``sglang.launch_server`` / ``sglang.Engine`` build the model in
    scheduler processes started with ``spawn``, where a patch made here is lost; there the SGLang plugin
    does it (:func:`sglang_plugin`, on by default once nsa_cp is installed: docs/sglang.md).

    Patches ``_cp_moves`` in every module of :data:`BOUNDARY_MODULES` (each imports it by name), and
    ``_bind_stage`` in ``construction`` and ``factories`` (so compact reaches FFN stages only). The
    patched function asks SGLang's for its choice and replaces only the DSA/MLA kind (the one with a
    ``reduce_scatter``), keeping SGLang's ``reduce_scatter_group`` (its GroupCoordinator); a batch the
    adapter declines (graph capture, attention DP, geometry) takes SGLang's own moves. It creates no
    transport: call ``nsa_cp.init_p2p`` or ``CpMovesAdapter.create_transport`` for that.
    Never stacks: on top of the plugin's hook it patches nothing (the moves are nsa_cp's already) and
    makes ``group`` / ``kwargs`` the plugin adapter's (:func:`configure`); a second install raises.

    Args:
        group, **kwargs: for :class:`CpMovesAdapter` (group None: SGLang's attention-CP group).

    Raises:
        ImportError when SGLang (its ``layer_boundary`` package) is not importable;
        ``contracts.ContractMismatch`` when SGLang's code meets no contract nsa_cp knows (nothing patched);
        RuntimeError when install() already patched these modules.
    """
    modules = [importlib.import_module(name) for name in BOUNDARY_MODULES]
    verdict = contract.verify()
    if verdict.contract is None:
        raise contracts.ContractMismatch(verdict)
    state.STATE.contract = verdict.as_status()

    original = modules[0]._cp_moves
    if getattr(original, "_nsa_cp_adapter", None) is not None:
        raise RuntimeError("nsa_cp.integrations.sglang.install: already installed (uninstall() the first)")
    if _binds_nsa_cp(original):
        adapter = _moves.configure(group, **kwargs) if (group is not None or kwargs) else _moves.configured()
        logger.info("nsa_cp: install(): the SGLang plugin's moves are already bound; nothing patched")
        return Installed(adapter, original, core.Patches(), [])
    adapter = CpMovesAdapter(group, **kwargs)

    def cp_moves():
        return _moves_on(original(), lambda: adapter, compact_ok=_STAGE_KIND.get() == "FFN")

    cp_moves._nsa_cp_adapter = adapter
    patches, patched = core.Patches(), []
    for module in modules:
        if getattr(module, "_cp_moves", None) is original:
            patches.set(module, "_cp_moves", cp_moves)
            patched.append(module)
    bind_stage = getattr(modules[1], "_bind_stage", None)

    def bind_stage_kind(declaration, *args, **kw):
        return _bind_stage_hook(bind_stage, declaration, *args, **kw)

    for module in modules[1:] if bind_stage is not None else ():
        if getattr(module, "_bind_stage", None) is bind_stage:
            patches.set(module, "_bind_stage", bind_stage_kind)
    core.wrap(patches, overlap.hooks())
    logger.info("nsa_cp: SGLang CP moves installed in %s", ", ".join(m.__name__ for m in patched))
    return Installed(adapter, original, patches, patched)
