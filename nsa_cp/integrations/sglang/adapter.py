"""The adapter: SGLang's per-layer CP moves (the ``CpMoves`` fields) on nsa_cp's collectives.

Contract (shapes per rank; ``n`` = this rank's real rows, ``physical`` = its local rows in SGLang,
``M = max_rank_len``, ``T = sum(n)`` over ranks, ``off[q]`` = the real rows before rank q):

* ``gather(hidden_states [physical, H], residual, forward_batch, norm, *, gather=<SGLang's read step>)``
  -> ``(padded [M * cp, H] rank-major, the padding rows zero | compact [T, H], residual)``;
* ``take_back(full [M * cp, H] | [T, H], residual, forward_batch)`` -> ``([physical, H], residual)``,
  this rank's rows, zeros after;
* ``reduce_scatter(partials [M * cp, H] | [T, H], residual, forward_batch)`` -> ``([physical, H],
  residual)``, the sum over ranks of this rank's real rows, zeros after, in a fresh tensor;
* ``reduce_scatter_group()`` -> SGLang's attention-CP GroupCoordinator, or a view with ``ranks``.

Padded is SGLang's own layout; compact (``NSA_CP_SGLANG_COMPACT=1`` or ``compact=True``) hands the MoE
only the real rows. take_back and reduce_scatter tell the two apart by the row count. The semantics,
and what they change for SGLang: docs/sglang.md.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Tuple

import torch
import torch.distributed as dist

from ... import envs
from ...collectives import cp_all_gather, cp_reduce_scatter
from ...communicator import NSACPLayerCommunicator
from ...layout import ShardLayout
from ...transport.p2p import get_p2p
from . import runtime
from .metadata import int_list, layout_from_cp_metadata, physical_rows, which_layout

logger = logging.getLogger("nsa_cp")

# tells "update not passed" from update=None: SGLang's read step gets it only when the caller gave it
NOT_GIVEN = object()


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
            coordinator = runtime.attn_cp_group()
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
        return md, layout, rank, physical_rows(md, rank, layout)

    def _use_compact(self, md) -> bool:
        wanted = envs.NSA_CP_SGLANG_COMPACT if self.compact is None else self.compact
        if not wanted or not int_list(md, "per_rank_logical_token"):
            return False
        if self._attn_dp is None:
            # with attention DP SGLang leaves through its own DP take-back over padded slots
            self._attn_dp = runtime.attn_dp_size() > 1
            if self._attn_dp:
                logger.info("nsa_cp: NSA_CP_SGLANG_COMPACT ignored with attention DP (padded MoE gather)")
        return not self._attn_dp

    def _first_use(self, compact: bool) -> None:
        self.used = True
        logger.info("nsa_cp: SGLang CP moves in use (rank %d of the attention-CP group, %s MoE gather)",
                    dist.get_rank(self.group), "compact" if compact else "padded")

    # --- CpMoves
    def gather(self, hidden_states, residual, forward_batch, norm, *, gather: Callable, update=NOT_GIVEN,
               cache=None, **call):
        """Run SGLang's read step ``gather`` (residual add + norm) on the local ``[physical, H]`` rows, then
        gather every rank's real rows: returns ``([max_rank_len * cp, H] rank-major, residual)``, the
        padding rows zero, or with compact ``([sum(n), H], residual)``, rank q's rows at ``off[q]``."""
        if update is not NOT_GIVEN:
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
        compact = which_layout("hidden_states", hidden_states, layout)
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
        compact = which_layout("hidden_states", hidden_states, layout)
        n = layout.count(rank)
        out = hidden_states.new_empty((rows, *hidden_states.shape[1:]))
        out[n:].zero_()
        cp_reduce_scatter(hidden_states, layout, self.group, compact=compact, out=out[:n], backend=self.backend,
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
        return self.communicator.mlp_output_buffer(layout, like)


def _passthrough_norm(x, residual=None):
    return x if residual is None else (x, residual)
