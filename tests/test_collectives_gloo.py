"""Multi-rank checks of cp_all_gather / cp_reduce_scatter / the communicator on gloo (CPU).

One process group per world size runs every case (spawned once, see dist_harness); each case is its
own test item so a failure names the case.
"""

import functools

import pytest

import dist_cases
from dist_harness import case_failures, run_world

WORLD_SIZES = (1, 2, 3, 4, 8)


@functools.lru_cache(maxsize=None)
def _world_results(world):
    cases = dist_cases.make_cases(world)
    return run_world(world, "gloo", dist_cases.run_cases, {"device": "cpu", "cases": cases})


PARAMS = [pytest.param(world, case["id"], id=f"w{world}-{case['id']}")
          for world in WORLD_SIZES for case in dist_cases.make_cases(world)]


@pytest.mark.parametrize("world,case_id", PARAMS)
def test_case(world, case_id):
    failures = case_failures(_world_results(world), case_id)
    assert not failures, "\n".join(failures)
