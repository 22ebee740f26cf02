"""nsa_cp's SGLang adapter against SGLang 0.5.23's own code, on CPU / gloo (tests/support/sglang_env.py).

* worlds 2 and 3 with SGLang's real attention-CP GroupCoordinator and metadata from its own
  ``ZigzagCPStrategy`` / ``InterleaveCPStrategy.build_metadata`` + ``pad_logical_token_to_physical``: nsa_cp's moves equal SGLang's,
  called the way SGLang calls them (``partial(moves.gather, gather=<its read step>)``, take_back and
  reduce_scatter with keywords and positionally), fp32 and bf16, garbage in the padding rows; the compact
  layout against a reference from every rank's inputs; an in-place MoE (the reduce-scatter's input is the
  tensor the gather returned) in both layouts.
* the plugin through its real entry point in a ``spawn``-ed process after SGLang's own ``load_plugins()``,
  the off switch, SGLANG_PLUGINS, and install() on top of the plugin or before it.

Skipped where SGLang does not import (failed instead with NSA_TEST_REQUIRE_SGLANG=1, as in CI).
"""

from __future__ import annotations

import traceback
from functools import partial
from types import SimpleNamespace as NS

import pytest
import torch

import sglang_env
from dist_harness import case_failures, run_world

H = 16
# (seq_lens) -> SGLang's zigzag split at the world's cp; ids name what the split gives
_SPLITS = {
    2: {"uneven": [37, 64, 21], "zero-token-rank": [1], "even": [8], "mixed": [100, 3, 9], "empty": []},
    3: {"uneven": [37, 64, 21], "zero-token-ranks": [1], "even": [6], "mixed": [50, 7], "empty": []},
}
# both of SGLang 0.5.23's strategies (DeepSeek-V3.2 takes interleave: it refuses zigzag for it)
CASES = {w: {f"{s}-{c}": (s, lens) for s in ("zigzag", "interleave") for c, lens in cases.items()}
         for w, cases in _SPLITS.items()}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _rand(seed, rows, dtype):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, H, generator=g, dtype=torch.float32).to(dtype)


def _garbage(t, n):
    """Padding rows [n:] hold large garbage (what a layer computes on padding rows), never zeros."""
    t[n:] = 1e4 * torch.rand(t.shape[0] - n, H, generator=torch.Generator().manual_seed(n + 7)).to(t.dtype) + 1e3
    return t


def _close(got, want, dtype, what):
    tol = TOL[dtype]
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if want.numel() == 0:
        return
    assert torch.allclose(got.double(), want, rtol=tol, atol=tol * (1 + want.abs().max().item())), \
        f"{what}: max diff {(got.double() - want).abs().max().item()}"


