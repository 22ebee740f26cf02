"""SGLang adapter: its CP metadata as a ShardLayout, and its per-layer CP moves on nsa_cp.

Nothing here imports ``sglang`` at module load; SGLang is touched only by :func:`install` (and by
:func:`reduce_scatter_group` / the group lookup when no group was configured).

What SGLang 0.5.23 does at the MoE boundary of a DSA (NSA) or MLA prefill-CP extend (read from its
wheel, ``sglang/srt/layers/...``):

* ``cp/padding.py: pad_logical_token_to_physical(md)`` pads every rank's shard once, up front, to one
  physical length (a multiple of ``2 * attn_cp_size`` for the zigzag split): afterwards
  ``md.per_rank_actual_token == md.max_rank_len == [physical] * cp`` and ``md.per_rank_logical_token``
  holds the real counts. Every local tensor has ``physical`` rows, the real ones first.
* ``layer_boundary/boundary.py: _cp_moves()`` returns a ``layer_boundary/contracts.py: CpMoves``;
  for DSA/MLA CP: ``gather=prepare._then_attn_cp_gather`` (run the inner read step ``gather=`` -- the
  residual add and the norm -- on the local shard, then ``cp/interleave.attn_cp_interleave_gather``, an
  ``all_gather_into_tensor`` of the equal padded shards), ``take_back=ops.attn_cp_take_back_output``
  (``tensor_split(cp)[rank]`` of a complete output), ``reduce_scatter=ops.attn_cp_reduce_scatter_output``
  (``reduce_scatter_tensor`` into ``tensor_split(cp)[rank]``), ``reduce_scatter_group=lambda:
  get_parallel().attn_cp_group``.
* ``layer_boundary/construction.py`` and ``layer_boundary/factories.py`` import ``_cp_moves`` by name, so
  an install patches it in all three modules, before the model is built (the moves are bound into each
  layer's plan at construction).

The moves here keep SGLang's shapes by default (a gathered ``[physical * cp, H]`` rank-major buffer,
local ``[physical, H]`` results), so nothing else in SGLang changes; what changes is how the rows move:
nsa_cp's collectives (the padding rows are written as zeros by the pack kernel instead of being gathered
from the ranks, P2P over NVLink where ``nsa_cp.init_p2p`` works, and the reduce-scatter sums only the
real rows' slots). With ``NSA_CP_SGLANG_COMPACT=1`` the gather returns only the real rows,
``[sum(per_rank_logical_token), H]`` in rank order, so the MoE skips SGLang's padding rows; take_back and
reduce_scatter accept both layouts (told apart by the row count) and return ``[physical, H]``, the rows
past the real count zero. On metadata without physical padding (``per_rank_logical_token`` None) the
shards may be uneven and the padded gather is ``[max_rank_len * cp, H]``.

How it gets into SGLang (docs/sglang.md): SGLang starts its scheduler processes with ``spawn`` and calls
``sglang.srt.plugins.load_plugins()`` first in each; the entry point ``nsa_cp`` of the group
``sglang.srt.plugins`` is :func:`sglang_plugin`, which registers an ``AROUND`` hook on
``sglang.srt.layers.layer_boundary.boundary._cp_moves`` (``NSA_CP_SGLANG=0``: nothing). SGLang's
``apply_hooks`` patches the three modules of :data:`BOUNDARY_MODULES`. :func:`install` does the same
patch by hand, for models built in the calling process. :func:`status` says what is bound.

Only the DSA/MLA kind of CP moves is replaced; GQA's MoE-CP moves and batches captured in SGLang's
breakable CUDA graphs (``md.graph_num_tokens`` set) keep SGLang's own functions.
"""

from __future__ import annotations

import logging
import operator
import sys
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import envs
from ..collectives import cp_all_gather, cp_reduce_scatter
from ..communicator import NSACPLayerCommunicator
from ..layout import ShardLayout
from ..moe import mask_padding_topk_ids
from ..transport.p2p import get_p2p

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
    "Installed",
    "BOUNDARY_MODULES",
    "sglang_plugin",
    "status",
    "TESTED_SGLANG",
]

logger = logging.getLogger("nsa_cp")

TESTED_SGLANG = "0.5.23"

