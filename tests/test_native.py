"""CPU tests of the native side: nsa_cp._native, nsa_cp._C without a GPU, and setup.py's helpers.

Nothing here needs a GPU. Tests that need the built module skip when it is absent (pure install);
tests that expect "no GPU" behaviour skip on a machine that has one.
"""

from __future__ import annotations

import importlib
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nsa_cp import _native

ROOT = Path(__file__).resolve().parents[1]


# ---- nsa_cp._native ---------------------------------------------------------------------------------


@pytest.fixture
def fresh_native():
    _native._reset_for_tests()
    yield _native
    _native._reset_for_tests()


def test_native_answers_without_raising(fresh_native):
    mod = fresh_native.load()
    assert mod is None or hasattr(mod, "device_count")
    ok = fresh_native.available()
    assert isinstance(ok, bool)
    reason = fresh_native.unavailable_reason()
    assert isinstance(reason, str)
    if ok:
        assert reason == ""
    else:
        assert reason.strip(), "unavailable_reason() must say why"


def _fake_import(monkeypatch, result):
    real = importlib.import_module

    def fake(name, *args, **kwargs):
        if name != "nsa_cp._C":
            return real(name, *args, **kwargs)
        if isinstance(result, BaseException):
            raise result
        return result

    monkeypatch.setattr(importlib, "import_module", fake)


def test_reason_when_not_built(fresh_native, monkeypatch):
    _fake_import(monkeypatch, ModuleNotFoundError("No module named 'nsa_cp._C'", name="nsa_cp._C"))
    assert fresh_native.load() is None
    assert fresh_native.available() is False
    assert "nsa_cp._C was not built (pure Python install" in fresh_native.unavailable_reason()


@pytest.mark.parametrize(
    "error",
    [ImportError("_C.so: undefined symbol: foo"), OSError("libstdc++.so.6: version not found"), RuntimeError("init")],
)
def test_reason_when_import_fails(fresh_native, monkeypatch, error):
    _fake_import(monkeypatch, error)
    assert fresh_native.load() is None
    assert not fresh_native.available()
    reason = fresh_native.unavailable_reason()
    assert reason.startswith("nsa_cp._C failed to import") and str(error) in reason


class _FakeC:
    def __init__(self, count=0, status="cudaErrorNoDevice: no CUDA-capable device is detected", raises=None):
        self._count, self._status, self._raises = count, status, raises

    def device_count(self):
        if self._raises:
            raise self._raises
        return self._count

    def device_status(self):
        return self._status


def test_reason_without_device(fresh_native, monkeypatch):
    _fake_import(monkeypatch, _FakeC(0))
    assert fresh_native.load() is not None
    assert fresh_native.available() is False
    reason = fresh_native.unavailable_reason()
    assert reason.startswith("no CUDA device visible") and "cudaErrorNoDevice" in reason


def test_reason_when_device_query_fails(fresh_native, monkeypatch):
    _fake_import(monkeypatch, _FakeC(raises=RuntimeError("device_count: cudaGetDeviceCount failed: boom")))
    assert fresh_native.available() is False
    assert "boom" in fresh_native.unavailable_reason()


def test_available_with_a_device(fresh_native, monkeypatch):
    _fake_import(monkeypatch, _FakeC(2, "ok"))
    assert fresh_native.available() is True
    assert fresh_native.unavailable_reason() == ""


def test_device_reason_when_the_kernels_do_not_load_there(fresh_native, monkeypatch):
    """A GPU the build has no machine code or PTX for (e.g. an A100 for a 90a build): the kernels fail
    to load there, which is said once per device and cached, before any launch could fail."""
    _fake_import(monkeypatch, _FakeC(2, "ok"))
    tried = []

    def no_image(index):
        tried.append(index)
        raise RuntimeError("kernel_info: cudaFuncGetAttributes failed: cudaErrorNoKernelImageForDevice: no kernel image")

    monkeypatch.setattr(fresh_native, "_load_kernels_on", no_image)
    reason = fresh_native.device_unsupported_reason(1)
    assert reason.startswith("nsa_cp._C (built for ?) has no kernels for cuda:1") and "NoKernelImage" in reason
    assert fresh_native.device_unsupported_reason(1) == reason and tried == [1]  # cached
    monkeypatch.setattr(fresh_native, "_load_kernels_on", lambda index: tried.append(index))
    assert fresh_native.device_unsupported_reason(0) == "" and tried == [1, 0]


def test_device_reason_without_the_module(fresh_native, monkeypatch):
    _fake_import(monkeypatch, ModuleNotFoundError("x", name="nsa_cp._C"))
    assert "nsa_cp._C was not built" in fresh_native.device_unsupported_reason(0)


