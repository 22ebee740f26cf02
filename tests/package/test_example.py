"""examples/nsa_prefill.py on CPU (gloo): the CP prefill matches the one-process model.

One spawned world per world size runs every configuration through the example's ``main(argv)`` (a
torchrun launch costs seconds of interpreter start-up per run on a 2-core CI machine); one test launches
it with torchrun exactly as the docstring says. Deliberate faults (two KV rows swapped; the FP8 wire's
quantization left out of the reference) must fail the check, so the check itself is shown to bite. On a
GPU, the one-GPU mode (ranks sharing it) runs every method at cp = 3 and 8.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import os
import re
import subprocess
import sys

import pytest

from dist_harness import case_failures, run_world

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "nsa_prefill.py")
SHARED = "--enable-nsa-prefill-cp-shared-kv"

# case id -> (argv, expect_ok)
CASES_2 = {
    "even-split-nsa_cp": ([], True),
    "even-split-baseline": (["--comm", "baseline"], True),
    "shared-kv-nsa_cp": ([SHARED], True),
    "shared-kv-baseline-nsa-topk": ([SHARED, "--comm", "baseline", "--nsa-index-topk", "16"], True),
    "shared-kv-both-nsa-topk-chunked": ([SHARED, "--comm", "both", "--nsa-index-topk", "16", "--page-size", "16",
                                         "--query-chunk", "7"], True),
    # page 8, requests of 5 and 3 tokens: one page each, both dealt to block 0 -> rank 1 holds nothing
    "shared-kv-zero-token-rank": ([SHARED, "--seq-lens", "5,3", "--page-size", "8", "--comm", "both"], True),
    "shared-kv-compact": ([SHARED, "--compact", "--nsa-index-topk", "16"], True),
    "shared-kv-both-bf16": ([SHARED, "--comm", "both", "--dtype", "bfloat16", "--nsa-index-topk", "16"], True),
    "fault-kv-order": ([SHARED, "--fault", "kv_order"], False),
    # one rank's rows wrong (the last rank's first MoE row is its second): the check replays the reference's
    # top-k choices, and must still see it
    "fault-one-rank-row": ([SHARED, "--comm", "all", "--fault", "one_rank_row", "--nsa-index-topk", "16"], False),
    # every method, the padded ones with their padding rows masked and routed
    "shared-kv-all-moe-padding-both": ([SHARED, "--comm", "all", "--moe-padding", "both"], True),
    "even-split-all-routed": (["--comm", "all", "--moe-padding", "routed"], True),
    # the FP8 wire: fp32 is the check that tells the quantization (the fault leaves it out of the reference)
    "shared-kv-fp8-all": ([SHARED, "--comm", "all", "--quant", "fp8_e4m3_g128"], True),
    "even-split-fp8-bf16": (["--comm", "both", "--quant", "fp8_e4m3_g128", "--dtype", "bfloat16"], True),
    "shared-kv-zero-token-rank-fp8": ([SHARED, "--seq-lens", "5,3", "--page-size", "8", "--comm", "all",
                                       "--quant", "fp8_e4m3_g128"], True),
    "fault-fp8-ref-without-quant": ([SHARED, "--quant", "fp8_e4m3_g128", "--fault", "ref_without_quant"], False),
    # vLLM's power-of-two scales: the reference quantizes in the same format, and leaving it out must fail
    "shared-kv-fp8-ue8m0-all": ([SHARED, "--comm", "all", "--quant", "fp8_e4m3_g128_ue8m0"], True),
    "fault-fp8-ue8m0-ref-without-quant": ([SHARED, "--quant", "fp8_e4m3_g128_ue8m0", "--fault", "ref_without_quant"],
                                          False),
    # the overlapped boundary (overlapped_mlp): the MoE per landed slot, the shared expert in the final sum
    "shared-kv-overlap-and-nsa_cp": ([SHARED, "--comm", "nsa_cp_overlap,nsa_cp", "--nsa-index-topk", "16"], True),
    "shared-kv-overlap-bf16": ([SHARED, "--comm", "nsa_cp_overlap", "--dtype", "bfloat16"], True),
    "even-split-overlap-moe-padding-both-chunked": (["--comm", "nsa_cp_overlap", "--moe-padding", "both",
                                                     "--overlap-chunk-rows", "5"], True),
    "shared-kv-zero-token-rank-overlap-fp8": ([SHARED, "--seq-lens", "5,3", "--page-size", "8", "--comm",
                                               "nsa_cp_overlap", "--quant", "fp8_e4m3_g128"], True),
    # one rank's own first row wrong inside the overlapped call: the check must see it
    "fault-one-rank-row-overlap": ([SHARED, "--comm", "nsa_cp_overlap", "--fault", "one_rank_row",
                                    "--nsa-index-topk", "16"], False),
}
CASES_3 = {
    "even-split-both": (["--comm", "both"], True),
    "shared-kv-both-nsa-topk": ([SHARED, "--comm", "both", "--nsa-index-topk", "16", "--seq-lens", "37,64,21"], True),
    "shared-kv-fp8-compact": ([SHARED, "--comm", "nsa_cp_compact,baseline", "--quant", "fp8_e4m3_g128",
                               "--seq-lens", "37,64,21"], True),
    "shared-kv-overlap-fp8-chunked": ([SHARED, "--comm", "nsa_cp_overlap", "--quant", "fp8_e4m3_g128",
                                       "--seq-lens", "37,64,21", "--overlap-chunk-rows", "9"], True),
}
# cp = 4 and 8: the worlds the one-GPU mode runs on CUDA; every method, both splits (cp = 8: 16 experts)
CASES_4 = {
    "even-split-all": (["--comm", "all"], True),
    "shared-kv-all-moe-padding-both": ([SHARED, "--comm", "all", "--moe-padding", "both"], True),
    "shared-kv-fp8": ([SHARED, "--comm", "all", "--quant", "fp8_e4m3_g128"], True),
    "shared-kv-overlap": ([SHARED, "--comm", "nsa_cp_overlap,baseline"], True),
}
CASES_8 = {
    "even-split-all": (["--comm", "all", "--experts", "16"], True),
    "shared-kv-all-moe-padding-both": ([SHARED, "--comm", "all", "--moe-padding", "both", "--experts", "16"], True),
    "shared-kv-fp8": ([SHARED, "--comm", "nsa_cp,nsa_cp_compact", "--quant", "fp8_e4m3_g128", "--experts", "16"], True),
    "even-split-overlap": (["--comm", "nsa_cp_overlap", "--moe-padding", "both", "--experts", "16"], True),
}
_ERR = re.compile(r"^max_rel_err=(\S+) tol=(\S+) ok=(\w+)", re.M)


def _load_example():
    spec = importlib.util.spec_from_file_location("nsa_prefill_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def _run_cases(rank, world_size, payload):
    import torch

    torch.set_num_threads(1)  # ranks share CI's 2 cores; more threads per rank only contend
    example = _load_example()
    results = {}
    for case_id, (argv, expect_ok) in payload.items():
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                rc = example.main(["--device", "cpu", *argv])
        except BaseException as e:  # noqa: BLE001  reported as this case's failure
            results[case_id] = f"raised {type(e).__name__}: {e}\n{out.getvalue()}"
            continue
        text = out.getvalue()
        problems = []
        if rc != (0 if expect_ok else 1):
            problems.append(f"exit code {rc}, expected {0 if expect_ok else 1}")
        if rank == 0:
            match = _ERR.search(text)
            if match is None:
                problems.append("no 'max_rel_err=... tol=... ok=...' line")
            else:
                err, tol = float(match.group(1)), float(match.group(2))
                if expect_ok and not err <= tol:
                    problems.append(f"max_rel_err {err} above tol {tol}")
                if not expect_ok and not err > 100 * tol:
                    problems.append(f"the fault gave max_rel_err {err}, not clearly above tol {tol}")
        results[case_id] = None if not problems else "; ".join(problems) + "\n" + text
    return results


WORLDS = {2: CASES_2, 3: CASES_3, 4: CASES_4, 8: CASES_8}


@functools.lru_cache(maxsize=None)
def _world(world: int):
    """Every case of one world size, run by one spawned world (the first test of that size spawns it)."""
    return run_world(world, "gloo", _run_cases, WORLDS[world], timeout_s=300)


def _world_test(world: int):
    """``test_example_world<N>[case]``: the case passed on every rank of the world of size N."""

    @pytest.mark.parametrize("case_id", list(WORLDS[world]))
    def test(case_id):
        errors = case_failures(_world(world), case_id)
        assert not errors, "\n".join(errors)

    test.__name__ = test.__qualname__ = f"test_example_world{world}"
    return test


test_example_world2, test_example_world3, test_example_world4, test_example_world8 = map(_world_test, WORLDS)


def test_methods_from_the_flags():
    """--comm and --moe-padding -> the methods run: aliases, order, only padded gathers run both ways."""
    example = _load_example()

    def labels(argv, has_padding=lambda compact: not compact):
        return [(m.label, m.kind, m.compact, m.route_padding)
                for m in example.parse_methods(example.parse_args(["--device", "cpu", *argv]), has_padding)]

    assert labels(["--comm", "both"]) == [("nsa_cp", "nsa_cp", False, False), ("baseline", "baseline", False, False)]
    assert labels(["--comm", "all", "--moe-padding", "both"]) == [
        ("nsa_cp/masked", "nsa_cp", False, False), ("nsa_cp/routed", "nsa_cp", False, True),
        ("nsa_cp_compact", "nsa_cp", True, False),
        ("baseline/masked", "baseline", False, False), ("baseline/routed", "baseline", False, True),
    ]
    # --compact makes "nsa_cp" compact; a repeated name runs once; no padding anywhere: one run each
    assert labels(["--comm", "nsa_cp,baseline,nsa_cp", "--compact", "--moe-padding", "both"],
                  has_padding=lambda compact: False) == [("nsa_cp", "nsa_cp", True, False),
                                                         ("baseline", "baseline", False, False)]
    assert labels(["--comm", "nsa_cp_compact,nsa_cp", "--moe-padding", "routed"]) == [
        ("nsa_cp_compact", "nsa_cp", True, True), ("nsa_cp", "nsa_cp", False, True)]
    # the overlapped boundary's MoE rows are compact: padding rows only where the token split adds them
    assert labels(["--comm", "nsa_cp_overlap,nsa_cp", "--moe-padding", "both"]) == [
        ("nsa_cp_overlap", "nsa_cp", True, False), ("nsa_cp/masked", "nsa_cp", False, False),
        ("nsa_cp/routed", "nsa_cp", False, True)]
    assert [m.overlapped for m in example.parse_methods(
        example.parse_args(["--device", "cpu", "--comm", "nsa_cp_overlap,nsa_cp_compact"]), lambda c: True)] == [
        True, False]
    with pytest.raises(SystemExit, match="--comm: expected a comma list"):
        labels(["--comm", "nsa_cp,nccl"])


def test_example_under_torchrun():
    """The documented launch: torchrun, 2 ranks, gloo, the shared-KV split, exit 0 and the error line."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         EXAMPLE, "--device", "cpu", SHARED, "--comm", "both"],
        capture_output=True, text=True, timeout=180, env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    match = _ERR.search(proc.stdout)
    assert match is not None, proc.stdout + proc.stderr
    assert float(match.group(1)) <= float(match.group(2))
    assert "nsa_cp: max_rel_err=" in proc.stdout and "baseline: max_rel_err=" in proc.stdout


