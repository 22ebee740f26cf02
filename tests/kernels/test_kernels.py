"""Row-copy kernels against the pure-torch reference, exactly (torch.equal), on every dtype and layout.

Both implementations: Triton (without a GPU under TRITON_INTERPRET=1 on CPU tensors, which conftest
sets; with one, on CUDA) and nsa_cp._C's native kernels (CUDA only: skipped, saying why, elsewhere).
Outputs are poisoned with NaN first so an unwritten row fails.
"""

import importlib.util
import random

import pytest
import torch

import nsa_cp
from nsa_cp.rows import _native, reference
from nsa_cp.support import Support

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed", allow_module_level=True)
# Triton present: an import error below (e.g. its interpreter's numpy missing) must fail, not skip
from nsa_cp.rows.kernels import compact as compact_kernels  # noqa: E402
from nsa_cp.rows.kernels import pack as pack_kernels  # noqa: E402

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
LAYOUTS = [
    ([0, 0, 0], 1),
    ([4, 4], 1),
    ([5, 0, 3], 1),
    ([0, 7], 4),
    ([1, 2, 3, 4, 5, 6, 7, 8], 1),
    ([9], 8),
    ([3, 3, 2, 0], 2),
]
RESTS = [(8,), (33,), (3, 5), (1,), (600,)]


IMPLS = ["triton", "native"]


@pytest.fixture(params=IMPLS)
def impl(request):
    if request.param == "native" and not (DEVICE.type == "cuda" and _native.available()):
        why = "no CUDA device" if DEVICE.type != "cuda" else _native.unavailable_reason()
        pytest.skip(f"native row kernels need a CUDA GPU and nsa_cp._C: {why}")
    return request.param


def _rand(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype).to(DEVICE)


