"""The adapter: SGLang's per-layer CP moves (the ``CpMoves`` fields) on nsa_cp's collectives.

Contract (shapes per rank; ``n`` = this rank's real rows, ``physical`` = its local rows in SGLang,
``M = max_rank_len``, ``T = sum(n)`` over ranks, ``off[q]`` = the real rows before rank q):

* ``gather(hidden_states [physical, H], residual, forward_batch, norm, *, gather=<SGLang's read step>)``
  -> ``(padded [M * cp, H] rank-major, the padding rows zero | compact [T, H], residual)``. Where the read
  step is SGLang's plain residual add + RMSNorm (``readstep``), one ``fused_add_rmsnorm_all_gather`` runs
  instead of the step and the gather; the residual comes back as SGLang's step leaves it, padding rows
  included;
* ``take_back(full [M * cp, H] | [T, H], residual, forward_batch)`` -> ``([physical, H], residual)``,
  this rank's rows, zeros after;
* ``reduce_scatter(partials [M * cp, H] | [T, H], residual, forward_batch)`` -> ``([physical, H],
  residual)``, the sum over ranks of this rank's real rows, zeros after, in a fresh tensor;
* ``reduce_scatter_group()`` -> SGLang's attention-CP GroupCoordinator, or a view with ``ranks``;
* :meth:`CpMovesAdapter.admit` -> why SGLang's own move must take a batch (graph capture, attention DP,
  geometry), or the batch's geometry for nsa_cp's move; :meth:`CpMovesAdapter.create_transport` creates the group's P2P transport (collective).

Padded is SGLang's own layout; compact (``NSA_CP_SGLANG_COMPACT=1`` or ``compact=True``) hands the MoE
only the real rows, and only through moves bound with ``compact_ok`` (the plugin binds it for FFN stages
alone). take_back and reduce_scatter tell the two apart by the row count. The semantics, and what they
change for SGLang: docs/sglang.md.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Tuple

import torch
import torch.distributed as dist

from ... import envs
from ...api.collectives import fused_add_rmsnorm_all_gather
from ...api.communicator import NSACPLayerCommunicator
from ...geometry.layout import ShardLayout
from ...rows.norm import fused_add_rmsnorm_into
from .. import moves as row_moves, state as shared
from . import readstep, runtime, state
from .metadata import int_list, layout_from_cp_metadata, physical_rows

logger = logging.getLogger("nsa_cp")

# tells "update not passed" from update=None: SGLang's read step gets it only when the caller gave it
NOT_GIVEN = object()


class Declined(ValueError):
    """A batch nsa_cp's move does not take after SGLang's read step ran (its rows are not the metadata's):
    the plugin hands ``rows`` / ``residual`` to SGLang's own gather. A ValueError for direct callers."""

    def __init__(self, message: str, reason: str, rows=None, residual=None):
        super().__init__(message)
        self.reason, self.rows, self.residual = reason, rows, residual


class _GroupView:
    """The bits of SGLang's GroupCoordinator the boundary reads (``ranks``), over a torch group."""

    def __init__(self, group: Optional[dist.ProcessGroup]):
        self.device_group = group
        self.ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        self.world_size = len(self.ranks)
        self.rank_in_group = dist.get_rank(group)

    def __repr__(self):
        return f"_GroupView(ranks={self.ranks})"


class CpMovesAdapter:
    """SGLang's CP moves (``CpMoves`` fields) on nsa_cp.

    Args:
        group: the torch process group of the attention-CP ranks. None: SGLang's
            ``get_parallel().attn_cp_group.device_group`` when SGLang is set up, else the default group.
        compact: gather only the real rows (module docstring). None: ``NSA_CP_SGLANG_COMPACT``, read on
            every gather. Without logical counts in the metadata it is padded.
        backend, validate: as for ``nsa_cp.cp_all_gather``.
        fuse: run ``fused_add_rmsnorm_all_gather`` where SGLang's read step is the plain add + RMSNorm.
        p2p_max_tokens_per_rank, hidden_size, dtype: create the P2P transport up front, on the first move
            (see :meth:`create_transport`, which a caller that knows the sizes calls instead).

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
        fuse: bool = True,
        p2p_max_tokens_per_rank: Optional[int] = None,
        hidden_size: Optional[int] = None,
        dtype: Optional[torch.dtype] = None,
    ):
        self._group = group
        self.compact = compact
        self.backend = backend
        self.validate = validate
        self.fuse = fuse
        self._sizes = (p2p_max_tokens_per_rank, hidden_size, dtype) if p2p_max_tokens_per_rank is not None else None
        self._comm: Optional[NSACPLayerCommunicator] = None
        self._attn_dp: Optional[bool] = None  # SGLang's attention DP, fixed for the process: read once
        self.used = False

    # --- plumbing
    @property
    def group(self) -> Optional[dist.ProcessGroup]:
        if self._group is None:
            coordinator = runtime.attn_cp_group()
            if coordinator is not None and getattr(coordinator, "device_group", None) is not None:
                self._group = coordinator.device_group
        return self._group

    def create_transport(self, max_tokens_per_rank: int, hidden_size: int, dtype: torch.dtype, device=None,
                         *, p2p: bool = True) -> dict:
        """Create this group's transport (``integrations.state.create_transport``): P2P where ``p2p`` and the
        group can take it (one node, ``nsa_cp._C``, CUDA), else nsa_cp's NCCL communicator where the group is
        NCCL. Collective: every rank of the group calls it, and every rank reaches the same decision. Returns
        the decision ``{"on", "bytes", "max_tokens_per_rank", "reason", "nccl"}``."""
        return shared.create_transport(self.group, max_tokens_per_rank, hidden_size, dtype, device, p2p=p2p,
                                     off_reason="NSA_CP_SGLANG_P2P=0")

    def _transport_once(self) -> None:
        """The transport asked for in the constructor (``p2p_max_tokens_per_rank``), created on first use."""
        if self._sizes is not None:
            sizes, self._sizes = self._sizes, None
            state.STATE.p2p = self.create_transport(*sizes)

    def _geometry(self, forward_batch) -> Tuple[Any, ShardLayout, int, int]:
        md = getattr(forward_batch, "attn_cp_metadata", None)
        if md is None:
            raise ValueError("forward_batch.attn_cp_metadata: expected SGLang's CP metadata of this extend, got None")
        layout = layout_from_cp_metadata(md)
        rank = dist.get_rank(self.group)
        return md, layout, rank, physical_rows(md, rank, layout)

    def _use_compact(self, md) -> bool:
        wanted = envs.NSA_CP_SGLANG_COMPACT if self.compact is None else self.compact
        return bool(wanted) and bool(int_list(md, "per_rank_logical_token"))

    def _first_use(self, compact: bool) -> None:
        self.used = state.STATE.used = True
        logger.info("nsa_cp: SGLang CP moves in use (rank %d of the attention-CP group, %s MoE gather)",
                    dist.get_rank(self.group), "compact" if compact else "padded")

    # --- which batches SGLang's own moves take
    def admit(self, name: str, hidden_states, forward_batch) -> Tuple[Optional[str], Optional[tuple]]:
        """``(reason, None)``: why SGLang's own ``name`` move must take this batch; else ``(None, geometry)``,
        the batch's ``(md, layout, rank, rows)`` for nsa_cp's move (``geometry=``: read once per move). The
        same answer on every rank (it reads the batch's metadata and the row counts, which SGLang makes
        equal across ranks). A reason reads ``"<kind> (<this batch's details>)"``; the kind is what is
        logged once and counted."""
        md = getattr(forward_batch, "attn_cp_metadata", None)
        if md is None:
            return "no attn_cp_metadata on the batch", None
        if getattr(md, "graph_num_tokens", None) is not None:
            return "a batch under SGLang's breakable CUDA graph", None
        if self._attn_dp is None:
            self._attn_dp = runtime.attn_dp_size() > 1
        if self._attn_dp:
            return "attention DP (SGLang returns over its own DP slots)", None
        try:
            layout = layout_from_cp_metadata(md)
        except ValueError as e:
            return f"metadata nsa_cp cannot read ({e})", None
        size = dist.get_world_size(self.group)
        if layout.cp_size != size:
            return f"metadata for another group size ({layout.cp_size} ranks, the attention-CP group has {size})", None
        if name != "gather":
            rows = hidden_states.shape[0] if isinstance(hidden_states, torch.Tensor) else None
            if rows not in (layout.padded_len, layout.total_len):
                return (f"{name} input rows not the metadata's ({rows}; padded {layout.padded_len}, compact "
                        f"{layout.total_len})"), None
        rank = dist.get_rank(self.group)
        return None, (md, layout, rank, physical_rows(md, rank, layout))

    # --- CpMoves
    def gather(self, hidden_states, residual, forward_batch, norm, *, gather: Callable, update=NOT_GIVEN,
               cache=None, **call):
        """SGLang's read step ``gather`` (residual add + norm) on the local ``[physical, H]`` rows, then a
        gather of every rank's real rows: returns ``([max_rank_len * cp, H] rank-major, residual)``, the
        padding rows zero, or with compact ``([sum(n), H], residual)``, rank q's rows at ``off[q]``. A
        plain add + RMSNorm step runs fused with the gather (module docstring)."""
        return self.gather_rows(hidden_states, residual, forward_batch, norm, gather=gather, update=update,
                                cache=cache, compact_ok=True, **call)

    def gather_rows(self, hidden_states, residual, forward_batch, norm, *, gather: Callable, update=NOT_GIVEN,
                    cache=None, compact_ok: bool, geometry: Optional[tuple] = None, **call):
        """:meth:`gather`, compact only where ``compact_ok`` (the stage's consumer is per-row: an FFN);
        ``geometry``: what :meth:`admit` read of this batch."""
        md, layout, rank, rows = geometry or self._geometry(forward_batch)
        n = layout.count(rank)
        compact = compact_ok and self._use_compact(md)
        if not self.used:
            self._first_use(compact)
        self._transport_once()
        row_moves.over_capacity(state.STATE, self.group, layout)
        kw = dict(group=self.group, compact=compact, backend=self.backend, validate=self.validate)
        fused, x, residual = self._read_step(hidden_states, residual, forward_batch, norm, gather, update, cache,
                                             call, n, rank, rows)
        if fused is not None:
            weight, eps = fused
            gathered, _ = fused_add_rmsnorm_all_gather(hidden_states[:n], residual[:n], weight, eps, layout, **kw)
            state.count(state.STATE.gathers, "fused_add_rmsnorm_all_gather")
            return gathered, residual
        state.count(state.STATE.gathers, "read_then_gather")
        return row_moves.gather_rows(x, layout, rank, **kw), residual

    def read_local(self, hidden_states, residual, forward_batch, norm, *, gather: Callable, update=NOT_GIVEN,
                   cache=None, geometry: Optional[tuple] = None, **call):
        """SGLang's read step on this rank's rows, nothing gathered (the overlapped boundary moves them):
        ``(x [n, H] the normed real rows, residual, compact)``. The residual comes back as :meth:`gather`
        leaves it; a plain add + RMSNorm step runs as the fused gather's local part (the same arithmetic),
        anything else as SGLang's step. :class:`Declined` (after SGLang's step) where its rows are not the
        metadata's."""
        md, layout, rank, rows = geometry or self._geometry(forward_batch)
        n = layout.count(rank)
        compact = self._use_compact(md)
        if not self.used:
            self._first_use(compact)
        self._transport_once()
        fused, x, residual = self._read_step(hidden_states, residual, forward_batch, norm, gather, update, cache,
                                             call, n, rank, rows)
        if fused is not None:
            weight, eps = fused
            x = hidden_states.new_empty((n, *hidden_states.shape[1:]))
            fused_add_rmsnorm_into(hidden_states[:n], residual[:n], weight, eps, out=x)
            state.count(state.STATE.gathers, "fused_add_rmsnorm_overlapped")
            return x, residual, compact
        state.count(state.STATE.gathers, "read_then_overlapped")
        return x[:n], residual, compact

    def _read_step(self, hidden_states, residual, forward_batch, norm, gather, update, cache, call, n, rank, rows):
        """SGLang's read step on this rank's ``[rows, H]`` (``n`` real), or, where it is the plain add + RMSNorm
        (``readstep``), its ``(weight, eps)`` for a fused kernel on the real rows: ``(fused | None, x [rows, H]
        | None, residual)``. With ``fused`` the padding rows' residual is already written, as SGLang's step
        writes it (nothing moves them). :class:`Declined` where SGLang's step returns other rows."""
        fused = readstep.NotFusable("fuse=False") if not self.fuse else readstep.plain_add_rmsnorm(
            gather, hidden_states, residual, norm, None if update is NOT_GIVEN else update, call)
        if not isinstance(fused, readstep.NotFusable) and hidden_states.shape[0] == rows and n <= rows:
            if n < rows:
                residual[n:rows].add_(hidden_states[n:rows])
            return fused, None, residual
        if isinstance(fused, readstep.NotFusable):
            state.record(state.STATE.unfused, fused, "nsa_cp: MoE gather not fused with the read step (%s); "
                         "SGLang's step, then nsa_cp's gather")
        if update is not NOT_GIVEN:
            call["update"] = update
        x, residual = gather(hidden_states, residual, forward_batch, norm, cache=cache, **call)
        if x.shape[0] != rows or n > rows:
            raise Declined(
                f"hidden_states: expected {rows} local rows (per_rank_actual_token[{rank}], of which {n} real), "
                f"got shape {list(x.shape)}", f"local rows not the metadata's ({x.shape[0]}; {rows})", x, residual)
        return None, x, residual

    def take_back(self, hidden_states, residual, forward_batch, *, geometry: Optional[tuple] = None, **kwargs):
        """This rank's ``[physical, H]`` rows of a complete output, padded ``[max_rank_len * cp, H]`` (a
        view, or a copy where a P2P transport serves the group) or compact ``[sum(n), H]`` (a copy, the
        rows past the real count zero)."""
        _, layout, rank, rows = geometry or self._geometry(forward_batch)
        return row_moves.take_back_rows(hidden_states, layout, rank, rows, self.group), residual

    def reduce_scatter(self, hidden_states, residual, forward_batch, *, geometry: Optional[tuple] = None,
                       **kwargs):
        """Sum the ranks' partials (padded ``[max_rank_len * cp, H]`` or compact ``[sum(n), H]``) and return
        this rank's ``[physical, H]`` rows (the rows past the real count zero), in a fresh tensor."""
        _, layout, rank, rows = geometry or self._geometry(forward_batch)
        out = row_moves.reduce_scatter_rows(hidden_states, layout, rank, rows, self.group, backend=self.backend,
                                       validate=self.validate)
        return out, residual

    def reduce_scatter_group(self):
        """The group ``reduce_scatter`` sums over: SGLang's attention-CP GroupCoordinator where SGLang is
        set up, else a view with its ``ranks`` over the configured torch group."""
        coordinator = runtime.attn_cp_group() if self._group is None else None
        return coordinator if coordinator is not None else _GroupView(self.group)

    def mlp_output_buffer(self, forward_batch, like: torch.Tensor) -> torch.Tensor:
        """Where a MoE you call yourself can write its partials for ``reduce_scatter`` (the P2P
        transport's reduce buffer when that is in use: no copy in). Padded layout."""
        _, layout, _, _ = self._geometry(forward_batch)
        self._transport_once()
        if self._comm is None:
            self._comm = NSACPLayerCommunicator(self.group, _passthrough_norm, _passthrough_norm, mlp_mode="full",
                                                backend=self.backend, validate=self.validate)
        return self._comm.mlp_output_buffer(layout, like)


def _passthrough_norm(x, residual=None):
    return x if residual is None else (x, residual)