# the hook target, and every module of SGLang 0.5.23 that binds ``_cp_moves`` by name
HOOK_TARGET = "sglang.srt.layers.layer_boundary.boundary._cp_moves"
BOUNDARY_MODULES = (
    "sglang.srt.layers.layer_boundary.boundary",
    "sglang.srt.layers.layer_boundary.construction",
    "sglang.srt.layers.layer_boundary.factories",
)

_NOT_GIVEN = object()


# ----------------------------------------------------------------------------- metadata -> layout
def _int_list(md: Any, name: str) -> Optional[List[int]]:
    value = getattr(md, name, None)
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    try:
        return [operator.index(v) if not isinstance(v, torch.Tensor) else int(v) for v in value]
    except TypeError:
        raise ValueError(f"md.{name}: expected a list of ints, got {value!r}") from None


def layout_from_cp_metadata(md: Any, *, align: Optional[int] = None) -> ShardLayout:
    """SGLang's ``forward_batch.attn_cp_metadata`` -> the ShardLayout of the real tokens.

    Reads ``per_rank_logical_token`` (the real counts once SGLang padded the shards) or, where that is
    None or empty, ``per_rank_actual_token``. When SGLang padded (logical counts present), the layout's
    ``max_rank_len`` is the physical length ``per_rank_actual_token[0]``, so the padded layout
    ``[physical * cp, H]`` is exactly SGLang's gathered buffer; ``align`` then defaults to that length
    (the smallest multiple >= the longest real shard; SGLang's own alignment, ``2 * attn_cp_size`` for
    zigzag, gives the same length). Without padding ``align`` defaults to 1.

    Args:
        md: an object with SGLang's field names (``ZigzagContextParallelMetadata``,
            ``InterleaveContextParallelMetadata``, or any duck-typed stand-in).
        align: override the alignment of ``max_rank_len``.

    Raises:
        ValueError naming the field when the counts are missing, negative or inconsistent.
    """
    actual = _int_list(md, "per_rank_actual_token")
    logical = _int_list(md, "per_rank_logical_token")
    if not logical:
        if not actual:
            raise ValueError(
                "md.per_rank_actual_token: expected a list of per-rank token counts, got "
                f"{getattr(md, 'per_rank_actual_token', None)!r} (and no per_rank_logical_token)"
            )
        return ShardLayout(actual, align=1 if align is None else align)
    if actual is None:
        return ShardLayout(logical, align=1 if align is None else align)
    if len(actual) != len(logical):
        raise ValueError(
            f"md.per_rank_logical_token: expected {len(actual)} counts (one per rank, as "
            f"per_rank_actual_token {actual}), got {logical}"
        )
    physical = max(actual)
    if any(n < 0 for n in logical) or max(logical) > physical:
        raise ValueError(
            f"md.per_rank_logical_token: expected counts in [0, {physical}] (the physical length "
            f"per_rank_actual_token {actual}), got {logical}"
        )
    if align is None:
        align = physical if physical > 0 else 1
    layout = ShardLayout(logical, align=align)
    if physical and layout.max_rank_len != physical:
        logger.debug("layout_from_cp_metadata: max_rank_len %d differs from the physical %d (align=%d)",
                     layout.max_rank_len, physical, align)
    return layout


def _physical_rows(md: Any, rank: int, layout: ShardLayout) -> int:
    """Rows of this rank's local tensors in SGLang: its physical (padded) count."""
    actual = _int_list(md, "per_rank_actual_token")
    return actual[rank] if actual else layout.count(rank)


# ----------------------------------------------------------------------------- groups
class _GroupView:
    """The bits of SGLang's GroupCoordinator the boundary reads (``ranks``), over a torch group."""

    def __init__(self, group: Optional[dist.ProcessGroup]):
        self.device_group = group
        self.ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        self.world_size = len(self.ranks)
        self.rank_in_group = dist.get_rank(group)

    def __repr__(self):
        return f"_GroupView(ranks={self.ranks})"


def _sglang_attn_cp_group():
    """SGLang's attention-CP GroupCoordinator, or None where SGLang is not importable or not set up."""
    try:
        from sglang.srt.runtime_context import get_parallel

        return get_parallel().attn_cp_group
    except Exception:  # noqa: BLE001  not installed, not initialised: the caller falls back
        return None


