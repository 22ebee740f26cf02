"""The overlapped boundary's two benchmarks on the CPU: overlap.py's smoke run (the same code path as on the
GPU, tiny shapes on CPU tensors, the link emulated and saying so), cost_model.py's calibration against the
measured 2x H200 collectives and its projection, and the model's arithmetic (cost_model_sim.py)."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import bench_scripts
from bench_scripts import csv_rows

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"


def _run(args, timeout=240):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = "1"
    if not torch.cuda.is_available():
        env.setdefault("TRITON_INTERPRET", "1")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - t0


def _load(name):
    return bench_scripts.load(name)


@pytest.fixture(scope="module")
def sim():
    return _load("cost_model_sim")


# ============================================================================ overlap.py
def test_overlap_smoke_run_says_smoke_and_emulated(tmp_path):
    out = tmp_path / "overlap.csv"
    proc, took = _run([str(BENCH / "overlap.py"), "--smoke", "--rounds", "1", "--warmup", "0", "--csv", str(out)])
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"rc {proc.returncode} after {took:.0f} s:\n{text[-4000:]}"
    assert "smoke run" in text and "link EMULATED" in text, text[-3000:]
    assert not re.search(r"\b(MISS|target <=)", text), "a smoke run prints no verdicts"
    assert "CHECK FAILED" not in text
    table = proc.stdout.strip().splitlines()
    last = [line for line in table if not line.startswith("wrote ")]
    assert re.match(r"\s+4\s+16 rs\s+ce\s", last[-1]), f"the table is not last:\n{proc.stdout[-1500:]}"
    rows = csv_rows(out)
    # both mechanisms side by side (the default): a row per (cp, dir, mech), each checked
    assert sorted((r["cp"], r["dir"], r["mech"]) for r in rows) == sorted(
        (cp, d, m) for cp in ("2", "4") for d in ("ag", "rs") for m in ("sm", "ce"))
    assert all(r["check"] == "ok" and r["gpu"].startswith("CPU") for r in rows), rows[0]
    head = next(line for line in table if "hidden" in line)
    assert " mech " in head and " carve " in head, "the table has no mech or carve column"
    assert sum(bool(re.match(r"\s+\d\s+16 (ag|rs)\s+ce\s", line)) for line in table) == 4, proc.stdout[-1500:]
    sm = [r for r in rows if r["mech"] == "sm"]
    ce = [r for r in rows if r["mech"] == "ce"]
    # sm: the carveout's own cost is a column (no carveout on the CPU: the carved run is the plain one, re-timed)
    assert all(r["carve_margin"] == "1.0" and float(r["carved_ms"]) > 0 for r in sm), sm[0]
    # ce: no carveout, so nothing carved to time; its own columns say the pieces
    assert all(r["carved_ms"] == "" and r["carveout_sms"] == "" and float(r["piece_MiB"]) > 0 for r in ce), ce[0]
    assert "link EMULATED (ce)" in text and "copy-engine pieces of" in text, text[-3000:]
    assert all(str(ROOT) not in v for r in rows for v in r.values()), "a row records the checkout's path"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_overlap_on_a_gpu_at_a_small_size():
    proc, took = _run([str(BENCH / "overlap.py"), "--M", "512", "--cp", "2", "4", "--rounds", "2", "--warmup", "1"],
                      timeout=600)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"rc {proc.returncode} after {took:.0f} s:\n{text[-4000:]}"
    assert "link EMULATED" in text and "paced copy: calibrated" in text and "CHECK FAILED" not in text
    assert "copy-engine pieces: calibrated" in text and "WARNING: more than 5%" not in text, text[-3000:]


def test_overlap_smoke_runs_the_copy_engine_mechanism_alone(tmp_path):
    out = tmp_path / "ce.csv"
    proc, took = _run([str(BENCH / "overlap.py"), "--smoke", "--mechanism", "ce", "--cp", "2", "--rounds", "1",
                       "--warmup", "0", "--csv", str(out)])
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"rc {proc.returncode} after {took:.0f} s:\n{text[-4000:]}"
    assert "link EMULATED (ce)" in text and "link EMULATED (sm)" not in text, text[-3000:]
    rows = csv_rows(out)
    assert [(r["dir"], r["mech"], r["check"]) for r in rows] == [("ag", "ce", "ok"), ("rs", "ce", "ok")], rows


def test_copy_engine_pieces_are_exact_and_sleep_only_on_a_gpu(monkeypatch):
    """Pieces cut at any element (a short last piece too) land bit for bit; on CPU tensors no sleep kernel."""
    oc = _load("overlap_copy")
    monkeypatch.setattr(torch.cuda, "_sleep", lambda *a: pytest.fail("torch.cuda._sleep called on CPU tensors"))
    src = torch.randn(7, 33, dtype=torch.bfloat16)
    dst = torch.full_like(src, float("nan"))
    seen = []
    real = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda d, s, *a: seen.append(s.numel()) or real(d, s, *a))
    oc.PacedPieces(piece_bytes=64, sleep_cycles=1000)(src, dst)
    assert torch.equal(src, dst)
    assert seen == [32] * 7 + [7], seen  # 231 elements in pieces of 32 (64 bytes of bf16)


def test_overlap_refuses_a_carve_margin_that_is_not_positive():
    proc, _ = _run([str(BENCH / "overlap.py"), "--smoke", "--carve-margin", "0"], timeout=120)
    assert proc.returncode == 2 and "--carve-margin > 0" in proc.stderr, proc.stderr[-2000:]


def test_overlap_methods_keep_the_local_chunk_first_and_last():
    """Gather: the local rows first, then the peers in rotation; reduce-scatter: the peers, the local chunk last."""
    om = _load("overlap_methods")
    S = om.Setup(4, 10, 16, torch.device("cpu"), seed=1)
    assert S.counts == [10, 8, 10, 8] and S.r == 1 and S.T == 36
    assert [(c.owner, c.off, c.rows) for c in S.ag] == [(1, 10, 8), (2, 18, 10), (3, 28, 8), (0, 0, 10)]
    assert [c.owner for c in S.rs] == [2, 3, 0, 1]
    for c in S.ag[1:]:  # the gathered buffer starts as gathered once, from the peers' own allocations
        assert torch.equal(S.rows(S.gathered, c), S.peer_src[c.owner])
        assert S.peer_src[c.owner].data_ptr() != S.gathered.data_ptr()


def test_the_consumer_has_deepseek_v3s_shapes_and_flops():
    h = _load("harness")
    s = h.MOE_DEEPSEEK_V3
    assert (s.hidden, s.inter, s.routed, s.topk) == (7168, 2048, 256, 8)
    small = h.MoeStandIn(h.MOE_SMOKE, 4, torch.device("cpu"))
    assert small.w_gate_up.shape == (256, 128) and small.w1.shape == (4, 256, 128) and small.w2.shape == (4, 64, 256)
    rows = 32  # 4 local experts of 16, top-4: 32 * 4 / 16 = 8 rows each
    assert small.rows_per_expert(rows) == 8 and small.flops(rows) == (rows + 4 * 8) * 6 * 256 * 64
    x = torch.randn(rows, 256, dtype=torch.bfloat16)
    out = torch.full_like(x, float("nan"))
    small(x, out)
    assert torch.isfinite(out).all()


# ============================================================================ cost_model.py
def test_cost_model_calibrates_then_projects(tmp_path):
    out = tmp_path / "projection.csv"
    proc, _ = _run([str(BENCH / "cost_model.py"), "--csv", str(out)], timeout=120)
    text = proc.stdout
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "calibration: 12 of 12 within 15%: pass" in text
    assert text.index("calibration:") < text.index("PROJECTION (a model, not a measurement)")
    for line in ("gather padded", "reduce-scatter compact"):
        assert line in text
    projected = {(int(m.group(1)), int(m.group(2))) for m in re.finditer(r"^\s+(\d)\s+(\d+)\s+\d+\.\d+", text, re.M)}
    assert projected == {(cp, M) for cp in (2, 4, 8) for M in (2048, 8192, 32768)}, projected
    assert "goal (projected): at cp = 8, M = 8192" in text
    rows = csv_rows(out)
    assert len(rows) == 9 and "projection" in rows[0]["gpu"]


def test_cost_model_projects_each_mechanism_given():
    proc, _ = _run([str(BENCH / "cost_model.py"), "--slowdown-ce", "0.04", "--slowdown", "0.21"], timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "calibration: 12 of 12 within 15%: pass" in proc.stdout
    shares = dict(re.findall(r"^exposed share at cp = 8, M = 8192, mechanism (sm|ce) \(slowdown (\S+),", proc.stdout,
                             re.M))
    assert shares == {"sm": "0.21", "ce": "0.04"}, proc.stdout[-2000:]
    proc, _ = _run([str(BENCH / "cost_model.py"), "--mechanism", "ce"], timeout=120)
    assert proc.returncode == 0 and "calibration: 12 of 12 within 15%: pass" in proc.stdout
    assert re.search(r"slowdown_ce\s+0.2\s+docs/performance.md", proc.stdout), proc.stdout[:3000]
    assert "copying 20% (mechanism ce)" in proc.stdout
    assert re.search(r"^exposed share .* mechanism ce \(slowdown 0.20, the default, measured\)", proc.stdout, re.M)
    assert "mechanism sm (" not in proc.stdout


def test_cost_model_refuses_to_project_when_the_calibration_fails():
    proc, _ = _run([str(BENCH / "cost_model.py"), "--rate-gbs", "250"], timeout=120)
    assert proc.returncode != 0
    assert "calibration: 0 of 12 within 15%: FAIL" in proc.stdout, proc.stdout[-2000:]
    assert "PROJECTION (" not in proc.stdout and "goal (projected)" not in proc.stdout, proc.stdout[-2000:]


def test_the_model_reproduces_the_measured_collectives():
    cm = _load("cost_model")
    inp = cm.make_inputs(cm.parse_args([]))
    rows = cm.calibrate(inp, cm.sim.Moe())
    assert len(rows) == 12 and all(r["ok"] for r in rows), rows
    assert max(abs(r["ratio"] - 1) for r in rows) < 0.1


# ============================================================================ the model's arithmetic
GRID = [(cp, M) for cp in (2, 4, 8) for M in (2048, 8192, 32768)]


@pytest.mark.parametrize("cp,M", GRID)
def test_one_chunk_is_the_serialized_boundary(sim, cp, M):
    counts, moe, inp = sim.counts_for(cp, M), sim.Moe(), sim.Inputs()
    ser, one = sim.serialized(counts, moe, inp), sim.overlapped(counts, moe, inp, one_chunk=True)
    assert one.total == pytest.approx(ser.total, rel=1e-12) and one.chunks == 1


@pytest.mark.parametrize("cp,M", [(cp, M) for cp, M in GRID if M >= 8192])
@pytest.mark.parametrize("slowdown", [0.0, 0.2])
def test_overlapped_is_no_slower_where_chunks_are_compute_bound(sim, cp, M, slowdown):
    counts, moe, inp = sim.counts_for(cp, M), sim.Moe(), sim.Inputs(slowdown=slowdown)
    ser, ovl = sim.serialized(counts, moe, inp), sim.overlapped(counts, moe, inp)
    assert ovl.total <= ser.total and ovl.chunks > 1
    assert 0 < sim.exposed(ovl) < ser.comm


def test_weight_bound_chunks_can_make_overlap_lose(sim):
    """At M = 2048 on cp = 2 every chunk re-reads the rank's 128 experts' weights: cutting the consumer costs
    more than the communication it hides (the projection says 'serialized is faster' there)."""
    counts, moe, inp = sim.counts_for(2, 2048), sim.Moe(), sim.Inputs()
    assert sim.overlapped(counts, moe, inp).total > sim.serialized(counts, moe, inp).total


def test_exposed_communication_falls_with_more_chunks(sim):
    """With a free consumer call and no slowdown, smaller chunks hide more: the first peer chunk lands sooner
    and the last chunk's partials, pulled at the end, are fewer."""
    counts, moe = sim.counts_for(8, 32768), sim.Moe()
    inp = sim.Inputs(launches=0, slowdown=0.0, hbm_gbs=1e9)  # weights and launches cost nothing
    exposed = [sim.exposed(sim.overlapped(counts, moe, inp, one_chunk=True))]
    exposed += [sim.exposed(sim.overlapped(counts, moe, inp, min_rows=rows)) for rows in (32768, 16384, 4096, 1024)]
    assert all(a > b for a, b in zip(exposed, exposed[1:])), exposed
    assert exposed[0] == pytest.approx(sim.serialized(counts, moe, inp).comm, rel=1e-9)


