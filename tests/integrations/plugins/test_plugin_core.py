"""The plugin skeleton both engine plugins share (nsa_cp.integrations.core): a target table resolved
through the contracts, all-or-nothing wrapping with one undo handle, and the live-binding check.

(It lives one folder down: a test file directly in tests/integrations/ puts that folder on sys.path, where
its sglang/ and vllm/ folders would import as namespace packages named like the engines.)"""

from __future__ import annotations

import sys
import types

import pytest

from nsa_cp.integrations import contracts, core

MOD = "nsa_cp_fake_engine"


@pytest.fixture
def engine(monkeypatch):
    module = types.ModuleType(MOD)

    class Runner:
        def forward(self, x):
            return x + 1

        def combine(self, x):
            return x * 2

    module.Runner = Runner
    monkeypatch.setitem(sys.modules, MOD, module)
    return module


def _contract(name, forward_path, combine_path=f"{MOD}.Runner.combine"):
    return contracts.Contract(name, {"forward": contracts.Spec((forward_path,), ("self", "x")),
                                     "combine": contracts.Spec((combine_path,), ("self", "x"))})


def test_targets_take_their_paths_from_the_contracts():
    table = (core.Target("forward", lambda o, *a: o(*a)),)
    known = (_contract("a", f"{MOD}.Runner.forward"), _contract("b", f"{MOD}.Runner.forward"))
    assert list(core.targets(table, known)) == [f"{MOD}.Runner.forward"]
    moved = (_contract("a", f"{MOD}.Runner.forward"), _contract("b", f"{MOD}.Other.forward"))
    with pytest.raises(ValueError, match="'forward'.*one path in every contract"):
        core.targets(table, moved)
    with pytest.raises(ValueError, match="'missing'"):
        core.targets((core.Target("missing", lambda o: o),), known)


def test_wrap_runs_the_body_around_the_original_and_undo_puts_it_back(engine):
    seen = []

    def around(original, runner, x):
        seen.append(x)
        return original(runner, x) * 10

    patches = core.Patches()
    original = engine.Runner.forward
    assert core.wrap(patches, {f"{MOD}.Runner.forward": around}) == 1
    assert engine.Runner().forward(3) == 40 and seen == [3]
    assert core.is_wrapped(f"{MOD}.Runner.forward") and not core.is_wrapped(f"{MOD}.Runner.combine")
    assert core.wrap(patches, {f"{MOD}.Runner.forward": around}) == 0, "a second load wrapped twice"
    assert engine.Runner().forward(3) == 40
    patches.undo()
    assert engine.Runner.forward is original and not core.is_wrapped(f"{MOD}.Runner.forward")


def test_wrap_is_all_or_nothing_and_names_the_missing_target(engine):
    patches = core.Patches()
    original = engine.Runner.forward
    items = {f"{MOD}.Runner.forward": lambda o, *a: o(*a), f"{MOD}.Runner.gone": lambda o, *a: o(*a)}
    with pytest.raises(AttributeError, match="gone"):
        core.wrap(patches, items)
    with pytest.raises(ImportError, match="nsa_cp_no_such_engine.Runner.forward"):
        core.wrap(patches, {"nsa_cp_no_such_engine.Runner.forward": lambda o, *a: o(*a)})
    assert engine.Runner.forward is original and len(patches) == 0


def test_is_wrapped_is_false_where_the_engine_does_not_import():
    assert not core.is_wrapped("nsa_cp_no_such_engine.Runner.forward")
