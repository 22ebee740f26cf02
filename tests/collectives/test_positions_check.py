"""``positions=`` that is not a permutation never returns memory the call did not write: the ordered calls
use nsa_cp.planning.checks.ordered_rows (a permutation computed on the device, no host sync, no collective), with a
documented result the same on every rank. On gloo, 2 and 3 ranks, padded and compact requests, the copy,
FP8 and norm gathers and the reduce-scatter (tests/support/positions_cases.py)."""

import functools
import random

import pytest
import torch

import positions_cases
from dist_harness import case_failures, run_world
from nsa_cp.planning import checks

WORLDS = (2, 3)


@functools.lru_cache(maxsize=None)
def _results(world):
    return run_world(world, "gloo", positions_cases.run_cases, {"cases": positions_cases.make_cases(world)})


@pytest.mark.parametrize("world,case_id", [(w, c["id"]) for w in WORLDS for c in positions_cases.make_cases(w)]
                         + [(w, "in-place-and-inference") for w in WORLDS])
def test_ordered_calls_with_any_positions(world, case_id):
    failures = case_failures(_results(world), case_id)
    assert not failures, "\n".join(failures)


def test_ordered_rows_is_the_documented_permutation():
    rng = random.Random(0)
    for trial in range(400):
        total = rng.randint(1, 50)
        if trial % 4 == 0:
            pos = rng.sample(range(total), total)
        else:
            pos = [rng.randint(-3, total + 2) for _ in range(total)]
        got = checks.ordered_rows(torch.tensor(pos, dtype=torch.int64), total).tolist()
        assert got == positions_cases.want_rows(pos, total), pos
        assert sorted(got) == list(range(total))
        if trial % 4 == 0:
            assert got == pos  # a permutation maps to itself
    assert checks.ordered_rows(torch.empty(0, dtype=torch.int64), 0).numel() == 0


def test_ordered_rows_is_cached_per_unchanged_tensor():
    pos = torch.tensor([2, 2, 0])
    first = checks.ordered_rows(pos, 3)
    assert checks.ordered_rows(pos, 3) is first
    pos[1] = 1
    assert checks.ordered_rows(pos, 3).tolist() == [2, 1, 0]
    other = torch.tensor([2, 2, 0])
    assert checks.ordered_rows(other, 3) is not first
