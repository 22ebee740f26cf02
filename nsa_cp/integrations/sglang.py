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

The moves here keep SGLang's shapes exactly (a gathered ``[physical * cp, H]`` rank-major buffer, local
``[physical, H]`` results), so nothing else in SGLang changes; what changes is how the rows move:
nsa_cp's collectives (the padding rows are written as zeros by the pack kernel instead of being gathered
from the ranks, P2P over NVLink where ``nsa_cp.init_p2p`` works, and the reduce-scatter sums only the
real rows' slots). On metadata without physical padding (``per_rank_logical_token`` None) the shards may
be uneven and the gathered buffer is ``[max_rank_len * cp, H]``.

Install (before the model is constructed, on every rank)::

    import nsa_cp.integrations.sglang as nsa_sglang
    handle = nsa_sglang.install()            # group: SGLang's attn-CP group, found at call time
    ...                                      # build the model / launch the engine in this process
    handle.uninstall()                       # optional: SGLang's own moves again (for models built later)

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

from ..collectives import cp_reduce_scatter
from ..communicator import NSACPLayerCommunicator
from ..layout import ShardLayout
from ..moe import mask_padding_topk_ids

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
]

logger = logging.getLogger("nsa_cp")

TESTED_SGLANG = "0.5.23"

# every module of SGLang 0.5.23 that binds ``_cp_moves`` by name
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
        backend, validate: as for ``nsa_cp.cp_all_gather``.
        p2p_max_tokens_per_rank, hidden_size, dtype: create the P2P transport up front (see
            ``NSACPLayerCommunicator``); give the largest physical shard a prefill can have.
    """

    def __init__(
        self,
        group: Optional[dist.ProcessGroup] = None,
        *,
        backend: str = "auto",
        validate: Optional[bool] = None,
        p2p_max_tokens_per_rank: Optional[int] = None,
        hidden_size: Optional[int] = None,
        dtype: Optional[torch.dtype] = None,
    ):
        self._group = group
        self.backend = backend
        self.validate = validate
        self._p2p = dict(p2p_max_tokens_per_rank=p2p_max_tokens_per_rank, hidden_size=hidden_size, dtype=dtype)
        self._comm: Optional[NSACPLayerCommunicator] = None

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

    def _geometry(self, forward_batch) -> Tuple[ShardLayout, int, int]:
        md = getattr(forward_batch, "attn_cp_metadata", None)
        if md is None:
            raise ValueError("forward_batch.attn_cp_metadata: expected SGLang's CP metadata of this extend, got None")
        layout = layout_from_cp_metadata(md)
        rank = dist.get_rank(self.group)
        return layout, rank, _physical_rows(md, rank, layout)

    # --- CpMoves
    def gather(self, hidden_states, residual, forward_batch, norm, *, gather: Callable, update=_NOT_GIVEN,
               cache=None, **call):
        """Run SGLang's read step ``gather`` (residual add + norm) on the local ``[physical, H]`` rows, then
        gather every rank's real rows: returns ``([max_rank_len * cp, H] rank-major, residual)``, the
        padding rows zero."""
        if update is not _NOT_GIVEN:
            call["update"] = update
        x, residual = gather(hidden_states, residual, forward_batch, norm, cache=cache, **call)
        layout, rank, rows = self._geometry(forward_batch)
        n = layout.count(rank)
        if x.shape[0] != rows or n > rows:
            raise ValueError(
                f"hidden_states: expected {rows} local rows (per_rank_actual_token[{rank}], of which {n} real), "
                f"got shape {list(x.shape)}"
            )
        gathered, _ = self.communicator.prepare_mlp(x[:n], None, layout)
        return gathered, residual

    def take_back(self, hidden_states, residual, forward_batch, **kwargs):
        """This rank's ``[physical, H]`` block of a complete ``[max_rank_len * cp, H]`` output (a view)."""
        layout, rank, rows = self._geometry(forward_batch)
        _check_global("hidden_states", hidden_states, layout)
        start = rank * layout.max_rank_len
        return hidden_states[start : start + rows], residual

    def reduce_scatter(self, hidden_states, residual, forward_batch, **kwargs):
        """Sum the ranks' ``[max_rank_len * cp, H]`` partials and return this rank's ``[physical, H]``
        rows (the rows past the real count zero)."""
        layout, rank, rows = self._geometry(forward_batch)
        _check_global("hidden_states", hidden_states, layout)
        n = layout.count(rank)
        if rows == n:
            out, _ = self.communicator.postprocess_layer(hidden_states, None, layout)
            return out, residual
        out = hidden_states.new_empty((rows, *hidden_states.shape[1:]))
        out[n:].zero_()
        cp_reduce_scatter(hidden_states, layout, self.group, out=out[:n], backend=self.backend, validate=self.validate)
        return out, residual

    def reduce_scatter_group(self):
        """The group ``reduce_scatter`` sums over: SGLang's attention-CP GroupCoordinator where SGLang is
        set up, else a view with its ``ranks`` over the configured torch group."""
        coordinator = _sglang_attn_cp_group() if self._group is None else None
        return coordinator if coordinator is not None else _GroupView(self.group)

    def mlp_output_buffer(self, forward_batch, like: torch.Tensor) -> torch.Tensor:
        """Where a MoE you call yourself can write its partials for ``reduce_scatter`` (the P2P
        transport's reduce buffer when that is in use: no copy in)."""
        layout, _, _ = self._geometry(forward_batch)
        return self.communicator.mlp_output_buffer(layout, like)


