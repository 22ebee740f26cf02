"""Getting nsa_cp's moves into SGLang: the plugin entry point, :func:`install`, :func:`status`.

Contract:

* :func:`sglang_plugin` is the entry point ``nsa_cp`` of the group ``sglang.srt.plugins``
  (``nsa_cp.integrations.sglang:sglang_plugin``). It registers an ``AROUND`` hook on :data:`HOOK_TARGET`
  with SGLang's ``HookRegistry``; SGLang's ``load_plugins()`` then patches every module of
  :data:`BOUNDARY_MODULES`. ``NSA_CP_SGLANG=0``: nothing registered. Registering twice is a no-op.
* :func:`install` patches the same bindings by hand, in this process only; ``Installed.uninstall()``
  undoes it. Neither stacks on the other.
* The patched ``_cp_moves`` asks SGLang's for its choice and replaces only the DSA/MLA kind (the one with
  a ``reduce_scatter``); GQA's moves keep SGLang's, and so does every batch under SGLang's breakable CUDA
  graphs (``attn_cp_metadata.graph_num_tokens`` set), move by move.
* :func:`status` says what is bound in this process.

Only SGLang's hook registry is imported to register; the group is resolved when the moves first run.
How SGLang loads plugins and why the three bindings: docs/sglang.md.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Callable, List, Optional

import torch.distributed as dist

from ... import envs
from . import moves as _moves
from .adapter import CpMovesAdapter
from .runtime import TESTED_SGLANG, sglang_version, warn_if_untested

logger = logging.getLogger("nsa_cp")

# the hook target, and every module of SGLang 0.5.23 that binds ``_cp_moves`` by name
HOOK_TARGET = "sglang.srt.layers.layer_boundary.boundary._cp_moves"
BOUNDARY_MODULES = (
    "sglang.srt.layers.layer_boundary.boundary",
    "sglang.srt.layers.layer_boundary.construction",
    "sglang.srt.layers.layer_boundary.factories",
)


class Installed:
    """What :func:`install` patched; ``uninstall()`` puts SGLang's ``_cp_moves`` back."""

    def __init__(self, adapter: CpMovesAdapter, original: Callable, patched: List[Any]):
        self.adapter, self.original, self.patched = adapter, original, patched

    def uninstall(self) -> None:
        for module in self.patched:
            module._cp_moves = self.original
        self.patched = []


def _in_graph(forward_batch) -> bool:
    return getattr(getattr(forward_batch, "attn_cp_metadata", None), "graph_num_tokens", None) is not None


def _is_ours(moves) -> bool:
    return getattr(moves.gather, "_nsa_cp_moves", False)


