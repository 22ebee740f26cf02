"""The skeleton of nsa_cp's engine plugins (``sglang``, ``vllm``); imports no engine.

Both engines pad every CP rank's shard up front to one physical length and move the MoE's rows rank-major;
only how a batch's counts are found and where the moves are hooked differ. Each engine's plugin is one
:class:`Plugin` record, the same for both:

* ``engine``, ``contracts`` (the engine contracts it serves: nsa_cp/integrations/contracts.py), ``targets``
  (its target table: :class:`Target` rows, a contract role and the body run around that function;
  :func:`targets` takes each row's path from the contracts, so a function that moves is one contract
  entry, not a code change), ``state`` (its one :class:`~.state.IntegrationState`);
* ONE install path, :meth:`Plugin.install`: the engine's code is verified against the contracts, then every
  binding is patched or none (:func:`wrap` and the engine's ``bind``); the engine's entry point is
  :meth:`Plugin.entry_point` (the env switch, then the install path; never raises into the engine), and a
  second install patches nothing and returns the first one's handle;
* ONE undo handle, :class:`Installed` (``uninstall()``; :class:`Patches` is what it puts back);
* ``status()`` from one schema (:func:`~.state.status`).

The rest: :func:`is_wrapped` reads a live binding; :func:`decline_contract` records and logs an engine that
meets no known contract; :func:`then_setup` runs the worker's transport setup after the engine's model
loading. The per-process state and the transport setup are ``state``; the moves on a rank's rows ``moves``.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Tuple

from . import contracts
from .state import IntegrationState, status

logger = logging.getLogger("nsa_cp")

__all__ = ["Plugin", "Installed", "Target", "targets", "wrap", "is_wrapped", "Patches", "decline_contract",
           "then_setup"]


class Patches:
    """What a plugin set on an engine's classes or modules, and the engine's value before, put back by
    :meth:`undo` in reverse order."""

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


class Installed:
    """The one undo handle of a plugin's install: ``uninstall()`` puts the engine's functions back and
    clears the plugin's registration (``patched``: how many bindings it set; ``verdict``: the contract served)."""

    def __init__(self, plugin: "Plugin", patches: Patches, verdict: contracts.Verdict):
        self.plugin, self.verdict, self._patches = plugin, verdict, patches

    @property
    def patched(self) -> int:
        return len(self._patches)

    def uninstall(self) -> None:
        self._patches.undo()
        if self.plugin.installed is self:
            self.plugin.installed = None
            self.plugin.state.handed = self.plugin.state.registered = False
            self.plugin.on_uninstall()


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


@dataclass(eq=False, repr=False)
class Plugin:
    """One engine's plugin (module docstring). ``bind(patches)`` patches the engine (all or nothing:
    ImportError / AttributeError naming what does not resolve); ``bindings()`` the paths it patches (for
    ``status()["bound"]``); ``describe()`` the engine's values of the schema's ``compact``, ``fusions``,
    ``overlap`` and ``first_use``; ``on_install(verdict)`` / ``on_uninstall()`` reset the engine's own
    per-process records; ``switch()`` is the env switch named ``switch_name``; ``summary()`` the log's
    words on the engine's options."""

    engine: str
    contracts: Tuple[contracts.Contract, ...]
    targets: Tuple[Target, ...]
    own_moves: str
    switch_name: str
    switch: Callable[[], bool]
    version: Callable[[], Optional[str]]
    verify: Callable[[], contracts.Verdict]
    bind: Callable[[Patches], None]
    bindings: Callable[[], Iterable[str]]
    describe: Callable[[], dict]
    summary: Callable[[], str]
    on_install: Callable[[contracts.Verdict], None] = lambda verdict: None
    on_uninstall: Callable[[], None] = lambda: None
    state: IntegrationState = field(default_factory=IntegrationState)
    installed: Optional[Installed] = None

    def __repr__(self) -> str:
        return f"Plugin({self.engine!r}, installed={self.installed is not None})"

    def install(self) -> Installed:
        """Verify the engine's code against :attr:`contracts`, then patch it in this process (all or nothing).
        Raises ``contracts.ContractMismatch`` (nothing patched) for code that meets no known contract, and
        ImportError / AttributeError for a target that does not resolve. A second call patches nothing and
        returns the first one's handle."""
        if self.installed is not None:
            return self.installed
        verdict = self.verify()
        if verdict.contract is None:
            raise contracts.ContractMismatch(verdict)
        patches = Patches()
        try:
            self.bind(patches)
        except BaseException:
            patches.undo()
            raise
        s = self.state
        s.contract, s.handed, s.registered, s.register_error = verdict.as_status(), True, True, None
        self.on_install(verdict)
        self.installed = Installed(self, patches, verdict)
        logger.info("nsa_cp: %s plugin registered (%d bindings patched; %s %s meets the contract %r; %s)",
                    self.engine, len(patches), self.engine, self.version(), verdict.contract.name, self.summary())
        return self.installed

    def uninstall(self) -> None:
        """The handle's ``uninstall()`` (nothing when not installed)."""
        if self.installed is not None:
            self.installed.uninstall()

    def entry_point(self) -> None:
        """What the engine's plugin loader calls in every process: the install path, where the switch is on.
        Never raises into the engine: code that meets no known contract, or a target that does not import,
        is logged with its cause and recorded in ``status()``; nothing is patched."""
        if not self.switch():
            logger.info("nsa_cp: %s=0, %s plugin off: %s are used", self.switch_name, self.engine, self.own_moves)
            return
        try:
            self.install()
        except contracts.ContractMismatch as e:
            decline_contract(self.state, self.engine, self.version(), e.verdict, self.own_moves)
        except Exception as e:  # noqa: BLE001  any failure: the engine's own moves, said with its cause
            self.state.register_error = f"{type(e).__name__}: {e}"
            logger.error("nsa_cp: %s plugin NOT registered, %s are used: %s", self.engine, self.own_moves,
                         self.state.register_error)

    def status(self) -> dict:
        """Where the plugin stands in this process (:func:`~.state.status` says every key)."""
        return status(self.state, engine=self.engine, version=self.version(),
                      bound={path: is_wrapped(path) for path in self.bindings()}, **self.describe())


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


def decline_contract(state: IntegrationState, engine: str, version: Optional[str], verdict, own: str) -> None:
    """The engine's code meets no contract nsa_cp knows: record it for ``status()["contract"]`` and log one
    line naming what differs; nothing is patched, the engine keeps ``own``."""
    state.contract = verdict.as_status()
    state.register_error = f"{engine} {version}: {verdict.problem}"
    logger.warning("nsa_cp: %s %s: %s; %s are used", engine, version, verdict.problem, own)


def then_setup(original: Callable, setup: Callable[[Any], Any], owner, *args, **kwargs):
    """``original(owner, ...)`` (the engine's model loading), then ``setup(owner)`` (the transport), which
    never raises into the engine: a failure is logged and leaves the NCCL path."""
    result = original(owner, *args, **kwargs)
    try:
        setup(owner)
    except Exception:  # noqa: BLE001  setup logs its own failures; this is a last guard
        logger.exception("nsa_cp: transport setup failed; the NCCL path is used")
    return result