# ----------------------------------------------------------------------------- the moves
class CpMovesAdapter:
    """SGLang's CP moves (``CpMoves`` fields) on nsa_cp.

    Args:
        group: the torch process group of the attention-CP ranks. None: SGLang's
            ``get_parallel().attn_cp_group.device_group`` when SGLang is set up, else the default group.
        compact: gather only the real rows (module docstring). None: ``NSA_CP_SGLANG_COMPACT``, read on
            every gather. Without logical counts in the metadata, or with attention DP, it is padded.
        backend, validate: as for ``nsa_cp.cp_all_gather``.
        p2p_max_tokens_per_rank, hidden_size, dtype: create the P2P transport up front (see
            ``NSACPLayerCommunicator``); give the largest physical shard a prefill can have.

    Results never alias a transport buffer that a later collective reuses: ``reduce_scatter`` writes a
    fresh ``[physical, H]`` tensor, and ``take_back`` copies where a P2P transport serves the group (its
    gathered rows live in the transport's buffer). The reduce-scatter's input may be the tensor the
    gather returned (SGLang's MoE runs in place by default).
    """

    def __init__(
        self,
        group: Optional[dist.ProcessGroup] = None,
        *,
        compact: Optional[bool] = None,
        backend: str = "auto",
        validate: Optional[bool] = None,
        p2p_max_tokens_per_rank: Optional[int] = None,
        hidden_size: Optional[int] = None,
        dtype: Optional[torch.dtype] = None,
    ):
        self._group = group
        self.compact = compact
        self.backend = backend
        self.validate = validate
        self._p2p = dict(p2p_max_tokens_per_rank=p2p_max_tokens_per_rank, hidden_size=hidden_size, dtype=dtype)
        self._comm: Optional[NSACPLayerCommunicator] = None
        self._attn_dp: Optional[bool] = None
        self.used = False

    # --- plumbing
    @property
    def group(self) -> Optional[dist.ProcessGroup]:
        if self._group is None:
            coordinator = _sglang_attn_cp_group()
            if coordinator is not None and getattr(coordinator, "device_group", None) is not None:
                self._group = coordinator.device_group
        return self._group

    @property
    def communicator(self) -> NSACPLayerCommunicator:
        """Built on first use (collective when it creates the P2P transport: every rank's first move)."""
        if self._comm is None:
            kwargs = self._p2p if self._p2p["p2p_max_tokens_per_rank"] is not None else {}
            # SGLang's own read step has already added the residual and normed the rows (with its update
            # and readout); the communicator only moves them, so its norms pass the rows through.
            self._comm = NSACPLayerCommunicator(
                self.group, _passthrough_norm, _passthrough_norm, mlp_mode="full", backend=self.backend,
                validate=self.validate, **kwargs,
            )
        return self._comm

    def _geometry(self, forward_batch) -> Tuple[Any, ShardLayout, int, int]:
        md = getattr(forward_batch, "attn_cp_metadata", None)
        if md is None:
            raise ValueError("forward_batch.attn_cp_metadata: expected SGLang's CP metadata of this extend, got None")
        layout = layout_from_cp_metadata(md)
        rank = dist.get_rank(self.group)
        return md, layout, rank, _physical_rows(md, rank, layout)

    def _use_compact(self, md) -> bool:
        wanted = envs.NSA_CP_SGLANG_COMPACT if self.compact is None else self.compact
        if not wanted or not _int_list(md, "per_rank_logical_token"):
            return False
        if self._attn_dp is None:
            # with attention DP SGLang leaves through its own DP take-back over padded slots
            self._attn_dp = _sglang_attn_dp_size() > 1
            if self._attn_dp:
                logger.info("nsa_cp: NSA_CP_SGLANG_COMPACT ignored with attention DP (padded MoE gather)")
        return not self._attn_dp

    def _first_use(self, compact: bool) -> None:
        self.used = True
        logger.info("nsa_cp: SGLang CP moves in use (rank %d of the attention-CP group, %s MoE gather)",
                    dist.get_rank(self.group), "compact" if compact else "padded")

    # --- CpMoves
    def gather(self, hidden_states, residual, forward_batch, norm, *, gather: Callable, update=_NOT_GIVEN,
               cache=None, **call):
        """Run SGLang's read step ``gather`` (residual add + norm) on the local ``[physical, H]`` rows, then
        gather every rank's real rows: returns ``([max_rank_len * cp, H] rank-major, residual)``, the
        padding rows zero, or with compact ``([sum(n), H], residual)``, rank q's rows at ``off[q]``."""
        if update is not _NOT_GIVEN:
            call["update"] = update
        x, residual = gather(hidden_states, residual, forward_batch, norm, cache=cache, **call)
        md, layout, rank, rows = self._geometry(forward_batch)
        n = layout.count(rank)
        if x.shape[0] != rows or n > rows:
            raise ValueError(
                f"hidden_states: expected {rows} local rows (per_rank_actual_token[{rank}], of which {n} real), "
                f"got shape {list(x.shape)}"
            )
        compact = self._use_compact(md)
        if not self.used:
            self._first_use(compact)
        self.communicator  # noqa: B018  creates the P2P transport where asked (collective, once)
        gathered = cp_all_gather(x[:n], layout, self.group, compact=compact, backend=self.backend,
                                 validate=self.validate)
        return gathered, residual

    def take_back(self, hidden_states, residual, forward_batch, **kwargs):
        """This rank's ``[physical, H]`` rows of a complete output, padded ``[max_rank_len * cp, H]`` (a
        view, or a copy where a P2P transport serves the group) or compact ``[sum(n), H]`` (a copy, the
        rows past the real count zero)."""
        md, layout, rank, rows = self._geometry(forward_batch)
        compact = _which_layout("hidden_states", hidden_states, layout)
        if compact:
            n, start = layout.count(rank), layout.offsets[rank]
            out = hidden_states.new_zeros((rows, *hidden_states.shape[1:]))
            out[:n].copy_(hidden_states[start : start + n])
            return out, residual
        start = rank * layout.max_rank_len
        back = hidden_states[start : start + rows]
        # an in-place MoE's output can be the P2P transport's gather buffer, which the next gathers reuse
        return (back.clone() if get_p2p(self.group) is not None else back), residual

    def reduce_scatter(self, hidden_states, residual, forward_batch, **kwargs):
        """Sum the ranks' partials (padded ``[max_rank_len * cp, H]`` or compact ``[sum(n), H]``) and return
        this rank's ``[physical, H]`` rows (the rows past the real count zero), in a fresh tensor."""
        md, layout, rank, rows = self._geometry(forward_batch)
        compact = _which_layout("hidden_states", hidden_states, layout)
        n = layout.count(rank)
        out = hidden_states.new_empty((rows, *hidden_states.shape[1:]))
        out[n:].zero_()
        cp_reduce_scatter(hidden_states, layout, self.group, compact=compact, out=out[:n], backend=self.backend,
                          validate=self.validate)
        return out, residual

    def reduce_scatter_group(self):
        """The group ``reduce_scatter`` sums over: SGLang's attention-CP GroupCoordinator where SGLang is
        set up, else a view with its ``ranks`` over the configured torch group."""
        coordinator = _sglang_attn_cp_group() if self._group is None else None
        return coordinator if coordinator is not None else _GroupView(self.group)

    def mlp_output_buffer(self, forward_batch, like: torch.Tensor) -> torch.Tensor:
        """Where a MoE you call yourself can write its partials for ``reduce_scatter`` (the P2P
        transport's reduce buffer when that is in use: no copy in). Padded layout."""
        _, layout, _, _ = self._geometry(forward_batch)
        return self.communicator.mlp_output_buffer(layout, like)


