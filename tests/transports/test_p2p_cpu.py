"""Pieces of the P2P transport that need no GPU: error records turned into messages (each code says what
failed and why), the CUDA IPC handle's views of peer buffers, and the choice between symmetric memory
and CUDA IPC."""

import pathlib
import re
import types

import pytest
import torch

import nsa_cp
from nsa_cp.transport import p2p
from nsa_cp.transport.p2p import errors as p2p_errors, memory as p2p_memory, registry as p2p_registry

OPS_H = pathlib.Path(__file__).resolve().parents[2] / "csrc" / "ops.h"


def test_codes_match_the_native_header():
    header = OPS_H.read_text()
    codes = dict(re.findall(r"constexpr uint32_t (kErr\w+) = (\d+);", header))
    assert int(codes["kErrTimeout"]) == p2p_errors._ERR_TIMEOUT
    assert int(codes["kErrBadDeviceArg"]) == p2p_errors._ERR_BAD_DEVICE_ARG
    assert int(codes["kErrBadPosition"]) == p2p_errors._ERR_BAD_POSITION
    assert int(codes["kErrLayoutMismatch"]) == p2p_errors._ERR_LAYOUT_MISMATCH
    words = re.search(r"constexpr int kErrRecordWords = (\d+);", header)
    assert words and int(words.group(1)) == p2p_errors.RECORD_WORDS


def test_fingerprint_flags_match_the_native_header():
    """The flag bits and the format code's place that the message decodes are the ones csrc/common.cuh sets."""
    common = (OPS_H.parent / "common.cuh").read_text()
    line = re.search(r"constexpr uint32_t (kFpCompact = .*?);", common).group(1)
    bits = {name: int(value.rstrip("u")) for name, value in re.findall(r"(kFp\w+) = (\w+)", line)}
    names = {"kFpCompact": "compact", "kFpOrdered": "ordered", "kFpNorm": "norm", "kFpScatter": "reduce-scatter",
             "kFpOverlap": dict((b, n) for b, n in p2p_errors._FP_FLAGS)[p2p_errors.FP_OVERLAP]}
    assert {names[k]: v for k, v in bits.items()} == {name: bit for bit, name in p2p_errors._FP_FLAGS}
    shift = int(re.search(r"constexpr int kFpFormatShift = (\d+);", common).group(1))
    assert shift == p2p_errors._FP_FORMAT_SHIFT and all(bit < 1 << shift for bit in bits.values())


def _mismatch_text(slot, own=(0x1234ABCD, (21 << 8) | 1), peer=(0x0BADF00D, (20 << 8) | 1 | (1 << 5)), epochs=(9, 9)):
    record = [p2p_errors._ERR_LAYOUT_MISMATCH, slot, 3, epochs[0], *own, *peer, epochs[1], 0, 0, 0]
    return p2p_errors.error_from_record(record, rank=0, timeout_ms=60000)


def test_layout_mismatch_names_both_sides():
    cls, text = _mismatch_text(slot=1)
    assert cls is p2p.LayoutMismatchError
    for word in ("all-gather", "call #9", "rank 0 assumed 21 rows in total, compact", "0x1234abcd",
                 "rank 3 assumed 20 rows in total, compact, fp8_e4m3_g128", "0x0badf00d", "ShardLayout", "overwritten with NaN",
                 "unusable"):
        assert word in text, (word, text)
    assert "never arrived" not in text and "NSA_CP_P2P_TIMEOUT_MS" not in text


@pytest.mark.parametrize("slot,words", [(0, ["all-gather", "No row of that call was moved"]),
                                        (2, ["reduce-scatter", "No row of that call was read"])])
def test_layout_mismatch_says_what_was_not_done(slot, words):
    _, text = _mismatch_text(slot=slot)
    for word in words:
        assert word in text, (word, text)


def test_layout_mismatch_of_call_numbers():
    """Ranks a call apart (one skipped a call): both call numbers appear."""
    _, text = _mismatch_text(slot=2, own=(1, 5 << 8), peer=(1, 5 << 8), epochs=(7, 8))
    assert "call #7" in text and "call #8" in text and "padded" in text