def _moves_on(theirs, adapter_of: Callable[[], CpMovesAdapter]):
    """SGLang's ``CpMoves`` -> nsa_cp's for the DSA/MLA kind (the one with a ``reduce_scatter``); GQA's
    moves and nsa_cp's own (a second install or the plugin on top of install) come back as they are."""
    if theirs.reduce_scatter is None or _is_ours(theirs):
        return theirs
    from sglang.srt.layers.layer_boundary.contracts import CpMoves

    def routed(name: str) -> Callable:
        """The move ``name``: SGLang's own for graph-captured batches, else the adapter's."""
        def move(hidden_states, residual, forward_batch, *args, **kwargs):
            owner = theirs if _in_graph(forward_batch) else adapter_of()
            return getattr(owner, name)(hidden_states, residual, forward_batch, *args, **kwargs)

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
    (:func:`configure`), resolved when the moves run (after SGLang's distributed init)."""
    theirs = original_fn(*args, **kwargs)
    try:
        return _moves_on(theirs, _moves.configured)
    except Exception:  # noqa: BLE001  never break model construction: SGLang's own moves, said loudly
        logger.exception("nsa_cp: could not build nsa_cp's CP moves; SGLang's own are used")
        return theirs


def _binds_nsa_cp(fn: Any) -> bool:
    """Whether a ``_cp_moves`` binding is nsa_cp's: install()'s function, or SGLang's hook wrapper
    around :func:`_cp_moves_hook` (followed through ``__wrapped__``)."""
    seen = 0
    while fn is not None and seen < 16:
        if getattr(fn, "_nsa_cp_adapter", None) is not None:
            return True
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                if cell.cell_contents is _cp_moves_hook:
                    return True
            except ValueError:  # an empty cell
                pass
        fn, seen = getattr(fn, "__wrapped__", None), seen + 1
    return False


_PLUGIN = {"registered": False}


def sglang_plugin() -> None:
    """SGLang's entry point (group ``sglang.srt.plugins``, name ``nsa_cp``): route SGLang's DSA/MLA
    prefill-CP moves through nsa_cp in every process that calls ``load_plugins()`` (every scheduler).

    Registers an ``AROUND`` hook on ``sglang.srt.layers.layer_boundary.boundary._cp_moves``; SGLang's
    ``apply_hooks`` then patches it there and in every module that imported it by name. Imports only
    SGLang's hook registry; the group is resolved when the moves first run. ``NSA_CP_SGLANG=0``:
    registers nothing. Registering twice in one process is a no-op. Logs one line either way, and the
    reason when it fails (SGLang itself only logs a plugin's exception).
    """
    try:
        if not envs.NSA_CP_SGLANG:
            logger.info("nsa_cp: NSA_CP_SGLANG=0, SGLang plugin off: SGLang's own CP moves are used")
            return
        if _PLUGIN["registered"]:
            return
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        HookRegistry.register(HOOK_TARGET, _cp_moves_hook, HookType.AROUND)
        _PLUGIN["registered"] = True
        version = sglang_version()
        logger.info("nsa_cp: SGLang plugin registered on %s (SGLang %s, tested %s; compact MoE gather %s)",
                    HOOK_TARGET, version, TESTED_SGLANG, "on" if envs.NSA_CP_SGLANG_COMPACT else "off")
        warn_if_untested(version)
    except Exception as e:
        logger.error("nsa_cp: SGLang plugin NOT registered, SGLang's own CP moves are used (%s: %s)",
                     type(e).__name__, e)
        raise


def status() -> dict:
    """Where nsa_cp stands in this process, for a running SGLang server (call it in a scheduler process,
    e.g. from a plugin or a debugger) or a test: ``bound`` maps every module of
    :data:`BOUNDARY_MODULES` that is imported to whether its ``_cp_moves`` is nsa_cp's; ``active`` is
    True when all three are; ``plugin_registered``; ``used``: whether the moves have run (a DSA/MLA
    prefill-CP extend went through them); ``compact``: the value of NSA_CP_SGLANG_COMPACT."""
    bound = {}
    for name in BOUNDARY_MODULES:
        module = sys.modules.get(name)
        if module is not None:
            bound[name] = _binds_nsa_cp(getattr(module, "_cp_moves", None))
    return {
        "active": len(bound) == len(BOUNDARY_MODULES) and all(bound.values()),
        "bound": bound,
        "plugin_registered": _PLUGIN["registered"],
        "used": _moves.configured().used,
        "compact": envs.NSA_CP_SGLANG_COMPACT,
        "sglang": sglang_version(),
    }


def install(group: Optional[dist.ProcessGroup] = None, **kwargs) -> Installed:
    """Route SGLang's DSA/MLA prefill-CP moves through nsa_cp in THIS process, before the model is built.

    When it works: a model built in the calling process (your own loop over SGLang's model classes, an
    in-process test). When it does not: ``sglang.launch_server`` / ``sglang.Engine`` build the model in
    scheduler processes started with ``spawn``, where a patch made here is lost; there the SGLang plugin
    does it (:func:`sglang_plugin`, on by default once nsa_cp is installed: docs/sglang.md).

    Patches ``_cp_moves`` in every module of :data:`BOUNDARY_MODULES` (each imports it by name). The
    patched function asks SGLang's for its choice and replaces only the DSA/MLA kind (the one with a
    ``reduce_scatter``), keeping SGLang's ``reduce_scatter_group`` (its GroupCoordinator); a batch under
    SGLang's breakable CUDA graphs (``attn_cp_metadata.graph_num_tokens`` set) takes SGLang's own moves.
    Never stacks: on top of the plugin's hook it patches nothing (the moves are nsa_cp's already) and
    makes ``group`` / ``kwargs`` the plugin adapter's (:func:`configure`); a second install raises.

    Args:
        group, **kwargs: for :class:`CpMovesAdapter` (group None: SGLang's attention-CP group).

    Raises:
        ImportError when SGLang (its ``layer_boundary`` package) is not importable; RuntimeError when
        install() already patched these modules.
    """
    import importlib

    modules = [importlib.import_module(name) for name in BOUNDARY_MODULES]
    warn_if_untested(sglang_version())
    importlib.import_module("sglang.srt.layers.layer_boundary.contracts")

    original = modules[0]._cp_moves
    if getattr(original, "_nsa_cp_adapter", None) is not None:
        raise RuntimeError("nsa_cp.integrations.sglang.install: already installed (uninstall() the first)")
    if _binds_nsa_cp(original):
        adapter = _moves.configure(group, **kwargs) if (group is not None or kwargs) else _moves.configured()
        logger.info("nsa_cp: install(): the SGLang plugin's moves are already bound; nothing patched")
        return Installed(adapter, original, [])
    adapter = CpMovesAdapter(group, **kwargs)

    def cp_moves():
        return _moves_on(original(), lambda: adapter)

    cp_moves._nsa_cp_adapter = adapter
    patched = []
    for module in modules:
        if getattr(module, "_cp_moves", None) is original:
            module._cp_moves = cp_moves
            patched.append(module)
    logger.info("nsa_cp: SGLang CP moves installed in %s", ", ".join(m.__name__ for m in patched))
    return Installed(adapter, original, patched)
