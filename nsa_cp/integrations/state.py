"""What an engine plugin did in this process, the one ``status()`` schema both plugins report, and the
worker's transport, created once by the one creation policy (nsa_cp/transport/policy.py).

* :class:`IntegrationState`: the one per-process state object of a plugin (its record's ``state``); written
  by the install path (registration), the worker's transport setup and the moves, read by ``status()``;
  :func:`count`, :func:`record`, :func:`declined` and :func:`once` (a per-batch reason is logged once per
  process, not per layer);
* :data:`STATUS_KEYS` and :func:`status`: ``status()``'s keys, the same with the same meaning for every engine;
* :func:`create_transport`: the CP group's transport, collectively, by the policy (a transport with buffers
  of its own where one of the table's rows can serve the group, else the torch.distributed path with nsa_cp's
  NCCL communicator where one can be made); :func:`setup_transport_once` records and logs the decision,
  :func:`create_sized` guards it (never raises into the engine).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Mapping, Optional

import torch
import torch.distributed as dist

from ..transport.policy import ensure_transport, transport_decision

logger = logging.getLogger("nsa_cp")

__all__ = ["IntegrationState", "STATUS_KEYS", "status", "count", "record", "once", "declined", "reset_logged",
           "transport_decision", "create_transport", "setup_transport_once", "create_sized"]


@dataclass
class IntegrationState:
    """Everything a plugin's ``status()`` reports beyond its live bindings.

    * ``handed``: the install path ran and patched the engine; ``registered``: its wrappers are in place;
      ``register_error``: why not.
    * ``used``: nsa_cp's moves have run in this process.
    * ``p2p``: the worker's transport decision (:func:`transport_decision`); None until it was made.
    * ``gathers``: MoE gathers that ran, by kind; ``unfused``: why a gather did not fuse, by reason;
      ``scatters``: reduce-scatters that ran, by kind.
    * ``declined``: the engine's own move ran instead of nsa_cp's, by reason (counted per call).
    * ``nccl_batches``: batches that took the NCCL path though a transport of the group's own exists (too large).
    * ``contract``: the engine contract verified at load (``Verdict.as_status()``), None before.
    """

    handed: bool = False
    registered: bool = False
    register_error: Optional[str] = None
    used: bool = False
    p2p: Optional[dict] = None
    gathers: Dict[str, int] = field(default_factory=dict)
    unfused: Dict[str, int] = field(default_factory=dict)
    scatters: Dict[str, int] = field(default_factory=dict)
    declined: Dict[str, int] = field(default_factory=dict)
    nccl_batches: int = 0
    contract: Optional[dict] = None

    def reset(self) -> None:
        """A fresh state, in place (tests)."""
        self.__dict__.update(IntegrationState().__dict__)


# status()'s keys, for every engine (their meaning: status()'s docstring)
STATUS_KEYS = ("engine", "version", "contract", "plugin_registered", "hooks_applied", "register_error", "active",
               "bound", "used", "compact", "p2p", "gathers", "reduce_scatters", "unfused", "fusions", "declined",
               "nccl_batches", "first_use", "overlap")


def status(state: IntegrationState, *, engine: str, version: Optional[str], bound: Mapping[str, bool],
           compact: bool, fusions: Mapping[str, str], overlap: dict, first_use: dict) -> dict:
    """One plugin's ``status()``, the same keys in every engine:

    * ``engine``, ``version``; ``contract``: the contract served (``served``) or what differs (``problem``),
      and where each function was found; ``plugin_registered``: the install path patched the engine;
      ``hooks_applied``: its wrappers are in place; ``register_error``: why not;
    * ``bound``: every binding the plugin patches -> whether nsa_cp's wrapper is there now; ``active``: all are;
    * ``used``: nsa_cp's moves have run; ``compact``: the engine's compact switch;
    * ``p2p``: the worker's transport decision (``on``, ``transport``, ``bytes``, ``max_tokens_per_rank``,
      ``reason``, ``nccl``: nsa_cp/transport/policy.py), None before it was made;
    * ``gathers`` / ``reduce_scatters``: nsa_cp's MoE moves that ran, by kind; ``unfused``: gathers that did
      not fuse the engine's norm, by reason; ``fusions``: what the ``gather`` and the ``reduce_scatter`` fuse
      in this engine, or why nothing (a sentence each);
    * ``declined``: calls the engine's own moves took, by reason; ``nccl_batches``: batches too large for the
      group's transport; ``first_use``: the first-use checks, calls checked and kinds declined, by kind;
      ``overlap``: the overlapped boundary (``on``, ``declined``, ``chunk_rows``, ``contract``, ``layers``,
      ``serialized``).
    """
    return {
        "engine": engine,
        "version": version,
        "contract": dict(state.contract) if state.contract is not None else None,
        "plugin_registered": state.handed,
        "hooks_applied": state.registered,
        "register_error": state.register_error,
        "active": bool(bound) and all(bound.values()),
        "bound": dict(bound),
        "used": state.used,
        "compact": bool(compact),
        "p2p": dict(state.p2p) if state.p2p is not None else None,
        "gathers": dict(state.gathers),
        "reduce_scatters": dict(state.scatters),
        "unfused": dict(state.unfused),
        "fusions": dict(fusions),
        "declined": dict(state.declined),
        "nccl_batches": state.nccl_batches,
        "first_use": first_use,
        "overlap": overlap,
    }


_LOGGED: set = set()


def count(table: Dict[str, int], key: str) -> None:
    table[key] = table.get(key, 0) + 1


def once(key: str, level: int, msg: str, *args) -> None:
    """Log ``msg`` the first time ``key`` comes up in this process."""
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.log(level, msg, *args)


def record(table: Dict[str, int], reason: str, msg: str) -> None:
    """Count ``reason`` in ``table`` by its kind (``"<kind> (<this batch's details>)"``: the text before the
    details) and log ``msg % reason`` the first time that kind comes up."""
    kind = reason.split(" (", 1)[0]
    count(table, kind)
    once(f"{id(table)}:{kind}", logging.INFO, msg, reason)


def declined(state: IntegrationState, reason: str, own: str) -> None:
    """The engine's ``own`` moves take this call: ``reason`` counted in ``state.declined`` by its kind, logged
    once per kind (the one place both plugins record a decline)."""
    record(state.declined, reason, f"nsa_cp: {own} for such calls: %s")


def reset_logged() -> None:
    _LOGGED.clear()


def create_transport(group: Optional[dist.ProcessGroup], max_tokens_per_rank: int, hidden_size: int,
                     dtype: torch.dtype, device=None, *, p2p: bool = True, off_reason: str = "P2P off") -> dict:
    """Create ``group``'s transport by the one policy (``transport.policy.ensure_transport``): one with
    buffers of its own where ``p2p`` and a row of the transport table can serve the group (an existing one
    that fits is kept), else nsa_cp's NCCL communicator where the group can take one. Collective.
    ``off_reason`` is the reason recorded when ``p2p`` is False (the engine's off switch). Returns
    :func:`transport_decision`."""
    return ensure_transport(group, max_tokens_per_rank, hidden_size, dtype, device, create=p2p, communicator=True,
                            off_reason=off_reason)


def setup_transport_once(state: IntegrationState, decide: Callable[[], dict], group: str, before: str) -> dict:
    """A worker's transport, decided once (``decide()`` -> :func:`transport_decision`; one already on is kept,
    e.g. a draft model's runner after the target's), recorded in ``state.p2p`` and logged in one line naming
    the ``group`` and what it was created ``before``."""
    if state.p2p is not None and state.p2p.get("on"):
        return state.p2p
    decision = decide()
    state.p2p = decision
    if decision["on"]:
        logger.info("nsa_cp: %s transport of the %s group on: %d rows per rank, %.1f MiB on this GPU, created "
                    "before %s", str(decision["transport"]).upper(), group, decision["max_tokens_per_rank"],
                    (decision["bytes"] or 0) / 2**20, before)
    else:
        logger.info("nsa_cp: P2P transport off (%s); the MoE gather and reduce-scatter take the NCCL path "
                    "through %s", decision["reason"], decision["nccl"] or "torch's process group")
    return decision


def create_sized(rows: Optional[int], hidden: Optional[int], dtype, create: Callable[[int, int, Any], dict],
                 engine: str) -> dict:
    """``create(rows, hidden, dtype)`` (the transport, :func:`create_transport`) where the engine's sizes were
    found, else the decision saying which were not; a failure is logged with its cause and becomes the
    decision's reason (never raised into the engine)."""
    if rows is None or hidden is None or dtype is None:
        return transport_decision(reason=f"{engine}'s sizes not found (rows per rank {rows}, hidden size {hidden}, "
                                  f"dtype {dtype})")
    try:
        return create(int(rows), int(hidden), dtype)
    except Exception as e:  # noqa: BLE001  never break the engine's start: the NCCL path, said loudly
        logger.exception("nsa_cp: could not create the %s transport", engine)
        return transport_decision(reason=f"creating it failed ({type(e).__name__}: {e})")
