"""nsa_cp._C.P2PState without a GPU: the P2P transport's native state checks everything fixed once, at
construction, and each launch checks only its per-call arguments, all before any CUDA call (ValueError);
a set error record refuses a launch before anything else (P2PDeviceError); a closed state refuses every
call. The error record is host memory, so a CPU tensor stands in for it here."""

from __future__ import annotations

import pytest
import torch

from nsa_cp.rows import _native

_C = _native.load()
pytestmark = pytest.mark.skipif(_C is None, reason=f"nsa_cp._C not importable: {_native._import_reason}")
_NO_GPU = _C is not None and _C.device_count() == 0
needs_no_gpu = pytest.mark.skipif(not _NO_GPU, reason="a CUDA device is visible (or _C is missing)")

P = 0x7F0000000000  # 16-byte aligned dummy device address (validation never dereferences it)
WORLD, HIDDEN, MAX_ROWS, DOUBLE_ROWS = 2, 1024, 64, 32


def _state_args(err, **kw):
    args = dict(device=0, rank=0, world=WORLD, gather_ptrs=P, reduce_ptrs=P, pads=P, seq=P, arrive=P,
                gather_state=P, err_host=err.data_ptr(), err_dev=P, timeout_ns=0, hidden=HIDDEN, dtype=0,
                sm_count=132, max_rows_per_rank=MAX_ROWS, double_buffer_rows=DOUBLE_ROWS)
    args.update(kw)
    return args


def _new_state(err, **kw):
    """A P2PState built from one P2PConfig (every fixed field by name)."""
    return _C.P2PState(_C.P2PConfig(**_state_args(err, **kw)))


@pytest.fixture
def err():
    return torch.zeros(_C.ERR_RECORD_WORDS, dtype=torch.int32)  # stands in for the host-mapped error record


@pytest.fixture
def state(err):
    s = _new_state(err)
    yield s
    s.close()


# Valid arguments of each launch: a test overrides the one it checks.
_CALL = dict(counts=P, offsets=P, max_rank_len=16, compact=False, stream=0, positions=0, num_positions=-1)
_NORM = dict(residual=P, residual_row_stride_bytes=HIDDEN * 2, weight=P, eps=1e-6)
_LAUNCH_ARGS = {
    "gather": dict(src=P, src_row_stride_bytes=HIDDEN * 2, **_CALL),
    "norm_gather": dict(x=P, x_row_stride_bytes=HIDDEN * 2, **_NORM, weight_dtype=0, norm=True, quant=0, **_CALL),
    "reduce_scatter": dict(out=P, out_row_stride_bytes=HIDDEN * 2, **_CALL),
    "reduce_scatter_norm": dict(out=P, out_row_stride_bytes=HIDDEN * 2, **_NORM, weight_dtype=2, **_CALL),
}


def _launch(state, name, **kw):
    return getattr(state, name)(**{**_LAUNCH_ARGS[name], **kw})


def _gather(state, **kw):
    return _launch(state, "gather", **kw)


def _norm_gather(state, **kw):
    return _launch(state, "norm_gather", **kw)


def _reduce_scatter(state, **kw):
    return _launch(state, "reduce_scatter", **kw)


def _reduce_scatter_norm(state, **kw):
    return _launch(state, "reduce_scatter_norm", **kw)


CONSTRUCTOR_BAD = [
    (dict(device=-1), "device must be"),
    (dict(world=0), "world must be in"),
    (dict(world=9), "world must be in"),
    (dict(rank=2), "rank must be in"),
    (dict(rank=-1), "rank must be in"),
    (dict(pads=0), "pads"),
    (dict(seq=0), "seq"),
    (dict(arrive=0), "arrive"),
    (dict(err_dev=0), "err"),
    (dict(gather_ptrs=0), "gather_ptrs"),
    (dict(reduce_ptrs=0), "reduce_ptrs"),
    (dict(gather_state=0), "gather_state"),
    (dict(err_host=0), "err_host"),
    (dict(dtype=3), "dtype must be"),
    (dict(hidden=0), "hidden must be"),
    (dict(sm_count=0), "sm_count must be"),
    (dict(max_rows_per_rank=0), "max_rows_per_rank must be"),
    (dict(max_rows_per_rank=2**31), "max_rows_per_rank must be"),
    (dict(double_buffer_rows=-1), "double_buffer_rows must be"),
    (dict(double_buffer_rows=MAX_ROWS + 1), "double_buffer_rows must be"),
    (dict(hidden=2**40, max_rows_per_rank=2**30), "overflows int64"),
]


