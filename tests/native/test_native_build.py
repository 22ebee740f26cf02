"""The build: setup.py's helpers (versions, archs, nvcc and cmake discovery, the build plan) and, where
nvcc is installed, ptxas's report on the kernels. No GPU needed."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[2]


# ---- setup.py helpers -------------------------------------------------------------------------------




def test_base_version_is_read_without_importing(setup_py, tmp_path):
    import nsa_cp

    assert setup_py.read_base_version(ROOT) == nsa_cp.__version__.split("+")[0]  # installed: +cuXX from setup.py
    (tmp_path / "nsa_cp").mkdir()
    (tmp_path / "nsa_cp" / "__init__.py").write_text('"""doc"""\nimport not_a_module\n__version__ = "2.3.4"\n')
    assert setup_py.read_base_version(tmp_path) == "2.3.4"
    (tmp_path / "nsa_cp" / "__init__.py").write_text("x = 1\n")
    with pytest.raises(setup_py.BuildConfigError, match="__version__"):
        setup_py.read_base_version(tmp_path)


def test_full_version(setup_py):
    assert setup_py.full_version("0.1.0", None) == "0.1.0"
    assert setup_py.full_version("0.1.0", 13) == "0.1.0+cu13"
    assert setup_py.full_version("0.1.0", 12) == "0.1.0+cu12"
    assert setup_py.full_version("0.1.0+dev", 13) == "0.1.0+dev.cu13"
    # the archs ride in the local version, so the wheel's file name says which GPUs it has code for
    assert setup_py.full_version("0.1.0", 13, ["90a", "100a"]) == "0.1.0+cu13.sm90a.sm100a"
    assert setup_py.full_version("0.1.0", None, ["90a"]) == "0.1.0"
    packaging_version = pytest.importorskip("packaging.version")
    assert str(packaging_version.Version(setup_py.full_version("0.1.0", 13))) == "0.1.0+cu13"
    full = setup_py.full_version("0.1.0", 13, ["90a", "100a", "120f"])
    assert str(packaging_version.Version(full)) == full == "0.1.0+cu13.sm90a.sm100a.sm120f"


def test_old_setuptools_is_a_clear_error(setup_py):
    for ok in ("77.0.3", "84.2.1", "100.0"):
        setup_py.check_setuptools(ok)
    with pytest.raises(setup_py.BuildConfigError) as info:
        setup_py.check_setuptools("69.5.1")
    assert "setuptools 69.5.1 is too old" in str(info.value) and "setuptools>=77" in str(info.value)


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("90a", ["90a"]),
        ("90a;100a", ["90a", "100a"]),
        (" 90a ; 100a ;", ["90a", "100a"]),
        ("90a,100a 120a", ["90a", "100a", "120a"]),
        ("sm_90a;compute_100a", ["90a", "100a"]),
        ("9.0a;10.0a", ["90a", "100a"]),
        ("90;90a;90", ["90", "90a"]),
        ("100f", ["100f"]),
    ],
)
def test_parse_archs(setup_py, spec, expected):
    assert setup_py.parse_archs(spec) == expected


@pytest.mark.parametrize("spec", ["", " ; ", "hopper", "90b", "sm90a", "90a;x"])
def test_parse_archs_rejects(setup_py, spec):
    with pytest.raises(setup_py.BuildConfigError, match="NSA_CP_CUDA_ARCHS"):
        setup_py.parse_archs(spec)


NVCC_13_LIST = "compute_75\ncompute_80\ncompute_90\ncompute_100\ncompute_110\ncompute_120\n"


def test_default_and_resolved_archs(setup_py):
    supported = setup_py.parse_gpu_arch_list(NVCC_13_LIST)
    assert supported == ["compute_75", "compute_80", "compute_90", "compute_100", "compute_110", "compute_120"]
    assert setup_py.default_archs(supported) == ["90a", "100a"]
    assert setup_py.default_archs(["compute_80", "compute_90"]) == ["90a"]
    assert setup_py.default_archs(["compute_90", "compute_100a"]) == ["90a", "100a"]
    assert setup_py.default_archs([]) == ["90a"]
    assert setup_py.resolve_archs({}, supported) == ["90a", "100a"]
    assert setup_py.resolve_archs({"NSA_CP_CUDA_ARCHS": "90a"}, supported) == ["90a"]
    assert setup_py.resolve_archs({"NSA_CP_CUDA_ARCHS": "  "}, ["compute_90"]) == ["90a"]
    with pytest.raises(setup_py.BuildConfigError, match="cannot build '100a'"):
        setup_py.resolve_archs({"NSA_CP_CUDA_ARCHS": "90a;100a"}, ["compute_80", "compute_90"])
    # no list from nvcc (old nvcc): trust the user
    assert setup_py.resolve_archs({"NSA_CP_CUDA_ARCHS": "100a"}, []) == ["100a"]


def test_parse_tool_versions(setup_py):
    text = "nvcc: NVIDIA (R) Cuda compiler driver\nCuda compilation tools, release 13.0, V13.0.88\n"
    assert setup_py.parse_nvcc_version(text) == (13, 0)
    with pytest.raises(setup_py.BuildConfigError):
        setup_py.parse_nvcc_version("something else")
    assert setup_py.parse_cmake_version("cmake version 3.25.1\n\nCMake suite") == (3, 25)


def test_build_cuda_decision(setup_py):
    nvcc = "/opt/cuda/bin/nvcc"
    assert setup_py.build_cuda_decision({}, nvcc) == (True, "nvcc found")
    assert setup_py.build_cuda_decision({"NSA_CP_BUILD_CUDA": "auto"}, nvcc)[0] is True
    built, why = setup_py.build_cuda_decision({}, None)
    assert built is False and "nvcc not found" in why
    assert setup_py.build_cuda_decision({"NSA_CP_BUILD_CUDA": "0"}, nvcc) == (False, "NSA_CP_BUILD_CUDA=0")
    assert setup_py.build_cuda_decision({"NSA_CP_BUILD_CUDA": "1"}, nvcc) == (True, "NSA_CP_BUILD_CUDA=1")
    with pytest.raises(setup_py.BuildConfigError, match="NSA_CP_BUILD_CUDA=1 but nvcc was not found"):
        setup_py.build_cuda_decision({"NSA_CP_BUILD_CUDA": "1"}, None)
    with pytest.raises(setup_py.BuildConfigError, match="auto, 0 or 1"):
        setup_py.build_cuda_decision({"NSA_CP_BUILD_CUDA": "yes"}, nvcc)


def _fake_cuda(tmp_path: Path, release: str = "12.8", archs: str = NVCC_13_LIST) -> Path:
    home = tmp_path / "cuda"
    (home / "bin").mkdir(parents=True)
    nvcc = home / "bin" / "nvcc"
    nvcc.write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        f'  --version) echo "Cuda compilation tools, release {release}, V{release}.1" ;;\n'
        f"  --list-gpu-arch) printf '{archs.replace(chr(10), chr(92) + 'n')}' ;;\n"
        "  *) exit 1 ;;\n"
        "esac\n"
    )
    nvcc.chmod(0o755)
    return home


def test_find_nvcc_prefers_cuda_home(setup_py, tmp_path):
    home = _fake_cuda(tmp_path)
    assert setup_py.find_nvcc({"CUDA_HOME": str(home)}) == str(home / "bin" / "nvcc")
    assert setup_py.find_nvcc({"CUDA_PATH": str(home)}) == str(home / "bin" / "nvcc")
    # a CUDA_HOME without nvcc falls through to the next places
    found = setup_py.find_nvcc({"CUDA_HOME": str(tmp_path / "none"), "PATH": str(home / "bin")})
    assert found is not None and found.endswith("nvcc")


def test_build_plan_with_cuda(setup_py, tmp_path):
    home = _fake_cuda(tmp_path, release="12.8")
    plan = setup_py.BuildPlan({"CUDA_HOME": str(home), "NSA_CP_BUILD_CUDA": "1"})
    assert plan.build_cuda and plan.nvcc == str(home / "bin" / "nvcc")
    assert plan.cuda_version == (12, 8)
    assert plan.archs == ["90a", "100a"]
    assert plan.version == setup_py.read_base_version() + "+cu12.sm90a.sm100a"
    summary = plan.summary()
    assert "CUDA 12.8" in summary and "90a;100a" in summary and "nsa_cp._C" in summary
    kwargs = setup_py.setup_kwargs(plan)
    assert kwargs["version"] == plan.version
    assert [e.name for e in kwargs["ext_modules"]] == ["nsa_cp._C"]
    assert "build_ext" in kwargs["cmdclass"]

    plan = setup_py.BuildPlan({"CUDA_HOME": str(home), "NSA_CP_CUDA_ARCHS": "90a"})
    assert plan.archs == ["90a"] and plan.version.endswith("+cu12.sm90a")


def test_build_plan_pure(setup_py, tmp_path):
    home = _fake_cuda(tmp_path)
    plan = setup_py.BuildPlan({"CUDA_HOME": str(home), "NSA_CP_BUILD_CUDA": "0"})
    assert not plan.build_cuda and plan.archs == []
    assert plan.version == setup_py.read_base_version()
    assert "skipped: NSA_CP_BUILD_CUDA=0" in plan.summary()
    kwargs = setup_py.setup_kwargs(plan)
    assert "ext_modules" not in kwargs  # -> py3-none-any wheel
    assert sorted(kwargs["cmdclass"]) == ["develop", "editable_wheel"]  # in-tree installs drop an old _C
    # a forced build with nvcc nowhere (PATH empty, CUDA_HOME bogus) is a clear error
    if not Path("/usr/local/cuda/bin/nvcc").exists():
        with pytest.raises(setup_py.BuildConfigError, match="nvcc was not found"):
            setup_py.BuildPlan({"CUDA_HOME": str(tmp_path / "none"), "PATH": "", "NSA_CP_BUILD_CUDA": "1"})


def test_setup_py_exits_with_clear_message(tmp_path):
    """Running setup.py with a bad setting fails before building anything, saying what to change."""
    env = {"PATH": "/usr/bin:/bin", "NSA_CP_BUILD_CUDA": "maybe"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "setup.py"), "--version"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert proc.returncode != 0
    assert "NSA_CP_BUILD_CUDA must be auto, 0 or 1" in proc.stderr


def _nvcc():
    import os

    found = shutil.which("nvcc")
    if found:
        return found
    default = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "nvcc"
    return str(default) if default.exists() else None


@pytest.mark.skipif(_nvcc() is None, reason="needs nvcc (the CUDA toolkit), not a GPU")
@pytest.mark.parametrize("source", ["p2p_gather.cu", "p2p_reduce_scatter.cu", "barrier.cu"])
def test_kernels_keep_everything_in_registers(source, tmp_path):
    """ptxas's report for sm_90a: no kernel has a stack frame or spills (the GPU test
    test_gpu_kernel_info checks the loaded module; this catches it on a machine without a GPU)."""
    proc = subprocess.run(
        [_nvcc(), "-arch=sm_90a", "-O3", "-std=c++17", "-Xptxas", "-v", "-c", str(ROOT / "csrc" / source),
         "-o", str(tmp_path / "k.o")],
        capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    frames = [line.strip() for line in proc.stderr.splitlines() if "stack frame" in line]
    assert frames, proc.stderr[-3000:]
    assert all(line.startswith("0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads") for line in frames), frames
