"""NSACPLayerCommunicator: the per-layer communication of a decoder layer under NSA prefill CP.

Data flow of one layer (names as in SGLang's LayerCommunicator)::

    prepare_attn       residual add + input_layernorm                  local [n_r, H]
    (attention)        CP-local (the KV cache is shared through the in-seq split)
    prepare_mlp        residual add + post_attention_layernorm, then in "full" mode
                       cp_all_gather -> every token on every rank      [M*P, H] or [T, H]
    (MoE)              partial sums for every token
    postprocess_layer  "full" mode: cp_reduce_scatter -> own tokens    local [n_r, H]

The residual always stays local ``[n_r, H]``. ``layout=None`` means CP is off for this batch: norms
only, no communication. In "scattered" mode the MLP runs on local tokens and nothing is communicated.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional, Tuple

import torch
import torch.distributed as dist

from .collectives import cp_all_gather, cp_reduce_scatter, select_p2p_transport
from .layout import ShardLayout
from .transport import p2p
from .transport.nccl import group_rank_and_size

__all__ = ["NSACPLayerCommunicator"]

logger = logging.getLogger("nsa_cp")

_MLP_MODES = ("full", "scattered")


class NSACPLayerCommunicator:
    """Owns a layer's CP communication.

    Args:
        group: the CP process group (None: the default group).
        input_layernorm, post_attention_layernorm: norms with the convention ``norm(x) -> y``,
            ``norm(x, residual) -> (y, x + residual)`` (e.g. ``nsa_cp.RMSNorm``).
        mlp_mode: "full" (gather before the MLP, reduce-scatter after) or "scattered" (local MLP).
        compact: gather into / reduce from the compact layout (no padding rows for the MoE).
        algo: compact algorithm on NCCL, see ``cp_all_gather``.
        backend: "auto", "nccl" or "p2p", see ``cp_all_gather``.
        validate: rank-agreement check on every collective (None: NSA_CP_VALIDATE), see ``cp_all_gather``.
        p2p_max_tokens_per_rank, hidden_size, dtype: when given, the communicator creates the group's
            intranode P2P transport up front (collective; before any CUDA-graph capture) with this
            capacity, unless one that large is registered already. Needs all three. Where P2P is
            unavailable (no nsa_cp._C, no GPU, ranks on several nodes, no peer access) backend "auto"
            logs why and uses NCCL; backend "p2p" raises. It allocates
            exactly ``nsa_cp.workspace_bytes(cp_size, p2p_max_tokens_per_rank, hidden_size, dtype)``.
        workspace_bytes: optional budget for that; a smaller one logs a warning with both numbers.
    """

    def __init__(
        self,
        group: Optional[dist.ProcessGroup],
        input_layernorm: Callable,
        post_attention_layernorm: Callable,
        *,
        mlp_mode: str = "full",
        compact: bool = False,
        algo: str = "auto",
        backend: str = "auto",
        validate: Optional[bool] = None,
        p2p_max_tokens_per_rank: Optional[int] = None,
        hidden_size: Optional[int] = None,
        dtype: Optional[torch.dtype] = None,
        workspace_bytes: Optional[int] = None,
    ):
        if mlp_mode not in _MLP_MODES:
            raise ValueError(f"mlp_mode: expected one of {_MLP_MODES}, got {mlp_mode!r}")
        self.backend = backend
        self.validate = validate
        if p2p_max_tokens_per_rank is not None:
            if hidden_size is None or dtype is None:
                raise ValueError("hidden_size, dtype: expected both with p2p_max_tokens_per_rank, got None")
            existing = p2p.get_p2p(group)
            if (
                existing is None
                or existing.max_tokens_per_rank < p2p_max_tokens_per_rank
                or existing.hidden_size != hidden_size
                or existing.dtype != dtype
            ):
                # collective; the same verdict on every rank. backend="auto" falls back to NCCL (e.g. a
                # group spanning nodes), backend="p2p" insists.
                reason = p2p.p2p_unavailable_reason(group) if backend != "p2p" else None
                if reason is None:
                    p2p.init_p2p(group, p2p_max_tokens_per_rank, hidden_size, dtype, workspace_bytes=workspace_bytes)
                else:
                    logger.info("nsa_cp communicator: P2P transport unavailable (%s); using NCCL", reason)
        self.group = group
        self.input_layernorm = input_layernorm
        self.post_attention_layernorm = post_attention_layernorm
        self.mlp_mode = mlp_mode
        self.compact = compact
        self.algo = algo

    def _check_local(self, name: str, t: torch.Tensor, layout: Optional[ShardLayout]) -> None:
        if layout is None:
            return
        rank, _ = group_rank_and_size(self.group)
        expected = layout.per_rank_actual_token[rank] if rank < layout.cp_size else None
        if expected is None or t.shape[0] != expected:
            raise ValueError(
                f"{name}: expected {expected} rows (per_rank_actual_token[{rank}] of {layout!r}), "
                f"got shape {list(t.shape)}"
            )

    @staticmethod
    def _norm(norm: Callable, hidden_states: torch.Tensor, residual: Optional[torch.Tensor]):
        if residual is None:
            return norm(hidden_states), hidden_states
        return norm(hidden_states, residual)

    def prepare_attn(
        self, hidden_states: torch.Tensor, residual: Optional[torch.Tensor], layout: Optional[ShardLayout]
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Residual add + input_layernorm on local tokens; returns ``(normed [n_r,H], residual [n_r,H])``."""
        self._check_local("hidden_states", hidden_states, layout)
        return self._norm(self.input_layernorm, hidden_states, residual)

    def prepare_mlp(
        self,
        hidden_states: torch.Tensor,
        residual: Optional[torch.Tensor],
        layout: Optional[ShardLayout],
        device_counts: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Residual add + post_attention_layernorm, then (full mode) gather every rank's tokens.

        Returns ``(hidden, residual)``: hidden is ``[M*P, H]`` (padded) or ``[T, H]`` (compact) in full
        mode with a layout, else local ``[n_r, H]``; residual is local ``[n_r, H]``.
        ``device_counts``: for CUDA graphs captured per bucket, see ``cp_all_gather`` (padded only).
        """
        self._check_local("hidden_states", hidden_states, layout)
        hidden_states, residual = self._norm(self.post_attention_layernorm, hidden_states, residual)
        if self.mlp_mode == "full" and layout is not None:
            hidden_states = cp_all_gather(
                hidden_states, layout, self.group, compact=self.compact, algo=self.algo, backend=self.backend,
                validate=self.validate, device_counts=device_counts,
            )
        return hidden_states, residual

    def mlp_output_buffer(self, layout: ShardLayout, like: torch.Tensor) -> torch.Tensor:
        """Where the MLP should write its partials for ``postprocess_layer``: ``[global_len, H]``.

        With a P2P transport that this call would use, it is the transport's symmetric reduce buffer (no
        copy before the pull); otherwise a fresh tensor like ``like`` (any tensor works for NCCL).
        """
        transport = select_p2p_transport(self.backend, self.group, "like", like, layout)
        if self.mlp_mode == "full" and transport is not None:
            return transport.reduce_buffer(layout, self.compact, like.shape[1:])
        return like.new_empty((layout.global_len(self.compact), *like.shape[1:]))

    def postprocess_layer(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor,
        layout: Optional[ShardLayout],
        device_counts: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Full mode: reduce-scatter the MLP's partials back to this rank's ``[n_r, H]``."""
        if self.mlp_mode == "full" and layout is not None:
            hidden_states = cp_reduce_scatter(
                hidden_states, layout, self.group, compact=self.compact, algo=self.algo, backend=self.backend,
                validate=self.validate, device_counts=device_counts,
            )
        return hidden_states, residual