def _sglang_attn_dp_size() -> int:
    try:
        from sglang.srt.runtime_context import get_parallel

        return int(get_parallel().attn_dp_size)
    except Exception:  # noqa: BLE001  not SGLang, or not published: no attention DP
        return 1


def _passthrough_norm(x, residual=None):
    return x if residual is None else (x, residual)


def _which_layout(name: str, t: torch.Tensor, layout: ShardLayout) -> bool:
    """True for the compact ``[total_len, ...]`` rows, False for the padded ``[padded_len, ...]`` (the same
    when there is no padding); ValueError for anything else."""
    if isinstance(t, torch.Tensor) and t.dim() >= 1:
        if t.shape[0] == layout.padded_len:
            return False
        if t.shape[0] == layout.total_len:
            return True
    got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
    raise ValueError(
        f"{name}: expected [{layout.padded_len}, ...] (padded: max_rank_len {layout.max_rank_len} * cp_size "
        f"{layout.cp_size}, rank-major) or [{layout.total_len}, ...] (compact: the real rows), got {got}"
    )


# ----------------------------------------------------------------------------- module-level moves
_DEFAULT = CpMovesAdapter()


def configure(group: Optional[dist.ProcessGroup] = None, **kwargs) -> CpMovesAdapter:
    """Replace the adapter behind the module-level moves (``group``, ``backend``, ``validate``, P2P sizes)."""
    global _DEFAULT
    _DEFAULT = CpMovesAdapter(group, **kwargs)
    return _DEFAULT