@pytest.mark.parametrize("bad,match", CONSTRUCTOR_BAD, ids=[m + "-" + ",".join(b) for b, m in CONSTRUCTOR_BAD])
def test_constructor_rejects_bad_arguments(err, bad, match):
    with pytest.raises(ValueError, match=match):
        _new_state(err, **bad)


def test_fixed_geometry(state):
    assert (state.rank, state.world, state.device, state.hidden) == (0, WORLD, 0, HIDDEN)
    assert state.row_bytes == HIDDEN * 2 and state.last_buffer == 0 and not state.closed
    assert (state.max_rows_per_rank, state.double_buffer_rows) == (MAX_ROWS, DOUBLE_ROWS)
    assert (state.gather_rows(0), state.gather_rows(1)) == (WORLD * MAX_ROWS, WORLD * DOUBLE_ROWS)
    # fp8: q block of rows * hidden bytes, then the scales from the next 16-byte boundary, inside the buffer
    for b in (0, 1):
        rows = state.gather_rows(b)
        assert state.scale_offset(b) == -(-rows * HIDDEN // 16) * 16
        assert state.scale_offset(b) + rows * HIDDEN // 128 * 4 <= rows * state.row_bytes
    with pytest.raises(ValueError, match="buffer must be 0 or 1"):
        state.gather_rows(2)


def test_without_a_second_buffer_both_tags_name_the_first(err):
    s = _new_state(err, double_buffer_rows=0)
    assert s.gather_rows(1) == s.gather_rows(0) and s.scale_offset(1) == s.scale_offset(0)


GATHER_BAD = [
    (dict(src_row_stride_bytes=-1), "src_row_stride_bytes must be >= 0"),
    (dict(src_row_stride_bytes=2**62), "overflows int64"),
    (dict(counts=0), "counts"),
    (dict(compact=True, offsets=0), "offsets"),
    (dict(max_rank_len=-1), "max_rank_len must be in"),
    (dict(max_rank_len=MAX_ROWS + 1), "the capacity"),
    (dict(positions=P), "compact geometry"),
    (dict(positions=P + 4, compact=True, num_positions=8), "8-byte aligned"),
    (dict(positions=P, compact=True, num_positions=-1), "num_positions must be in"),
    (dict(positions=P, compact=True, num_positions=WORLD * 16 + 1), "num_positions must be in"),
]
NORM_BAD = [
    (dict(quant=7), "quant must be"),
    (dict(norm=False, quant=0, residual=0), "nothing to compute"),
    (dict(x=P + 8), "16-byte aligned"),
    (dict(x_row_stride_bytes=HIDDEN * 2 + 8), "16-byte aligned"),
    (dict(x_row_stride_bytes=-16), "16-byte aligned"),
    (dict(residual=P + 4), "residual and its row stride"),
    (dict(residual_row_stride_bytes=24), "residual and its row stride"),
    (dict(norm=False, quant=1), "a residual needs norm=True"),
    (dict(weight=0), "weight"),
    (dict(weight_dtype=5), "weight_dtype must be"),
    (dict(weight=P + 1), "aligned to its element size"),
    (dict(eps=-1.0), "eps must be >= 0"),
    (dict(max_rank_len=MAX_ROWS + 1), "the capacity"),
    (dict(positions=P, num_positions=4), "compact geometry"),
]
SCATTER_BAD = [
    (dict(out_row_stride_bytes=HIDDEN * 2 - 2), "out_row_stride_bytes must be"),
    (dict(out_row_stride_bytes=HIDDEN * 2 + 1), "out_row_stride_bytes must be"),
    (dict(out=P + 1), "out must be aligned"),
    (dict(counts=0), "counts"),
    (dict(compact=True, offsets=0), "offsets"),
    (dict(max_rank_len=MAX_ROWS + 1), "the capacity"),
    (dict(positions=P, compact=True, num_positions=WORLD * 16 + 1), "num_positions must be in"),
]
SCATTER_NORM_BAD = [
    (dict(residual=P + 4), "residual and its row stride"),
    (dict(residual_row_stride_bytes=HIDDEN * 2 + 2), "residual and its row stride"),
    (dict(out=P + 2), "out and its row stride"),
    (dict(out_row_stride_bytes=HIDDEN * 2 - 16), "out_row_stride_bytes must be >="),
    (dict(weight=0), "weight"),
    (dict(weight_dtype=3), "weight_dtype must be"),
    (dict(eps=-1e-3), "eps must be >= 0"),
    (dict(max_rank_len=MAX_ROWS + 1), "the capacity"),
    (dict(positions=P, num_positions=4), "compact geometry"),
]
LAUNCH_BAD = (
    [(_gather, b, m) for b, m in GATHER_BAD]
    + [(_norm_gather, b, m) for b, m in NORM_BAD]
    + [(_reduce_scatter, b, m) for b, m in SCATTER_BAD]
    + [(_reduce_scatter_norm, b, m) for b, m in SCATTER_NORM_BAD]
)


@pytest.mark.parametrize("launch,bad,match", LAUNCH_BAD,
                         ids=[f"{f.__name__.strip('_')}-{','.join(b)}-{i}" for i, (f, b, m) in enumerate(LAUNCH_BAD)])
def test_launch_rejects_bad_arguments_before_any_cuda_call(state, launch, bad, match):
    with pytest.raises(ValueError, match=match):
        launch(state, **bad)
    assert state.last_buffer == 0  # a refused gather does not flip the double buffer


def test_norm_stage_limits_need_their_geometry(err):
    odd = _new_state(err, hidden=1001)  # 2002-byte rows: not whole 16-byte words
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        _norm_gather(odd, x_row_stride_bytes=2016, residual_row_stride_bytes=2016)
    ungrouped = _new_state(err, hidden=1032)  # 16-byte rows, but not groups of 128
    with pytest.raises(ValueError, match="multiple of 128"):
        _norm_gather(ungrouped, quant=1, x_row_stride_bytes=2064, residual_row_stride_bytes=2064)
    wide = _new_state(err, hidden=32768 + 8)  # more than 4 words per thread
    with pytest.raises(ValueError, match="longer than the norm stage holds"):
        _norm_gather(wide, x_row_stride_bytes=2 * 32776, residual_row_stride_bytes=2 * 32776)
    with pytest.raises(ValueError, match="longer than the norm stage holds"):
        _reduce_scatter_norm(wide, out_row_stride_bytes=2 * 32776, residual_row_stride_bytes=2 * 32776)
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        _reduce_scatter_norm(odd, out_row_stride_bytes=2016, residual_row_stride_bytes=2016)


@pytest.mark.parametrize("call", ["gather", "norm_gather", "reduce_scatter", "reduce_scatter_norm", "barrier",
                                  "copy_engine_begin", "pull_begin"])
def test_a_set_error_record_refuses_every_launch_first(state, err, call):
    """After a device-side error nothing more is enqueued, whatever the arguments (even bad ones)."""
    err[:4] = torch.tensor([1, 3, 1, 17], dtype=torch.int32)  # a timeout of the reduce-scatter's done phase
    launch = {
        "gather": lambda: _gather(state, counts=0),
        "norm_gather": lambda: _norm_gather(state, quant=7),
        "reduce_scatter": lambda: _reduce_scatter(state, out=P + 1),
        "reduce_scatter_norm": lambda: _reduce_scatter_norm(state, residual=P + 4),
        "barrier": lambda: state.barrier(0),
        "copy_engine_begin": lambda: state.copy_engine_begin(0),
        "pull_begin": lambda: state.pull_begin(0, 0x1234, 8),
    }[call]
    with pytest.raises(_C.P2PDeviceError, match="code 1 .*epoch 17.*nothing was enqueued"):
        launch()
    assert issubclass(_C.P2PDeviceError, RuntimeError)
    assert state.error() == [1, 3, 1, 17] + [0] * (_C.ERR_RECORD_WORDS - 4)


@needs_no_gpu
@pytest.mark.parametrize("call", ["gather", "norm_gather", "reduce_scatter", "reduce_scatter_norm", "barrier",
                                  "copy_engine_end", "pull_begin", "poison_on_error"])
def test_valid_launch_without_gpu_is_a_clean_runtime_error(state, call):
    launch = {
        "gather": lambda: _gather(state),
        "norm_gather": lambda: _norm_gather(state),
        "reduce_scatter": lambda: _reduce_scatter(state),
        "reduce_scatter_norm": lambda: _reduce_scatter_norm(state),
        "barrier": lambda: state.barrier(0),
        "copy_engine_end": lambda: state.copy_engine_end(0),
        "pull_begin": lambda: state.pull_begin(0, 0x1234, 8),
        "poison_on_error": lambda: state.poison_on_error(P, 64, 0),
    }[call]
    with pytest.raises(RuntimeError, match="cudaError") as info:
        launch()
    assert not isinstance(info.value, _C.P2PDeviceError)
    assert state.last_buffer == 0


@needs_no_gpu  # on a GPU these launches would run with the dummy pointers and fault the device
def test_ordered_and_fp8_arguments_pass_the_checks(state):
    """Valid ordered / fp8 / residual-free calls get past every argument check (to the CUDA call)."""
    calls = [
        lambda: _gather(state, compact=True, positions=P, num_positions=WORLD * 16),
        lambda: _gather(state, compact=True, positions=P, num_positions=0),
        lambda: _norm_gather(state, quant=1),
        lambda: _norm_gather(state, residual=0, residual_row_stride_bytes=0),
        lambda: _norm_gather(state, norm=False, quant=1, residual=0, weight=0, weight_dtype=9, eps=-1.0),
        lambda: _reduce_scatter(state, compact=True, positions=P, num_positions=7),
        lambda: _reduce_scatter_norm(state, compact=True, positions=P, num_positions=7, weight_dtype=0),
        lambda: _reduce_scatter_norm(state, out=0, residual=0),  # a rank without rows: empty tensors
    ]
    for call in calls:
        try:
            call()
        except ValueError as err:  # pragma: no cover - the failure this test exists for
            pytest.fail(f"a valid call was refused: {err}")
        except RuntimeError:
            pass  # no GPU here: the launch itself fails, after the checks


def test_closed_state_refuses_everything(state):
    state.close()
    assert state.closed
    for call in (lambda: _gather(state), lambda: _norm_gather(state), lambda: _reduce_scatter(state),
                 lambda: _reduce_scatter_norm(state),
                 lambda: state.barrier(0), lambda: state.copy_engine_begin(0), lambda: state.copy_engine_end(0),
                 state.error):
        with pytest.raises(RuntimeError, match="closed"):
            call()


def test_pointer_arguments_are_unsigned(err):
    with pytest.raises(TypeError):
        _new_state(err, pads=-1)


def test_config_takes_every_field_by_name(err):
    """P2PConfig: keyword fields only; a missing, unknown or positional field is a TypeError."""
    args = _state_args(err)
    config = _C.P2PConfig(**args)
    assert (config.world, config.hidden, config.max_rows_per_rank, config.check_layout) == (WORLD, HIDDEN, MAX_ROWS, True)
    with pytest.raises(TypeError):
        _C.P2PConfig(**{k: v for k, v in args.items() if k != "pads"})
    with pytest.raises(TypeError):
        _C.P2PConfig(**args, bogus=1)
    with pytest.raises(TypeError):
        _C.P2PConfig(*args.values())