def test_native_logs_instead_of_printing(fresh_native, monkeypatch, caplog, capsys):
    _fake_import(monkeypatch, ModuleNotFoundError("x", name="nsa_cp._C"))
    with caplog.at_level("DEBUG", logger="nsa_cp"):
        fresh_native.available()
    assert capsys.readouterr() == ("", "")
    assert any("not built" in rec.getMessage() for rec in caplog.records)


# ---- nsa_cp._C without a GPU ------------------------------------------------------------------------

_C = _native.load()
needs_C = pytest.mark.skipif(_C is None, reason=f"nsa_cp._C not importable: {_native._import_reason}")
_NO_GPU = _C is not None and _C.device_count() == 0
needs_no_gpu = pytest.mark.skipif(not _NO_GPU, reason="a CUDA device is visible (or _C is missing)")

FUNCTIONS = [
    "device_count",
    "device_status",
    "can_access_peer",
    "enable_peer_access",
    "runtime_version",
    "driver_version",
    "kernel_info",
    "alloc_host_mapped_u32",
    "free_host_mapped",
    "read_u32",
    "write_u32",
    "barrier",
    "p2p_gather",
    "p2p_reduce_scatter",
    "pack_rows",
    "padded_compact",
]


@needs_C
def test_module_surface():
    for name in FUNCTIONS:
        fn = getattr(_C, name)
        assert callable(fn) and fn.__doc__, name
    assert _C.MAX_WORLD == 8 and _C.MAX_BLOCKS == 65535 and _C.THREADS_PER_BLOCK == 512
    assert (_C.ERR_NONE, _C.ERR_TIMEOUT, _C.ERR_BAD_DEVICE_ARG) == (0, 1, 2)
    assert (_C.DTYPE_BF16, _C.DTYPE_FP16, _C.DTYPE_FP32) == (0, 1, 2)
    assert "90a" in _C.CUDA_ARCHS.split(";")
    assert _C.runtime_version() >= 12000
    # argument names are part of the contract (keyword calls from nsa_cp.transport)
    assert "num_blocks" in _C.p2p_gather.__doc__ and "timeout_ns" in _C.barrier.__doc__


@needs_C
def test_module_links_no_cuda_driver_or_shared_runtime():
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("readelf not installed")
    out = subprocess.run([readelf, "-d", _C.__file__], check=True, capture_output=True, text=True).stdout
    needed = [line for line in out.splitlines() if "(NEEDED)" in line]
    assert needed
    assert not [line for line in needed if "libcuda" in line or "libcudart" in line], needed


@needs_C
def test_device_count_is_a_clean_int():
    count = _C.device_count()
    assert isinstance(count, int) and count >= 0
    status = _C.device_status()
    assert (status == "ok") == (count > 0), status


@needs_no_gpu
def test_without_gpu_queries_fail_cleanly():
    assert _C.device_count() == 0
    assert _C.device_status().startswith("cudaError")
    assert _C.driver_version() >= 0
    for call in (lambda: _C.alloc_host_mapped_u32(4), lambda: _C.can_access_peer(0, 1),
                 lambda: _C.enable_peer_access(0, 1), _C.kernel_info):
        with pytest.raises(RuntimeError, match="cudaError"):
            call()


@needs_C
def test_host_mapped_checks_need_no_gpu():
    with pytest.raises(ValueError, match="n must be"):
        _C.alloc_host_mapped_u32(0)
    for call in (lambda: _C.read_u32(12345, 0), lambda: _C.write_u32(12345, 0, 1), lambda: _C.free_host_mapped(12345)):
        with pytest.raises(ValueError, match="not an allocation"):
            call()
    with pytest.raises(ValueError, match=">= 0"):
        _C.can_access_peer(-1, 0)
    with pytest.raises(ValueError, match=">= 0"):
        _C.enable_peer_access(0, -1)
    assert _C.can_access_peer(3, 3) is True  # a device reaches itself: no CUDA call
    assert _C.enable_peer_access(3, 3) is None  # nothing to enable


# Valid-looking arguments (fake addresses: validation never dereferences them).
P = 0x7F0000000000  # 16-byte aligned dummy device address


def _barrier_args(**kw):
    args = dict(pads=P, rank=0, world=2, channel=0, phase=0, seq=P, advance=False, timeout_ns=0, err=P, stream=0)
    args.update(kw)
    return args


def _gather_args(**kw):
    args = dict(
        src=P, src_row_stride_bytes=256, row_bytes=256, bufs=P, counts=P, offsets=P, max_rank_len=16,
        compact=False, rank=0, world=2, pads=P, channel=0, seq=P, arrive=P, timeout_ns=0, err=P,
        num_blocks=4, stream=0, buffer=0, state=P,
    )
    args.update(kw)
    return args