def test_the_slowdown_costs_time_only_while_a_copy_runs(sim):
    assert sim._advance(1.0, 2.0, [], 0.5) == 3.0
    assert sim._advance(0.0, 1.0, [(0.0, 10.0)], 0.5) == pytest.approx(2.0)
    assert sim._advance(0.0, 2.0, [(0.0, 1.0), (0.5, 1.0)], 0.5) == pytest.approx(2.5)  # 0.5 in the window, 1.5 after
    assert sim._advance(5.0, 1.0, [(0.0, 4.0)], 0.9) == 6.0


def test_the_boundary_shape_arithmetic(sim):
    assert sim.counts_for(4, 8192) == [8192, 6554, 8192, 6554]
    assert sim.port_rows([8192, 6554]) == 8192  # cp 2: one slot each way
    assert sim.port_rows(sim.counts_for(8, 1000)) == 7000  # the big ranks' rows out to 7 peers
    moe = sim.Moe()
    assert moe.flops_per_row(8) == pytest.approx(9 / 8 * 6 * 7168 * 2048)
    assert dataclasses.replace(moe, shared_split=False).flops_per_row(8) == pytest.approx((1 + 1) * 6 * 7168 * 2048)
    assert 3000 < moe.balance_rows(8, sim.Inputs()) < 6000  # ~130 rows an expert at 600 TFLOP/s and 4.1 TB/s
