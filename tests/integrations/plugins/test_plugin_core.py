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


def test_both_plugins_are_one_record_with_one_status_schema(monkeypatch):
    """SGLang's and vLLM's plugins are the same record (nsa_cp.integrations.core.Plugin): the same fields, one
    install path that the entry point runs, one undo handle, one state object, and ``status()`` with the
    same keys (nsa_cp.integrations.state.STATUS_KEYS), each of the same type in both."""
    import dataclasses

    import nsa_cp.integrations.sglang as nsa_sglang
    import nsa_cp.integrations.vllm as nsa_vllm
    from nsa_cp.integrations import state
    from nsa_cp.integrations.sglang import state as sglang_state
    from nsa_cp.integrations.vllm import moe

    plugins = {"SGLang": (nsa_sglang, nsa_sglang.sglang_plugin, sglang_state.STATE),
               "vLLM": (nsa_vllm, nsa_vllm.vllm_plugin, moe.STATE)}
    fields = {f.name for f in dataclasses.fields(core.Plugin)}
    statuses = {}
    for engine, (module, entry, own_state) in plugins.items():
        plugin = module.PLUGIN
        assert type(plugin) is core.Plugin and plugin.engine == engine
        assert {f.name for f in dataclasses.fields(plugin)} == fields
        assert plugin.state is own_state and isinstance(own_state, state.IntegrationState)
        assert plugin.targets == module.TABLE and plugin.contracts == module.KNOWN
        for name in ("install", "uninstall", "status"):
            assert callable(getattr(module, name)), (engine, name)
        # the entry point runs the install path (and nothing else)
        calls = []
        monkeypatch.setattr(plugin, "install", lambda: calls.append("install"))
        monkeypatch.setattr(plugin, "switch", lambda: True)
        entry()
        assert calls == ["install"], (engine, calls)
        monkeypatch.setattr(plugin, "switch", lambda: False)
        entry()
        assert calls == ["install"], f"{engine}: the off switch still installed"
        statuses[engine] = module.status()
    sglang, vllm = statuses["SGLang"], statuses["vLLM"]
    assert tuple(sglang) == tuple(vllm) == state.STATUS_KEYS
    for key in state.STATUS_KEYS:
        assert sglang[key] is None or vllm[key] is None or type(sglang[key]) is type(vllm[key]), key
    assert set(sglang["fusions"]) == set(vllm["fusions"]) == {"gather", "reduce_scatter"}
    assert set(sglang["overlap"]) == set(vllm["overlap"]) and set(sglang["first_use"]) == set(vllm["first_use"])


def test_the_undo_handle_puts_the_engine_back_and_clears_the_record(engine):
    """One Plugin on a stand-in engine: install patches the target table, a second install returns the same
    handle, ``uninstall()`` puts the functions back and status() says so."""
    def around(original, runner, x):
        return original(runner, x) * 10

    known = (_contract("a", f"{MOD}.Runner.forward"),)
    table = (core.Target("forward", around),)
    paths = core.targets(table, known)
    plugin = core.Plugin(engine="Fake", contracts=known, targets=table, own_moves="its own moves",
                         switch_name="NSA_CP_FAKE", switch=lambda: True, version=lambda: "1",
                         verify=lambda: contracts.Verdict(known[0], {}), bind=lambda p: core.wrap(p, paths),
                         bindings=lambda: paths, describe=lambda: {"compact": False, "fusions": {}, "overlap": {},
                                                                   "first_use": {}}, summary=lambda: "")
    original = engine.Runner.forward
    handle = plugin.install()
    assert plugin.install() is handle and handle.patched == 1
    assert engine.Runner().forward(1) == 20 and plugin.status()["active"] and plugin.status()["plugin_registered"]
    handle.uninstall()
    assert engine.Runner.forward is original and plugin.installed is None
    status = plugin.status()
    assert not status["active"] and not status["plugin_registered"] and not status["hooks_applied"], status