def _check_case(rank, world, strategy, seq_lens, dtype, log):
    import nsa_cp
    from nsa_cp.integrations import sglang as nsa_sglang

    md, n = sglang_env.build_metadata(seq_lens, world, strategy)
    P = md.per_rank_actual_token[0]
    off = [sum(n[:q]) for q in range(world)]
    T = sum(n)
    fb = NS(attn_cp_metadata=md)
    theirs = sglang_env.sglang_moves()
    ours_padded = nsa_sglang.CpMovesAdapter(compact=False)
    ours_compact = nsa_sglang.CpMovesAdapter(compact=True)
    step = sglang_env.read_step()
    norm = nsa_cp.RMSNorm(H).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(H, generator=torch.Generator().manual_seed(3)))
    hs = [_garbage(_rand(100 + q, P, dtype), n[q]) for q in range(world)]
    res = [_garbage(_rand(200 + q, P, dtype), n[q]) for q in range(world)]
    # every rank's read step (deterministic, local): the rows each rank puts into the gather
    normed = [step(hs[q].clone(), res[q].clone(), fb, norm)[0] for q in range(world)]

    # --- gather, called as SGLang calls it
    g_theirs, r_theirs = partial(theirs.gather, gather=step)(hs[rank].clone(), res[rank].clone(), fb, norm)
    g_ours, r_ours = partial(ours_padded.gather, gather=step)(hs[rank].clone(), res[rank].clone(), fb, norm)
    assert g_ours.shape == g_theirs.shape == (P * world, H), (g_ours.shape, g_theirs.shape)
    assert torch.equal(r_ours, r_theirs), "residual"
    for q in range(world):
        real = slice(q * P, q * P + n[q])
        assert torch.equal(g_ours[real], g_theirs[real]), f"rank {q}'s rows"
        assert torch.equal(g_ours[real], normed[q][: n[q]]), f"rank {q}'s rows vs its read step"
        assert not g_ours[q * P + n[q] : (q + 1) * P].any(), f"rank {q}'s padding rows are zero"
    g_c, r_c = partial(ours_compact.gather, gather=step)(hs[rank].clone(), res[rank].clone(), fb, norm)
    assert g_c.shape == (T, H) and torch.equal(r_c, r_theirs)
    assert torch.equal(g_c, torch.cat([normed[q][: n[q]] for q in range(world)])), "compact gather"
    log.append("gather")

    # --- take_back: keywords (SGLang's exit) and positionally
    full = _rand(300, P * world, dtype)
    want, _ = theirs.take_back(hidden_states=full, residual=r_theirs, forward_batch=fb)
    for ours in (ours_padded, ours_compact):
        kw, rk = ours.take_back(hidden_states=full, residual=r_theirs, forward_batch=fb)
        pos, rp = ours.take_back(full, r_theirs, fb)
        assert torch.equal(kw, want) and torch.equal(pos, want) and rk is r_theirs and rp is r_theirs
    full_c = _rand(301, T, dtype)
    back, _ = ours_compact.take_back(hidden_states=full_c, residual=None, forward_batch=fb)
    assert back.shape == (P, H) and torch.equal(back[: n[rank]], full_c[off[rank] : off[rank] + n[rank]])
    assert not back[n[rank]:].any()
    log.append("take_back")

    # --- reduce_scatter: every rank's partials known to all; garbage in the padding rows
    partials = [_rand(400 + q, P * world, dtype) for q in range(world)]
    for t in partials:
        for q in range(world):
            t[q * P + n[q] : (q + 1) * P] = 1e4
    ref = sum(t.double() for t in partials)[rank * P : rank * P + n[rank]]
    s_theirs, _ = theirs.reduce_scatter(hidden_states=partials[rank].clone(), residual=r_theirs, forward_batch=fb)
    for ours in (ours_padded, ours_compact):
        for how in ("kw", "pos"):
            x = partials[rank].clone()
            out, r = (ours.reduce_scatter(hidden_states=x, residual=r_theirs, forward_batch=fb) if how == "kw"
                      else ours.reduce_scatter(x, r_theirs, fb))
            assert out.shape == s_theirs.shape == (P, H) and r is r_theirs
            _close(out[: n[rank]], ref, dtype, f"reduce_scatter {how}")
            _close(out[: n[rank]], s_theirs[: n[rank]].double(), dtype, f"reduce_scatter {how} vs SGLang's")
            assert not out[n[rank]:].any(), "rows past the real count are zero"
    parts_c = [_rand(500 + q, T, dtype) for q in range(world)]
    ref_c = sum(t.double() for t in parts_c)[off[rank] : off[rank] + n[rank]]
    out, _ = ours_compact.reduce_scatter(parts_c[rank].clone(), None, fb)
    assert out.shape == (P, H)
    _close(out[: n[rank]], ref_c, dtype, "compact reduce_scatter")
    assert not out[n[rank]:].any()
    log.append("reduce_scatter")

    # --- in-place MoE: the reduce-scatter's input is the tensor the gather returned
    for ours, name in ((ours_padded, "padded"), (ours_compact, "compact")):
        g, r = partial(ours.gather, gather=step)(hs[rank].clone(), res[rank].clone(), fb, norm)
        g.mul_(rank + 2).add_(1.0)  # the MoE writes its output over its input
        out, _ = ours.reduce_scatter(g, r, fb)
        # rank q's MoE turned every row x into x * (q + 2) + 1, rounded to the dtype as it ran in place
        want = sum(normed[rank][: n[rank]].mul(q + 2).add(1.0).double() for q in range(world))
        _close(out[: n[rank]], want, dtype, f"in-place {name}")
        assert not out[n[rank]:].any()
    log.append("in-place")

    # --- bad rows: ValueError naming the tensor, both layouts' lengths
    try:
        ours_padded.reduce_scatter(_rand(1, P * world + 1, dtype), None, fb)
        raise AssertionError("no ValueError for a wrong row count")
    except ValueError as e:
        assert "hidden_states: expected" in str(e) and str(P * world) in str(e), e
    log.append("bad-rows")


