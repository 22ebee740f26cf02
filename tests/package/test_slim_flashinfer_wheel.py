"""scripts/slim_flashinfer_wheel.py on a made-up wheel: it keeps every module, the norm's two sources and
csrc's top-level headers, drops csrc's other kernels and flashinfer.experimental's kernel files, and writes
a RECORD that lists exactly what the slim wheel holds, with the right hashes (pip installs from it)."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("slim_flashinfer_wheel", ROOT / "scripts" / "slim_flashinfer_wheel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


KEPT = ["flashinfer/__init__.py", "flashinfer/norm/__init__.py", "flashinfer/experimental/cake/support.py",
        "flashinfer/data/include/flashinfer/norm.cuh", "flashinfer/data/csrc/norm.cu",
        "flashinfer/data/csrc/flashinfer_norm_binding.cu", "flashinfer/data/csrc/tvm_ffi_utils.h",
        "flashinfer/data/cutlass/include/cute/tensor.hpp", "flashinfer_python-9.9.9.dist-info/METADATA"]
DROPPED = ["flashinfer/data/csrc/batch_prefill.cu", "flashinfer/data/csrc/cake_fmha/kernel.cu",
           "flashinfer/data/csrc/fused_moe/x.cuh", "flashinfer/experimental/cake/kernel.cubin",
           "flashinfer/experimental/cake/build.json"]


def test_slim_wheel_keeps_the_norm_and_a_true_record(tmp_path):
    wheel = tmp_path / "flashinfer_python-9.9.9-py3-none-any.whl"
    record = "flashinfer_python-9.9.9.dist-info/RECORD"
    with zipfile.ZipFile(wheel, "w") as z:
        for name in KEPT + DROPPED:
            z.writestr(name, f"contents of {name}")
        z.writestr(record, "stale\n")
    out = _script().slim(wheel, tmp_path / "slim")
    assert out.name == wheel.name
    with zipfile.ZipFile(out) as z:
        names = set(z.namelist())
        assert names == set(KEPT) | {record}, sorted(names ^ (set(KEPT) | {record}))
        rows = {line.split(",")[0]: line.split(",")[1:] for line in z.read(record).decode().splitlines()}
        assert set(rows) == names
        for name in KEPT:
            data = z.read(name)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert rows[name] == [f"sha256={digest}", str(len(data))], name
