"""Triton kernels against the pure-torch reference, exactly (torch.equal), on every dtype and layout.

Without a GPU these run under TRITON_INTERPRET=1 on CPU tensors (conftest sets it); with one, on CUDA.
Outputs are poisoned with NaN first so an unwritten row fails.
"""

import importlib.util
import random

import pytest
import torch

import nsa_cp
from nsa_cp import reference

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed", allow_module_level=True)
# Triton present: an import error below (e.g. its interpreter's numpy missing) must fail, not skip
from nsa_cp.kernels import compact as compact_kernels  # noqa: E402
from nsa_cp.kernels import pack as pack_kernels  # noqa: E402

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
def test_pack_into_slot(counts, align, dtype, rest, contiguous):
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
        pack_kernels.pack_into_slot(x, got, counts_dev[rank])
        assert torch.equal(got, want)
        assert not torch.isnan(got).any()


@pytest.mark.parametrize("counts,align,dtype,rest,contiguous", list(_cases()))
def test_padded_compact_round_trip(counts, align, dtype, rest, contiguous):
    layout = nsa_cp.ShardLayout(counts, align=align)
    padded = _rand((layout.padded_len, *rest), dtype, 11)
    want = _nan((layout.total_len, *rest), dtype)
    got = want.clone()
    reference.padded_to_compact(padded, layout, want)
    compact_kernels.padded_to_compact(padded, layout, got)
    assert torch.equal(got, want) and not torch.isnan(got).any()

    compact = _rand((layout.total_len, *rest), dtype, 12)
    if not contiguous and layout.total_len:
        compact = _rand((layout.total_len, 2, *rest), dtype, 12)[:, 0]
    want = _nan((layout.padded_len, *rest), dtype)
    got = want.clone()
    reference.compact_to_padded(compact, layout, want)
    compact_kernels.compact_to_padded(compact, layout, got)
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


def test_output_must_be_a_dense_view():
    layout = nsa_cp.ShardLayout([2, 2])
    counts_dev, _ = layout.device_tensors(DEVICE)
    x = _rand((2, 4), torch.float32, 0)
    strided_slot = _nan((2, 8), torch.float32)[:, ::2]
    with pytest.raises(ValueError, match="slot"):
        pack_kernels.pack_into_slot(x, strided_slot, counts_dev[0])
