"""NSACPLayerCommunicator: the per-layer communication of a decoder layer under NSA prefill CP.

Data flow of one layer (names as in SGLang's LayerCommunicator)::

    prepare_attn       residual add + input_layernorm                  local [n_r, H]
    (attention)        CP-local (the KV cache is shared through the in-seq split)
    prepare_mlp        residual add + post_attention_layernorm, then in "full" mode
                       the gather -> every token on every rank          [M*P, H] or [T, H]
    (MoE)              partial sums for every token, written into mlp_output_buffer()
    postprocess_layer  "full" mode: reduce-scatter -> own tokens        local [n_r, H]

The residual always stays local ``[n_r, H]`` and is updated in place by every add + norm (SGLang's and
flashinfer's convention): the tensor passed as ``residual`` holds ``x + residual`` afterwards.
``layout=None`` means CP is off for this batch: norms only, no communication. In "scattered" mode the MLP runs on local tokens and nothing is communicated.

Norms: an RMSNorm that exposes its ``weight`` and epsilon (``nsa_cp.RMSNorm``; SGLang's and vLLM's
``RMSNorm``, with ``variance_epsilon``; ``torch.nn.RMSNorm``, whose ``eps=None`` is fp32's machine epsilon,
as torch adds it; ``norm_parameters``), or any callable with the convention ``norm(x) -> y``,
``norm(x, residual) -> (y, residual)``. Anything else is refused at construction (ValueError). A norm
that takes no residual (``torch.nn.RMSNorm``) gets the residual add from the communicator.

Fused paths (the default where the norms allow it, ``fuse=True``): an RMSNorm with ``weight`` and
epsilon is applied inside the collective: ``prepare_mlp`` is one ``fused_add_rmsnorm_all_gather`` (on P2P
one kernel normalises each row and pushes it to every peer). Other norm objects keep norm-then-gather.

Reduce-scatter + next norm: ``comm.set_next(next_comm)`` (or ``NSACPLayerCommunicator.chain(comms)``
for a whole stack) lets ``postprocess_layer`` run ``reduce_scatter_fused_add_rmsnorm`` with the next
layer's ``input_layernorm``. It returns the next layer's normed input and residual, and hands the pair
to ``next_comm``: when the decoder loop passes exactly those two tensors to ``next_comm.prepare_attn``,
it returns them as they are instead of norming again. The loop itself does not change; any other pair
(a different tensor, a skipped layer) is normed as usual.

Overlapped (``overlapped_mlp``): the MLP as a per-row consumer, run on each rank's rows as they land while
the partials of finished rows travel back (``cp_overlapped_boundary``); one call in place of ``prepare_mlp``,
the MLP and ``postprocess_layer``.

FP8 wire: ``quant="fp8_e4m3_g128"`` makes ``prepare_mlp`` return ``((q, scale), residual)``: the rows are
quantized before they move (half the bytes), for an FP8 block-scale MoE (nsa_cp.quant_fp8_g128).
"""

from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..planning.checks import check_flag, check_layer_args
from .collectives import (cp_all_gather, cp_reduce_scatter, cp_reduce_scatter_buffer, fused_add_rmsnorm_all_gather,
                          reduce_scatter_fused_add_rmsnorm)
from ..geometry.layout import ShardLayout
from ..rows.norm import fused_add_rmsnorm_into
from ..transport.policy import ensure_transport
from .boundary import Chunk, as_partial, check_shared, cp_overlapped_boundary
from .norms import check_norm, norm_parameters, weight_or_ones
from ..geometry.wire import format_of

__all__ = ["NSACPLayerCommunicator", "norm_parameters"]

logger = logging.getLogger("nsa_cp")

_MLP_MODES = ("full", "scattered")


