"""Without ``validate=``, ranks that disagree on a call of the torch.distributed path raise LayoutMismatchError on
every rank (nsa_cp/transport/dist/agreement.py): gloo at 2-4 ranks, each disagreement of
tests/support/agreement_cases.py caught in that call, naming the argument, nothing hanging (the harness's
timeout); an agreeing call after each stays bitwise the call with the check off. The device check (NCCL's:
the result NaN, the next call raising) is forced on gloo, its kernel under Triton's interpreter on CPU."""

import functools
import os
from unittest import mock

import pytest

import agreement_cases
from dist_harness import case_failures, run_world

WORLDS = (2, 3, 4)


@functools.lru_cache(maxsize=None)
def _host(world, mode):
    return run_world(world, "gloo", agreement_cases.run_host, {"mode": mode}, timeout_s=300)


@functools.lru_cache(maxsize=None)
def _device(world):
    # CPU tensors: the kernel runs under Triton's interpreter in the rank processes, on a machine with a GPU
    # too (there Triton would compile it for the GPU and refuse CPU pointers; the workers read this at spawn)
    with mock.patch.dict(os.environ, {"TRITON_INTERPRET": "1"}):
        return run_world(world, "gloo", agreement_cases.run_device, {}, timeout_s=600)


def _ids(world):
    return [case_id for case_id, _, _ in agreement_cases.cases(world)]


@pytest.mark.parametrize("world,case_id", [(w, c) for w in WORLDS for c in _ids(w)])
def test_disagreement_raises_on_every_rank_in_that_call(world, case_id):
    failures = case_failures(_host(world, "auto"), case_id)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("case_id", ["counts-same-max", "quant", "max-rank-len"])
def test_separate_mode_catches_them_too(case_id):
    failures = case_failures(_host(2, "separate"), case_id)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world,case_id", [(w, c) for w in (2, 3) for c in agreement_cases.DEVICE_CASES])
def test_device_check_poisons_the_result_and_the_next_call_raises(world, case_id):
    failures = case_failures(_device(world), case_id)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("case_id", ["chunk-rows", "after"])
def test_overlapped_boundary_chunk_rows_named_without_validate(case_id):
    failures = case_failures(_overlap(), case_id)
    assert not failures, "\n".join(failures)


@functools.lru_cache(maxsize=None)
def _overlap():
    return run_world(3, "gloo", agreement_cases.run_overlap_chunk_rows, {}, timeout_s=120)


def test_record_copies_after_each_check_where_the_host_copy_is_out_of_reach():
    """The check kernel writes a record it sets to the group's host copy directly (pinned, mapped); where
    Triton refuses that pointer (ValueError, before any launch) the record falls back for good to writing the
    device record only and copying it to the host copy after each check."""
    import torch

    from nsa_cp.transport.dist.agreement import _Record

    rec = _Record(torch.device("cpu"))
    calls = []

    def kernel(table, rank, record, target, host):
        calls.append(host is rec.host)
        if host is rec.host:
            raise ValueError("Pointer argument cannot be accessed from Triton (cpu tensor?)")
        record.fill_(7)
        host.fill_(7)

    table = torch.zeros(2, 3, dtype=torch.int32)
    rec.check(kernel, table, 0, table[:0])
    assert calls == [True, False] and not rec.mapped and int(rec.view[0]) == 7
    rec.check(kernel, table, 0, table[:0])
    assert calls == [True, False, False]