def test_layout_mismatch_is_both_a_p2p_error_and_the_validation_error():
    """One except clause catches the device-side check and validate=True's."""
    assert issubclass(p2p.LayoutMismatchError, nsa_cp.P2PError)
    assert issubclass(p2p.LayoutMismatchError, nsa_cp.LayoutMismatchError)
    assert issubclass(p2p.LayoutMismatchError, ValueError) and issubclass(p2p.LayoutMismatchError, RuntimeError)
    from nsa_cp.transport.p2p import LayoutMismatchError

    assert LayoutMismatchError is p2p_errors.LayoutMismatchError


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
    cls, _ = p2p_errors.error_from_record([4, 0, 1, 1] + [0] * 8, rank=0, timeout_ms=100)
    assert cls is p2p.LayoutMismatchError


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
    import p2p_fault_cases
    from dist_harness import case_failures, run_world

    failures = case_failures(run_world(2, "gloo", p2p_fault_cases.run_config_mismatch, {}, timeout_s=120), "config-mismatch")
    assert not failures, "\n".join(failures)


# ---- the runner factory against a recording stand-in for the native state (no GPU) -------------------


class _RecordingState:
    """Records every launch of ``P2PState``; gathers return the buffer tag ``tag``."""

    closed = False

    def __init__(self, tag=1):
        self.calls, self.tag = [], tag

    def _record(self, name, result):
        def launch(*args):
            self.calls.append((name, args))
            return result
        return launch

    def __getattr__(self, name):
        if name in ("gather", "norm_gather"):
            return self._record(name, self.tag)
        if name in ("reduce_scatter", "reduce_scatter_norm", "copy_engine_begin", "copy_engine_end", "barrier"):
            return self._record(name, None)
        raise AttributeError(name)

    def scale_offset(self, buffer):
        return 0

    def error(self):
        return [0] * p2p_errors.RECORD_WORDS


def _recording_transport(world=2, rank=1, hidden=256, max_tokens=8, double=8, refuse=False):
    """A P2PTransport over CPU tensors whose native state records its launches (support() says yes:
    the verdicts are tested elsewhere; this checks what the runners hand the native state)."""
    from nsa_cp.support import Support
    from nsa_cp.transport.p2p.buffers import P2PBuffers

    class FakeC:
        P2PDeviceError = type("P2PDeviceError", (RuntimeError,), {})

    t = object.__new__(p2p.P2PTransport)
    state = _RecordingState()
    if refuse:
        def refused(*args):
            raise FakeC.P2PDeviceError("refused")
        state.gather = refused
        state.error = lambda: [p2p_errors._ERR_TIMEOUT, 0, 0, 3] + [0] * (p2p_errors.RECORD_WORDS - 4)
    t._broken, t._C, t._state, t.group, t.rank, t.world = None, FakeC, state, None, rank, world
    t.device, t.max_tokens_per_rank, t.hidden_size, t.dtype = torch.device("cpu"), max_tokens, hidden, torch.bfloat16
    t.double_buffer_tokens, t.timeout_ns, t._elem, t._row_bytes = double, 10**9, 2, hidden * 2
    t._gathers = tuple(torch.zeros(world * max_tokens, hidden, dtype=torch.bfloat16) for _ in range(2))
    t._stream, t._reduce_views = (lambda index: 77), {}
    t._codes = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}  # nsa_cp._C's DTYPE_* codes
    t._buffers = buffers = object.__new__(P2PBuffers)  # its views over CPU tensors; nothing native to close
    buffers.reduce, buffers.gathers, buffers.hidden_size = torch.zeros(world * max_tokens, hidden, dtype=torch.bfloat16), \
        t._gathers, hidden
    buffers.state, buffers._err_host = state, None
    t.support = lambda *args, **kw: Support.yes()
    return t, state


