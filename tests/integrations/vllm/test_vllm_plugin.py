"""nsa_cp's vLLM plugin as vLLM loads it: through the entry point in spawned processes, the off switch,
the VLLM_PLUGINS whitelist, a truthful registration log and status(), the worker's transport decision and
its sizing, and the calls nsa_cp hands back to vLLM (CUDA-graph capture, naive DP/EP dispatch).

Skipped where vLLM does not import (failed instead with NSA_TEST_REQUIRE_VLLM=1, as in CI).
"""

from __future__ import annotations

import logging
import os
import traceback
import types

import pytest
import torch

import vllm_env
from dist_harness import case_failures, run_cases, run_spawned, run_world


def _load_plugins_probe(env, queue):
    """A fresh process that loads vLLM's general plugins, as each vLLM worker does."""
    try:
        for name, value in env.items():  # None: unset in this process
            os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)
        vllm_env.prepare_process()
        records = []
        handler = logging.Handler()
        handler.emit = lambda record: records.append(record.getMessage())
        logger = logging.getLogger("nsa_cp")
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.plugins import load_general_plugins

        says = None
        if env.get("DRIFT"):  # vLLM's own module drifts before vLLM loads its plugins
            import vllm_drift

            says, _ = vllm_drift.apply(env["DRIFT"])
        with set_current_vllm_config(VllmConfig()):
            load_general_plugins()
            load_general_plugins()  # vLLM may load plugins more than once: a no-op
        import nsa_cp.integrations.vllm as nsa_vllm

        queue.put({"status": nsa_vllm.status(), "logs": [m for m in records if m.startswith("nsa_cp")], "says": says})
    except BaseException:  # noqa: BLE001
        queue.put({"error": traceback.format_exc()})


@pytest.fixture(scope="module", autouse=True)
def _vllm():
    vllm_env.require_vllm()


def _require_entry_point():
    from importlib.metadata import entry_points

    import engines

    names = [ep.value for ep in entry_points(group="vllm.general_plugins") if ep.name == "nsa_cp"]
    reason = None if names == ["nsa_cp.integrations.vllm:vllm_plugin"] else \
        f"nsa_cp's vllm.general_plugins entry point is not installed here (found {names})"
    engines.require(reason, "NSA_TEST_REQUIRE_VLLM", "nsa_cp (pip install -e .)")


def _spawned(**env):
    _require_entry_point()
    base = {"NSA_CP_VLLM": "1", "VLLM_PLUGINS": None, "NSA_CP_VLLM_COMPACT": None}
    base.update(env)
    return run_spawned(_load_plugins_probe, base)


def test_entry_point_loads_in_a_spawned_process_and_wraps_every_target():
    out = _spawned()
    status = out["status"]
    assert status["active"] and all(status["bound"].values()), status
    assert status["plugin_registered"] and status["register_error"] is None, status
    assert status["version"] == vllm_env.version() and status["contract"]["served"], status
    registered = [m for m in out["logs"] if "vLLM plugin registered" in m]
    assert len(registered) == 1, out["logs"]  # loaded twice, registered once


@pytest.mark.parametrize("drift", ["arity", "helper", "signature", "forward"])
def test_a_drifted_contract_patches_nothing_logs_one_line_and_says_why(drift):
    """vLLM's MoERunner drifts (another return arity, a renamed helper, a changed signature) before
    load_general_plugins(): the plugin verifies before it patches, so it wraps nothing, logs one line naming
    the difference, and status() reports it under "contract"."""
    out = _spawned(DRIFT=drift)
    status, says = out["status"], out["says"]
    assert not any(status["bound"].values()) and not status["plugin_registered"], status
    assert status["contract"]["served"] is None and says in status["contract"]["problem"], status["contract"]
    assert says in status["register_error"] and status["version"] == vllm_env.version(), status
    lines = [m for m in out["logs"] if says in m]
    assert len(lines) == 1 and "vLLM's own PCP MoE moves are used" in lines[0], out["logs"]
    assert not any("registered (" in m for m in out["logs"]), out["logs"]


def test_whitelist_naming_nsa_cp_loads_it():
    status = _spawned(VLLM_PLUGINS="nsa_cp")["status"]
    assert status["active"], status


def test_whitelist_without_nsa_cp_leaves_vllm_untouched():
    out = _spawned(VLLM_PLUGINS="some_other_plugin")
    assert not any(out["status"]["bound"].values()) and not out["status"]["plugin_registered"], out
    assert out["logs"] == [], out["logs"]


