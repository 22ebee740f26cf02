"""The agreement check of the torch.distributed path on CUDA (nsa_cp/transport/dist/agreement.py): NCCL with one
rank per GPU (one GPU is enough: the grouped fingerprint, the device kernel, the pinned record and the raise),
and ranks sharing one GPU over gloo (2 and 3), each disagreement of tests/support/agreement_cases.py caught on
every rank, the device check forced there too. Skips cleanly, saying why, without a GPU (or where gloo here
does not move CUDA tensors)."""

import functools

import pytest
import torch

import agreement_cases
from dist_harness import case_failures, run_world

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS < 1, reason=f"needs a CUDA GPU, found {GPUS}")]


@functools.lru_cache(maxsize=None)
def _one_rank():
    return run_world(1, "nccl", agreement_cases.run_one_rank, {}, timeout_s=300)


@functools.lru_cache(maxsize=None)
def _shared(world, kind):
    return run_world(world, "gloo-shared-gpu", agreement_cases.run_shared_gpu, {"kind": kind}, timeout_s=600)


@pytest.mark.parametrize("case_id", ["modes-bitwise", "modes-finite", "poison-then-raise-auto",
                                     "poison-then-raise-separate", "record-mapped-auto", "record-mapped-separate"])
def test_one_rank_nccl(case_id):
    failures = case_failures(_one_rank(), case_id)
    assert not failures, "\n".join(failures)


def _check_shared(world, kind, case_id):
    results = _shared(world, kind)
    skip = [r.get("__skip__") for r in results if r.get("__skip__")]
    if skip:
        pytest.skip(skip[0])
    failures = case_failures(results, case_id)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world,case_id", [(w, c) for w in (2, 3) for c, _, _ in agreement_cases.cases(w)])
def test_shared_gpu_host_check(world, case_id):
    _check_shared(world, "host", case_id)


@pytest.mark.parametrize("world,case_id", [(w, c) for w in (2, 3) for c in agreement_cases.DEVICE_CASES_CUDA])
def test_shared_gpu_device_check(world, case_id):
    _check_shared(world, "device", case_id)
