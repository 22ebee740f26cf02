"""The engine-independent core of nsa_cp's engine plugins (``sglang``, ``vllm``); imports no engine.

Both engines pad every CP rank's shard up front to one physical length and move the MoE's rows rank-major;
only how a batch's counts are found and where the moves are hooked differ. What they share lives here:

* the plugin skeleton: a plugin's target table (:class:`Target` rows: the contract role of each engine
  function it wraps and the body run around it; :func:`targets` takes each row's path from the contracts,
  so a function that moves is one contract entry, not a code change); the engine's code is verified
  against the contracts a plugin knows (``contracts``) before anything is patched;
  :func:`decline_contract` records and logs one that does not hold; :func:`wrap` puts every wrapper in
  place or none, :class:`Patches` is the one undo handle of what was patched, :func:`is_wrapped` reads a
  live binding; :func:`status_fields` the ``status()`` keys both engines report alike;
* :class:`IntegrationState`, what a plugin did in this process (one instance per engine binding), with
  :func:`count`, :func:`record` and :func:`once` (a per-batch reason is logged once per process, not per
  layer) and :func:`transport_decision` (the ``status()["p2p"]`` record);
* :func:`create_transport`: the CP group's transport, created collectively once per worker: P2P where the
  group is on one node and P2P can serve it, else nsa_cp's NCCL communicator where one can be made;
  :func:`setup_transport_once` records and logs that decision, :func:`then_setup` runs it after the
  engine's model loading;
* :func:`over_capacity`: a batch larger than the P2P transport serves (it takes the NCCL path, logged once);
* the moves on a rank's physical rows (``rows`` local rows, of which the layout's ``n`` are real, padding
  last): :func:`gather_rows` (``[rows, H]`` -> padded ``[M * cp, H]`` with the padding rows zero, or compact
  ``[T, H]``), :func:`reduce_scatter_rows` (either layout -> a fresh ``[rows, H]``, zeros past ``n``) and
  :func:`take_back_rows` (this rank's ``[rows, H]`` of a complete output);
* :func:`which_layout`: a tensor's row count -> compact or padded.

Shapes: ``M = layout.max_rank_len`` (the engine's physical length: ``align`` is set so), ``T =
layout.total_len``; rank q's rows sit at ``q * M`` (padded) or ``layout.offsets[q]`` (compact).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

from ..api.collectives import cp_all_gather, cp_reduce_scatter
from ..geometry.layout import ShardLayout
from ..transport.policy import capacity, ensure_transport, holds_rows, transport_decision
from . import contracts

logger = logging.getLogger("nsa_cp")

__all__ = ["Target", "targets", "wrap", "is_wrapped", "Patches", "decline_contract", "declined", "status_fields", "IntegrationState", "count", "record", "once", "reset_logged", "transport_decision", "create_transport",
           "setup_transport_once", "create_sized", "then_setup", "over_capacity", "gather_rows",
           "reduce_scatter_rows", "take_back_rows", "which_layout"]


@dataclass
class IntegrationState:
    """Everything a plugin's ``status()`` reports beyond its live bindings.

    * ``handed``: the plugin handed its hooks to the engine (or patched them); ``registered``: they are in
      place (for SGLang: seen from the first hook that ran); ``register_error``: why not.
    * ``p2p``: the worker's transport decision (:func:`transport_decision`); None until it was made.
    * ``gathers``: MoE gathers that ran, by kind; ``unfused``: why a gather did not fuse, by reason;
      ``scatters``: reduce-scatters that ran, by kind.
    * ``declined``: the engine's own move ran instead of nsa_cp's, by reason (counted per call).
    * ``nccl_batches``: batches that took the NCCL path though a P2P transport exists (too large for it).
    * ``contract``: the engine contract verified at load (``Verdict.as_status()``), None before.
    """

    handed: bool = False
    registered: bool = False
    register_error: Optional[str] = None
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


class Patches:
    """The one undo handle of a plugin: every attribute it set on an engine's classes or modules, and the
    engine's value before, put back by :meth:`undo` in reverse order."""

    def __init__(self) -> None:
        self._done: list = []

    def set(self, owner: Any, name: str, value: Any) -> Any:
        """``owner.name = value``; returns the engine's value (a class's own attribute, not an inherited one)."""
        original = _current(owner, name)
        setattr(owner, name, value)
        self._done.append((owner, name, original))
        return original

    def undo(self) -> None:
        while self._done:
            owner, name, original = self._done.pop()
            setattr(owner, name, original)

    def __len__(self) -> int:
        return len(self._done)