def test_runners_resolve_pointers_in_one_place():
    import nsa_cp

    t, state = _recording_transport()
    layout = nsa_cp.ShardLayout([3, 5])
    counts, offsets = layout.device_tensors("cpu")
    x = torch.randn(5, 256).bfloat16()
    got = t.gather_runner(layout, True, (256,), engine="sm")(x)
    assert got.data_ptr() == t._gathers[1].data_ptr() and got.shape == (8, 256)  # the buffer the state picked
    tail = (counts.data_ptr(), offsets.data_ptr(), 5, True, 77, 0, -1)
    assert state.calls[-1] == ("gather", (x.data_ptr(), 512) + tail)
    mine = (torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32))
    positions = torch.arange(8)
    t.gather_runner(layout, True, (256,), ordered=True)(x, mine, positions)
    assert state.calls[-1][1][2:] == (mine[0].data_ptr(), mine[1].data_ptr(), 5, True, 77, positions.data_ptr(), 8)
    with pytest.raises(ValueError, match="positions: an ordered gather needs"):
        t.gather_runner(layout, True, (256,), ordered=True)(x)

    res, w = torch.randn(5, 256).bfloat16(), torch.ones(256)
    t.norm_gather_runner(layout, False, (256,))(x, res, w, 1e-6)
    assert state.calls[-1] == ("norm_gather", (x.data_ptr(), 512, res.data_ptr(), 512, w.data_ptr(), 2, 1e-6, True, 0,
                                               counts.data_ptr(), offsets.data_ptr(), 5, False, 77, 0, -1))
    t.gather_runner(layout, False, (256,), quant="fp8_e4m3_g128")(x)
    assert state.calls[-1][1][:9] == (x.data_ptr(), 512, 0, 0, 0, 0, 0.0, False, 1)

    y = t.reduce_buffer(layout, True, (256,))
    out, residual = t.reduce_scatter_runner(layout, True, (256,), norm=True)(y, res, w, 1e-6)
    assert out.shape == (5, 256) and residual is res
    assert state.calls[-1] == ("reduce_scatter_norm", (out.data_ptr(), 512, res.data_ptr(), 512, w.data_ptr(), 2, 1e-6)
                               + tail)
    elsewhere = torch.randn(8, 256).bfloat16()
    out = t.reduce_scatter_runner(layout, True, (256,))(elsewhere)
    assert torch.equal(y, elsewhere) and state.calls[-1] == ("reduce_scatter", (out.data_ptr(), 512) + tail)
    with pytest.raises(ValueError, match="positions: an ordered reduce-scatter needs"):
        t.reduce_scatter_runner(layout, True, (256,), ordered=True)(y)


def test_a_refused_launch_raises_the_recorded_error():
    import nsa_cp

    t, _ = _recording_transport(refuse=True)
    run = t.gather_runner(nsa_cp.ShardLayout([3, 5]), True, (256,), engine="sm")
    with pytest.raises(p2p.P2PTimeoutError, match="timed out"):
        run(torch.randn(5, 256).bfloat16())


def test_the_pulls_fingerprint_covers_every_argument_the_ranks_must_agree_on():
    """The overlapped boundary's entry-barrier fingerprint (hash, desc) differs when the layout, the wire
    format, chunk_rows, the output row shape or dtype, or shared differ; desc carries the overlap flag, the
    format's code and the total rows, as errors.describe_fingerprint reads them."""
    import nsa_cp
    from nsa_cp.planning.request import OverlapRequest, Request
    from nsa_cp.transport.p2p import pulls

    x = torch.zeros(3, 256, dtype=torch.bfloat16)

    def req(counts=(3, 1), quant=None, chunk_rows=None, row=(256,), dtype=torch.bfloat16, shared=False):
        call = Request.of("cp_overlapped_boundary", x, nsa_cp.ShardLayout(list(counts)), None, quant=quant)
        return OverlapRequest(call, chunk_rows, row, dtype, shared)

    base = pulls.fingerprint(req())
    variants = [req(counts=(2, 2)), req(quant="fp8_e4m3_g128"), req(chunk_rows=2), req(row=(2, 128)),
                req(dtype=torch.float32), req(shared=True)]
    hashes = [pulls.fingerprint(r)[0] for r in variants]
    assert base[0] not in hashes and len(set(hashes)) == len(hashes)
    assert base == pulls.fingerprint(req())
    desc = pulls.fingerprint(req(quant="fp8_e4m3_g128"))[1]
    assert desc & p2p_errors.FP_OVERLAP and desc >> 8 == 4
    text = p2p_errors.describe_fingerprint(*pulls.fingerprint(req(quant="fp8_e4m3_g128")), 5)
    assert "overlapped boundary" in text and "fp8_e4m3_g128" in text and text.startswith("4 rows in total")
