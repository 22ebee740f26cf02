"""Once per vLLM worker: the PCP group's transport, sized from vLLM's own limits.

Contract: :func:`setup_transport` ``(worker)`` runs right after ``Worker.load_model()`` (the plugin wraps
it), before ``determine_available_memory()`` profiles the memory left for the KV cache, so the
transport's buffers are part of what vLLM accounts for. It is collective over the PCP group (every
worker loads its model), and it never raises into vLLM: a failure is logged with its cause and leaves
nsa_cp's moves on the NCCL path. The decision goes to ``status()["p2p"]`` and to one log line.

Sizing (:func:`max_tokens_per_rank`): a step schedules at most ``max_num_batched_tokens`` tokens; the
DualChunkSwap split gives a rank two chunks of ``ceil(len / 2P)`` per prefill (at most ``len / P + 2``
rows) and replicates short requests, so a rank holds at most ``ceil(T / P) + 2 * max_num_seqs`` rows,
and never more than ``T``. A step whose shards come out larger takes the NCCL path for that step
(logged once), never an error.
"""

from __future__ import annotations

from typing import Any, Optional

from ... import envs
from .. import state
from . import moe, runtime

def max_tokens_per_rank(scheduler_config: Any, pcp: int) -> Optional[int]:
    """Rows per rank the transport is sized for, from vLLM's scheduler limits; None without them."""
    tokens = getattr(scheduler_config, "max_num_batched_tokens", None)
    if not tokens or pcp < 1:
        return None
    seqs = int(getattr(scheduler_config, "max_num_seqs", 0) or 0)
    return min(int(tokens), -(-int(tokens) // pcp) + 2 * seqs)


def setup_transport(worker: Any) -> dict:
    """Create (or reuse) this worker's PCP transport; returns and records the decision."""
    return state.setup_transport_once(moe.STATE, lambda: _decide(worker), "PCP",
                                     "vLLM profiles memory for its KV cache")


def _decide(worker: Any) -> dict:
    coordinator = runtime.pcp_group_or_none()
    pcp = getattr(coordinator, "world_size", 1)
    if pcp < 2:
        return state.transport_decision(reason=f"prefill context parallel size {pcp}")
    config = getattr(worker, "vllm_config", None)
    model_config = getattr(config, "model_config", None)
    rows = max_tokens_per_rank(getattr(config, "scheduler_config", None), pcp)
    hidden = model_config.get_hidden_size() if hasattr(model_config, "get_hidden_size") else None
    dtype = getattr(model_config, "dtype", None)
    return state.create_sized(rows, hidden, dtype, lambda r, h, d: state.create_transport(
        coordinator.device_group, r, h, d, getattr(worker, "device", None), p2p=envs.NSA_CP_VLLM_P2P,
        off_reason="NSA_CP_VLLM_P2P=0"), "vLLM")
