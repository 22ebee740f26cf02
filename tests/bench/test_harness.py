"""The test harness itself (tests/support/dist_harness.py): a rank allowed to exit without a result."""

import os

import torch.distributed as dist

from dist_harness import case_failures, run_world


def _exit_on_rank_1(rank, world, payload):
    # both ranks past gloo's connectFullMesh first: a peer gone mid-init fails init, not this test's subject
    dist.barrier()
    if rank == 1:
        os._exit(3)
    return {"survivor": None}


def test_rank_may_exit():
    per_rank = run_world(2, "gloo", _exit_on_rank_1, None, timeout_s=60, may_exit=(1,))
    assert per_rank[1] == {"__exited__": 3}
    assert case_failures(per_rank[:1], "survivor") == []


def test_unexpected_exit_fails_the_world():
    per_rank = run_world(2, "gloo", _exit_on_rank_1, None, timeout_s=5)
    assert "__world__" in per_rank[1] and "no result" in per_rank[1]["__world__"]
