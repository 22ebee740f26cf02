"""Faults and rank disagreement on the P2P transport at cp = 8 (ranks sharing one GPU over gloo + CUDA IPC
where there are fewer than 8 GPUs): a peer that never arrives, a peer that dies inside a call, a rank
seconds late (within and beyond the timeout), and ranks whose calls disagree (the call fingerprint that
every launch carries in its signals). Each surviving rank gets the documented error within the timeout,
nothing wrong is written, the broken transport refuses further calls, and a new one works. The group is
gloo either way, so that a dead rank cannot take a NCCL communicator down with it. Needs CUDA and
nsa_cp._C; skips cleanly, saying why, otherwise.
"""

import functools

import pytest
import torch

import p2p_fault_cases
import p2p_fingerprint_cases
from dist_harness import case_failures, run_world
from nsa_cp.rows import _native

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
WORLD = 8
BACKEND = "gloo" if GPUS >= WORLD else "gloo-shared-gpu"  # a GPU per rank, or all ranks on cuda:0

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS < 1, reason=f"needs a CUDA GPU, found {GPUS}"),
    pytest.mark.skipif(not _native.available(), reason=f"nsa_cp._C unavailable: {_native.unavailable_reason()}"),
]


@functools.lru_cache(maxsize=None)
def _results(name, world=WORLD):
    fn = {"never": p2p_fault_cases.run_fault_never_arrives, "delayed": p2p_fault_cases.run_fault_delayed,
          "fingerprint": p2p_fingerprint_cases.run_fingerprint_checks}[name]
    return run_world(world, BACKEND, fn, {}, timeout_s=300)


@pytest.mark.parametrize("case", ["never-arrives-gather", "never-arrives-scatter"])
def test_peer_never_arrives(case):
    failures = case_failures(_results("never"), case)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("case", ["delayed-within-timeout", "delayed-beyond-timeout"])
def test_rank_delayed_by_seconds(case):
    failures = case_failures(_results("delayed"), case)
    assert not failures, "\n".join(failures)


def test_peer_dies_mid_call():
    per_rank = run_world(WORLD, BACKEND, p2p_fault_cases.run_fault_peer_dies, {}, timeout_s=300, may_exit=(WORLD - 1,))
    assert per_rank[WORLD - 1] == {"__exited__": 0}, per_rank[WORLD - 1]
    failures = case_failures(per_rank[: WORLD - 1], "peer-dies-mid-call")
    assert not failures, "\n".join(failures)


FINGERPRINT_CASES = ["gather-double-buffered", "gather-entry", "scatter", "stage", "format", "check-off"]


@pytest.mark.parametrize("case", FINGERPRINT_CASES)
def test_disagreeing_calls_raise_on_every_rank(case):
    failures = case_failures(_results("fingerprint"), f"fingerprint-{case}")
    assert not failures, "\n".join(failures)


# Worlds 3 and 4 run in-process (tests/native/test_native_gpu.py, test_gpu_p2p_state_fingerprint, worlds 2-8); two
# processes here, which the sanitizer run uses (docs/development.md).
@pytest.mark.parametrize("world", [2])
@pytest.mark.parametrize("case", ["gather-double-buffered", "gather-entry", "scatter"])
def test_disagreeing_calls_smaller_worlds(world, case):
    failures = case_failures(_results("fingerprint", world), f"fingerprint-{case}")
    assert not failures, "\n".join(failures)
