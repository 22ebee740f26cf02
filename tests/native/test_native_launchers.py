"""nsa_cp._C without a GPU: the module's surface, host-mapped memory, and the free launchers' argument
checks, which run before any CUDA call. Skips when the module is absent (pure install); tests that
expect "no GPU" behaviour skip on a machine that has one."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from nsa_cp.rows import _native



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
    assert (_C.ERR_NONE, _C.ERR_TIMEOUT, _C.ERR_BAD_DEVICE_ARG, _C.ERR_BAD_POSITION) == (0, 1, 2, 3)
    assert _C.ERR_LAYOUT_MISMATCH == 4 and _C.ERR_RECORD_WORDS == 12
    assert (_C.QUANT_NONE, _C.QUANT_FP8_E4M3_G128, _C.QUANT_FP8_E4M3_G128_UE8M0) == (0, 1, 2)
    from nsa_cp.geometry import wire

    for fmt in wire.FORMATS.values():  # csrc/codes.h's traits are nsa_cp/geometry/wire.py's
        assert wire.native_mismatch(fmt, _C) is None, wire.native_mismatch(fmt, _C)
    for method in ("gather", "norm_gather", "reduce_scatter", "reduce_scatter_norm", "barrier", "copy_engine_begin",
                   "copy_engine_end", "pull_begin", "poison_on_error", "error", "gather_rows", "scale_offset", "close"):
        assert getattr(_C.P2PState, method).__doc__, method
    assert _C.P2PState.__doc__ and issubclass(_C.P2PDeviceError, RuntimeError)
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


@needs_C
def test_signal_pad_layout_matches_the_workspace():
    """The transport allocates the pad the kernels index: the epoch slots of every channel at the
    largest world, then the gather's done counters, inside SIGNAL_WORDS."""
    from nsa_cp.geometry import workspace

    assert workspace.SIGNAL_WORDS == _C.SIGNAL_WORDS
    assert workspace.NUM_CHANNELS * 2 * _C.MAX_WORLD <= _C.DONE_BASE
    assert _C.DONE_BASE + workspace.NUM_CHANNELS * _C.MAX_WORLD <= _C.SIGNAL_WORDS
    # then the call fingerprints: [channel][epoch parity][source rank] x FP_WORDS
    assert _C.DONE_BASE + workspace.NUM_CHANNELS * _C.MAX_WORLD <= _C.FP_BASE
    assert _C.FP_BASE + workspace.NUM_CHANNELS * 2 * _C.MAX_WORLD * _C.FP_WORDS <= _C.SIGNAL_WORDS
    assert _C.DONE_QUANTUM > _C.MAX_BLOCKS  # every block's share of a launch's quantum is >= 1