def _reduce_args(**kw):
    args = dict(
        out=P, out_row_stride_bytes=256, bufs=P, counts=P, offsets=P, max_rank_len=16, compact=False,
        hidden=128, dtype=0, rank=0, world=2, pads=P, channel=0, seq=P, arrive=P, timeout_ns=0, err=P,
        num_blocks=4, stream=0,
    )
    args.update(kw)
    return args


COMMON_BAD = [
    (dict(world=0), "world must be in"),
    (dict(world=9), "world must be in"),
    (dict(rank=-1), "rank must be in"),
    (dict(rank=2), "rank must be in"),
    (dict(channel=-1), "channel must be in"),
    (dict(channel=32), "channel must be in"),  # epoch slots past the done counters at world 2
    (dict(pads=0), "pads"),
    (dict(seq=0), "seq"),
    (dict(err=0), "err"),
]
BARRIER_BAD = COMMON_BAD + [(dict(phase=2), "phase must be"), (dict(phase=-1), "phase must be")]
DATA_BAD = COMMON_BAD + [
    (dict(arrive=0), "arrive"),
    (dict(bufs=0), "bufs"),
    (dict(counts=0), "counts"),
    (dict(offsets=0, compact=True), "offsets"),
    (dict(max_rank_len=-1), "max_rank_len"),
    (dict(max_rank_len=2**31), "max_rank_len"),
    (dict(num_blocks=0), "num_blocks"),
    (dict(num_blocks=65536), "num_blocks"),
]
GATHER_BAD = DATA_BAD + [
    (dict(row_bytes=0), "row_bytes must be > 0"),
    (dict(src_row_stride_bytes=-16), "src_row_stride_bytes"),
    (dict(row_bytes=2**40, max_rank_len=2**30), "overflows"),
    (dict(buffer=2), "buffer must be 0 or 1"),
    (dict(buffer=-1), "buffer must be 0 or 1"),
    (dict(state=0), "state"),
    (dict(channel=16), "done counters"),
]
REDUCE_BAD = DATA_BAD + [
    (dict(dtype=3), "dtype must be"),
    (dict(dtype=-1), "dtype must be"),
    (dict(hidden=0), "hidden must be"),
    (dict(out_row_stride_bytes=128), "out_row_stride_bytes"),
    (dict(out_row_stride_bytes=257), "multiple of the element size"),
    (dict(out=P + 1), "out must be aligned"),
]


def _pack_args(**kw):
    args = dict(src=P, src_row_stride_bytes=256, src_rows=8, dst=P, dst_row_stride_bytes=256, dst_rows=16,
                row_bytes=256, count=P, stream=0)
    args.update(kw)
    return args


def _padded_compact_args(**kw):
    args = dict(padded=P, padded_row_stride_bytes=256, compact=P, compact_row_stride_bytes=256, compact_rows=20,
                row_bytes=256, counts=P, offsets=P, max_rank_len=16, world=2, to_compact=True, stream=0)
    args.update(kw)
    return args


PACK_BAD = [
    (dict(row_bytes=0), "row_bytes must be > 0"),
    (dict(dst_rows=-1), "dst rows must be in"),
    (dict(src_rows=2**31), "src rows must be in"),
    (dict(dst_row_stride_bytes=128), r"dst row stride \(128 bytes\) must be >= row_bytes \(256\)"),
    (dict(src_row_stride_bytes=0), "src row stride"),
    (dict(dst=0), "dst must be a non-null"),
    (dict(src=0), "src must be a non-null"),
    (dict(count=0), "count"),
    (dict(dst_row_stride_bytes=2**62, dst_rows=4), "dst size in bytes overflows"),
]
PADDED_COMPACT_BAD = [
    (dict(row_bytes=-4), "row_bytes must be > 0"),
    (dict(world=0), "world must be in"),
    (dict(max_rank_len=-1), "world \\* max_rank_len"),
    (dict(max_rank_len=2**30), "world \\* max_rank_len"),
    (dict(padded=0), "padded must be a non-null"),
    (dict(compact=0), "compact must be a non-null"),
    (dict(compact_row_stride_bytes=8), "compact row stride"),
    (dict(counts=0), "counts"),
    (dict(offsets=0), "offsets"),
]


