"""The test harness itself (tests/support/dist_harness.py): a rank that crashes without a result fails its
world within seconds, never at the world's timeout, and its blocked peer is released too."""

from __future__ import annotations

import os
import time

from dist_harness import run_world


def _crash_one(rank, world, payload):
    import torch.distributed as dist

    if rank == 1:
        os._exit(3)  # a hard crash: no result, no exception
    try:
        dist.barrier()  # waits on the crashed peer
    except Exception as e:  # noqa: BLE001  gloo reports the lost peer
        return {"barrier": f"{type(e).__name__}"}
    return {"barrier": None}


def test_a_crashed_rank_fails_the_world_fast():
    t0 = time.monotonic()
    results = run_world(2, "gloo", _crash_one, {}, timeout_s=300)
    took = time.monotonic() - t0
    assert "exited (code 3) without sending its result" in results[1].get("__world__", ""), results
    assert took < 120, f"the crashed world took {took:.0f} s (its timeout is 300 s)"
    assert "barrier" in results[0] or "__world__" in results[0], results