def test_off_switch_wraps_nothing_and_says_so():
    out = _spawned(NSA_CP_VLLM="0")
    assert not any(out["status"]["bound"].values()) and not out["status"]["plugin_registered"], out
    assert any("NSA_CP_VLLM=0" in m for m in out["logs"]), out["logs"]


def test_a_target_that_does_not_import_is_reported_and_nothing_is_wrapped(monkeypatch, caplog):
    import nsa_cp.integrations.vllm as nsa_vllm
    from nsa_cp.integrations.vllm import moe, plugin

    nsa_vllm.uninstall()
    moe.STATE.reset()
    targets = dict(plugin.TARGETS)
    targets["vllm.no_such_module.Thing.method"] = lambda original, self: None
    monkeypatch.setattr(plugin, "TARGETS", targets)
    with caplog.at_level(logging.ERROR, logger="nsa_cp"):
        nsa_vllm.vllm_plugin()
    status = nsa_vllm.status()
    assert not status["plugin_registered"] and "vllm.no_such_module" in status["register_error"], status
    assert not any(status["bound"].values()), status  # all or nothing
    assert "NOT registered" in caplog.text and "vllm.no_such_module" in caplog.text
    moe.STATE.reset()


def test_install_and_uninstall_put_vllm_functions_back():
    import nsa_cp.integrations.vllm as nsa_vllm
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    original = MoERunner.__dict__["_maybe_dispatch"]
    nsa_vllm.install()
    nsa_vllm.install()  # a second install wraps nothing twice
    try:
        wrapped = MoERunner.__dict__["_maybe_dispatch"]
        assert wrapped is not original and wrapped._nsa_cp_original is original
        assert nsa_vllm.status()["active"]
    finally:
        nsa_vllm.uninstall()
    assert MoERunner.__dict__["_maybe_dispatch"] is original
    assert not any(nsa_vllm.status()["bound"].values())


def test_transport_sizing_from_vllm_limits():
    from nsa_cp.integrations.vllm.worker import max_tokens_per_rank

    limits = types.SimpleNamespace(max_num_batched_tokens=8192, max_num_seqs=256)
    assert max_tokens_per_rank(limits, 2) == 4096 + 512
    assert max_tokens_per_rank(limits, 8) == 1024 + 512
    assert max_tokens_per_rank(types.SimpleNamespace(max_num_batched_tokens=100, max_num_seqs=256), 2) == 100
    assert max_tokens_per_rank(types.SimpleNamespace(max_num_batched_tokens=None), 2) is None


def test_calls_nsa_cp_hands_back_to_vllm(monkeypatch):
    from nsa_cp.integrations.vllm import moe

    runner = vllm_env.runner(2)
    h = torch.zeros(4, 8)
    naive = types.SimpleNamespace(**{**vars(runner), "do_naive_dispatch_combine": True})
    assert moe.admit(naive, h)[0].startswith("naive DP/EP dispatch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert moe.admit(runner, h)[0].startswith("a CUDA graph capture")


def _transport_worker(rank, world, payload):
    """The worker hook's decision on CPU over gloo (no P2P there), and the off switch."""
    from vllm.config import SchedulerConfig

    from nsa_cp.integrations.vllm import moe, worker

    config, _ = vllm_env.setup_parallel(rank, world)

    def check(p2p):
        os.environ["NSA_CP_VLLM_P2P"] = p2p
        try:
            moe.STATE.reset()
            config.scheduler_config = SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=16,
                                                      max_model_len=4096, is_encoder_decoder=False)
            fake = types.SimpleNamespace(vllm_config=types.SimpleNamespace(
                scheduler_config=config.scheduler_config,
                model_config=types.SimpleNamespace(get_hidden_size=lambda: 64, dtype=torch.bfloat16)),
                device=torch.device("cpu"))
            decision = worker.setup_transport(fake)
            assert decision == moe.STATE.p2p and not decision["on"], decision
            assert decision["max_tokens_per_rank"] == -(-4096 // world) + 32, decision
            want = "NSA_CP_VLLM_P2P=0" if p2p == "0" else "CUDA"
            assert want in decision["reason"], decision
            assert decision["nccl"].startswith("torch's process group"), decision
        finally:
            os.environ.pop("NSA_CP_VLLM_P2P", None)

    return run_cases({key: (p2p,) for key, p2p in payload.items()}, check)


def test_worker_transport_decision_on_cpu_and_the_off_switch():
    per_rank = run_world(2, "gloo", _transport_worker, {"p2p-on": "1", "p2p-off": "0"}, timeout_s=600)
    for key in ("p2p-on", "p2p-off"):
        errors = case_failures(per_rank, key)
        assert not errors, "\n".join(errors)