# (launcher, valid arguments, one bad override, the message it must raise), every launcher of _C
BAD_ARGUMENTS = [
    (fn, args, bad, match)
    for fn, args, table in (
        ("barrier", _barrier_args, BARRIER_BAD),
        ("p2p_gather", _gather_args, GATHER_BAD),
        ("p2p_reduce_scatter", _reduce_args, REDUCE_BAD),
        ("pack_rows", _pack_args, PACK_BAD),
        ("padded_compact", _padded_compact_args, PADDED_COMPACT_BAD),
    )
    for bad, match in table
]


@needs_C
@pytest.mark.parametrize("fn, args, bad, match", BAD_ARGUMENTS, ids=lambda v: getattr(v, "__name__", str(v)))
def test_launcher_rejects_bad_arguments(fn, args, bad, match):
    with pytest.raises(ValueError, match=match):
        getattr(_C, fn)(**args(**bad))


@needs_C
def test_row_copies_with_nothing_to_do_launch_nothing():
    # zero destination rows (pack) or an empty slot (padded_compact): validated, then no launch, so
    # null tensors of empty layouts are fine and no GPU is needed
    assert _C.pack_rows(**_pack_args(src=0, src_rows=0, dst=0, dst_rows=0)) is None
    assert _C.padded_compact(**_padded_compact_args(padded=0, compact=0, compact_rows=0, max_rank_len=0)) is None


@needs_C
def test_null_src_and_out_are_allowed_for_empty_shards():
    # validation passes (the kernel checks counts[rank] == 0 on the device); only the launch fails
    # here, and only for lack of a GPU
    if not _NO_GPU:
        pytest.skip("would launch on a real GPU with fake pointers")
    with pytest.raises(RuntimeError):
        _C.p2p_gather(**_gather_args(src=0, src_row_stride_bytes=0))
    with pytest.raises(RuntimeError):
        _C.p2p_reduce_scatter(**_reduce_args(out=0))


@needs_no_gpu
@pytest.mark.parametrize(
    "call",
    [
        lambda: _C.barrier(**_barrier_args()),
        lambda: _C.p2p_gather(**_gather_args()),
        lambda: _C.p2p_gather(**_gather_args(row_bytes=255, src_row_stride_bytes=255)),  # byte path
        lambda: _C.p2p_reduce_scatter(**_reduce_args(dtype=2, hidden=64)),
        lambda: _C.p2p_reduce_scatter(**_reduce_args(hidden=3, out_row_stride_bytes=6)),  # scalar path
        lambda: _C.pack_rows(**_pack_args()),
        lambda: _C.pack_rows(**_pack_args(row_bytes=6, src_row_stride_bytes=6, dst_row_stride_bytes=6)),
        lambda: _C.padded_compact(**_padded_compact_args()),
        lambda: _C.padded_compact(**_padded_compact_args(to_compact=False, row_bytes=4, compact_row_stride_bytes=4)),
    ],
)
def test_valid_launch_without_gpu_is_a_clean_runtime_error(call):
    with pytest.raises(RuntimeError, match="kernel launch failed: cudaError"):
        call()


def test_negative_pointer_is_a_type_error():
    if _C is None:
        pytest.skip("nsa_cp._C not importable")
    with pytest.raises(TypeError):
        _C.barrier(**_barrier_args(pads=-1))


