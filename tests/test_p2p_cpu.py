"""Pieces of the P2P transport that need no GPU: error records turned into messages (each code says what
failed and why), the CUDA IPC handle's views of peer buffers, and the choice between symmetric memory
and CUDA IPC."""

import pathlib
import re

import pytest

import nsa_cp
from nsa_cp.transport import p2p, p2p_errors, p2p_memory, p2p_registry

OPS_H = pathlib.Path(__file__).resolve().parents[1] / "csrc" / "ops.h"


def test_codes_match_the_native_header():
    header = OPS_H.read_text()
    codes = dict(re.findall(r"constexpr uint32_t (kErr\w+) = (\d+);", header))
    assert int(codes["kErrTimeout"]) == p2p_errors._ERR_TIMEOUT
    assert int(codes["kErrBadDeviceArg"]) == p2p_errors._ERR_BAD_DEVICE_ARG
    assert int(codes["kErrBadPosition"]) == p2p_errors._ERR_BAD_POSITION


def test_timeout_names_the_call_the_phase_and_both_ranks():
    text = p2p_errors.describe_error(p2p_errors._ERR_TIMEOUT, slot=1 * 2 + 1, peer=3, epoch=17, rank=0, timeout_ms=1500)
    for word in ("reduce-scatter", "call #17", "done barrier", "rank 0", "rank 3 never arrived", "1500 ms",
                 "NSA_CP_P2P_TIMEOUT_MS", "unusable"):
        assert word in text, (word, text)


def test_bad_device_geometry_is_not_reported_as_a_timeout():
    text = p2p_errors.describe_error(p2p_errors._ERR_BAD_DEVICE_ARG, slot=0, peer=1, epoch=2, rank=0, timeout_ms=60000)
    assert "never arrived" not in text and "NSA_CP_P2P_TIMEOUT_MS" not in text
    for word in ("all-gather", "call #2", "rank 0", "rank 1", "device_counts", "No rows were moved"):
        assert word in text, (word, text)


def test_bad_position_is_bad_geometry_not_a_timeout():
    text = p2p_errors.describe_error(p2p_errors._ERR_BAD_POSITION, slot=2, peer=1, epoch=4, rank=1, timeout_ms=60000)
    assert "never arrived" not in text and "No rows were moved" not in text
    for word in ("reduce-scatter", "call #4", "rank 1", "positions", "clamped", "device-side geometry", "unusable"):
        assert word in text, (word, text)


def test_error_from_record_picks_the_class():
    cls, text = p2p_errors.error_from_record([1, 1, 1, 5], rank=0, timeout_ms=100)
    assert cls is p2p.P2PTimeoutError and "timed out" in text
    for code in (2, 3, 9):
        cls, _ = p2p_errors.error_from_record([code, 0, 0, 1], rank=0, timeout_ms=100)
        assert cls is p2p.P2PError


def test_facade_reexports():
    """nsa_cp and the communicator import these from nsa_cp.transport.p2p."""
    from nsa_cp.transport.p2p import (P2PError, P2PTimeoutError, destroy_p2p, get_p2p, init_p2p,  # noqa: F401
                                      p2p_unavailable_reason)

    assert P2PError is p2p_errors.P2PError and init_p2p is p2p_registry.init_p2p
    assert nsa_cp.P2PError is P2PError and nsa_cp.init_p2p is init_p2p


def test_generation_changes_on_destroy():
    """The plan cache keys on it: every destroy_p2p (and init_p2p, GPU tests) gives a new value."""
    seen = {p2p.generation()}
    for _ in range(3):
        p2p.destroy_p2p(object())  # no transport registered for this key: still a new generation
        seen.add(p2p.generation())
    assert len(seen) == 4 and isinstance(p2p.generation(), int)


def test_unknown_code_is_reported_as_such():
    assert "unknown error code 9" in p2p_errors.describe_error(9, slot=0, peer=0, epoch=1, rank=1, timeout_ms=1)


@pytest.mark.parametrize("cls", [nsa_cp.P2PError, nsa_cp.P2PTimeoutError])
def test_error_classes(cls):
    assert issubclass(cls, RuntimeError) and issubclass(nsa_cp.P2PTimeoutError, nsa_cp.P2PError)


def test_ipc_peer_views():
    """The CUDA IPC handle's views of a peer's buffer (the copy engine writes through them): the right
    bytes, shape and dtype from an offset, on plain CPU tensors standing in for the mapped ones."""
    import torch

    buffers = [torch.arange(64, dtype=torch.float32) + 100 * q for q in range(3)]
    peers = p2p_memory._IpcPeers(buffers)
    assert peers.buffer_ptrs == [b.data_ptr() for b in buffers]
    view = peers.get_buffer(2, (4, 3), torch.float32, offset=8)  # 8 bytes: skip two floats
    assert view.shape == (4, 3) and view.dtype == torch.float32
    assert torch.equal(view.flatten(), buffers[2][2:14])
    view.fill_(-1)  # a view, not a copy: writes land in the peer's buffer
    assert torch.equal(buffers[2][2:14], torch.full((12,), -1.0))
    halves = peers.get_buffer(0, (8,), torch.bfloat16, offset=0)
    assert halves.data_ptr() == buffers[0].data_ptr() and halves.numel() == 8


@pytest.mark.parametrize("indices,setting,want", [
    ([0, 1], None, "symm_mem"),  # one GPU per rank
    ([0, 0], None, "cuda_ipc"),  # ranks share a GPU: symmetric memory would refuse
    ([0], None, "symm_mem"),
    ([0], "cuda_ipc", "cuda_ipc"),
    ([1, 1, 1], "cuda_ipc", "cuda_ipc"),
    ([0, 1, 2, 3], "auto", "symm_mem"),
    ([0, 1], "cuda_ipc", "unavailable: NSA_CP_P2P_MEMORY=cuda_ipc with ranks on different GPUs"),
    ([0, 0], "symm_mem", "unavailable: NSA_CP_P2P_MEMORY=symm_mem with ranks sharing one GPU"),
    ([0, 0, 1, 1], None, "unavailable: ranks share some GPUs but not all"),
])
def test_memory_kind(indices, setting, want, monkeypatch):
    """How the transport maps its peers' buffers, from every rank's device index and NSA_CP_P2P_MEMORY,
    or why it cannot (then P2P reports itself unavailable with that reason, and auto keeps NCCL)."""
    monkeypatch.delenv("NSA_CP_P2P_MEMORY", raising=False)
    if setting is not None:
        monkeypatch.setenv("NSA_CP_P2P_MEMORY", setting)
    problem = p2p_memory._memory_problem(indices)
    if want.startswith("unavailable: "):
        assert problem is not None and problem.startswith(want[len("unavailable: "):]), problem
    else:
        assert problem is None and p2p_memory.memory_kind(indices) == want


def test_memory_kind_rejects_an_unknown_setting(monkeypatch):
    monkeypatch.setenv("NSA_CP_P2P_MEMORY", "nvshmem")
    with pytest.raises(ValueError, match="NSA_CP_P2P_MEMORY"):
        p2p_memory.memory_kind([0, 1])


def test_ranks_that_disagree_on_a_setting_all_raise():
    import p2p_cases
    from dist_harness import case_failures, run_world

    failures = case_failures(run_world(2, "gloo", p2p_cases.run_config_mismatch, {}, timeout_s=120), "config-mismatch")
    assert not failures, "\n".join(failures)
