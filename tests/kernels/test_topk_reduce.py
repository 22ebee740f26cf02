"""The top-k reduce (``y = scale * sum_j w[:, j] * out[:, j]``, fp32 sum, one rounding): the Triton kernel
(under TRITON_INTERPRET=1 on CPU tensors without a GPU, which conftest sets; on CUDA with one), the
dispatcher ``nsa_cp.rows.topk.topk_reduce`` and the reference, each against an fp64 oracle written here.
Outputs are poisoned with NaN first; random inputs; zero rows, k = 1, no weights and odd row lengths
among the cases."""

import importlib.util
import math

import pytest
import torch

from nsa_cp.rows import reference
from nsa_cp.rows.topk import topk_reduce

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed", allow_module_level=True)
from nsa_cp.rows.kernels import topk_reduce as kernels  # noqa: E402

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
CASES = [  # rows, k, row shape, weights?, scale
    (0, 8, (128,), True, 1.0),
    (1, 1, (7,), True, 1.0),
    (5, 8, (1030,), True, 2.5),
    (9, 6, (3, 40), False, 1.0),
    (33, 2, (2048,), True, 0.5),
]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _inputs(rows, k, shape, weighted, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    out = torch.randn((rows, k, *shape), generator=g).to(dtype).to(DEVICE)
    w = torch.rand((rows, k), generator=g).to(DEVICE) if weighted else None
    return out, w


def _oracle(out, w, scale):
    terms = out.double() * (w.double().view(*w.shape, *([1] * (out.dim() - 2))) if w is not None else 1.0)
    return terms.sum(1) * scale, terms.abs().sum(1) * abs(scale)


def _check(got, out, w, scale, dtype):
    exact, magnitude = _oracle(out, w, scale)
    assert got.shape == exact.shape and got.dtype == dtype
    assert torch.isfinite(got).all(), "rows left unwritten (NaN)"
    # fp32 accumulation over k terms (FMA or not), then one rounding to dtype (whose spacing below its
    # smallest normal is smallest_normal * eps: subnormal results)
    fin = torch.finfo(dtype)
    bound = ((out.shape[1] + 1) * torch.finfo(torch.float32).eps * magnitude + fin.eps * exact.abs()
             + fin.smallest_normal * fin.eps)
    err = (got.double() - exact).abs()
    assert (err <= bound).all(), f"max error {err.max().item()} beyond the bound"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}x{c[2]}-w{int(c[3])}")
def test_triton_kernel_against_fp64(case, dtype):
    rows, k, shape, weighted, scale = case
    out, w = _inputs(rows, k, shape, weighted, dtype, seed=rows * 7 + k)
    y = torch.full((rows, *shape), float("nan"), dtype=dtype, device=DEVICE)
    row_len = math.prod(shape)
    kernels.topk_reduce(out.reshape(rows, k, row_len), w, scale, y.view(rows, row_len))
    _check(y, out, w, scale, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}x{c[2]}-w{int(c[3])}")
def test_dispatcher_and_reference_against_fp64(case, dtype):
    rows, k, shape, weighted, scale = case
    out, w = _inputs(rows, k, shape, weighted, dtype, seed=rows * 11 + k)
    _check(topk_reduce(out, w, scale, dtype), out, w, scale, dtype)
    _check(reference.topk_reduce(out, w, scale, dtype), out, w, scale, dtype)
    # bf16 partials from fp32 expert outputs: one rounding, at the end
    _check(topk_reduce(out.float(), w, scale, torch.bfloat16), out.float(), w, scale, torch.bfloat16)


def test_strided_expert_outputs_and_weights():
    """A transposed weights view and expert outputs sliced from a wider buffer reduce like contiguous ones."""
    out, _ = _inputs(6, 4, (256,), False, torch.bfloat16, seed=3)
    wide = torch.randn(6, 4, 512, device=DEVICE).to(torch.bfloat16)
    wide[..., :256] = out
    w = torch.rand(4, 6, device=DEVICE).t()
    _check(topk_reduce(wide[..., :256], w, 1.0, torch.bfloat16), out, w, 1.0, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(3, 0, 64), (4, 5, 96), (8, 7, 1030), (1, 3, 16)], ids=str)
@pytest.mark.parametrize("shared", [False, True])
def test_slot_sum_is_the_in_order_fp32_sum_bit_for_bit(shape, dtype, shared):
    """The overlapped boundary's sum (``rows.slot_sum``): the top-k kernel over the reduce buffer's slots as
    its k axis, scale 1, the shared output added before the one rounding, equals ``acc = 0; acc += slot_q``
    in rank order then ``+ shared``, rounded once (the P2P reduce-scatter's arithmetic), bit for bit; the
    rows past ``n`` in each slot (poisoned) are never read."""
    from nsa_cp.rows.slot_sum import slot_sum

    size, n, width = shape
    m = n + 2
    g = torch.Generator().manual_seed(size * 100 + n)
    slots = torch.full((size, m, width), float("nan"), dtype=dtype)
    slots[:, :n] = torch.randn((size, n, width), generator=g).to(dtype)
    slots = slots.to(DEVICE)
    add = torch.randn((n, width), generator=g).to(DEVICE) if shared else None
    acc = torch.zeros((n, width), dtype=torch.float32, device=DEVICE)
    for q in range(size):
        acc += slots[q, :n].float()
    if add is not None:
        acc += add
    want = acc.to(dtype)
    got = slot_sum(slots, n, add, dtype)
    assert got.shape == (n, width) and got.dtype == dtype
    assert torch.equal(got, want)
    if width and DEVICE.type == "cuda":  # the compiled kernel rounds to nearest even (the interpreter's cast
        # does not: exact_fp32's docstring), so it is bitwise where it runs compiled
        y = torch.full((n, width), float("nan"), dtype=dtype, device=DEVICE)
        if n:
            rows = slots.as_strided((n, size, width), (slots.stride(1), slots.stride(0), 1))
            kernels.topk_reduce(rows, None, 1.0, y, add)
        assert torch.equal(y, want)


def test_the_top_k_kernel_adds_the_shared_output_before_its_one_rounding():
    """``add`` joins the fp32 sum (within the fp64 bound: the interpreter's cast is not the compiled one's)."""
    out, w = _inputs(9, 3, (300,), True, torch.float32, seed=5)
    add = torch.randn(9, 300, device=DEVICE)
    y = torch.full((9, 300), float("nan"), dtype=torch.float32, device=DEVICE)
    kernels.topk_reduce(out, w, 2.0, y, add)
    exact, magnitude = _oracle(out, w, 2.0)
    err = (y.double() - exact - add.double()).abs()
    assert (err <= 5 * torch.finfo(torch.float32).eps * (magnitude + add.double().abs())).all()
