"""nsa_cp/rows/kernels/agree.py: the agreement check's device half. Ranks that agree: nothing written (the
result keeps its values, the record stays 0). A differing field: its bit and the set bit in the record and
the whole result poisoned (NaN in every floating dtype, all ones in the integer ones). A record already set
(an earlier call the host has not raised for): poisoned again. Triton's interpreter on CPU, or the GPU."""

import pytest
import torch

from nsa_cp.rows.kernels.agree import SET_BIT, check_and_poison

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.uint8, torch.int32, torch.int64]


def _table(rows):
    return torch.tensor(rows, dtype=torch.int32, device=DEVICE)


def _values(n, dtype):
    return torch.randn(n, device=DEVICE).mul(3).to(dtype) if dtype.is_floating_point else \
        torch.randint(0, 100, (n,), device=DEVICE).to(dtype)


def _poisoned(t):
    if t.dtype.is_floating_point:
        return bool(torch.isnan(t.float()).all())
    return bool((t.view(torch.uint8) == 0xFF).all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_agreeing_ranks_write_nothing(dtype):
    out = _values(3000, dtype)
    before = out.clone()
    record = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    check_and_poison(_table([[7, 8, 9], [7, 8, 9], [7, 8, 9]]), 1, record, out)
    assert int(record[0]) == 0
    assert torch.equal(out.view(torch.uint8), before.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_differing_field_poisons_the_whole_result_and_names_the_field(dtype):
    out = _values(5000, dtype)
    record = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    check_and_poison(_table([[7, 8, 9, 1], [7, 8, 9, 2], [7, 5, 9, 1]]), 0, record, out)
    assert int(record[0]) == SET_BIT | 1 << 1 | 1 << 3
    assert _poisoned(out)


def test_a_record_already_set_poisons_again_and_keeps_its_bits():
    out = _values(100, torch.float32)
    record = torch.full((1,), SET_BIT | 1 << 2, dtype=torch.int32, device=DEVICE)
    check_and_poison(_table([[1, 2, 3], [1, 2, 3]]), 0, record, out)
    assert int(record[0]) == SET_BIT | 1 << 2 and _poisoned(out)


def test_an_empty_result_still_sets_the_record():
    record = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    check_and_poison(_table([[1], [2]]), 1, record, torch.empty(0, 16, device=DEVICE))
    assert int(record[0]) == SET_BIT | 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_a_set_record_is_also_written_to_the_host_copy_and_only_then(dtype):
    """``host``: the record's host copy (pinned on CUDA, written through its device mapping): the value the
    record takes on a mismatch, nothing when the ranks agree."""
    host = torch.zeros(1, dtype=torch.int32)
    host = host.pin_memory() if DEVICE == "cuda" else host
    record = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    out = _values(2000, dtype)
    check_and_poison(_table([[3, 4], [3, 4]]), 0, record, out, host)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    assert int(host[0]) == 0 and int(record[0]) == 0
    check_and_poison(_table([[3, 4], [3, 5]]), 1, record, out, host)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    assert int(host[0]) == int(record[0]) == SET_BIT | 1 << 1 and _poisoned(out)


def test_a_strided_result_keeps_its_values_and_the_record_is_set():
    out = _values(64, torch.float32).view(8, 8).t()
    before = out.clone()
    record = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    check_and_poison(_table([[1], [2]]), 0, record, out)
    assert int(record[0]) == SET_BIT | 1 and torch.equal(out, before)
