"""The plan cache lets destroyed groups go: a program that creates and destroys 50 process groups, with a
collective on each, keeps no plan (and so no buffer, and no group) of a destroyed group once it calls
again (gloo, world 2)."""

from __future__ import annotations

import gc
import traceback
import weakref

from dist_harness import case_failures, run_world


def _worker(rank, world, payload):
    import torch
    import torch.distributed as dist

    import nsa_cp
    from nsa_cp.planning import plan

    try:
        layout = nsa_cp.ShardLayout([5, 3])
        x = torch.randn(layout.count(rank), 16)
        groups = []  # weak references to the destroyed groups
        for _ in range(50):
            group = dist.new_group([0, 1])
            full = nsa_cp.cp_all_gather(x, layout, group)
            back = nsa_cp.cp_reduce_scatter(full, layout, group)
            assert torch.equal(back, 2 * x)
            groups.append(weakref.ref(group))
            dist.destroy_process_group(group)
        live = plan.cache_size()
        nsa_cp.cp_all_gather(x, layout)  # a call on the default group: a miss, which forgets the destroyed
        del group, full, back
        gc.collect()
        from torch.distributed import distributed_c10d as c10d

        dead = [k for k in plan._CACHE if k[1] not in c10d._world.pg_map]
        assert not dead, f"{len(dead)} plans of destroyed groups still cached (the cache held {live})"
        alive = [r for r in groups if r() is not None]
        assert not alive, f"{len(alive)} of 50 destroyed groups still alive: something holds them"
        assert plan.cache_size() <= 2, plan.cache_size()
        return {"groups": None}
    except Exception:  # noqa: BLE001
        return {"groups": traceback.format_exc()}


def test_destroyed_groups_leave_the_plan_cache():
    errors = case_failures(run_world(2, "gloo", _worker, None, timeout_s=240), "groups")
    assert not errors, "\n".join(errors)