def gather(hidden_states, residual, forward_batch, norm, *, gather, update=_NOT_GIVEN, cache=None, **call):
    """``CpMoves.gather`` on the configured adapter (see :meth:`CpMovesAdapter.gather`)."""
    return _DEFAULT.gather(hidden_states, residual, forward_batch, norm, gather=gather, update=update, cache=cache, **call)


def take_back(hidden_states, residual, forward_batch, **kwargs):
    """``CpMoves.take_back`` on the configured adapter."""
    return _DEFAULT.take_back(hidden_states, residual, forward_batch, **kwargs)


def reduce_scatter(hidden_states, residual, forward_batch, **kwargs):
    """``CpMoves.reduce_scatter`` on the configured adapter."""
    return _DEFAULT.reduce_scatter(hidden_states, residual, forward_batch, **kwargs)


def reduce_scatter_group():
    """``CpMoves.reduce_scatter_group`` on the configured adapter."""
    return _DEFAULT.reduce_scatter_group()


def mask_padding_topk_ids_for_batch(topk_ids: torch.Tensor, forward_batch) -> torch.Tensor:
    """``nsa_cp.mask_padding_topk_ids`` with the layout of ``forward_batch.attn_cp_metadata``: the
    physical padding rows of the gathered ``[physical * cp, top_k]`` ids -> -1, in place."""
    return mask_padding_topk_ids(topk_ids, layout_from_cp_metadata(forward_batch.attn_cp_metadata))


# ----------------------------------------------------------------------------- install / plugin
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
        return _moves_on(theirs, lambda: _DEFAULT)
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
        version = _sglang_version()
        logger.info("nsa_cp: SGLang plugin registered on %s (SGLang %s, tested %s; compact MoE gather %s)",
                    HOOK_TARGET, version, TESTED_SGLANG, "on" if envs.NSA_CP_SGLANG_COMPACT else "off")
        if version is not None and not str(version).startswith(TESTED_SGLANG):
            logger.warning("nsa_cp: written against SGLang %s's layer_boundary, found %s; check the CpMoves "
                           "signatures", TESTED_SGLANG, version)
    except Exception as e:
        logger.error("nsa_cp: SGLang plugin NOT registered, SGLang's own CP moves are used (%s: %s)",
                     type(e).__name__, e)
        raise


def _sglang_version() -> Optional[str]:
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:  # noqa: BLE001
        return getattr(sys.modules.get("sglang"), "__version__", None)


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
        "used": _DEFAULT.used,
        "compact": envs.NSA_CP_SGLANG_COMPACT,
        "sglang": _sglang_version(),
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
    version = getattr(sys.modules.get("sglang"), "__version__", None)
    if version is not None and not str(version).startswith(TESTED_SGLANG):
        logger.warning("nsa_cp.integrations.sglang: written against SGLang %s's layer_boundary, found %s; "
                       "check the CpMoves signatures", TESTED_SGLANG, version)
    importlib.import_module("sglang.srt.layers.layer_boundary.contracts")

    original = modules[0]._cp_moves
    if getattr(original, "_nsa_cp_adapter", None) is not None:
        raise RuntimeError("nsa_cp.integrations.sglang.install: already installed (uninstall() the first)")
    if _binds_nsa_cp(original):
        adapter = configure(group, **kwargs) if (group is not None or kwargs) else _DEFAULT
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