class NSACPLayerCommunicator:
    """Owns a layer's CP communication.

    Args:
        group: the CP process group (None: the default group).
        input_layernorm, post_attention_layernorm: RMSNorms exposing ``weight`` and an epsilon
            (``nsa_cp.RMSNorm``, ``torch.nn.RMSNorm``, SGLang's / vLLM's), or callables with the convention
            ``norm(x) -> y``, ``norm(x, residual) -> (y, residual)``; others raise ValueError here.
        mlp_mode: "full" (gather before the MLP, reduce-scatter after) or "scattered" (local MLP).
        compact: gather into / reduce from the compact layout (no padding rows for the MoE).
        algo: compact algorithm on NCCL, see ``cp_all_gather``.
        backend: "auto", "nccl" or "p2p", see ``cp_all_gather``.
        validate: rank-agreement check on every collective (None: NSA_CP_VALIDATE), see ``cp_all_gather``.
        fuse: apply the norms inside the collectives where they allow it (module docstring).
        quant: None or "fp8_e4m3_g128": the FP8 wire for ``prepare_mlp`` (module docstring).
        p2p_max_tokens_per_rank, hidden_size, dtype: when given, the communicator creates the group's
            intranode P2P transport up front (collective; before any CUDA-graph capture) with this
            capacity, unless one that large is registered already. Needs all three. Where P2P is
            unavailable (no nsa_cp._C, no GPU, ranks on several nodes, no peer access) backend "auto"
            logs why and uses NCCL; backend "p2p" raises. It allocates
            exactly ``nsa_cp.transport.workspace_bytes(cp_size, p2p_max_tokens_per_rank, hidden_size, dtype)``.
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
        fuse: bool = True,
        quant: Optional[str] = None,
        p2p_max_tokens_per_rank: Optional[int] = None,
        hidden_size: Optional[int] = None,
        dtype: Optional[torch.dtype] = None,
        workspace_bytes: Optional[int] = None,
    ):
        input_spec = check_norm("input_layernorm", input_layernorm)
        mlp_spec = check_norm("post_attention_layernorm", post_attention_layernorm)
        if mlp_mode not in _MLP_MODES:
            raise ValueError(f"mlp_mode: expected one of {_MLP_MODES}, got {mlp_mode!r}")
        check_flag("compact", compact), check_flag("fuse", fuse)
        format_of(quant)  # ValueError naming quant for a format nsa_cp does not know
        if p2p_max_tokens_per_rank is not None:
            if hidden_size is None or dtype is None:
                raise ValueError("hidden_size, dtype: expected both with p2p_max_tokens_per_rank, got None")
            # collective, the same verdict on every rank (transport.policy): backend="auto" falls back to
            # NCCL (e.g. a group spanning nodes), backend="p2p" insists
            decision = ensure_transport(group, p2p_max_tokens_per_rank, hidden_size, dtype,
                                        insist=None if backend == "auto" else backend,
                                        workspace_bytes=workspace_bytes)
            if not decision["on"]:
                logger.info("nsa_cp communicator: no transport with buffers of its own (%s); using NCCL",
                            decision["reason"])
        self.group = group
        self.input_layernorm = input_layernorm
        self.post_attention_layernorm = post_attention_layernorm
        self.mlp_mode = mlp_mode
        self.compact = compact
        self.algo = algo
        self.backend = backend
        self.validate = validate
        self.quant = quant
        self.fuse = fuse
        # the model's dtype: what the MLP's partials are in. With the FP8 wire, prepare_mlp hands the MLP
        # (q, scale), which no longer carries it; set by prepare_mlp's input when not given here.
        self._partials_dtype: Optional[torch.dtype] = dtype
        self._norm_specs = {"input": input_spec, "mlp": mlp_spec}
        self._mlp_norm = mlp_spec[0] if fuse else None
        self._next: Optional["NSACPLayerCommunicator"] = None
        self._next_norm = None
        self._prenormed = None  # (hidden, residual) handed over by the previous layer's postprocess_layer
        if quant is not None and mlp_mode == "full" and self._mlp_norm is None and fuse:
            logger.info("nsa_cp communicator: %s is not fusable; FP8 wire after a separate norm",
                        type(post_attention_layernorm).__name__)

    # ------------------------------------------------------------------ chaining
    def set_next(self, next_comm: Optional["NSACPLayerCommunicator"]) -> None:
        """Fuse this layer's reduce-scatter with ``next_comm``'s input norm (None: stop fusing)."""
        self._next = next_comm
        self._next_norm = None
        if next_comm is not None and self.fuse and next_comm.fuse:
            self._next_norm = next_comm._norm_specs["input"][0]

    @staticmethod
    def chain(comms: Sequence["NSACPLayerCommunicator"]) -> None:
        """``set_next`` along a decoder stack: layer i's reduce-scatter fuses layer i+1's input norm."""
        for this, following in zip(comms, comms[1:]):
            this.set_next(following)

    # ------------------------------------------------------------------ the layer
    def _norm(self, which: str, hidden_states: torch.Tensor, residual: Optional[torch.Tensor]):
        """``norm`` with the convention ``(y, residual)``. A norm that takes no residual (``torch.nn.RMSNorm``)
        gets the add done here: nsa_cp's fused add + RMSNorm with its weight and epsilon when fusing, else
        ``residual += x`` (in fp32, rounded once) and ``norm(residual)``."""
        norm = self.input_layernorm if which == "input" else self.post_attention_layernorm
        params, takes_residual = self._norm_specs[which]
        if residual is None:
            return norm(hidden_states), hidden_states
        if takes_residual:
            return norm(hidden_states, residual)
        if self.fuse:
            weight, eps = params
            return fused_add_rmsnorm_into(hidden_states, residual, weight_or_ones(weight, hidden_states), eps,
                                          out=torch.empty_like(hidden_states))
        with torch.no_grad():
            residual.copy_(residual.float() + hidden_states.float())
        return norm(residual), residual

    def prepare_attn(
        self, hidden_states: torch.Tensor, residual: Optional[torch.Tensor], layout: Optional[ShardLayout]
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Residual add + input_layernorm on local tokens; returns ``(normed [n_r,H], residual [n_r,H])``.

        The pair the previous layer's fused ``postprocess_layer`` returned is already normed: returned as is.
        """
        check_layer_args("prepare_attn", hidden_states, residual, layout)
        handed, self._prenormed = self._prenormed, None
        if handed is not None and handed[0] is hidden_states and handed[1] is residual:
            return hidden_states, residual
        return self._norm("input", hidden_states, residual)

    def prepare_mlp(
        self,
        hidden_states: torch.Tensor,
        residual: Optional[torch.Tensor],
        layout: Optional[ShardLayout],
        device_counts: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
    ):
        """Residual add + post_attention_layernorm, then (full mode) gather every rank's tokens.

        Returns ``(hidden, residual)``: hidden is ``[M*P, H]`` (padded) or ``[T, H]`` (compact) in full
        mode with a layout (``(q, scale)`` with the FP8 wire), else local ``[n_r, H]``; residual is local
        ``[n_r, H]``. ``device_counts``: for CUDA graphs captured per bucket, see ``cp_all_gather``.

        ``residual`` is updated IN PLACE: the tensor passed holds ``hidden_states + residual`` (rounded to its
        dtype) afterwards and is the one returned (SGLang's and flashinfer's convention); clone it first to
        keep the old values. ``residual=None``: ``hidden_states`` itself is returned as the residual.
        """
        check_layer_args("prepare_mlp", hidden_states, residual, layout)
        if hidden_states.is_floating_point():
            self._partials_dtype = hidden_states.dtype
        if self.mlp_mode != "full" or layout is None:
            return self._norm("mlp", hidden_states, residual)
        kw = dict(compact=self.compact, algo=self.algo, backend=self.backend, validate=self.validate,
                  device_counts=device_counts)
        if self._mlp_norm is not None:
            weight, eps = self._mlp_norm
            weight = weight_or_ones(weight, hidden_states)
            return fused_add_rmsnorm_all_gather(hidden_states, residual, weight, eps, layout, self.group,
                                                quant=self.quant, **kw)
        hidden_states, residual = self._norm("mlp", hidden_states, residual)
        return cp_all_gather(hidden_states, layout, self.group, quant=self.quant, **kw), residual

    def overlapped_mlp(self, hidden_states: torch.Tensor, residual: Optional[torch.Tensor],
                       layout: Optional[ShardLayout], consumer: Callable, out_dtype: Optional[torch.dtype] = None,
                       chunk_rows: Optional[int] = None, shared_mlp: Optional[Callable] = None
                       ) -> Tuple[torch.Tensor, torch.Tensor]:
        """``prepare_mlp``, the MLP and ``postprocess_layer`` in one call, the MLP as a per-row
        ``consumer(rows, chunk)`` run on each rank's rows as they land (``cp_overlapped_boundary``).
        ``residual`` is updated IN PLACE, as ``prepare_mlp`` updates it (details below).

        Residual add + post_attention_layernorm on this rank's rows, then in full mode with a layout the
        overlapped boundary (the communicator's group and FP8 wire); otherwise, as ``prepare_mlp`` hands
        them on, the consumer on this rank's normed rows (not quantized), as one chunk. Either way the
        consumer returns ``[rows, H]`` or a ``TopK`` (reduced by nsa_cp). ``shared_mlp(normed [n_r, H]) ->
        [n_r, H]``: the shared expert on this rank's normed rows, added in fp32 before the one rounding.
        Returns ``(out [n_r, H], residual [n_r, H])``; ``out`` is not normed for the next layer
        (``set_next`` does not apply). ``out_dtype``, ``chunk_rows``: as for ``cp_overlapped_boundary``, which
        runs on the communicator's ``backend`` and ``validate``. ``residual [n_r, H]`` is updated in place: the
        tensor passed holds ``hidden_states + residual`` afterwards and is the one returned (``residual=None``:
        ``hidden_states`` is returned as the residual); clone it first to keep the old values.
        """
        check_layer_args("overlapped_mlp", hidden_states, residual, layout)
        normed, residual = self._norm("mlp", hidden_states, residual)
        shared = shared_mlp(normed) if shared_mlp is not None else None
        if self.mlp_mode == "full" and layout is not None:
            return cp_overlapped_boundary(normed, layout, consumer, self.group, quant=self.quant, out_dtype=out_dtype,
                                          chunk_rows=chunk_rows, shared=shared, backend=self.backend,
                                          validate=self.validate), residual
        rank = dist.get_rank(self.group) if dist.is_initialized() else 0
        n, dtype = normed.shape[0], out_dtype or normed.dtype
        chunk = Chunk(rank, n, 0, 0, 0)
        out = as_partial(consumer(normed, chunk), chunk, normed.shape[1:], dtype, normed.device)
        if shared is not None:
            check_shared(shared, normed.shape, normed.device, rank)
            out = (out.float() + shared.float()).to(dtype)
        return out, residual

    def mlp_output_buffer(self, layout: Optional[ShardLayout], like, dtype: Optional[torch.dtype] = None
                          ) -> torch.Tensor:
        """Where the MLP should write its partials for ``postprocess_layer``.

        ``like``: what ``prepare_mlp`` returned as hidden: a tensor ``[rows, H]``, or with the FP8 wire the
        ``(q, scale)`` pair. The buffer has ``like``'s rows (``[global_len, H]`` in full mode with a
        layout, else the local rows), on its device, in the model's dtype: the partials are not FP8.
        ``dtype``: that dtype; default: the communicator's ``dtype=``, else the dtype of the last
        ``prepare_mlp`` input (a tensor ``like`` gives its own). In full mode it is the P2P transport's
        reduce buffer where the reduce-scatter will use it (no copy in).
        """
        if isinstance(like, (tuple, list)):
            if len(like) != 2 or not all(isinstance(t, torch.Tensor) for t in like) or like[0].dim() < 2:
                got = ", ".join(type(t).__name__ if not isinstance(t, torch.Tensor) else
                                f"{t.dtype} {list(t.shape)}" for t in like)
                raise ValueError("like: expected a tensor [rows, H] or the (q, scale) pair prepare_mlp returned "
                                 f"with the FP8 wire, got a {type(like).__name__} of ({got})")
            q = like[0]
            dtype = dtype or self._partials_dtype
            if dtype is None:
                raise ValueError(f"dtype: like is the FP8 pair (q {q.dtype} {list(q.shape)}, scale) and the model's "
                                 "dtype is not known yet (no prepare_mlp call, no dtype= given): pass dtype=")
            like = q.new_empty((0, *q.shape[1:]), dtype=dtype)  # only its row shape, dtype and device count
            rows = q.shape[0]
        elif isinstance(like, torch.Tensor):
            rows = like.shape[0] if like.dim() else 0
            if dtype is not None and dtype != like.dtype:
                like = like.new_empty((0, *like.shape[1:]), dtype=dtype)
        else:
            raise ValueError(f"like: expected a tensor [rows, H] or the (q, scale) pair prepare_mlp returned, "
                             f"got {type(like).__name__}")
        if like.dim() < 2:
            raise ValueError(f"like: expected a tensor of 2 or more dims [rows, H, ...], got shape {list(like.shape)}")
        if self.mlp_mode != "full" or layout is None:
            return like.new_empty((rows, *like.shape[1:]))
        return cp_reduce_scatter_buffer(like, layout, self.group, compact=self.compact, backend=self.backend)

    def postprocess_layer(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor,
        layout: Optional[ShardLayout],
        device_counts: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Full mode: reduce-scatter the MLP's partials back to this rank's ``[n_r, H]``.

        With ``set_next`` and a fusable next norm: the next layer's add + norm too, and the returned
        ``(normed, residual)`` is handed to the next communicator's ``prepare_attn`` (module docstring).
        """
        check_layer_args("postprocess_layer", hidden_states, residual, layout, "the MLP's partials, a torch.Tensor "
                         "[rows, H] in the model's dtype (written into mlp_output_buffer(layout, hidden))")
        if self.mlp_mode != "full" or layout is None:
            return hidden_states, residual
        kw = dict(compact=self.compact, algo=self.algo, backend=self.backend, validate=self.validate,
                  device_counts=device_counts)
        if self._next_norm is None:
            return cp_reduce_scatter(hidden_states, layout, self.group, **kw), residual
        weight, eps = self._next_norm
        weight = weight_or_ones(weight, hidden_states)
        normed, residual = reduce_scatter_fused_add_rmsnorm(hidden_states, residual, weight, eps, layout, self.group,
                                                            **kw)
        self._next._prenormed = (normed, residual)
        return normed, residual
