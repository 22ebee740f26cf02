"""cp_overlapped_boundary on CUDA tensors, ranks sharing one GPU (2, 3, 4 and 8) over gloo: the rows a
consumer is handed equal nsa_cp's P2P gather's bit for bit (FP8 bytes and scales included), and the result
equals the P2P serialized boundary's bit for bit (both sum in fp32 in rank order; the consumer is
row-independent), besides the fp64 oracle; chunked slots, TopK + shared, zero-token ranks and a late peer;
a peer failing mid-pipeline (wrong output, or its process dies) gives P2PTimeoutError on the others.
gloo moves host memory, so the overlapped boundary stages CUDA rows through it here (what this checks is
the schedule, the consumer's chunks and the sums on the GPU, not the link's speed). Needs a CUDA GPU and
nsa_cp._C (the serialized boundary's P2P transport); skips cleanly, saying why, without them."""

import functools

import pytest
import torch

import overlap_cases
from dist_harness import case_failures, run_world
from nsa_cp.rows import _native

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
WORLDS = (2, 3, 4, 8)
LAYOUTS = {8: 4}  # the 8-rank world (8 processes time-slicing one GPU) runs the first 4 layouts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS < 1, reason=f"needs a CUDA GPU, found {GPUS}"),
    pytest.mark.skipif(GPUS >= 1 and not _native.available(),
                       reason=f"nsa_cp._C unavailable (the P2P transport): {_native.unavailable_reason()}"),
]


def _cases(world):
    return overlap_cases.gpu_cases(world, seed=3, layouts=LAYOUTS.get(world))


@functools.lru_cache(maxsize=None)
def _world_results(world):
    payload = {"gpu": True, "max_tokens": 64, "cases": _cases(world)}
    return run_world(world, "gloo-shared-gpu", overlap_cases.run_cases, payload, timeout_s=600)


@pytest.mark.parametrize("world,case_id", [pytest.param(w, c["id"], id=f"w{w}-{c['id']}")
                                           for w in WORLDS for c in _cases(w)])
def test_case(world, case_id):
    failures = case_failures(_world_results(world), case_id)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("kind", overlap_cases.FAULTS)
@pytest.mark.parametrize("world", [2, 4])
def test_a_peer_failing_mid_pipeline_gives_every_other_rank_a_timeout(world, kind):
    results = run_world(world, "gloo-shared-gpu", overlap_cases.run_fault,
                        {"kind": kind, "timeout_ms": 5000, "gpu": True}, timeout_s=180,
                        may_exit=(world - 1,) if kind == "dies" else ())
    failures = overlap_cases.fault_failures(results, kind)
    assert not failures, "\n".join(failures)


def test_ranks_that_disagree_raise_layout_mismatch_naming_the_argument_on_the_p2p_pulls():
    results = run_world(3, "gloo-shared-gpu", overlap_cases.run_disagreements, {"gpu": True}, timeout_s=300)
    failures = [f"rank {r}: {k}: {v}" for r, res in enumerate(results) for k, v in res.items() if v]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world", [2, 4])
def test_p2p_pulls_fault_cases_never_hang_and_never_return_silently_wrong(world):
    results = run_world(world, "gloo-shared-gpu", overlap_cases.run_p2p_faults, {"timeout_ms": 4000}, timeout_s=300)
    failures = [f"rank {r}: {k}: {v}" for r, res in enumerate(results) for k, v in res.items() if v]
    assert all(set(res) == {"chunk_rows", "raises", "recreated"} for res in results), results
    assert not failures, "\n".join(failures)
