"""The intranode P2P transport on real GPUs: both engines, both layouts, back-to-back calls, a stress run
with injected delays, CUDA-graph replays with changing counts, capacity and geometry errors, a peer that
never arrives and a peer that dies. Needs CUDA GPUs with peer access and nsa_cp._C (on one GPU: one rank
over NCCL, and two ranks sharing the GPU over gloo); skips cleanly, saying why, otherwise.
"""

import functools
import json
import os

import pytest
import torch

import p2p_cases
import p2p_fault_cases
from dist_harness import case_failures, run_world
from nsa_cp.rows import _native

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
# (world size, process-group backend). One GPU per rank where there are enough GPUs; on a machine with one
# GPU, one rank over NCCL (its own buffers, kernels, graphs) and 2, 3, 4 and 8 ranks sharing the GPU over
# gloo: the cross-process protocol (peer buffers mapped through CUDA IPC, signals, epochs, double buffering,
# reuse safety under a delayed rank, graphs, the peer-never-arrives timeout) without NVLink and without the
# NCCL comparisons. The shared GPU time-slices the ranks' kernels, so larger shared worlds run subsets
# (SUBSETS) to keep the GPU test line within minutes.
_SHARED = [(1, "nccl")] + [(w, "gloo-shared-gpu") for w in (2, 3, 4, 8)]
WORLDS = [(w, "nccl") for w in (2, 4, 8) if w <= GPUS] or (_SHARED if GPUS == 1 else [])
# NSA_TEST_P2P_WORLDS="2 8" keeps those world sizes (scripts/gpu_run.sh's sanitizer stage: a short run)
if os.environ.get("NSA_TEST_P2P_WORLDS"):
    WORLDS = [(w, b) for w, b in WORLDS if str(w) in os.environ["NSA_TEST_P2P_WORLDS"].split()]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS < 1, reason=f"needs CUDA GPUs, found {GPUS}"),
    pytest.mark.skipif(not _native.available(), reason=f"nsa_cp._C unavailable: {_native.unavailable_reason()}"),
]

PAYLOAD = {
    # (hidden, dtype): production rows (16-byte vectors), and rows of 72 / 70 bytes for the narrow paths
    # (256, fp16): the fused norm / fp8 stages on fp16 with two fp8 groups; 36 / 35 bf16 rows: the norm
    # stage refuses them (not 16-byte words), the check asserts the refusal
    "shapes": [(7168, torch.bfloat16), (36, torch.bfloat16), (35, torch.bfloat16), (100, torch.float32),
               (256, torch.float16)],
    "max_tokens": 96,
    # second gather buffer: unset = the default (every call fits: always double buffered); 48 = layouts
    # on both sides of it, so calls mix double buffering with entry waits; 0 = none (always wait)
    "double_buffer_tokens": {"36-bfloat16": 48, "35-bfloat16": 0},
}
_KINDS = ("stress", "graph", "slow-readers", "capacity", "communicator", "strided", "copy-in", "norm", "fp8", "ordered",
          "norm-graph", "scatter-norm")
# Shared-GPU worlds above 2: (shapes, checks). The ranks' kernels time-slice the one GPU, so a call costs
# far more than on a GPU each (5-10 s per check at 8 ranks on an H200 against well under 1 s at 2), and
# these worlds run subsets to keep the GPU test line within about 7 minutes:
#   3 ranks: the 70-byte rows with no second buffer (an entry barrier on every call), every check;
#   4 ranks: production rows, double buffered: both engines and layouts, the reduce-scatter and the fused
#            one, CUDA graphs, the communicator, the FP8 wire, the timeout;
#   8 ranks: production rows: the SM and copy-engine gathers, the reduce-scatter, the FP8 wire and the
#            timeout (tests/transports/test_p2p_faults.py adds the faults and disagreeing calls at 8).
# Every check runs at 2 ranks on every shape.
_ALL_SHAPES = PAYLOAD["shapes"]
SUBSETS = {
    3: ([(35, torch.bfloat16)], None),
    4: ([(7168, torch.bfloat16)], ("gather", "scatter", "graph", "communicator", "fp8", "timeout")),
    8: ([(7168, torch.bfloat16)],
        ("gather-7168-bfloat16-sm-padded", "gather-7168-bfloat16-ce-compact", "scatter-7168-bfloat16-compact",
         "fp8", "timeout")),
}


