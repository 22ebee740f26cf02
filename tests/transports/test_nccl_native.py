"""nsa_cp's own NCCL communicator (nsa_cp.init_nccl, nsa_cp._C.NcclComm) without a GPU.

* the native module's surface and the argument checks that run before any NCCL call;
* on gloo: init_nccl refuses, saying why; the rows -> NCCL counts/offsets arithmetic of the uneven
  entries against torch's own path (tests/support/nccl_native_worker.py); NSA_CP_NCCL_CALL turns it off.

Its collectives on GPUs: tests/collectives/test_collectives_gpu.py (the whole case list again after init_nccl).
"""

from __future__ import annotations

import functools

import pytest

import nccl_native_worker
from dist_harness import case_failures, run_world
from nsa_cp.rows import _native

_C = _native.load()
needs_C = pytest.mark.skipif(_C is None, reason=f"nsa_cp._C not importable: {_native._import_reason}")


@needs_C
def test_surface():
    for name in ("nccl_library", "nccl_version", "nccl_unique_id", "NcclComm"):
        assert hasattr(_C, name), name
    assert _C.NCCL_UNIQUE_ID_BYTES == 128
    for method in ("all_gather", "pack_all_gather", "reduce_scatter", "all_gather_v", "reduce_scatter_v",
                   "async_error", "close"):
        assert getattr(_C.NcclComm, method).__doc__, method


@needs_C
@pytest.mark.parametrize("args,words", [
    ((b"x" * 5, 2, 0, 0), ["unique_id", "128", "5"]),
    ((bytes(128), 0, 0, 0), ["world", ">= 1", "0"]),
    ((bytes(128), 2, 2, 0), ["rank", "world=2", "2"]),
    ((bytes(128), 2, -1, 0), ["rank", "-1"]),
    ((bytes(128), 2, 0, -3), ["device", "-3"]),
])
def test_comm_bad_arguments(args, words):
    with pytest.raises(ValueError) as err:
        _C.NcclComm(*args)
    for word in words:
        assert word in str(err.value), (word, str(err.value))


@needs_C
def test_library_not_found_names_it():
    with pytest.raises((RuntimeError, ValueError)) as err:
        _C.nccl_library("/nonexistent/libnccl-for-test.so")
    assert "/nonexistent/libnccl-for-test.so" in str(err.value)


@functools.lru_cache(maxsize=None)
def _gloo(world):
    return run_world(world, "gloo", nccl_native_worker.run_checks, {})


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("name", ["refused", "rows_arithmetic", "padded_scatter", "env", "cpu_plans"])
def test_gloo(world, name):
    failures = case_failures(_gloo(world), name)
    assert not failures, "\n".join(failures)
