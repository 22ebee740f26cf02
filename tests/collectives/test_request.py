"""The call record (nsa_cp/planning/request.py) on gloo: an unknown quant is refused, a non-tensor input is named
after the record is built (which never raises), and the record keys the plan cache (tests/support/request_worker.py)."""

import functools

import pytest

import request_worker
from dist_harness import case_failures, run_world


@functools.lru_cache(maxsize=None)
def _results(world):
    return run_world(world, "gloo", request_worker.run_request_checks, {})


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("case", ["bad-quant", "not-a-tensor", "cache-key"])
def test_request(world, case):
    failures = case_failures(_results(world), case)
    assert not failures, "\n".join(failures)
