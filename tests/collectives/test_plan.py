"""The plan cache never serves a stale plan (tests/support/plan_worker.py).

* named checks on gloo: a repeated call hits its plan, an equal layout built anew finds it, every change
  of what a plan is keyed on gets another plan, a new P2P generation drops every plan;
* the same with init_p2p / destroy_p2p on 2 GPUs (skipped without them, saying why);
* hypothesis: sequences of calls with validation off (the cached hot path) in a persistent gloo world,
  each call with its own layout, row shape, dtype, compact, out= and environment, every result checked.
"""

from __future__ import annotations

import functools

import pytest
import torch

import plan_worker
from dist_harness import WorldPool, case_failures, run_world

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@functools.lru_cache(maxsize=None)
def _checks(backend: str, world: int):
    device = "cuda" if backend == "nccl" else "cpu"
    names = ["keys"] + (["p2p_reinit"] if backend == "nccl" else [])
    return run_world(world, backend, plan_worker.run_checks, {"device": device, "checks": names})


@pytest.mark.parametrize("world", [1, 2, 3])
def test_plan_keys_gloo(world):
    failures = case_failures(_checks("gloo", world), "keys")
    assert not failures, "\n".join(failures)


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 2, reason=f"init_p2p / destroy_p2p need 2 GPUs, found {GPUS}")
@pytest.mark.parametrize("name", ["keys", "p2p_reinit"])
def test_plan_keys_nccl(name):
    from nsa_cp.rows import _native

    if name == "p2p_reinit" and _native.load() is None:
        pytest.skip(_native.unavailable_reason())
    failures = case_failures(_checks("nccl", 2), name)
    assert not failures, "\n".join(failures)


# --------------------------------------------------------------------------- sequences of calls
def _counts(world):
    return st.lists(st.integers(0, 9), min_size=world, max_size=world)


def _call(world):
    return st.fixed_dictionaries(dict(
        op=st.sampled_from(["gather", "scatter"]),
        counts=st.one_of(_counts(world), st.integers(1, 6).map(lambda n: [n] * world)),
        align=st.sampled_from([1, 1, 2, 8]),
        rest=st.sampled_from([(8,), (16,), (2, 4)]),
        dtype=st.sampled_from(["bf16", "fp32", "fp16"]),
        compact=st.booleans(),
        out=st.booleans(),
        env=st.sampled_from([{}, {}, {"NSA_CP_NCCL_CALL": "public"}, {"NSA_CP_COMPACT_ALGO": "padded"},
                             {"NSA_CP_BACKEND": "nccl"}]),
        seed=st.integers(0, 1 << 20),
    ))


@pytest.fixture(scope="module", params=[2, 3])
def pool(request):
    with WorldPool(request.param, "gloo", plan_worker.handle, timeout_s=60.0) as p:
        yield request.param, p


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_sequences(pool, data):
    world, p = pool
    calls = data.draw(st.lists(_call(world), min_size=2, max_size=8))
    # repeat some calls verbatim later in the sequence: cache hits between other calls
    calls += data.draw(st.lists(st.sampled_from(calls), max_size=4))
    per_rank = p.run({"calls": calls})
    for rank, results in enumerate(per_rank):
        for i, problem in enumerate(results):
            assert problem is None, f"rank {rank}, call {i} of {calls}: {problem}"