def _world_worker(rank, world, payload):
    results = {}
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    try:
        sglang_env.setup_parallel(rank, world)
    except Exception:  # noqa: BLE001
        return {"__world__": traceback.format_exc()}
    for case_id, (strategy, seq_lens) in payload.items():
        for dname, dtype in DTYPES.items():
            log = []
            try:
                _check_case(rank, world, strategy, seq_lens, dtype, log)
                results[f"{case_id}-{dname}"] = None
            except Exception:  # noqa: BLE001
                results[f"{case_id}-{dname}"] = f"after {log}:\n{traceback.format_exc()}"
    return results


_WORLDS = {}


def _world(world):
    if world not in _WORLDS:
        _WORLDS[world] = run_world(world, "gloo", _world_worker, CASES[world], timeout_s=300)
    return _WORLDS[world]


@pytest.mark.parametrize("world,case_id", [(w, f"{c}-{d}") for w in CASES for c in CASES[w] for d in DTYPES])
def test_moves_equal_sglangs(world, case_id):
    sglang_env.require_sglang()
    errors = case_failures(_world(world), case_id)
    assert not errors, "\n".join(errors)


# ----------------------------------------------------------------------------- the plugin, spawned
def _plugin_probe(env, order, queue):
    """A scheduler process's first steps: SGLang's load_plugins(), then its modules; report the bindings."""
    import os

    try:
        os.environ.update({k: v for k, v in env.items() if v is not None})
        for key in [k for k, v in env.items() if v is None]:
            os.environ.pop(key, None)
        sglang_env.prepare_process()
        import importlib
        import inspect
        import logging
        from unittest import mock

        records = []
        handler = logging.Handler()
        handler.emit = lambda record: records.append(record.getMessage())
        logging.getLogger("nsa_cp").addHandler(handler)
        logging.getLogger("nsa_cp").setLevel(logging.INFO)
        if order == "install-first":
            import nsa_cp.integrations.sglang as nsa_sglang

            nsa_sglang.install()
        mods, says = [], None
        if order.startswith("drift:"):  # SGLang's own module drifts before SGLang loads its plugins
            import sglang_drift

            says = sglang_drift.apply(order.split(":", 1)[1])
        if order == "modules-first":
            mods = [importlib.import_module(m) for m in sglang_env.MODULES[:3]]
        from sglang.srt.plugins import load_plugins

        load_plugins()
        mods = [importlib.import_module(m) for m in sglang_env.MODULES[:3]]
        import nsa_cp.integrations.sglang as nsa_sglang
        from sglang.srt.layers.layer_boundary import boundary, prepare

        out = {"status": nsa_sglang.status(), "log": records, "says": says}
        out["same_binding"] = all(m._cp_moves is mods[0]._cp_moves for m in mods)
        out["hook_wrapped"] = [hasattr(m._cp_moves, "__wrapped__") for m in mods]
        out["is_sglang_original"] = [getattr(m._cp_moves, "__module__", None) == boundary.__name__
                                     and not hasattr(m._cp_moves, "__wrapped__") for m in mods]
        with mock.patch.object(boundary, "_cp_gathers_over_attn_cp", return_value=True):
            moves = [m._cp_moves() for m in mods]
        out["ours"] = [bool(getattr(mv.gather, "_nsa_cp_moves", False)) for mv in moves]
        if out["ours"][0]:
            inner = inspect.getclosurevars(moves[0].gather).nonlocals["theirs"]
            out["wraps_sglang_gather"] = inner.gather is prepare._then_attn_cp_gather
        if order == "plugin-then-install":
            handle = nsa_sglang.install()
            out["same_handle"] = handle is nsa_sglang.PLUGIN.installed and handle.patched > 0
            with mock.patch.object(boundary, "_cp_gathers_over_attn_cp", return_value=True):
                mv = boundary._cp_moves()
            inner = inspect.getclosurevars(mv.gather).nonlocals["theirs"]
            out["after_install_wraps_sglang_gather"] = inner.gather is prepare._then_attn_cp_gather
        queue.put(out)
    except BaseException:  # noqa: BLE001
        queue.put({"error": traceback.format_exc()})


