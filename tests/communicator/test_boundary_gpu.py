"""tests/support/boundary_cases.py over NCCL with CUDA tensors, and again with the P2P transport forced
(``backend="p2p"``: norm-and-push, FP8 push, ordered push, pull + norm). Needs CUDA GPUs; skips cleanly,
saying why, without them (the P2P world also needs nsa_cp._C and 2 GPUs with peer access)."""

import functools

import pytest
import torch

import boundary_cases
from dist_harness import case_failures, run_world

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
WORLD = 2 if GPUS >= 2 else 1

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS < 1, reason=f"needs a CUDA GPU for NCCL, found {GPUS}")]

HIDDEN = 256  # one transport row for every P2P case (a multiple of 128 for the FP8 wire)


def _p2p_reason():
    if GPUS < 2:
        return f"the P2P world needs 2 GPUs, found {GPUS}"
    from nsa_cp.rows import _native

    if _native.load() is None:
        return _native.unavailable_reason()
    return None


def _cases(p2p: bool):
    if p2p:
        return boundary_cases.make_cases(WORLD, seed=2, gpu=True, backend="p2p", hidden=HIDDEN, dtype="bf16")
    return boundary_cases.make_cases(WORLD, seed=1, gpu=True)


@functools.lru_cache(maxsize=None)
def _world_results(p2p: bool):
    payload = {"device": "cuda", "cases": _cases(p2p), "p2p": HIDDEN if p2p else None}
    return run_world(WORLD, "nccl", boundary_cases.run_cases, payload)


@pytest.mark.parametrize("case_id", [c["id"] for c in _cases(False)])
def test_nccl(case_id):
    failures = case_failures(_world_results(False), case_id)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("case_id", [c["id"] for c in _cases(True)])
def test_p2p(case_id):
    reason = _p2p_reason()
    if reason:
        pytest.skip(reason)
    failures = case_failures(_world_results(True), case_id)
    assert not failures, "\n".join(failures)
