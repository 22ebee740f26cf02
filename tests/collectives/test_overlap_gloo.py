"""cp_overlapped_boundary on gloo (CPU tensors) at 2, 3, 4 and 8 ranks: the rows the consumer is handed are
the serialized gather's bit for bit (FP8 bytes and scales included), in the rotation order, and the result
is the fp64 oracle's sum (the serialized boundary checked against the same oracle in the same case);
zero-token ranks, empty and even layouts, the engine's physical [M, H] rows, a late peer; bad input refused
before anything moves; a peer failing mid-pipeline gives P2PTimeoutError on the others, never a hang."""

import pytest

import overlap_cases
from dist_harness import gloo_case_test, run_world

test_case = gloo_case_test(overlap_cases, world_sizes=(2, 3, 4, 8))


@pytest.mark.parametrize("kind", overlap_cases.FAULTS)
@pytest.mark.parametrize("world", [2, 4])
def test_a_peer_failing_mid_pipeline_gives_every_other_rank_a_timeout(world, kind):
    results = run_world(world, "gloo", overlap_cases.run_fault, {"kind": kind, "timeout_ms": 3000}, timeout_s=120,
                        may_exit=(world - 1,) if kind == "dies" else ())
    failures = overlap_cases.fault_failures(results, kind)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_inside_torch_compile_equals_eager(backend):
    results = run_world(2, "gloo", overlap_cases.run_compiled, {"backend": backend}, timeout_s=300)
    failures = [f"rank {r}: {res['compiled']}" for r, res in enumerate(results) if res["compiled"]]
    assert not failures, "\n".join(failures)


def test_a_non_gloo_group_is_started_once_by_one_all_reduce():
    results = run_world(3, "gloo", overlap_cases.run_started, {}, timeout_s=120)
    failures = [f"rank {r}: {res['started']}" for r, res in enumerate(results) if res["started"]]
    assert not failures, "\n".join(failures)


def test_ranks_that_disagree_raise_layout_mismatch_naming_the_argument_with_validate():
    results = run_world(3, "gloo", overlap_cases.run_disagreements, {}, timeout_s=180)
    failures = [f"rank {r}: {k}: {v}" for r, res in enumerate(results) for k, v in res.items() if v]
    assert all(set(res) >= set(overlap_cases.DISAGREEMENTS) for res in results)
    assert not failures, "\n".join(failures)


def test_validate_env_catches_divergent_layouts_without_an_abort(monkeypatch):
    monkeypatch.setenv("NSA_CP_VALIDATE", "1")
    results = run_world(2, "gloo", overlap_cases.run_env_validated, {}, timeout_s=120)
    failures = [f"rank {r}: {res['env']}" for r, res in enumerate(results) if res["env"]]
    assert not failures, "\n".join(failures)
