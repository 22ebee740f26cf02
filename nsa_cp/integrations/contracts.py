"""Engine contracts: what a plugin relies on in an engine's code, verified before anything is patched.

An engine's private functions change between versions without notice. A plugin therefore never asks "which
version is this?"; it reads the functions it wraps or calls and checks them against the contracts it knows:

* :class:`Spec`: one engine function (or class) as nsa_cp relies on it: where it lives (``paths``: the first
  that imports wins, for a helper that moved), its parameter names (``params``; a trailing ``"..."`` leaves
  the rest free), the number of values its ``return`` statements give (``returns``: read from its source,
  a tuple's length, 1 for any other value, 0 for a bare ``return`` or none) and the names its code must
  refer to (``reads``: helpers it calls, attributes the wrapper mirrors) and parameter defaults it relies on
  (``defaults``).
* :class:`Contract`: a named set of specs by role (``"dispatch"``, ``"combine"``...) plus the ``features``
  the serving code reads (e.g. whether a dispatch returns a scale). A plugin holds a table of them, one
  per engine contract it was tested against.
* :func:`verify` checks every contract of the table in this process and returns a :class:`Verdict`: the
  first contract that holds entirely (``verdict.contract``), or None with one line naming what differs
  from the closest one ("MoERunner._maybe_dispatch returns 4 values; nsa_cp knows 2 and 3").

Reading a function runs none of it: ``inspect.signature`` and the source's syntax tree, nothing else. A
function without readable source (a compiled build) fails the contract: nsa_cp cannot tell what it does.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple

__all__ = ["Spec", "Contract", "Verdict", "Found", "ContractMismatch", "resolve", "read", "verify"]

ANY_MORE = "..."


@dataclass(frozen=True)
class Spec:
    """One engine function as a plugin relies on it (module docstring). ``paths``: dotted
    ``module.function`` or ``module.Class.attribute``; ``returns``: the set of value counts its returns give,
    None to leave them unchecked."""

    paths: Tuple[str, ...]
    params: Optional[Tuple[str, ...]] = None
    returns: Optional[FrozenSet[int]] = None
    reads: Tuple[str, ...] = ()
    defaults: Tuple[Tuple[str, Any], ...] = ()

    @property
    def name(self) -> str:
        """The short name used in messages: ``Class.method`` or ``module.function``."""
        return ".".join(self.paths[0].rsplit(".", 2)[-2:])


@dataclass(frozen=True)
class Contract:
    """A named set of :class:`Spec` by role, and the ``features`` the serving code reads for it."""

    name: str
    specs: Mapping[str, Spec]
    features: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class Found:
    """What one engine function is in this process: where it was found, its parameter names, the value
    counts of its returns, the names its code refers to; ``missing``: why it could not be read."""

    path: Optional[str] = None
    obj: Any = None
    params: Optional[Tuple[str, ...]] = None
    returns: Optional[FrozenSet[int]] = None
    names: FrozenSet[str] = frozenset()
    defaults: Mapping[str, Any] = field(default_factory=dict)
    missing: Optional[str] = None


@dataclass
class Verdict:
    """:func:`verify`'s answer: ``contract`` (None: none holds), ``found`` by role, and ``problem``, one line
    naming what differs from the closest known contract (None when one holds)."""

    contract: Optional[Contract]
    found: Dict[str, Found]
    problem: Optional[str] = None

    def as_status(self) -> dict:
        """The ``status()["contract"]`` record: the contract served (its name) or why none."""
        return {"served": self.contract.name if self.contract else None, "problem": self.problem,
                "found": {role: f.path or f.missing for role, f in self.found.items()}}


class ContractMismatch(RuntimeError):
    """The engine's code in this process meets no contract nsa_cp knows (``verdict.problem`` says what)."""

    def __init__(self, verdict: Verdict):
        super().__init__(verdict.problem)
        self.verdict = verdict


def resolve(path: str) -> Any:
    """The object at ``module.name`` or ``module.Class.attribute`` (the longest importable module prefix);
    raises ImportError / AttributeError."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = inspect.getattr_static(obj, name) if inspect.isclass(obj) else getattr(obj, name)
        return obj
    raise ImportError(f"no module of {path!r} imports")


def _function(obj: Any) -> Any:
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    while hasattr(obj, "_nsa_cp_original"):  # nsa_cp's own wrapper: read the engine's function under it
        obj = obj._nsa_cp_original
    return obj


def _return_counts(node: ast.AST) -> FrozenSet[int]:
    """The value counts of ``node``'s own return statements (nested functions and classes excluded)."""
    counts, stack = set(), list(ast.iter_child_nodes(node))
    while stack:
        child = stack.pop()
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(child, ast.Return):
            value = child.value
            if value is None:
                counts.add(0)
            elif isinstance(value, ast.Tuple) and not any(isinstance(e, ast.Starred) for e in value.elts):
                counts.add(len(value.elts))
            else:
                counts.add(1)
        stack.extend(ast.iter_child_nodes(child))
    return frozenset(counts or {0})