def _passthrough_norm(x, residual=None):
    return x if residual is None else (x, residual)


def _check_global(name: str, t: torch.Tensor, layout: ShardLayout) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() < 1 or t.shape[0] != layout.padded_len:
        got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(
            f"{name}: expected [{layout.padded_len}, ...] (max_rank_len {layout.max_rank_len} * cp_size "
            f"{layout.cp_size}, rank-major), got {got}"
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


# ----------------------------------------------------------------------------- install
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


def install(group: Optional[dist.ProcessGroup] = None, **kwargs) -> Installed:
    """Route SGLang's DSA/MLA prefill-CP moves through nsa_cp. Call before the model is constructed.

    Patches ``_cp_moves`` in every module of :data:`BOUNDARY_MODULES` (each imports it by name). The
    patched function asks SGLang's for its choice and replaces only the DSA/MLA kind (the one with a
    ``reduce_scatter``), keeping SGLang's ``reduce_scatter_group`` (its GroupCoordinator); a batch under
    SGLang's breakable CUDA graphs (``attn_cp_metadata.graph_num_tokens`` set) takes SGLang's own moves.

    Args:
        group, **kwargs: for :class:`CpMovesAdapter` (group None: SGLang's attention-CP group).

    Raises:
        ImportError when SGLang (its ``layer_boundary`` package) is not importable.
    """
    import importlib

    modules = [importlib.import_module(name) for name in BOUNDARY_MODULES]
    version = getattr(sys.modules.get("sglang"), "__version__", None)
    if version is not None and not str(version).startswith(TESTED_SGLANG):
        logger.warning("nsa_cp.integrations.sglang: written against SGLang %s's layer_boundary, found %s; "
                       "check the CpMoves signatures", TESTED_SGLANG, version)
    from sglang.srt.layers.layer_boundary.contracts import CpMoves

    original = modules[0]._cp_moves
    if getattr(original, "_nsa_cp_adapter", None) is not None:
        raise RuntimeError("nsa_cp.integrations.sglang.install: already installed (uninstall() the first)")
    adapter = CpMovesAdapter(group, **kwargs)

    def cp_moves():
        theirs = original()
        if theirs.reduce_scatter is None:
            return theirs  # GQA MoE-CP moves: not ours

        def gather_(hidden_states, residual, forward_batch, norm, **call):
            if _in_graph(forward_batch):
                return theirs.gather(hidden_states, residual, forward_batch, norm, **call)
            return adapter.gather(hidden_states, residual, forward_batch, norm, **call)

        def take_back_(hidden_states, residual, forward_batch, **kw):
            if _in_graph(forward_batch):
                return theirs.take_back(hidden_states, residual, forward_batch, **kw)
            return adapter.take_back(hidden_states, residual, forward_batch, **kw)

        def reduce_scatter_(hidden_states, residual, forward_batch, **kw):
            if _in_graph(forward_batch):
                return theirs.reduce_scatter(hidden_states, residual, forward_batch, **kw)
            return adapter.reduce_scatter(hidden_states, residual, forward_batch, **kw)

        return CpMoves(
            gather=gather_,
            take_back=take_back_,
            reduce_scatter=reduce_scatter_,
            reduce_scatter_group=theirs.reduce_scatter_group or adapter.reduce_scatter_group,
        )

    cp_moves._nsa_cp_adapter = adapter
    patched = []
    for module in modules:
        if getattr(module, "_cp_moves", None) is original:
            module._cp_moves = cp_moves
            patched.append(module)
    logger.info("nsa_cp: SGLang CP moves installed in %s", ", ".join(m.__name__ for m in patched))
    return Installed(adapter, original, patched)
