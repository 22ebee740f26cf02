"""The row kernel compiles for sm_90 on this machine (no GPU needed: Triton's bundled ptxas), in each stage and
with each rounding, and the GPU's casts (``CAST_ROUNDS``) leave fewer instructions than the interpreter's
integer rounding: a compile error in the GPU-only branch shows here, not first on a GPU. Runs
scripts/norm_rows_sass.py in a process of its own (the tests decorate the kernels under TRITON_INTERPRET=1)."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_casts_compile_and_cut_instructions():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "norm_rows_sass.py")], env=env, capture_output=True,
                          text=True, timeout=300)
    if proc.returncode != 0 and "cuobjdump" in proc.stderr and "No such file" in proc.stderr:
        pytest.skip("this Triton carries no NVIDIA tools (cuobjdump)")
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = {}
    for stage, cast, n in re.findall(r"^\| ([a-z0-9+ ]+) \| (True|False) \| (\d+) \|", proc.stdout, re.M):
        counts[stage, cast == "True"] = int(n)
    stages = {stage for stage, _ in counts}
    assert stages == {"norm", "norm+fp8", "fp8 quant"}, proc.stdout
    for stage in stages:
        assert 0 < counts[stage, True] < counts[stage, False], (stage, counts)