def _spawn_probe(env, order="plugins-first"):
    return sglang_env.run_spawned(_plugin_probe, env, order)


def _require_entry_point():
    sglang_env.require_sglang()
    from importlib.metadata import entry_points

    names = [ep.value for ep in entry_points(group="sglang.srt.plugins") if ep.name == "nsa_cp"]
    if names != ["nsa_cp.integrations.sglang:sglang_plugin"]:
        reason = f"nsa_cp's sglang.srt.plugins entry point is not installed here (found {names}); pip install -e ."
        if sglang_env.REQUIRED:
            pytest.fail(reason)
        pytest.skip(reason)


ON = {"NSA_CP_SGLANG": None, "SGLANG_PLUGINS": None}


@pytest.mark.parametrize("order", ["plugins-first", "modules-first"])
def test_plugin_binds_every_module(order):
    _require_entry_point()
    out = _spawn_probe(ON, order)
    assert out["status"]["active"] and out["status"]["plugin_registered"], out["status"]
    assert out["same_binding"] and out["ours"] == [True] * 3 and out["wraps_sglang_gather"], out
    assert not any(out["is_sglang_original"]), out
    assert any("SGLang plugin registered" in line for line in out["log"]), out["log"]


def test_plugin_off_switch():
    _require_entry_point()
    out = _spawn_probe({**ON, "NSA_CP_SGLANG": "0"})
    assert not out["status"]["active"] and not out["status"]["plugin_registered"], out["status"]
    assert out["is_sglang_original"] == [True] * 3 and out["ours"] == [False] * 3, out
    assert any("NSA_CP_SGLANG=0" in line for line in out["log"]), out["log"]


@pytest.mark.parametrize("drift", ["arity", "helper", "signature"])
def test_a_drifted_contract_registers_nothing_logs_one_line_and_says_why(drift):
    """SGLang's code drifts (another return arity, a renamed helper, a changed signature) before
    load_plugins(): the plugin verifies before it registers, so no hook is registered, SGLang's modules keep
    their own _cp_moves (its own moves, the plugin-off bindings), one line names the difference, and
    status() reports it under "contract"."""
    _require_entry_point()
    out = _spawn_probe(ON, f"drift:{drift}")
    status, says = out["status"], out["says"]
    assert not status["active"] and not status["plugin_registered"] and out["ours"] == [False] * 3, out
    assert out["same_binding"] and out["hook_wrapped"] == [False] * 3, out  # no hook chained on _cp_moves
    assert out["is_sglang_original"] == [drift != "helper"] * 3, out  # the helper drift replaced _cp_moves itself
    assert status["contract"]["served"] is None and says in status["contract"]["problem"], status["contract"]
    assert says in status["register_error"], status
    lines = [m for m in out["log"] if says in m]
    assert len(lines) == 1 and "SGLang's own CP moves are used" in lines[0], out["log"]
    assert not any("hooks handed" in m for m in out["log"]), out["log"]


@pytest.mark.parametrize("whitelist,loaded", [("someone_else", False), ("someone_else, nsa_cp", True)])
def test_sglang_plugins_whitelist(whitelist, loaded):
    _require_entry_point()
    out = _spawn_probe({**ON, "SGLANG_PLUGINS": whitelist})
    assert out["status"]["active"] is loaded and out["ours"] == [loaded] * 3, out


@pytest.mark.parametrize("order", ["plugin-then-install", "install-first"])
def test_install_and_plugin_never_stack(order):
    _require_entry_point()
    out = _spawn_probe(ON, order)
    assert out["status"]["active"] and out["ours"] == [True] * 3 and out["wraps_sglang_gather"], out
    if order == "plugin-then-install":
        assert out["same_handle"] and out["after_install_wraps_sglang_gather"], out