@dataclass(frozen=True)
class Target:
    """One row of a plugin's target table: the contract ``role`` of an engine function the plugin wraps
    (its path comes from the contract: ``Spec.paths``) and ``around``, called as ``around(original, *args,
    **kwargs)`` in its place (for a method, ``args[0]`` is the instance)."""

    role: str
    around: Callable


def targets(table: Iterable[Target], known: Iterable[contracts.Contract]) -> Dict[str, Callable]:
    """``{"module.Class.method": around}`` for a target table. Every known contract must put each wrapped
    role at the same single path (a wrapped function that moved between versions needs a wrapper per
    path, which the table does not express): ValueError naming the role otherwise."""
    known = tuple(known)
    out: Dict[str, Callable] = {}
    for row in table:
        paths = {c.specs[row.role].paths for c in known if row.role in c.specs}
        if len(paths) != 1 or len(next(iter(paths))) != 1:
            raise ValueError(f"target {row.role!r}: the known contracts give {sorted(paths) or 'no'} paths; "
                             "a wrapped role needs one path in every contract")
        out[next(iter(paths))[0]] = row.around
    return out


def _current(owner: Any, name: str) -> Any:
    """``owner.name`` as bound now: a class's own attribute (not a staticmethod's function, nor one it
    inherits), else ``getattr`` (AttributeError naming it)."""
    if isinstance(owner, type) and name in owner.__dict__:
        return owner.__dict__[name]
    return getattr(owner, name)


def _owner(path: str) -> Tuple[Any, str]:
    """``"module.Class.method"`` -> ``(Class, "method")``; ImportError naming ``path`` where it does not import."""
    where, name = path.rsplit(".", 1)
    try:
        return contracts.resolve(where), name
    except Exception as e:  # noqa: BLE001  said with the target it concerns
        raise ImportError(f"{path}: {type(e).__name__}: {e}") from e


def _wrapper(around: Callable, original: Callable) -> Callable:
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        return around(original, *args, **kwargs)

    wrapper._nsa_cp_original = original  # the marker is_wrapped() and a second load read
    return wrapper


def wrap(patches: Patches, items: Mapping[str, Callable]) -> int:
    """Wrap every ``path -> around`` of ``items`` in place, recording each in ``patches``; returns how many
    were wrapped now. All or nothing: every path is resolved first (ImportError / AttributeError naming it,
    nothing wrapped); one already nsa_cp's wrapper is left as it is (a second load)."""
    resolved = []
    for path, around in items.items():
        owner, name = _owner(path)
        resolved.append((owner, name, _current(owner, name), around))
    done = 0
    for owner, name, current, around in resolved:
        if getattr(current, "_nsa_cp_original", None) is None:
            patches.set(owner, name, _wrapper(around, current))
            done += 1
    return done


def is_wrapped(path: str) -> bool:
    """Whether ``path`` is bound to an nsa_cp wrapper now (False where it does not import)."""
    try:
        current = _current(*_owner(path))
    except (ImportError, AttributeError):
        return False
    return getattr(current, "_nsa_cp_original", None) is not None


def decline_contract(state: "IntegrationState", engine: str, version: Optional[str], verdict, own: str) -> None:
    """The engine's code meets no contract nsa_cp knows: record it for ``status()["contract"]`` and log one
    line naming what differs; nothing is patched, the engine keeps ``own``."""
    state.contract = verdict.as_status()
    state.register_error = f"{engine} {version}: {verdict.problem}"
    logger.warning("nsa_cp: %s %s: %s; %s are used", engine, version, verdict.problem, own)


