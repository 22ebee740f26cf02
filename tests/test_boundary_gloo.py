"""The layer boundary (fused norm + gather, FP8 wire, reduce-scatter + norm, ordered gather, chained
communicators, autograd, bad input) on gloo with CPU tensors: tests/boundary_cases.py."""

import functools

import pytest

import boundary_cases
from dist_harness import case_failures, run_world

WORLD_SIZES = (1, 2, 3, 4, 8)


@functools.lru_cache(maxsize=None)
def _world_results(world):
    return run_world(world, "gloo", boundary_cases.run_cases,
                     {"device": "cpu", "cases": boundary_cases.make_cases(world)})


PARAMS = [pytest.param(world, case["id"], id=f"w{world}-{case['id']}")
          for world in WORLD_SIZES for case in boundary_cases.make_cases(world)]


@pytest.mark.parametrize("world,case_id", PARAMS)
def test_case(world, case_id):
    failures = case_failures(_world_results(world), case_id)
    assert not failures, "\n".join(failures)
