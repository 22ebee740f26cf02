"""workspace_bytes is exact: the transport allocates its plan through workspace.allocate and nothing else."""

import logging

import pytest
import torch

import nsa_cp
from nsa_cp import workspace


def _recording_allocators(record):
    def symmetric(entry):
        t = torch.zeros(entry.shape, dtype=entry.dtype)
        record.append(("symmetric", entry.name, t.numel() * t.element_size()))
        return t

    def local(entry):
        t = torch.zeros(entry.shape, dtype=entry.dtype)
        record.append(("local", entry.name, t.numel() * t.element_size()))
        return t

    return symmetric, local


@pytest.mark.parametrize("cp_size,tokens,hidden,dtype", [
    (2, 32768, 7168, torch.bfloat16), (8, 4096, 7168, torch.bfloat16), (1, 1, 1, torch.float32),
    (3, 96, 35, torch.float16), (4, 513, 100, torch.float32),
])
def test_workspace_bytes_is_what_is_allocated(cp_size, tokens, hidden, dtype):
    record = []
    plan = workspace.workspace_plan(cp_size, tokens, hidden, dtype)
    tensors = workspace.allocate(plan, *_recording_allocators(record))
    allocated = sum(t.numel() * t.element_size() for t in tensors.values())
    assert allocated == sum(nbytes for _, _, nbytes in record) == nsa_cp.workspace_bytes(cp_size, tokens, hidden, dtype)
    element = torch.empty((), dtype=dtype).element_size()
    assert tensors["gather"].shape == (cp_size * tokens, hidden) and tensors["reduce"].shape == (cp_size * tokens, hidden)
    # the two data buffers dominate; everything else is small and fixed
    assert allocated - 2 * cp_size * tokens * hidden * element == workspace.SIGNAL_WORDS * 4 + 3 * cp_size * 8 + 2 * workspace.NUM_CHANNELS * 4
    assert [kind for kind, _, _ in record][:3] == ["symmetric"] * 3


def test_known_value():
    assert nsa_cp.workspace_bytes(2, 32768, 7168, torch.bfloat16) == 2 * 65536 * 14336 + 1024 + 48 + 16


def test_budget_warning(caplog):
    required = nsa_cp.workspace_bytes(2, 1024, 7168, torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="nsa_cp"):
        assert workspace.check_budget(required, 2, 1024, 7168, torch.bfloat16) == required
        assert not caplog.records
        assert workspace.check_budget(required - 1, 2, 1024, 7168, torch.bfloat16) == required
    (record,) = caplog.records
    assert str(required - 1) in record.getMessage() and f"workspace_bytes={required}" in record.getMessage()


@pytest.mark.parametrize("bad", [dict(cp_size=0), dict(max_tokens_per_rank=-1), dict(hidden_size=2.5)])
def test_bad_sizes(bad):
    args = dict(cp_size=2, max_tokens_per_rank=8, hidden_size=16, dtype=torch.bfloat16)
    args.update(bad)
    with pytest.raises(ValueError, match=next(iter(bad))):
        workspace.workspace_plan(**args)


def test_allocator_shape_mismatch_is_caught():
    plan = workspace.workspace_plan(2, 4, 8, torch.bfloat16)
    with pytest.raises(RuntimeError, match="allocator returned"):
        workspace.allocate(plan, lambda e: torch.zeros(1), lambda e: torch.zeros(e.shape, dtype=e.dtype))