def status_fields(state: "IntegrationState", engine: str, version: Optional[str]) -> dict:
    """The ``status()`` keys every engine plugin reports alike."""
    return {
        "engine": engine,
        "version": version,
        "contract": dict(state.contract) if state.contract is not None else None,
        "plugin_registered": state.handed,
        "register_error": state.register_error,
        "p2p": dict(state.p2p) if state.p2p is not None else None,
        "declined": dict(state.declined),
        "nccl_batches": state.nccl_batches,
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


def declined(state: "IntegrationState", reason: str, own: str) -> None:
    """The engine's ``own`` moves take this call: ``reason`` counted in ``state.declined`` by its kind, logged
    once per kind (the one place both plugins record a decline)."""
    record(state.declined, reason, f"nsa_cp: {own} for such calls: %s")


def reset_logged() -> None:
    _LOGGED.clear()


def create_transport(group: Optional[dist.ProcessGroup], max_tokens_per_rank: int, hidden_size: int,
                     dtype: torch.dtype, device=None, *, p2p: bool = True, off_reason: str = "P2P off") -> dict:
    """Create ``group``'s transport by the one policy (``transport.policy.ensure_transport``): P2P where
    ``p2p`` and the group can take it (an existing transport that fits is kept), else nsa_cp's NCCL
    communicator where the group is NCCL. Collective. ``off_reason`` is the reason recorded when ``p2p`` is
    False (the engine's off switch). Returns :func:`transport_decision`."""
    return ensure_transport(group, max_tokens_per_rank, hidden_size, dtype, device, create=p2p, communicator=True,
                            off_reason=off_reason)


def setup_transport_once(state: IntegrationState, decide: Callable[[], dict], group: str, before: str) -> dict:
    """A worker's transport, decided once (``decide()`` -> :func:`transport_decision`; a P2P transport
    already on is kept, e.g. a draft model's runner after the target's), recorded in ``state.p2p`` and
    logged in one line naming the ``group`` and what it was created ``before``."""
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


def then_setup(original: Callable, setup: Callable[[Any], Any], owner, *args, **kwargs):
    """``original(owner, ...)`` (the engine's model loading), then ``setup(owner)`` (the transport), which
    never raises into the engine: a failure is logged and leaves the NCCL path."""
    result = original(owner, *args, **kwargs)
    try:
        setup(owner)
    except Exception:  # noqa: BLE001  setup logs its own failures; this is a last guard
        logger.exception("nsa_cp: transport setup failed; the NCCL path is used")
    return result


def over_capacity(state: IntegrationState, group: Optional[dist.ProcessGroup], layout: ShardLayout) -> bool:
    """Whether this batch is larger than ``group``'s P2P transport serves (it then takes the NCCL path:
    counted in ``state.nccl_batches``, logged once per process)."""
    rows = capacity(group)
    if rows is None or layout.is_even or layout.max_rank_len <= rows:
        return False
    state.nccl_batches += 1
    once("p2p-capacity", logging.INFO, "nsa_cp: a batch of %d rows per rank exceeds the P2P transport's %d: such "
         "batches take the NCCL path", layout.max_rank_len, rows)
    return True


def which_layout(name: str, t: torch.Tensor, layout: ShardLayout) -> bool:
    """True for the compact ``[total_len, ...]`` rows, False for the padded ``[padded_len, ...]`` (the same
    when there is no padding); ValueError naming ``name`` for anything else."""
    if isinstance(t, torch.Tensor) and t.dim() >= 1:
        if t.shape[0] == layout.padded_len:
            return False
        if t.shape[0] == layout.total_len:
            return True
    got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
    raise ValueError(
        f"{name}: expected [{layout.padded_len}, ...] (padded: max_rank_len {layout.max_rank_len} * cp_size "
        f"{layout.cp_size}, rank-major) or [{layout.total_len}, ...] (compact: the real rows), got {got}"
    )


def gather_rows(x: torch.Tensor, layout: ShardLayout, rank: int, group, *, compact: bool, **kw) -> torch.Tensor:
    """``x [rows, ...]`` (this rank's physical rows, the first ``layout.count(rank)`` real) -> every rank's
    real rows: padded ``[M * cp, ...]`` (padding rows zero) or compact ``[T, ...]``. ``kw``: ``backend``,
    ``validate`` as for ``cp_all_gather``."""
    return cp_all_gather(x[: layout.count(rank)], layout, group, compact=compact, **kw)


def reduce_scatter_rows(partials: torch.Tensor, layout: ShardLayout, rank: int, rows: int, group, *,
                        name: str = "hidden_states", **kw) -> torch.Tensor:
    """Sum the ranks' partials (padded ``[M * cp, ...]`` or compact ``[T, ...]``, told apart by the row count)
    and return this rank's ``[rows, ...]`` (zeros past its real count) in a fresh tensor."""
    compact = which_layout(name, partials, layout)
    n = layout.count(rank)
    out = partials.new_empty((rows, *partials.shape[1:]))
    out[n:].zero_()
    cp_reduce_scatter(partials, layout, group, compact=compact, out=out[:n], **kw)
    return out


def take_back_rows(full: torch.Tensor, layout: ShardLayout, rank: int, rows: int, group, *,
                   name: str = "hidden_states") -> torch.Tensor:
    """This rank's ``[rows, ...]`` of a complete output, padded ``[M * cp, ...]`` (a view, or a copy where a
    P2P transport serves the group: its gathered rows live in a buffer the next gathers reuse) or compact
    ``[T, ...]`` (a copy, the rows past the real count zero)."""
    if which_layout(name, full, layout):
        n, start = layout.count(rank), layout.offsets[rank]
        out = full.new_zeros((rows, *full.shape[1:]))
        out[:n].copy_(full[start : start + n])
        return out
    start = rank * layout.max_rank_len
    back = full[start : start + rows]
    return back.clone() if holds_rows(group) else back