def _tag(h, d):
    return f"{h}-{str(d).split('.')[-1]}"


def _world_payload(world, backend):
    shapes, only = SUBSETS.get(world, (_ALL_SHAPES, None)) if backend != "nccl" else (_ALL_SHAPES, None)
    keep = os.environ.get("NSA_TEST_P2P_SHAPES")  # e.g. "7168-bfloat16": those shapes only (sanitizer runs)
    if keep:
        shapes = [(h, d) for h, d in shapes if _tag(h, d) in keep.split()]
    return dict(PAYLOAD, shapes=shapes, only=only)


def _checks(payload):
    tags = [_tag(h, d) for h, d in payload["shapes"]]
    checks = (
        [f"gather-{t}-{e}-{lay}" for t in tags for e in ("sm", "ce") for lay in ("padded", "compact")]
        + [f"scatter-{t}-{lay}" for t in tags for lay in ("padded", "compact")]
        + [f"{k}-{t}" for t in tags for k in _KINDS]
        + ["bad-geometry", "bad-positions", "closed", "timeout"]
    )
    only = payload["only"]
    return [c for c in checks if only is None or any(c == k or c.startswith(k + "-") for k in only)], tags


def _params():
    for world, backend in WORLDS or [(2, "nccl")]:
        name = f"w{world}" + ("-shared-gpu" if backend != "nccl" else "")
        checks, tags = _checks(_world_payload(world, backend))
        for check in checks:
            if check != "timeout" or world > 1:
                yield pytest.param(world, backend, check, id=f"{name}-{check}")
        for check in [f"capacity-fallback-{t}" for t in tags]:  # backend auto falling back to NCCL
            marks = [] if backend == "nccl" else [pytest.mark.skip(reason="needs NCCL; the ranks share one GPU")]
            yield pytest.param(world, backend, check, id=f"{name}-{check}", marks=marks)


@functools.lru_cache(maxsize=None)
def _world_results(world, backend):
    return run_world(world, backend, p2p_cases.run_p2p_checks, _world_payload(world, backend), timeout_s=900)


@pytest.mark.parametrize("world,backend,check", list(_params()))
def test_p2p(world, backend, check):
    failures = case_failures(_world_results(world, backend), check)
    assert not failures, "\n".join(failures)


@pytest.mark.skipif(not any(w == 2 for w, _ in WORLDS), reason="needs a 2-rank world")
def test_peer_dies():
    """A peer process that exits mid-run: the survivor's next call ends in P2PTimeoutError. The group is
    gloo either way, so that the dead rank cannot take a NCCL communicator down with it."""
    backend = dict((w, b) for w, b in WORLDS)[2]
    per_rank = run_world(2, "gloo" if backend == "nccl" else backend, p2p_fault_cases.run_peer_dies, {},
                         timeout_s=300, may_exit=(1,))
    assert per_rank[1] == {"__exited__": 0}, per_rank[1]
    failures = case_failures(per_rank[:1], "peer-dies")
    assert not failures, "\n".join(failures)
    print(f"peer-dies: peers' buffers mapped through {per_rank[0]['__info__']['memory']}")


@pytest.mark.parametrize("world,backend", WORLDS or [(2, "nccl")])
def test_report_reduce_scatter_accuracy(world, backend, capsys):
    """Not a pass/fail on accuracy beyond the bound checked above: prints P2P (fp32 accumulation) vs
    NCCL (bf16) max relative error against fp64, for the GPU run record."""
    per_rank = _world_results(world, backend)
    assert all("__world__" not in r for r in per_rank), per_rank
    with capsys.disabled():
        for rank, result in enumerate(per_rank):
            print(f"\n[rs-accuracy] world {world} {backend} rank {rank}: {json.dumps(result['__info__'])}")