def _p2p_reason():
    try:
        import nsa_cp.rows._native as native

        return None if native.available() else native.unavailable_reason()
    except Exception as e:  # noqa: BLE001  reported as the skip reason
        return f"nsa_cp.rows._native: {e}"


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU (ranks sharing it)")
@pytest.mark.parametrize("cp", [3, 8])
def test_example_one_gpu(cp):
    """The one-GPU mode: cp ranks on cuda:0 (gloo, nsa_cp over P2P/CUDA IPC, the baseline over gloo on host
    copies), every method, both splits and the FP8 wire in one sweep; each run checked against the model
    without CP."""
    reason = _p2p_reason()
    if reason:
        pytest.skip(f"the one-GPU mode needs nsa_cp's P2P transport: {reason}")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0],
               NSA_CP_P2P_TIMEOUT_MS="60000",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    common = ["--device", "cuda", "--comm", "all", "--hidden", "256", "--layers", "2", "--heads", "4",
              "--experts", "24", "--topk", "2", "--moe-intermediate", "256", "--shared-intermediate", "256",
              "--seq-lens", "300x4,900", "--page-size", "64", "--iters", "0"]
    runs = [[], [SHARED, "--moe-padding", "both"], [SHARED, "--quant", "fp8_e4m3_g128", "--dtype", "float32"],
            [SHARED, "--comm", "nsa_cp_overlap,nsa_cp", "--overlap-chunk-rows", "200"]]
    argv = common + [t for run in runs for t in ["::", *run]]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(cp),
                           os.path.join(ROOT, "examples", "nsa_prefill_sweep.py"), *argv],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    assert "one-GPU mode" in proc.stdout, proc.stdout
    for i in range(len(runs)):
        assert f"sweep: run {i} rc=0" in proc.stdout, proc.stdout
    assert proc.stdout.count("baseline: max_rel_err=") + proc.stdout.count("baseline/masked: max_rel_err=") == 3
    assert proc.stdout.count("nsa_cp_overlap: max_rel_err=") == 1, proc.stdout


@pytest.mark.skipif(
    not (__import__("torch").cuda.is_available() and __import__("torch").cuda.device_count() >= 2),
    reason="needs 2 CUDA GPUs (NCCL, P2P where init_p2p works)",
)
@pytest.mark.parametrize("split", ["even", "shared-kv"])
def test_example_cuda_small(split):
    """The CUDA path (bf16, NCCL/P2P, both methods, timing) on a small model: exit 0, both checked."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    argv = ["--device", "cuda", "--comm", "both", "--hidden", "1024", "--layers", "2", "--heads", "16",
            "--experts", "8", "--topk", "2", "--moe-intermediate", "512", "--shared-intermediate", "512",
            "--seq-lens", "700x8,3000", "--page-size", "64", "--nsa-index-topk", "256", "--iters", "2", "--warmup", "1"]
    if split == "shared-kv":
        argv.append(SHARED)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           EXAMPLE, *argv], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "nsa_cp: max_rel_err=" in proc.stdout and "baseline: max_rel_err=" in proc.stdout, proc.stdout
    assert "baseline over nsa_cp:" in proc.stdout, proc.stdout
