"""Once per SGLang scheduler: the attention-CP group's transport, sized from SGLang's own limits.

Contract: :func:`setup_transport` ``(runner)`` runs right after SGLang's ``ModelRunner.initialize()`` (the
plugin's hook), which loads the model and ends before ``alloc_memory_pool`` profiles the free memory
for the KV cache, so the transport's buffers are part of what SGLang accounts for. It is collective over
the attention-CP group (every rank's model runner initialises), and it never raises into SGLang: a
failure is logged with its cause and leaves nsa_cp's moves on the NCCL path. The decision goes to
``status()["p2p"]`` and to one log line.

Sizing (:func:`max_tokens_per_rank`): the largest prefill SGLang schedules, ``max(chunked_prefill_size,
max_prefill_tokens)`` over the positive ones, split over ``cp`` ranks, plus one alignment unit for the
split's rounding, rounded up to SGLang's shard alignment (``2 * cp`` zigzag, ``cp`` interleave). A batch
whose shards come out larger takes the NCCL path for that batch (logged once), never an error.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from ... import envs
from .. import state as shared
from . import moves, runtime, state

logger = logging.getLogger("nsa_cp")


def max_tokens_per_rank(server_args: Any, cp_size: int, align: int) -> Optional[int]:
    """Rows per rank the transport is sized for, from SGLang's prefill limits; None without any limit."""
    limits = [int(v) for v in (getattr(server_args, "chunked_prefill_size", None),
                               getattr(server_args, "max_prefill_tokens", None)) if v is not None and int(v) > 0]
    if not limits or cp_size < 1:
        return None
    rows = -(-max(limits) // cp_size) + align
    return -(-rows // align) * align


def setup_transport(runner: Any) -> dict:
    """Create (or reuse) this scheduler's attention-CP transport; returns and records the decision."""
    return shared.setup_transport_once(state.STATE, lambda: _decide(runner), "attention-CP",
                                     "SGLang sizes its KV cache")


def _decide(runner: Any) -> dict:
    if not runtime.cp_gathers_over_attn_cp():
        return state.transport_decision(reason="not a DSA/MLA prefill-CP deployment: nsa_cp's moves are not on this path")
    cp = getattr(runtime.attn_cp_group(), "world_size", 1)
    if cp < 2:
        return state.transport_decision(reason=f"attention-CP size {cp}")
    server_args = getattr(runner, "server_args", None)
    config = getattr(runner, "model_config", None)
    rows = max_tokens_per_rank(server_args, cp, runtime.cp_align(cp))
    hidden = getattr(config, "hidden_size", None)
    dtype = getattr(config, "dtype", None) or getattr(runner, "dtype", None)
    if getattr(server_args, "enable_symm_mem", False):
        # SGLang's symmetric pool (NCCL window-registered) serves its own collectives; nsa_cp's buffers are
        # separate allocations, and its moves replace the two collectives that would read that pool here
        logger.info("nsa_cp: --enable-symm-mem: SGLang's symmetric pool and nsa_cp's P2P buffers are separate "
                    "allocations; the CP MoE gather and reduce-scatter go through nsa_cp")
    return shared.create_sized(rows, hidden, dtype, lambda r, h, d: moves.configured().create_transport(
        r, h, d, p2p=envs.NSA_CP_SGLANG_P2P), "SGLang")
