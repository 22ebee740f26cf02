"""What the SGLang integration did in this process, for :func:`~.plugin.status` and the logs.

Contract: one :data:`STATE` per process (every scheduler has its own). Its fields are written by the
plugin (registration), the scheduler hook (the transport) and the moves (fusions, declined batches), and
only read by ``status()``. :func:`once` logs a message the first time its key is seen in this process,
so a per-batch reason is logged once, not per layer or per batch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Dict, Optional

logger = logging.getLogger("nsa_cp")


@dataclass
class IntegrationState:
    """Everything ``status()`` reports beyond the live bindings.

    * ``handed``: the plugin handed its hooks to SGLang's HookRegistry; ``registered``: SGLang applied
      them (seen from the first hook that ran); ``register_error``: why not.
    * ``p2p``: the scheduler's transport decision: ``{"on": bool, "bytes": int | None,
      "max_tokens_per_rank": int | None, "reason": str | None}``; None until the model runner decided.
    * ``gathers``: moves that ran, by kind: ``"fused_add_rmsnorm_all_gather"`` (one kernel: add + norm +
      gather), ``"read_then_gather"`` (SGLang's read step, then nsa_cp's gather).
    * ``unfused``: why a gather did not fuse, by reason (counted per call).
    * ``declined``: SGLang's own move ran instead of nsa_cp's, by reason (counted per call).
    * ``nccl_batches``: batches that took the NCCL path though a P2P transport exists (too large for it).
    """

    handed: bool = False
    registered: bool = False
    register_error: Optional[str] = None
    p2p: Optional[dict] = None
    gathers: Dict[str, int] = field(default_factory=dict)
    unfused: Dict[str, int] = field(default_factory=dict)
    declined: Dict[str, int] = field(default_factory=dict)
    nccl_batches: int = 0


STATE = IntegrationState()
_LOGGED: set = set()


def count(table: Dict[str, int], key: str) -> None:
    table[key] = table.get(key, 0) + 1


def transport_decision(*, on: bool = False, bytes: Optional[int] = None, max_tokens_per_rank: Optional[int] = None,
                       reason: Optional[str] = None, nccl: Optional[str] = None) -> dict:
    """The scheduler's transport decision, as ``status()["p2p"]`` reports it (``IntegrationState.p2p``)."""
    return {"on": on, "bytes": bytes, "max_tokens_per_rank": max_tokens_per_rank, "reason": reason, "nccl": nccl}


def record(table: Dict[str, int], reason: str, msg: str) -> None:
    """Count ``reason`` in ``table`` by its kind (``"<kind> (<this batch's details>)"``: the text before the
    details) and log ``msg % reason`` the first time that kind comes up."""
    kind = reason.split(" (", 1)[0]
    count(table, kind)
    once(f"{id(table)}:{kind}", logging.INFO, msg, reason)


def once(key: str, level: int, msg: str, *args) -> None:
    """Log ``msg`` the first time ``key`` comes up in this process."""
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.log(level, msg, *args)


def reset() -> None:
    """A fresh state, in place (tests)."""
    STATE.__dict__.update(IntegrationState().__dict__)
    _LOGGED.clear()
