"""Every script in benchmarks/ runs at a tiny size on the CPU (gloo ranks), so none rots unnoticed. On
a GPU machine the same tiny runs take the GPU where a script does (stages.py, the one-GPU mode).

Scripts are found, not listed: every ``benchmarks/*.py`` with a ``__main__`` guard is a script (the
helper, ``harness.py``, has none). Each must have tiny-size arguments in ``SMOKE``
(run, exit status 0, outputs written, a CPU run says it is a smoke run and prints no verdicts) or be
in ``GPU_ONLY`` (on a machine without GPUs it must refuse within seconds, saying what it needs), so a
new script cannot be forgotten. Also: a bad output path fails before anything is measured, a failing
rank ends a spawned run at once with its traceback, and result rows carry no local path.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import bench_scripts
from bench_scripts import csv_rows

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if re.search(r"^if __name__ == .__main__.:", p.read_text(), re.M))
TIMEOUT_S = 240
NO_GPU = not __import__("torch").cuda.is_available()

# script -> list of (id, arguments, outputs under the run's directory); "{out}" is that directory
GS_ARGS = ["--cpu-ranks", "2", "--M", "8", "16", "--imbalance", "0.2", "--hidden", "128", "--rounds", "2",
           "--warmup", "1"]
SMOKE = {
    "gather_scatter.py": [("cpu", GS_ARGS + ["--csv", "{out}/gs.csv", "--json", "{out}/gs.json"], ["gs.csv", "gs.json"])],
    "layer_tail.py": [
        ("tail", ["--cpu-ranks", "2", "--M", "8", "--hidden", "128", "--rounds", "1", "--warmup", "0", "--layers", "1",
                  "--csv", "{out}/tail.csv", "--json", "{out}/tail.json"], ["tail.csv", "tail.json"]),
        ("boundary", ["--part", "boundary", "--cpu-ranks", "2", "--M", "8", "--hidden", "128", "--rounds", "1",
                      "--warmup", "0", "--layers", "1", "--csv", "{out}/boundary.csv"], ["boundary.csv"]),
    ],
    "stages.py": [("cpu", ["--M", "16", "--hidden", "256", "--cp", "3", "--rounds", "2", "--warmup", "1",
                           "--csv", "{out}/stages.csv", "--json", "{out}/stages.json"], ["stages.csv", "stages.json"]),
                  # an earlier commit's row kernels beside today's (here today's file: checked bitwise equal)
                  ("kernels-before", ["--M", "16", "--hidden", "256", "--rounds", "1", "--warmup", "0",
                                      "--kernels-before", "nsa_cp/rows/kernels/norm_rows.py", "--csv", "{out}/ab.csv"],
                   ["ab.csv"])],
    "sglang_boundary.py": [("cpu", ["--cpu-ranks", "2", "--M", "8", "--hidden", "128", "--rounds", "1", "--warmup", "0",
                                    "--compact", "--csv", "{out}/sb.csv", "--json", "{out}/sb.json"], ["sb.csv", "sb.json"])],
    "dispatch_overhead.py": [("cpu", ["--worlds", "2", "--M", "8", "--H", "64", "--calls", "20", "--rounds", "2"], [])],
    "readme_tables.py": [("committed-csv", ["benchmarks/results/2xH200.csv"], [])],
    "plot_busbw.py": [("committed-csv", ["benchmarks/results/2xH200.csv", "--out", "{out}/plot.png"], ["plot.png"])],
    # counts only (SGLang's own split, no timing): it needs sglang, which CI installs (.ci/install_sglang.sh)
    "sglang_padding.py": [("sglang-split", [], [])],
    # the same for vLLM's own PCP split: it needs vllm, which CI installs (.ci/install_vllm.sh)
    "vllm_padding.py": [("vllm-split", [], [])],
    "overlap.py": [("smoke", ["--smoke", "--rounds", "1", "--warmup", "0", "--csv", "{out}/overlap.csv"], ["overlap.csv"])],
    "cost_model.py": [("projection", ["--csv", "{out}/projection.csv"], ["projection.csv"])],
    "overlapped_boundary.py": [("cpu", ["--cpu-ranks", "2", "--M", "16", "--chunk-rows", "0", "5", "--rounds", "1",
                                        "--warmup", "0", "--csv", "{out}/ob.csv", "--json", "{out}/ob.json"],
                                ["ob.csv", "ob.json"])],
}
# scripts that time nothing, so print no smoke-run label
# cost_model.py prints a model's verdicts and times nothing
NOT_TIMED = ("readme_tables.py", "plot_busbw.py", "sglang_padding.py", "vllm_padding.py", "cost_model.py")
GPU_ONLY = {
    "host_overhead.py": "needs 1 CUDA GPU",
    "p2p_latency.py": "needs 2 CUDA GPU",
}


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if NO_GPU:  # as conftest.py: Triton kernels on CPU tensors run under its interpreter
        env.setdefault("TRITON_INTERPRET", "1")
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run(args, cwd=ROOT, timeout=TIMEOUT_S):
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=timeout)
    return proc, time.monotonic() - t0


def _no_verdicts(text: str) -> None:
    assert "smoke run" in text, "a CPU run must say it is a smoke run"
    assert not re.search(r"\b(MISS|target <=)", text), "a CPU run prints no pass/miss verdicts"


def test_every_script_has_a_smoke_run():
    assert SCRIPTS, "no benchmark scripts found"
    missing = [s for s in SCRIPTS if s not in SMOKE and s not in GPU_ONLY]
    assert not missing, f"benchmark scripts without a smoke run: {missing}; add tiny-size arguments to SMOKE"
    stale = [s for s in list(SMOKE) + list(GPU_ONLY) if s not in SCRIPTS]
    assert not stale, f"SMOKE / GPU_ONLY name scripts that are gone: {stale}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_answers_help_without_measuring(script):
    proc, took = _run([str(BENCH / script), "--help"], timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith("usage:"), f"{script} --help: rc {proc.returncode}\n" \
        f"{proc.stdout[-1500:]}\n{proc.stderr[-1500:]}"
    assert took < 30, f"{script} --help took {took:.0f} s: it measured something?"


PARTS = sorted(p.name for p in BENCH.glob("*.py") if p.name not in SCRIPTS)


@pytest.mark.parametrize("part", PARTS)
def test_a_part_run_as_a_script_names_the_script_to_run(part):
    proc, _ = _run([str(BENCH / part)], timeout=60)
    owner = "gather_scatter.py" if part == "harness.py" else next(s for s in SCRIPTS if part.startswith(s[:-3] + "_"))
    assert proc.returncode == 2 and f"run python benchmarks/{owner} --help" in proc.stderr, \
        f"{part}: rc {proc.returncode}\n{proc.stderr[-1500:]}"


@pytest.mark.parametrize("script,case", [(s, c) for s, cases in SMOKE.items() for c in cases],
                         ids=[f"{s}-{c[0]}" for s, cases in SMOKE.items() for c in cases])
def test_script_runs_at_a_tiny_size(script, case, tmp_path):
    _, args, outputs = case
    if script == "plot_busbw.py":
        pytest.importorskip("matplotlib", reason='plot_busbw.py needs matplotlib (pip install -e ".[bench]")')
    if script == "sglang_padding.py":
        pytest.importorskip("sglang", reason="sglang_padding.py needs sglang==0.5.23 (bash .ci/install_sglang.sh)")
    if script == "vllm_padding.py":
        import vllm_env

        vllm_env.require_vllm()
    argv = [str(BENCH / script)] + [a.replace("{out}", str(tmp_path)) for a in args]
    proc, took = _run(argv)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{script} exited {proc.returncode} after {took:.0f} s:\n{text[-4000:]}"
    for name in outputs:
        path = tmp_path / name
        assert path.is_file() and path.stat().st_size > 0, f"{script} did not write {name}:\n{text[-2000:]}"
    # a CPU run (every run here without a GPU; --cpu-ranks everywhere) is a smoke run; readme_tables and
    # plot_busbw read the committed GPU run
    if script not in NOT_TIMED and (NO_GPU or "--cpu-ranks" in args):
        _no_verdicts(text)
    for name in outputs:
        if name.endswith(".csv"):
            _check_tags(tmp_path / name)
        if name.endswith(".json"):
            rows = json.loads((tmp_path / name).read_text())["rows"]
            assert rows and all(str(ROOT) not in json.dumps(r) for r in rows), "a JSON row records the checkout's path"
    if "--kernels-before" in args:  # each row-kernel stage has its "before" row, checked and timed
        rows = csv_rows(tmp_path / "ab.csv")
        before = {r["stage"]: r["check"] for r in rows if r["method"].endswith("(before)")}
        assert before == {"add + RMSNorm into slot": "ok", "FP8 quantization": "ok",
                          "add + RMSNorm + FP8 into slot": "ok"}, before


def _check_tags(path: Path) -> None:
    """Versions and devices, never a local path."""
    rows = csv_rows(path)
    assert rows, f"{path.name}: no rows"
    for key in ("date", "gpu", "torch", "nsa_cp", "git_rev"):
        assert key in rows[0], f"{path.name}: no {key!r} tag"
    for key, value in rows[0].items():
        assert not str(value).startswith(("/", "~")) and str(ROOT) not in str(value), (
            f"{path.name}: tag {key}={value!r} is a local path")


@pytest.mark.parametrize("name", sorted(p.name for p in (BENCH / "results").glob("*.csv")))
def test_committed_results_carry_versions_and_devices_not_local_names(name):
    """The committed rows carry the tags env_tags writes (versions and devices): no local path, no host name."""
    path = BENCH / "results" / name
    _check_tags(path)
    rows = csv_rows(path)
    assert "host" not in rows[0] and not any("nsa_cp_path" in k for k in rows[0]), sorted(rows[0])
    assert not [(k, v) for r in rows for k, v in r.items() if str(v).startswith(("/", "~"))], f"{name}: a local path"
    js = path.with_suffix(".json")
    if js.exists():
        text = js.read_text()
        assert '"host"' not in text and '"/' not in text, f"{js.name}: a host name or a local path"


@pytest.mark.skipif(not NO_GPU, reason="checks the refusal on a machine without GPUs")
@pytest.mark.parametrize("script", sorted(GPU_ONLY))
def test_gpu_only_script_refuses_quickly_saying_why(script):
    proc, took = _run([str(BENCH / script)], timeout=120)
    assert proc.returncode != 0, f"{script} ran without a GPU: {proc.stdout[-1000:]}"
    assert GPU_ONLY[script] in proc.stderr + proc.stdout, proc.stderr[-2000:]
    assert took < 60, f"{script} took {took:.0f} s to refuse"
    helped, _ = _run([str(BENCH / script), "--help"], timeout=120)
    assert helped.returncode == 0, helped.stderr[-2000:]


@pytest.mark.parametrize("script,engine,hint", [("sglang_padding.py", "sglang", ".ci/install_sglang.sh"),
                                                ("vllm_padding.py", "vllm", ".ci/install_vllm.sh")])
def test_engine_script_without_its_engine_refuses_in_one_line(script, engine, hint):
    """As the GPU-only scripts refuse: status nonzero, one line saying what to install, no traceback. The
    engine is hidden from the script (an import of it fails) so that this runs where it is installed too."""
    hide = (f"import runpy, sys; sys.modules[{engine!r}] = None; sys.argv = [{str(BENCH / script)!r}]; "
            f"runpy.run_path(sys.argv[0], run_name='__main__')")
    proc, _ = _run(["-c", hide], timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len(lines) == 1 and hint in lines[0] and engine in lines[0], proc.stderr[-2000:]


@pytest.mark.parametrize("script,flag", [("gather_scatter.py", "--csv"), ("gather_scatter.py", "--json"),
                                         ("layer_tail.py", "--csv"), ("stages.py", "--json")])
def test_a_bad_output_path_fails_before_any_measurement(script, flag):
    bad = "/nonexistent/dir/x.csv"
    proc, took = _run([str(BENCH / script), "--cpu-ranks", "2", flag, bad] if script != "stages.py"
                      else [str(BENCH / script), flag, bad], timeout=120)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text[-2000:]
    assert bad in text and "does not exist" in text, text[-2000:]
    assert "check" not in proc.stdout and "counts [" not in proc.stdout, f"it measured first:\n{text[-2000:]}"
    assert took < 30, f"{took:.0f} s to refuse a bad path"


@pytest.mark.parametrize("rank0", ["barrier", "sleep"])
def test_a_failing_rank_ends_the_run_at_once_with_its_traceback(tmp_path, rank0):
    """Rank 1 raises while rank 0 waits in a barrier (a gloo timeout of 10 minutes; it fails a moment
    later, "connection reset") or sleeps for 10 minutes (it never notices): the parent stops rank 0 and
    exits with rank 1's traceback, the first failure, within seconds."""
    script = tmp_path / "failing.py"
    script.write_text(textwrap.dedent(f"""
        import datetime, socket, sys
        sys.path.insert(0, {str(BENCH)!r})
        import harness

        def worker(rank, world, port):
            import torch.distributed as dist
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{port}}", rank=rank, world_size=world,
                                    timeout=datetime.timedelta(minutes=10))
            if rank == 1:
                raise ValueError("boom from rank 1")
            if {rank0!r} == "sleep":
                import time
                time.sleep(600)
            dist.barrier()

        if __name__ == "__main__":
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            harness.run_main(lambda: harness.spawn(worker, 2, (port,), what="failing"))
    """))
    proc, took = _run([str(script)], cwd=tmp_path, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "rank 1 of 2 failed first" in proc.stderr and "ValueError: boom from rank 1" in proc.stderr, proc.stderr
    assert "During handling of the above exception" not in proc.stderr, proc.stderr
    assert took < 60, f"{took:.0f} s to end the run"


def test_a_mismatch_on_one_rank_aborts_every_rank(tmp_path):
    """harness.verdicts, the end of every script's correctness check: a method BAD on rank 1 alone ends the
    run with a CORRECTNESS FAILURE naming it; a method skipped on one rank is skipped on all."""
    script = tmp_path / "verdicts.py"
    script.write_text(textwrap.dedent(f"""
        import socket, sys
        sys.path.insert(0, {str(BENCH)!r})
        import torch
        import torch.distributed as dist
        import harness

        class Layout:
            per_rank_actual_token = (3, 2)

        def worker(rank, world, port, bad):
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{port}}", rank=rank, world_size=world)
            ctx = harness.Ctx(None, Layout(), None, rank, world, torch.device("cpu"), "gloo")
            status = torch.tensor([harness.OK, harness.SKIP if rank == 0 else harness.OK,
                                   harness.BAD if bad and rank == 1 else harness.OK])
            notes = {{"b": "why"}} if rank == 0 else {{"c": "rows differ"}} if bad else {{}}
            flags, skipped = harness.verdicts(ctx, ["a", "b", "c"], status, notes)
            assert flags == [harness.OK, harness.SKIP, harness.OK], flags
            want = {{"b": "why"}} if rank == 0 else {{"b": "NotImplementedError on another rank"}}
            assert skipped == want, skipped
            print("verdicts ok", flush=True)

        if __name__ == "__main__":
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            harness.run_main(lambda: harness.spawn(worker, 2, (port, sys.argv[1] == "bad"), what="verdicts"))
    """))
    good, _ = _run([str(script), "good"], cwd=tmp_path, timeout=120)
    assert good.returncode == 0 and good.stdout.count("verdicts ok") == 2, good.stdout + good.stderr
    bad, _ = _run([str(script), "bad"], cwd=tmp_path, timeout=120)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "CORRECTNESS FAILURE, counts [3, 2]: ['c']" in bad.stderr and "rows differ" in bad.stderr, bad.stderr
    assert "verdicts ok" not in bad.stdout, bad.stdout


def _load_benchmark(name):
    return bench_scripts.load(name)


@pytest.mark.parametrize("gpus,argv,want", [
    (0, [], ("cpu", 2)), (0, ["--cpu-ranks", "3"], ("cpu", 3)),
    (1, [], ("stages", 1)), (1, ["--shared-gpu", "4"], ("shared-gpu", 4)), (1, ["--cpu-ranks", "2"], ("cpu", 2)),
    (2, [], ("nccl", 2)), (8, ["--gpus", "1"], ("stages", 1)),
])
def test_gather_scatter_picks_its_mode_from_the_gpus(monkeypatch, gpus, argv, want):
    """The mode from the visible GPUs and the flags: no GPU, gloo ranks; one GPU (or --gpus 1), the stages
    (the README's line runs there too); --shared-gpu N, N ranks on one GPU; two GPUs or more, NCCL."""
    import torch

    gs = _load_benchmark("gather_scatter")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    args = gs.parse_args(argv)
    assert gs.choose_mode(args) == want
    if want[0] == "stages":  # the stage benchmark takes what gather_scatter hands it
        stages = _load_benchmark("stages")
        sargs = stages.parse_args(gs.stage_argv(gs.parse_args(["--M", "64", "--csv", "x.csv", "--rounds", "3"])))
        assert (sargs.M, sargs.csv, sargs.rounds) == ([64], "x.csv", 3)


def test_shared_gpu_refuses_without_a_gpu_or_past_8_ranks(monkeypatch):
    import torch

    gs = _load_benchmark("gather_scatter")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        gs.choose_mode(gs.parse_args(["--shared-gpu", "2"]))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(SystemExit, match="2 to 8"):
        gs.choose_mode(gs.parse_args(["--shared-gpu", "9"]))


def _owner(stem: str, scripts) -> str:
    """The script a module belongs to: itself, or the script ``<script>_<part>.py`` is a part of
    (the longest such name); "harness" for the harness every script shares; "" for none."""
    if stem in scripts or stem == "harness":
        return stem
    return max((s for s in scripts if stem.startswith(s + "_")), key=len, default="")


def test_no_benchmark_imports_another():
    """One file per measured thing over one harness: what every script shares lives in harness.py; a
    script's own parts (``<script>_<part>.py``, no ``__main__`` guard: its check, report, command line,
    a family of its rows) are imported by that script alone. So no script imports another, nor another's
    parts (gather_scatter.py runs stages.py, on one GPU, as a process of its own)."""
    scripts = {Path(s).stem for s in SCRIPTS}
    modules = {p.stem for p in BENCH.glob("*.py")}
    orphans = [m for m in sorted(modules) if not _owner(m, scripts)]
    assert not orphans, (f"benchmarks/ modules that are neither a script (a __main__ guard), harness.py, nor "
                         f"a part named <script>_<part>.py: {orphans}")
    found = []
    for path in sorted(BENCH.glob("*.py")):
        mine = _owner(path.stem, scripts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for n in names:
                other = _owner(n.split(".")[0], scripts) if n.split(".")[0] in modules else ""
                if other and other not in ("harness", mine):
                    found.append(f"{path.name}:{node.lineno} imports {n} (of {other}.py)")
    assert not found, found


def test_gather_scatter_on_one_gpu_runs_the_stages(monkeypatch, tmp_path, capfd):
    """The one-GPU mode hands its sizes, rounds and outputs to stages.py (here on the CPU: the child
    process sees no GPU) and exits with its status."""
    import torch

    gs = _load_benchmark("gather_scatter")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("PYTHONPATH", _env()["PYTHONPATH"])
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "stages.csv"
    gs.main(["--M", "16", "--hidden", "256", "--rounds", "1", "--warmup", "0", "--csv", str(out)])
    text = capfd.readouterr().out
    assert "one CUDA GPU: no link to time between ranks" in text and f"wrote {out}" in text, text[-2000:]
    rows = csv_rows(out)
    assert rows and {r["M"] for r in rows} == {"16"} and {r["rounds"] for r in rows} == {"1"}, rows[:2]


def test_the_committed_plot_is_made_for_a_person(monkeypatch, tmp_path):
    """plot_busbw.py on the committed 2x H200 CSV: one panel per operation, at most six lines each, a legend
    outside the data (below the axes), a title with the machine and the date; a CPU run's title says smoke."""
    pytest.importorskip("matplotlib", reason='the plot needs matplotlib (pip install -e ".[bench]")')
    import matplotlib.pyplot as plt

    monkeypatch.syspath_prepend(str(BENCH))
    import plot_busbw

    figures = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figures.append(fig))
    series, tags = plot_busbw.load(str(BENCH / "results" / "2xH200.csv"), 0.2)
    plot_busbw.plot(series, tags, 0.2, str(tmp_path / "plot.png"))
    (fig,) = figures
    axes = fig.get_axes()
    assert [ax.get_title() for ax in axes] == ["all-gather", "reduce-scatter"]
    for ax in axes:
        assert 2 <= len(ax.get_lines()) <= 6, (ax.get_title(), len(ax.get_lines()))
        legend = ax.get_legend()
        assert legend is not None and legend.get_bbox_to_anchor().y1 < ax.get_window_extent().y0 + 1
    title = fig._suptitle.get_text()
    assert "H200" in title and "2026-12-01" in title and "smoke" not in title
    assert "smoke" in plot_busbw.title_of({"backend": "gloo", "gpu": "cpu", "world": 2, "date": "2026-12-01"}, 0.2)