# ---- setup.py helpers -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def setup_py():
    spec = importlib.util.spec_from_file_location("nsa_cp_setup_under_test", ROOT / "setup.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    try:
        spec.loader.exec_module(mod)  # must not run setup(): guarded by __name__ == "__main__"
        yield mod
    finally:
        sys.modules.pop(spec.name, None)


def test_base_version_is_read_without_importing(setup_py, tmp_path):
    import nsa_cp

    assert setup_py.read_base_version(ROOT) == nsa_cp.__version__
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
    packaging_version = pytest.importorskip("packaging.version")
    assert str(packaging_version.Version(setup_py.full_version("0.1.0", 13))) == "0.1.0+cu13"


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
    assert plan.version == setup_py.read_base_version() + "+cu12"
    summary = plan.summary()
    assert "CUDA 12.8" in summary and "90a;100a" in summary and "nsa_cp._C" in summary
    kwargs = setup_py.setup_kwargs(plan)
    assert kwargs["version"] == plan.version
    assert [e.name for e in kwargs["ext_modules"]] == ["nsa_cp._C"]
    assert "build_ext" in kwargs["cmdclass"]

    plan = setup_py.BuildPlan({"CUDA_HOME": str(home), "NSA_CP_CUDA_ARCHS": "90a"})
    assert plan.archs == ["90a"] and plan.version.endswith("+cu12")


def test_build_plan_pure(setup_py, tmp_path):
    home = _fake_cuda(tmp_path)
    plan = setup_py.BuildPlan({"CUDA_HOME": str(home), "NSA_CP_BUILD_CUDA": "0"})
    assert not plan.build_cuda and plan.archs == []
    assert plan.version == setup_py.read_base_version()
    assert "skipped: NSA_CP_BUILD_CUDA=0" in plan.summary()
    kwargs = setup_py.setup_kwargs(plan)
    assert "ext_modules" not in kwargs and "cmdclass" not in kwargs  # -> py3-none-any wheel
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


# ---- on a GPU: several "ranks" of one process on one device ----------------------------------------
#
# Each simulated rank has its own pad, seq, arrive, buffers and stream, exactly as separate processes
# would (peers' pointers are just local ones here), so the protocol, the layouts and the arithmetic
# run for real on one GPU. Every wait has a timeout: a protocol bug fails the test instead of hanging.

needs_gpu = pytest.mark.skipif(
    _C is None or _NO_GPU or not __import__("torch").cuda.is_available(), reason="needs nsa_cp._C and a CUDA device"
)
TIMEOUT_NS = 5_000_000_000
CHANNELS = 2


class _Ranks:
    def __init__(self, world, capacity_rows, hidden, dtype, num_blocks=8):
        import torch

        dev = torch.device("cuda")
        self.torch, self.world, self.hidden, self.dtype, self.num_blocks = torch, world, hidden, dtype, num_blocks
        self.pads = [torch.zeros(_C.SIGNAL_WORDS, dtype=torch.int32, device=dev) for _ in range(world)]
        self.pad_ptrs = torch.tensor([p.data_ptr() for p in self.pads], dtype=torch.int64, device=dev)
        # garbage, so unwritten rows and un-zeroed padding show up
        self.bufs = [torch.full((capacity_rows, hidden), 7, dtype=dtype, device=dev) for _ in range(world)]
        self.buf_ptrs = torch.tensor([b.data_ptr() for b in self.bufs], dtype=torch.int64, device=dev)
        self.seq = [torch.zeros(CHANNELS, dtype=torch.int32, device=dev) for _ in range(world)]
        self.arrive = [torch.zeros(CHANNELS, dtype=torch.int32, device=dev) for _ in range(world)]
        self.state = [torch.zeros(CHANNELS, 2, dtype=torch.int32, device=dev) for _ in range(world)]  # gather state
        self.err = [_C.alloc_host_mapped_u32(4) for _ in range(world)]
        self.streams = [torch.cuda.Stream() for _ in range(world)]
        torch.cuda.synchronize()

    def close(self):
        for host, _ in self.err:
            _C.free_host_mapped(host)

    def sig(self, r, channel):
        return dict(
            rank=r, world=self.world, pads=self.pad_ptrs.data_ptr(), channel=channel,
            seq=self.seq[r].data_ptr() + 4 * channel, arrive=self.arrive[r].data_ptr() + 4 * channel,
            timeout_ns=TIMEOUT_NS, err=self.err[r][1],
        )

    def gather_state(self, r, channel=0):
        return self.state[r][channel].data_ptr()

    def errors(self):
        return [[_C.read_u32(host, i) for i in range(4)] for host, _ in self.err]

    @staticmethod
    def layout(counts, compact):
        import torch

        offsets = [sum(counts[:q]) for q in range(len(counts))]
        dc = torch.tensor(counts, dtype=torch.int32, device="cuda")
        do = torch.tensor(offsets, dtype=torch.int32, device="cuda")
        return offsets, dc, do

    def gather(self, shards, counts, M, compact, channel=0, ranks=None):
        torch = self.torch
        _, dc, do = self.layout(counts, compact)
        torch.cuda.synchronize()
        for r in ranks if ranks is not None else range(self.world):
            x = shards[r]
            with torch.cuda.stream(self.streams[r]):
                _C.p2p_gather(
                    src=x.data_ptr(), src_row_stride_bytes=x.stride(0) * x.element_size(),
                    row_bytes=self.hidden * x.element_size(), bufs=self.buf_ptrs.data_ptr(), counts=dc.data_ptr(),
                    offsets=do.data_ptr(), max_rank_len=M, compact=compact, num_blocks=self.num_blocks,
                    stream=self.streams[r].cuda_stream, buffer=0, state=self.gather_state(r, channel),
                    **self.sig(r, channel),
                )
        torch.cuda.synchronize()

    def reduce_scatter(self, outs, counts, M, compact, dtype_code, channel=1):
        torch = self.torch
        _, dc, do = self.layout(counts, compact)
        torch.cuda.synchronize()
        for r in range(self.world):
            with torch.cuda.stream(self.streams[r]):
                _C.p2p_reduce_scatter(
                    out=outs[r].data_ptr(), out_row_stride_bytes=outs[r].stride(0) * outs[r].element_size(),
                    bufs=self.buf_ptrs.data_ptr(), counts=dc.data_ptr(), offsets=do.data_ptr(), max_rank_len=M,
                    compact=compact, hidden=self.hidden, dtype=dtype_code, num_blocks=self.num_blocks,
                    stream=self.streams[r].cuda_stream, **self.sig(r, channel),
                )
        torch.cuda.synchronize()


def _expected_gather(shards, counts, M, compact, hidden, dtype):
    import torch

    if compact:
        return torch.cat([s[:n] for s, n in zip(shards, counts)])
    out = torch.zeros(len(counts) * M, hidden, dtype=dtype, device="cuda")
    for q, (s, n) in enumerate(zip(shards, counts)):
        out[q * M : q * M + n] = s[:n]
    return out


@needs_gpu
def test_gpu_kernel_info():
    info = _C.kernel_info()
    names = {k["name"] for k in info}
    families = ("barrier", "p2p_gather", "p2p_reduce_scatter", "pack_rows", "padded_compact")
    assert {n.split("<")[0] for n in names} == set(families), names
    assert len(info) == 16
    import torch

    assert _native.device_unsupported_reason(torch.cuda.current_device()) == ""  # this GPU runs them
    for k in info:
        assert k["local_bytes"] == 0, k  # no spills / stack
        assert k["binary_version"] >= 90, k
    print(info)


@needs_gpu
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize("hidden, dtype_name", [(256, "bfloat16"), (9, "bfloat16"), (6, "float32"), (33, "float16")])
def test_gpu_p2p_gather(world, compact, hidden, dtype_name):
    import torch

    dtype = getattr(torch, dtype_name)
    M = 37
    ranks = _Ranks(world, world * M, hidden, dtype)
    try:
        gen = torch.Generator(device="cuda").manual_seed(world)
        # an odd number of calls with changing counts (0 and M included): epochs, stale rows, padding
        rounds = [[M - q for q in range(world)], [(7 * q) % (M + 1) for q in range(world)], [M] * world]
        rounds[1][0] = 0
        for counts in rounds:
            shards = [torch.randn(M, hidden, generator=gen, device="cuda").to(dtype) for _ in range(world)]
            if world > 1:  # a strided source
                wide = torch.randn(M, hidden + 8, generator=gen, device="cuda").to(dtype)
                shards[1] = wide[:, :hidden]
            for b in ranks.bufs:  # unwritten rows and un-zeroed padding must show
                b.fill_(float("nan"))
            ranks.gather(shards, counts, M, compact)
            assert ranks.errors() == [[0, 0, 0, 0]] * world
            expected = _expected_gather(shards, counts, M, compact, hidden, dtype)
            for r in range(world):
                got = ranks.bufs[r][: expected.shape[0]]
                assert torch.equal(got, expected), (r, counts)
        assert all(int(s[0]) == len(rounds) for s in ranks.seq)
        assert all(int(a[0]) == 0 for a in ranks.arrive)
    finally:
        ranks.close()


@needs_gpu
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize(
    "hidden, dtype_name, code",
    [(512, "bfloat16", 0), (512, "float16", 1), (128, "float32", 2), (7, "bfloat16", 0), (5, "float32", 2)],
)
def test_gpu_p2p_reduce_scatter(world, compact, hidden, dtype_name, code):
    import torch

    dtype = getattr(torch, dtype_name)
    M = 29
    ranks = _Ranks(world, world * M, hidden, dtype)
    try:
        gen = torch.Generator(device="cuda").manual_seed(100 + world)
        for counts in ([M - 3 * q for q in range(world)], [M] * world, [0] + [M // 2] * (world - 1)):
            total = sum(counts) if compact else world * M
            for b in ranks.bufs:
                b[:total] = torch.randn(total, hidden, generator=gen, device="cuda").to(dtype)
            outs = [torch.full((counts[r], hidden), 3, dtype=dtype, device="cuda") for r in range(world)]
            ranks.reduce_scatter(outs, counts, M, compact, code)
            assert ranks.errors() == [[0, 0, 0, 0]] * world
            for r in range(world):
                start = sum(counts[:r]) if compact else r * M
                rows = slice(start, start + counts[r])
                acc = ranks.bufs[0][rows].float()
                for p in range(1, world):
                    acc = acc + ranks.bufs[p][rows].float()  # fixed order, fp32
                assert torch.equal(outs[r], acc.to(dtype)), (r, counts)
    finally:
        ranks.close()


@needs_gpu
def test_gpu_barrier_and_timeout_record():
    import torch

    ranks = _Ranks(2, 4, 16, torch.bfloat16)
    try:
        # both ranks: phase 0 (no advance), phase 1 (advance) -> seq 1
        for phase, advance in ((0, False), (1, True)):
            for r in range(2):
                with torch.cuda.stream(ranks.streams[r]):
                    kw = ranks.sig(r, 0)
                    kw.pop("arrive")
                    _C.barrier(phase=phase, advance=advance, stream=ranks.streams[r].cuda_stream, **kw)
            torch.cuda.synchronize()
        assert [int(s[0]) for s in ranks.seq] == [1, 1]
        assert ranks.errors() == [[0, 0, 0, 0]] * 2

        # rank 0 alone on channel 1: times out waiting for rank 1, records it, and returns
        kw = ranks.sig(0, 1)
        kw.pop("arrive")
        kw["timeout_ns"] = 2_000_000
        _C.barrier(phase=0, advance=True, stream=0, **kw)
        torch.cuda.synchronize()
        assert ranks.errors()[0] == [_C.ERR_TIMEOUT, 1 * 2 + 0, 1, 1]
        _C.write_u32(ranks.err[0][0], 0, 0)

        # the same through p2p_gather: the entry wait times out, the launch still completes and
        # leaves arrive reset and seq advanced
        shards = [torch.ones(4, 16, dtype=torch.bfloat16, device="cuda")] * 2
        kw = ranks.sig(0, 0)
        kw["timeout_ns"] = 2_000_000
        dc = torch.tensor([4, 4], dtype=torch.int32, device="cuda")
        _C.p2p_gather(src=shards[0].data_ptr(), src_row_stride_bytes=32, row_bytes=32, bufs=ranks.buf_ptrs.data_ptr(),
                      counts=dc.data_ptr(), offsets=0, max_rank_len=4, compact=False, num_blocks=8, stream=0,
                      buffer=0, state=ranks.gather_state(0), **kw)
        torch.cuda.synchronize()
        assert ranks.errors()[0] == [_C.ERR_TIMEOUT, 0, 1, 2]
        assert int(ranks.seq[0][0]) == 2 and int(ranks.arrive[0][0]) == 0
        _C.write_u32(ranks.err[0][0], 0, 0)

        # device-side counts out of range: recorded, nothing moved, nobody waits
        bad = torch.tensor([5, 4], dtype=torch.int32, device="cuda")
        _C.p2p_gather(src=shards[0].data_ptr(), src_row_stride_bytes=32, row_bytes=32, bufs=ranks.buf_ptrs.data_ptr(),
                      counts=bad.data_ptr(), offsets=0, max_rank_len=4, compact=False, num_blocks=8, stream=0,
                      buffer=0, state=ranks.gather_state(0), **kw)
        torch.cuda.synchronize()
        assert ranks.errors()[0] == [_C.ERR_BAD_DEVICE_ARG, 0, 0, 3]
    finally:
        ranks.close()


@needs_gpu
def test_gpu_double_buffer_entry_wait():
    """The entry wait is skipped exactly when the previous gather wrote the other buffer. Rank 0 calls
    alone, so the phase that times out (in the error record) shows whether it waited at entry; then both
    ranks alternate buffers, and results and the recorded tags are checked."""
    import torch

    world, M, hidden, dtype = 2, 8, 16, torch.bfloat16
    ranks = _Ranks(world, world * M, hidden, dtype)
    try:
        alt = [torch.full((world * M, hidden), 7, dtype=dtype, device="cuda") for _ in range(world)]
        ptrs = [ranks.buf_ptrs, torch.tensor([b.data_ptr() for b in alt], dtype=torch.int64, device="cuda")]
        bufs = [ranks.bufs, alt]
        dc = torch.tensor([M, M - 3], dtype=torch.int32, device="cuda")

        def call(r, shard, buffer, timeout_ns=TIMEOUT_NS):
            kw = ranks.sig(r, 0)
            kw["timeout_ns"] = timeout_ns
            with torch.cuda.stream(ranks.streams[r]):
                _C.p2p_gather(src=shard.data_ptr(), src_row_stride_bytes=hidden * 2, row_bytes=hidden * 2,
                              bufs=ptrs[buffer].data_ptr(), counts=dc.data_ptr(), offsets=0, max_rank_len=M,
                              compact=False, num_blocks=4 + r, stream=ranks.streams[r].cuda_stream, buffer=buffer,
                              state=ranks.gather_state(r), **kw)

        shard = torch.randn(M, hidden, device="cuda").to(dtype)
        # last 0, buffer 1: no entry wait, so the done barrier is what times out (slot 0*2 + 1), epoch 1
        call(0, shard, 1, timeout_ns=2_000_000)
        torch.cuda.synchronize()
        assert ranks.errors()[0] == [_C.ERR_TIMEOUT, 1, 1, 1]
        assert int(ranks.state[0][0, 0]) == 1
        for i in range(4):
            _C.write_u32(ranks.err[0][0], i, 0)
        # last 1, buffer 1: the entry wait (slot 0) times out first, epoch 2
        call(0, shard, 1, timeout_ns=2_000_000)
        torch.cuda.synchronize()
        assert ranks.errors()[0] == [_C.ERR_TIMEOUT, 0, 1, 2]
        for i in range(4):
            _C.write_u32(ranks.err[0][0], i, 0)

        # both ranks in step again (rank 1 catches up to epoch 2), then alternate 0, 1, 0, 1, 1
        for t in ranks.pads + ranks.seq + ranks.state:  # the pads hold rank 0's signals of epochs 1 and 2
            t.zero_()
        for buffer in (0, 1, 0, 1, 1):
            shards = [torch.randn(M, hidden, device="cuda").to(dtype) for _ in range(world)]
            torch.cuda.synchronize()
            for r in range(world):
                call(r, shards[r], buffer)
            torch.cuda.synchronize()
            assert ranks.errors() == [[0, 0, 0, 0]] * world
            expected = _expected_gather(shards, [M, M - 3], M, False, hidden, dtype)
            for r in range(world):
                assert torch.equal(bufs[buffer][r], expected), (r, buffer)
                assert int(ranks.state[r][0, 0]) == buffer
        # every launch added DONE_QUANTUM to every rank's counter, whatever its grid (4 and 5 blocks)
        for r in range(world):
            counters = ranks.pads[r][_C.DONE_BASE : _C.DONE_BASE + world].tolist()
            assert counters == [5 * _C.DONE_QUANTUM] * world and int(ranks.state[r][0, 1]) == 5 * _C.DONE_QUANTUM
    finally:
        ranks.close()


@needs_gpu
def test_gpu_graph_replay_with_new_counts():
    """Each rank's gather captured once; replays (an odd number) read new counts from device memory."""
    import torch

    world, M, hidden, dtype = 2, 16, 64, torch.bfloat16
    ranks = _Ranks(world, world * M, hidden, dtype)
    try:
        counts_dev = torch.tensor([M, M], dtype=torch.int32, device="cuda")
        offsets_dev = torch.zeros(world, dtype=torch.int32, device="cuda")
        shards = [torch.randn(M, hidden, device="cuda").to(dtype) for _ in range(world)]
        _C.kernel_info()  # load the module before capture
        graphs = []
        for r in range(world):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=ranks.streams[r]):
                _C.p2p_gather(
                    src=shards[r].data_ptr(), src_row_stride_bytes=hidden * 2, row_bytes=hidden * 2,
                    bufs=ranks.buf_ptrs.data_ptr(), counts=counts_dev.data_ptr(), offsets=offsets_dev.data_ptr(),
                    max_rank_len=M, compact=False, num_blocks=4, stream=ranks.streams[r].cuda_stream,
                    buffer=0, state=ranks.gather_state(r), **ranks.sig(r, 0),
                )
            graphs.append(g)
        for counts in ([3, 16], [16, 0], [9, 11]):
            counts_dev.copy_(torch.tensor(counts, dtype=torch.int32))
            torch.cuda.synchronize()
            for r in range(world):
                with torch.cuda.stream(ranks.streams[r]):
                    graphs[r].replay()
            torch.cuda.synchronize()
            assert ranks.errors() == [[0, 0, 0, 0]] * world
            expected = _expected_gather(shards, counts, M, False, hidden, dtype)
            for r in range(world):
                assert torch.equal(ranks.bufs[r], expected), (r, counts)
        assert [int(s[0]) for s in ranks.seq] == [3, 3]  # capture itself ran nothing
    finally:
        ranks.close()


@needs_C
def test_signal_pad_layout_matches_the_workspace():
    """The transport allocates the pad the kernels index: the epoch slots of every channel at the
    largest world, then the gather's done counters, inside SIGNAL_WORDS."""
    from nsa_cp import workspace

    assert workspace.SIGNAL_WORDS == _C.SIGNAL_WORDS
    assert workspace.NUM_CHANNELS * 2 * _C.MAX_WORLD <= _C.DONE_BASE
    assert _C.DONE_BASE + workspace.NUM_CHANNELS * _C.MAX_WORLD <= _C.SIGNAL_WORDS
    assert _C.DONE_QUANTUM > _C.MAX_BLOCKS  # every block's share of a launch's quantum is >= 1


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