def _nan(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def _cases():
    rng = random.Random(0)
    for counts, align in LAYOUTS:
        for dtype in DTYPES:
            yield counts, align, dtype, rng.choice(RESTS), rng.choice([True, False])


@pytest.mark.parametrize("counts,align,dtype,rest,contiguous", list(_cases()))
def test_pack_into_slot(counts, align, dtype, rest, contiguous, impl):
    layout = nsa_cp.ShardLayout(counts, align=align)
    counts_dev, _ = layout.device_tensors(DEVICE)
    for rank, n in enumerate(counts):
        if contiguous:
            x = _rand((n, *rest), dtype, rank)
        else:  # rows with a gap between them: row stride != row length
            x = _rand((n, 2, *rest), dtype, rank)[:, 1]
        want = _nan((layout.max_rank_len, *rest), dtype)
        got = want.clone()
        reference.pack_into_slot(x, want)
        pack_kernels.pack_into_slot(x, got, counts_dev[rank], impl=impl)
        assert torch.equal(got, want)
        assert not torch.isnan(got).any()


@pytest.mark.parametrize("counts,align,dtype,rest,contiguous", list(_cases()))
def test_padded_compact_round_trip(counts, align, dtype, rest, contiguous, impl):
    layout = nsa_cp.ShardLayout(counts, align=align)
    padded = _rand((layout.padded_len, *rest), dtype, 11)
    want = _nan((layout.total_len, *rest), dtype)
    got = want.clone()
    reference.padded_to_compact(padded, layout, want)
    compact_kernels.padded_to_compact(padded, layout, got, impl=impl)
    assert torch.equal(got, want) and not torch.isnan(got).any()

    compact = _rand((layout.total_len, *rest), dtype, 12)
    if not contiguous and layout.total_len:
        compact = _rand((layout.total_len, 2, *rest), dtype, 12)[:, 0]
    want = _nan((layout.padded_len, *rest), dtype)
    got = want.clone()
    reference.compact_to_padded(compact, layout, want)
    compact_kernels.compact_to_padded(compact, layout, got, impl=impl)
    assert torch.equal(got, want) and not torch.isnan(got).any()


def test_reference_layout_semantics():
    """The reference itself against hand-written expectations (it is the oracle for the kernels)."""
    layout = nsa_cp.ShardLayout([2, 0, 1], align=1)
    compact = torch.arange(3 * 2, dtype=torch.float32).reshape(3, 2) + 1
    padded = torch.full((6, 2), float("nan"))
    reference.compact_to_padded(compact, layout, padded)
    assert torch.equal(padded, torch.tensor([[1, 2], [3, 4], [0, 0], [0, 0], [5, 6], [0, 0]], dtype=torch.float32))
    back = torch.full((3, 2), float("nan"))
    reference.padded_to_compact(padded, layout, back)
    assert torch.equal(back, compact)


def test_output_must_be_a_dense_view(impl):
    layout = nsa_cp.ShardLayout([2, 2])
    counts_dev, _ = layout.device_tensors(DEVICE)
    x = _rand((2, 4), torch.float32, 0)
    strided_slot = _nan((2, 8), torch.float32)[:, ::2]
    with pytest.raises(ValueError, match="slot"):
        pack_kernels.pack_into_slot(x, strided_slot, counts_dev[0], impl=impl)


def test_conversion_rejects_wrong_row_counts(impl):
    layout = nsa_cp.ShardLayout([3, 1])
    padded = _rand((layout.padded_len, 8), torch.float32, 1)
    short = _nan((layout.total_len - 1, 8), torch.float32)
    with pytest.raises(ValueError, match=r"compact: expected 4 rows .* got shape \[3, 8\]"):
        compact_kernels.padded_to_compact(padded, layout, short, impl=impl)
    with pytest.raises(ValueError, match=r"padded: expected 6 rows .* got shape \[5, 8\]"):
        compact_kernels.compact_to_padded(_rand((4, 8), torch.float32, 2), layout, padded[:5], impl=impl)
    assert not torch.isnan(padded).any() and torch.isnan(short).all()  # nothing written


def test_impl_choice_errors():
    x = torch.randn(2, 4)
    slot = torch.full((3, 4), float("nan"))
    count = torch.tensor(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="impl: expected one of"):
        pack_kernels.pack_into_slot(x, slot, count, impl="cuda")
    with pytest.raises(ValueError, match="impl: 'native' row kernels cannot run here: the tensors are not on a CUDA"):
        pack_kernels.pack_into_slot(x, slot, count, impl="native")
    assert torch.isnan(slot).all()


def test_row_kernels_env_choice(monkeypatch):
    from nsa_cp.rows.kernels import _rows

    t = torch.empty(1, device=DEVICE)
    monkeypatch.setenv("NSA_CP_ROW_KERNELS", "triton")
    assert _rows.native_module(t, None) is None
    monkeypatch.setenv("NSA_CP_ROW_KERNELS", "auto")
    expect_native = DEVICE.type == "cuda" and _native.available()
    assert (_rows.native_module(t, None) is not None) == expect_native
    monkeypatch.setenv("NSA_CP_ROW_KERNELS", "gpu")
    with pytest.raises(ValueError, match="NSA_CP_ROW_KERNELS: expected one of"):
        _rows.native_module(t, None)


def test_row_kernels_fall_back_to_triton_on_a_gpu_without_native_code(monkeypatch):
    """auto takes Triton on a device the native build cannot run on; "native" there says why."""
    from types import SimpleNamespace

    from nsa_cp.rows.kernels import _rows

    monkeypatch.setattr(_native, "device_support", lambda index: Support.no(f"no kernels for cuda:{index}"))
    gpu_tensor = SimpleNamespace(is_cuda=True, device=SimpleNamespace(index=3))  # all native_module reads
    assert _rows.native_module(gpu_tensor, "auto") is None
    with pytest.raises(ValueError, match="cannot run here: no kernels for cuda:3"):
        _rows.native_module(gpu_tensor, "native")


# ---- what only the native kernels promise: device-side counts and offsets never reach out of bounds


def _native_only():
    if not (DEVICE.type == "cuda" and _native.available()):
        why = "no CUDA device" if DEVICE.type != "cuda" else _native.unavailable_reason()
        pytest.skip(f"native row kernels need a CUDA GPU and nsa_cp._C: {why}")


@pytest.mark.parametrize("device_count,expect_rows", [(-3, 0), (0, 0), (2, 2), (5, 5), (9, 5)])
def test_native_pack_clamps_the_device_count(device_count, expect_rows):
    _native_only()
    x = _rand((5, 24), torch.bfloat16, 3)
    slot = _nan((7, 24), torch.bfloat16)
    count = torch.tensor(device_count, dtype=torch.int32, device=DEVICE)
    pack_kernels.pack_into_slot(x, slot, count, impl="native")
    want = torch.zeros_like(slot)
    want[:expect_rows] = x[:expect_rows]
    assert torch.equal(slot, want)


def test_native_expand_and_compact_skip_rows_outside_the_compact_tensor():
    _native_only()
    from nsa_cp.rows.kernels import _rows

    layout = nsa_cp.ShardLayout([3, 2])  # M = 3, total 5
    native = _rows.native_module(torch.empty(1, device=DEVICE), "native")
    # rank 0 claims offset -1 (rows 1..2 land at 0..1), rank 1 offset 4 (row 0 lands at 4, row 1 outside)
    counts = torch.tensor([3, 2], dtype=torch.int32, device=DEVICE)
    offsets = torch.tensor([-1, 4], dtype=torch.int32, device=DEVICE)
    compact = _rand((5, 16), torch.float32, 4)
    guard = _rand((8, 16), torch.float32, 5)  # compact sits inside a larger allocation: rows around it stay
    guard[1:6] = compact
    padded = _nan((6, 16), torch.float32)
    stream = _native.current_stream(DEVICE)
    row_bytes = 16 * 4
    native.padded_compact(padded.data_ptr(), row_bytes, guard[1:6].data_ptr(), row_bytes, 5, row_bytes,
                          counts.data_ptr(), offsets.data_ptr(), layout.max_rank_len, 2, False, stream)
    want = torch.zeros_like(padded)
    want[1:3] = compact[0:2]  # rank 0 rows 1, 2 <- compact 0, 1; row 0 (index -1) zero
    want[3] = compact[4]  # rank 1 row 0 <- compact 4; row 1 (index 5) zero
    assert torch.equal(padded, want)
    before = guard.clone()
    native.padded_compact(padded.data_ptr(), row_bytes, guard[1:6].data_ptr(), row_bytes, 5, row_bytes,
                          counts.data_ptr(), offsets.data_ptr(), layout.max_rank_len, 2, True, stream)
    after = before.clone()
    after[1:3] = padded[1:3]
    after[5] = padded[3]
    assert torch.equal(guard, after)  # rows 0, 6, 7 of the allocation untouched


def test_native_kernels_launch_on_the_tensors_gpu_whatever_the_current_one():
    """Tensors on cuda:1 while cuda:0 is current: the launch goes to cuda:1 (as torch's kernels do)."""
    _native_only()
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA GPUs, found {torch.cuda.device_count()}")
    other = torch.device("cuda", 1)
    layout = nsa_cp.ShardLayout([6, 2])
    counts_dev, _ = layout.device_tensors(other)
    x = torch.randn(2, 40, device=other).bfloat16()
    padded = torch.randn(layout.padded_len, 40, device=other).bfloat16()
    with torch.cuda.device(0):
        slot = torch.full((6, 40), float("nan"), device=other).bfloat16()
        pack_kernels.pack_into_slot(x, slot, counts_dev[1], impl="native")
        compact = torch.full((layout.total_len, 40), float("nan"), device=other).bfloat16()
        compact_kernels.padded_to_compact(padded, layout, compact, impl="native")
        back = torch.full((layout.padded_len, 40), float("nan"), device=other).bfloat16()
        compact_kernels.compact_to_padded(compact, layout, back, impl="native")
        assert torch.cuda.current_device() == 0
    want = torch.zeros_like(slot)
    want[:2] = x
    assert torch.equal(slot, want)
    want_compact = torch.full_like(compact, float("nan"))
    reference.padded_to_compact(padded, layout, want_compact)
    assert torch.equal(compact, want_compact)
    want_back = torch.full_like(back, float("nan"))
    reference.compact_to_padded(compact, layout, want_back)
    assert torch.equal(back, want_back)


_FIRST_USE_IN_A_GRAPH = """
import torch
from nsa_cp.rows.kernels import compact, pack
import nsa_cp

layout = nsa_cp.ShardLayout([5, 3])
x = torch.randn(5, 64, device="cuda").bfloat16()
slot = torch.full((5, 64), float("nan"), device="cuda").bfloat16()
padded = torch.randn(layout.padded_len, 64, device="cuda").bfloat16()
out = torch.full((layout.total_len, 64), float("nan"), device="cuda").bfloat16()
count = torch.tensor([4], dtype=torch.int32, device="cuda")
layout.device_tensors(x.device)  # the layout's device tensors exist before capture (as in the collectives)
stream = torch.cuda.Stream()
graph = torch.cuda.CUDAGraph()
with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
    pack.pack_into_slot(x, slot, count[0])  # the first native launch of this process, inside the capture
    compact.padded_to_compact(padded, layout, out)
from nsa_cp.rows import _native
assert _native.device_support(0), _native.device_support(0).reason
for n in (4, 0, 5):
    count.fill_(n)
    graph.replay()
    torch.cuda.synchronize()
    want = torch.zeros_like(slot)
    want[:n] = x[:n]
    assert torch.equal(slot, want), n
assert torch.equal(out, torch.cat([padded[:5], padded[5:8]]))
print("ok")
"""


def test_first_native_launch_inside_a_cuda_graph_capture():
    """A process whose first row-copy launch is captured (e.g. a serving engine capturing its first
    forward): the per-device check of the native kernels (which loads them) runs inside the capture and
    must neither break it nor fall back; the replays then follow the device counts."""
    _native_only()
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _FIRST_USE_IN_A_GRAPH], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr
