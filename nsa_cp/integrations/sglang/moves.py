"""The process's configured adapter, and the module-level ``CpMoves`` functions that run on it.

Contract: :func:`configure` replaces the adapter (a new :class:`~.adapter.CpMovesAdapter`) and returns it;
:func:`configured` is the one in use now (the plugin's moves resolve it when they run, so a later
``configure`` reaches them); ``gather`` / ``take_back`` / ``reduce_scatter`` / ``reduce_scatter_group``
have the signatures and shapes of the adapter's methods. :func:`mask_padding_topk_ids_for_batch` needs
no adapter.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ...api.moe import mask_padding_topk_ids
from .adapter import NOT_GIVEN, CpMovesAdapter
from .metadata import layout_from_cp_metadata

_DEFAULT = CpMovesAdapter()


def configured() -> CpMovesAdapter:
    """The adapter behind the module-level moves and the plugin's hook."""
    return _DEFAULT


def configure(group: Optional[dist.ProcessGroup] = None, **kwargs) -> CpMovesAdapter:
    """Replace the adapter behind the module-level moves (``group``, ``backend``, ``validate``, P2P sizes)."""
    global _DEFAULT
    _DEFAULT = CpMovesAdapter(group, **kwargs)
    return _DEFAULT


def gather(hidden_states, residual, forward_batch, norm, *, gather, update=NOT_GIVEN, cache=None, **call):
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
