"""The collective checks of test_collectives_gloo over NCCL with CUDA tensors (Triton kernels).

Needs CUDA GPUs; skips cleanly, saying why, without them. Runs at every world size in (1, 2, 4, 8)
that the machine has GPUs for (world 1 still exercises the Triton kernels, align padding and CUDA
graphs over a one-rank NCCL group). Outputs are poisoned with NaN (handed-in outputs directly, fresh
outputs through the caching allocator) so an unwritten row fails.
"""

import functools

import pytest
import torch

import dist_cases
from dist_harness import case_failures, run_world

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
WORLD_SIZES = [w for w in (1, 2, 4, 8) if w <= GPUS]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS < 1, reason=f"needs a CUDA GPU for NCCL, found {GPUS}"),
]


def _cases(world):
    return dist_cases.make_cases(world, seed=1, random_layouts=16, big_layouts=4, gpu=True)


@functools.lru_cache(maxsize=None)
def _world_results(world):
    return run_world(world, "nccl", dist_cases.run_cases, {"device": "cuda", "cases": _cases(world)})


PARAMS = [pytest.param(world, case["id"], id=f"w{world}-{case['id']}")
          for world in (WORLD_SIZES or [2]) for case in _cases(world)]


@pytest.mark.parametrize("world,case_id", PARAMS)
def test_case(world, case_id):
    failures = case_failures(_world_results(world), case_id)
    assert not failures, "\n".join(failures)


# ---- the same cases through nsa_cp's own NCCL communicator (nsa_cp.init_nccl) ------------------------
@functools.lru_cache(maxsize=None)
def _native_results(world):
    return run_world(world, "nccl", dist_cases.run_cases,
                     {"device": "cuda", "cases": _cases(world), "native_nccl": True})


NATIVE_PARAMS = [pytest.param(world, case_id, id=f"native-w{world}-{case_id}")
                 for world in (WORLD_SIZES or [2])
                 for case_id in ["native_plans"] + [case["id"] for case in _cases(world)]]


@pytest.mark.parametrize("world,case_id", NATIVE_PARAMS)
def test_case_native_nccl(world, case_id):
    from nsa_cp.rows import _native

    C = _native.load()
    if C is None or not hasattr(C, "NcclComm"):
        pytest.skip(f"nsa_cp._C without NcclComm: {_native.unavailable_reason() or 'built before it existed'}")
    failures = case_failures(_native_results(world), case_id)
    assert not failures, "\n".join(failures)
