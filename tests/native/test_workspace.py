"""workspace_bytes is exact: the transport allocates its plan through workspace.allocate and nothing else."""

import logging

import pytest
import torch

import nsa_cp
from nsa_cp.geometry import workspace


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
@pytest.mark.parametrize("double_buffer_tokens", [0, 1, 100, 1024, None])
def test_workspace_bytes_is_what_is_allocated(cp_size, tokens, hidden, dtype, double_buffer_tokens, monkeypatch):
    monkeypatch.setenv("NSA_CP_P2P_DOUBLE_BUFFER_TOKENS", "7")  # what None means
    record = []
    plan = workspace.workspace_plan(cp_size, tokens, hidden, dtype, double_buffer_tokens)
    tensors = workspace.allocate(plan, *_recording_allocators(record))
    allocated = sum(t.numel() * t.element_size() for t in tensors.values())
    assert allocated == sum(nbytes for _, _, nbytes in record) == nsa_cp.transport.workspace_bytes(
        cp_size, tokens, hidden, dtype, double_buffer_tokens)
    element = torch.empty((), dtype=dtype).element_size()
    assert tensors["gather"].shape == (cp_size * tokens, hidden) and tensors["reduce"].shape == (cp_size * tokens, hidden)
    alt_tokens = min(tokens, 7 if double_buffer_tokens is None else double_buffer_tokens)
    assert ("gather_alt" in tensors) == (alt_tokens > 0)
    if alt_tokens:
        assert tensors["gather_alt"].shape == (cp_size * alt_tokens, hidden)
    # the data buffers dominate; everything else is small and fixed
    small = workspace.SIGNAL_WORDS * 4 + 4 * cp_size * 8 + 2 * workspace.NUM_CHANNELS * 4 + 8
    assert allocated - (2 * tokens + alt_tokens) * cp_size * hidden * element == small
    assert [kind for kind, _, _ in record][: 3 + bool(alt_tokens)] == ["symmetric"] * (3 + bool(alt_tokens))


def test_known_value():
    small = 1024 + 4 * 2 * 8 + 16 + 8
    assert nsa_cp.transport.workspace_bytes(2, 32768, 7168, torch.bfloat16, 0) == 2 * 65536 * 14336 + small
    assert nsa_cp.transport.workspace_bytes(2, 32768, 7168, torch.bfloat16, 1024) == (2 * 65536 + 2048) * 14336 + small


def test_double_buffer_setting(monkeypatch):
    monkeypatch.setenv("NSA_CP_P2P_DOUBLE_BUFFER_TOKENS", "64")
    assert workspace.double_buffer_rows(1000) == 64 and workspace.double_buffer_rows(10) == 10
    assert workspace.double_buffer_rows(1000, 0) == 0 and workspace.double_buffer_rows(1000, 5000) == 1000
    monkeypatch.delenv("NSA_CP_P2P_DOUBLE_BUFFER_TOKENS")
    assert workspace.double_buffer_rows(1 << 20) == 1024  # the default
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="double_buffer_tokens"):
            workspace.double_buffer_rows(8, bad)


def test_budget_warning(caplog):
    required = nsa_cp.transport.workspace_bytes(2, 1024, 7168, torch.bfloat16)
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