def _name(node: ast.AST) -> Optional[str]:
    """The name a node refers to: a variable, an attribute or a keyword argument."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.arg if isinstance(node, ast.keyword) else None


def read(paths: Sequence[str]) -> Found:
    """Read the first of ``paths`` that resolves: its signature, its returns' value counts and the names its
    code refers to (for a class: its constructor's parameters and its source's names)."""
    errors = []
    for path in paths:
        try:
            obj = _function(resolve(path))
        except Exception as e:  # noqa: BLE001  any failure: not here, try the next place
            errors.append(f"{path}: {type(e).__name__}: {e}")
            continue
        found = Found(path=path, obj=obj)
        try:
            parameters = inspect.signature(obj).parameters
            found.params = tuple(parameters)
            found.defaults = {k: p.default for k, p in parameters.items() if p.default is not inspect.Parameter.empty}
        except (TypeError, ValueError) as e:
            found.missing = f"{path}: no signature ({e})"
            return found
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(obj)))
        except (OSError, TypeError, SyntaxError) as e:
            found.missing = f"{path}: source not readable ({type(e).__name__})"
            return found
        top = tree.body[0] if tree.body else tree
        found.names = frozenset(_name(n) for n in ast.walk(top) if _name(n))
        if isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found.returns = _return_counts(top)
        return found
    return Found(missing="; ".join(errors) or "no path")


def _params_match(want: Tuple[str, ...], got: Tuple[str, ...]) -> bool:
    if want and want[-1] == ANY_MORE:
        return got[: len(want) - 1] == want[:-1]
    return got == want


def _counts(values) -> str:
    values = sorted(values)
    return " and ".join(str(v) for v in values) if len(values) < 3 else ", ".join(map(str, values))


def _problems(contract: Contract, found: Dict[str, Found]) -> List[Tuple[str, str]]:
    """``(role, what differs)`` for every spec of ``contract`` that the engine's code does not meet."""
    out = []
    for role, spec in contract.specs.items():
        f = found[role]
        if f.missing is not None:
            out.append((role, f"{spec.name} not found ({f.missing})"))
            continue
        if spec.params is not None and not _params_match(spec.params, f.params):
            out.append((role, f"{spec.name} takes ({', '.join(f.params)}), nsa_cp knows "
                              f"({', '.join(spec.params)})"))
        if spec.returns is not None and f.returns != spec.returns:
            out.append((role, f"{spec.name} returns {_counts(f.returns)} values"))
        for name, value in spec.defaults:
            if f.defaults.get(name, inspect.Parameter.empty) != value:
                out.append((role, f"{spec.name}'s {name} defaults to {f.defaults.get(name, 'nothing')!r}, nsa_cp "
                                  f"knows {value!r}"))
        lacking = [n for n in spec.reads if n not in f.names]
        if lacking:
            out.append((role, f"{spec.name} no longer refers to {', '.join(lacking)}"))
    return out


def verify(contracts: Sequence[Contract]) -> Verdict:
    """The first of ``contracts`` whose every spec holds in this process, else why none does (the closest
    contract's differences; for a return count, every count the table knows)."""
    found: Dict[str, Found] = {}
    for contract in contracts:
        for role, spec in contract.specs.items():
            key = f"{role}@{'|'.join(spec.paths)}"
            if key not in found:
                found[key] = read(spec.paths)
    per_contract = []
    for contract in contracts:
        mine = {role: found[f"{role}@{'|'.join(spec.paths)}"] for role, spec in contract.specs.items()}
        problems = _problems(contract, mine)
        if not problems:
            return Verdict(contract, mine)
        per_contract.append((len(problems), contract, mine, problems))
    if not per_contract:
        return Verdict(None, {}, "no contract known")
    _, closest, mine, problems = min(per_contract, key=lambda item: item[0])
    lines = []
    for role, text in problems:
        if text.endswith("values") and " returns " in text:
            known = set()
            for c in contracts:
                if role in c.specs and c.specs[role].returns is not None:
                    known |= set(c.specs[role].returns)
            text += f"; nsa_cp knows {_counts(known)}"
        lines.append(text)
    return Verdict(None, mine, "; ".join(lines))
