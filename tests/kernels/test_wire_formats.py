"""The wire formats as data (nsa_cp/geometry/wire.py, csrc/codes.h): one set of traits, read by the reference, the Triton
quantizer and the P2P kernels; the second format (``fp8_e4m3_g128_ue8m0``, vLLM's power-of-two scales) against an
oracle written here; and a format added with one table row, served end to end on gloo.

Without a GPU the Triton kernels run under TRITON_INTERPRET=1 on CPU tensors (conftest sets it); with one, on
CUDA. The P2P kernels' side (the same bytes over P2P, the fingerprint's format code) runs in the GPU line:
tests/support/p2p_gather_cases.py, p2p_fingerprint_cases.py ("format"), tests/native/test_native_gpu.py.
"""

import importlib.util
import re
from pathlib import Path

import pytest
import torch

import nsa_cp
from nsa_cp.geometry import wire

ROOT = Path(__file__).resolve().parents[2]
DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
UE8M0 = wire.FP8_E4M3_G128_UE8M0
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")


def _oracle_ue8m0(x: torch.Tensor):
    """vLLM's per_token_group_quant_fp8(use_ue8m0=True): scale = 2^ceil(log2(max(max(amax, 1e-10) / 448, 1e-10)))
    (fp64 here: ceil(log2) of an fp32 is exact in fp64), q = clamp(x / scale, +-448) as e4m3."""
    rows, h = x.shape
    g = x.float().reshape(rows, h // 128, 128)
    s = g.abs().amax(-1, keepdim=True).clamp_min(1e-10) / 448.0
    s = torch.exp2(torch.ceil(torch.log2(s.double().clamp_min(1e-10)))).float()
    q = (g / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.reshape(rows, h), s.reshape(rows, h // 128)


def _rows(dtype, rows=9, h=384, seed=0):
    """Random rows of several magnitudes, a zero row and a group under the amax floor."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, h, generator=g) * torch.logspace(-9, 3, rows).unsqueeze(1)
    x[2] = 0.0
    x[4, :128] = 1e-12
    return x.to(dtype)


def _codes_h_structs() -> dict:
    """csrc/codes.h's format structs: {kName: {trait: value}} and the WireFormats list, parsed as text."""
    text = (ROOT / "csrc" / "codes.h").read_text()
    found = {}
    for name, base, body in re.findall(r"struct (\w+)(?: : (\w+))? \{(.*?)\n\};", text, re.S):
        found[name] = {**found.get(base, {}), **dict(re.findall(r"static constexpr [\w\s*]+?(k\w+) = ([^;]+);", body))}
    structs = {name: traits for name, traits in found.items() if "kCode" in traits}
    listed = re.search(r"using WireFormats = FormatList<([^>]*)>;", text).group(1).replace(" ", "").split(",")
    return structs, listed


def _number(v: str) -> float:
    return float(v.rstrip("f")) if v not in ("true", "false") else v == "true"


def test_codes_h_repeats_every_python_format_exactly():
    structs, listed = _codes_h_structs()
    by_name = {t["kName"].strip('"'): (s, t) for s, t in structs.items()}
    assert listed[0] == "NoQuant" and by_name["QUANT_NONE"][1]["kCode"] == "0"
    assert {by_name[f.native_name][0] for f in wire.FORMATS.values()} | {"NoQuant"} == set(listed)
    for fmt in wire.FORMATS.values():
        _, t = by_name[fmt.native_name]
        got = {"name": fmt.native_name, "code": int(t["kCode"]), "group": int(t["kGroup"]),
               **{k: float(torch.tensor(_number(t[c]), dtype=torch.float32))
                  for k, c in (("max", "kMax"), ("amax_floor", "kAmaxFloor"), ("scale_floor", "kScaleFloor"))},
               "pow2_scales": _number(t["kPow2Scales"])}
        assert got == fmt.traits(), fmt
    codes = [f.code for f in wire.FORMATS.values()]
    assert len(set(codes)) == len(codes) and all(0 < c < 8 for c in codes)  # the fingerprint's 3 bits


def test_native_traits_agree_where_built():
    from nsa_cp.rows import _native

    C = _native.load()
    if C is None:
        pytest.skip("nsa_cp._C is not built here (its traits are checked as text above)")
    for fmt in wire.FORMATS.values():
        assert wire.native_mismatch(fmt, C) is None


def test_native_mismatch_names_what_differs():
    class C:
        WIRE_FORMATS = [dict(wire.FP8_E4M3_G128.traits(), max=240.0)]

    assert "max 240.0 != 448.0" in wire.native_mismatch(wire.FP8_E4M3_G128, C)
    assert "no kernels" in wire.native_mismatch(UE8M0, C)


def test_pow2_up_is_the_exact_ceiling():
    g = torch.Generator().manual_seed(3)
    s = torch.cat([torch.exp2(torch.arange(-40, 40).float()),  # powers of two stay
                   torch.exp2(torch.arange(-40, 40).float()) * (1 + 2.0 ** -23),  # one ulp above: the next power
                   torch.rand(10000, generator=g) * torch.exp2(torch.randint(-60, 60, (10000,), generator=g).float()),
                   torch.tensor([float("inf")])])
    want = torch.exp2(torch.ceil(torch.log2(s.double()))).float()
    assert torch.equal(wire.pow2_up(s), want)
    assert torch.isnan(wire.pow2_up(torch.tensor([float("nan")]))).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_ue8m0_reference_is_vllms_convention(dtype):
    x = _rows(dtype)
    q, s = UE8M0.quantize_reference(x)
    q_want, s_want = _oracle_ue8m0(x)
    assert torch.equal(s, s_want) and torch.equal(q.view(torch.uint8), q_want.view(torch.uint8))
    assert UE8M0.pad_scale == float(s_want[2, 0]) == 2.0 ** -33  # a zero group: 2^ceil(log2(1e-10))
    mant = s.view(torch.int32) & ((1 << 23) - 1)
    assert bool((mant == 0).all())  # every scale a power of two


def test_ue8m0_log2f_agrees_on_half_precision_rows():
    """The module docstring's claim: for every positive finite bf16 and fp16 amax, amax / 448 in fp32 is a power of
    two or lies at least 1e-4 (relative) above one, so vLLM's exp2f(ceilf(log2f(s))) rounds it as pow2_up does."""
    for dtype, bits in ((torch.bfloat16, torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16)),
                        (torch.float16, torch.arange(1, 0x7C00, dtype=torch.int32).to(torch.int16))):
        amax = bits.view(dtype).float()
        s = torch.maximum(amax.clamp_min(1e-10) / 448.0, torch.tensor(1e-10))
        frac = s.double() / torch.exp2(torch.floor(torch.log2(s.double()))) - 1
        assert bool(((frac == 0) | (frac >= 1e-4)).all()), dtype


@needs_triton
@pytest.mark.parametrize("quant", list(wire.FORMATS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_quantizer_is_the_reference_for_every_format(quant, dtype):
    fmt = wire.FORMATS[quant]
    x = _rows(dtype, seed=5)
    q, s = nsa_cp.quantize(x.to(DEVICE), quant)
    q_want, s_want = fmt.quantize_reference(x)
    assert torch.equal(q.cpu().view(torch.uint8), q_want.view(torch.uint8)) and torch.equal(s.cpu(), s_want)


@needs_triton
@pytest.mark.parametrize("quant", list(wire.FORMATS))
def test_triton_slot_writer_pads_with_the_formats_zero_scale(quant):
    from nsa_cp.rows import reference
    from nsa_cp.rows.kernels import norm_rows

    fmt = wire.FORMATS[quant]
    x, res = _rows(torch.bfloat16, rows=6, h=256, seed=7), _rows(torch.bfloat16, rows=6, h=256, seed=8)
    w = torch.rand(256, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    n, m = 4, 7
    q = torch.full((m, 256), float("nan"), device=DEVICE).to(torch.float8_e4m3fn)
    s = torch.full((m, 2), float("nan"), device=DEVICE)
    r = res.clone().to(DEVICE)
    count = torch.tensor([n], dtype=torch.int32, device=DEVICE)
    norm_rows.fused_add_rmsnorm_into(x.to(DEVICE), r, w.to(DEVICE), 1e-6, q, count, quant=quant, dst_scale=s)
    q_want, s_want = torch.empty_like(q, device="cpu"), torch.empty_like(s, device="cpu")
    reference.fused_add_rmsnorm_quant_into_slot(x, res.clone(), w, 1e-6, q_want, s_want, n, fmt)
    assert bool((s.cpu()[n:] == fmt.pad_scale).all()) and bool((q.cpu()[n:].view(torch.uint8) == 0).all())
    if DEVICE.type == "cpu":  # the interpreter runs the reference's arithmetic; CUDA is checked in the GPU line
        assert torch.equal(q.cpu().view(torch.uint8), q_want.view(torch.uint8)) and torch.equal(s.cpu(), s_want)


def test_bad_quant_names_the_choices():
    with pytest.raises(ValueError, match="fp8_e4m3_g128_ue8m0"):
        nsa_cp.quantize(torch.randn(2, 128), "fp8_e5m2")
    with pytest.raises(ValueError, match="x: fp8_e4m3_g128_ue8m0 needs H a multiple of 128, got shape \\[2, 100\\]"):
        nsa_cp.quantize(torch.randn(2, 100), UE8M0.name)


# ---- a third format, added as one row of nsa_cp.geometry.wire.FORMATS (group 64), served on gloo by the reference path
def _added_format_worker(rank, world, payload):
    import torch.distributed as dist

    from nsa_cp.geometry import wire as w

    fmt = w.WireFormat("fp8_e4m3_g64", "fp8_g64", 3, group=64, max_=448.0, amax_floor=1e-10)
    w.FORMATS[fmt.name] = fmt  # the row
    counts = payload["counts"]
    layout = nsa_cp.ShardLayout(counts)
    xs = [torch.randn(n, 192, generator=torch.Generator().manual_seed(11 + r)).to(torch.bfloat16)
          for r, n in enumerate(counts)]
    out = {}
    for compact in (False, True):
        q, s = nsa_cp.cp_all_gather(xs[rank], layout, compact=compact, quant=fmt.name)
        want_q, want_s = fmt.quantize_reference(torch.cat(xs))
        starts = [sum(counts[:r]) if compact else r * layout.max_rank_len for r in range(world)]
        real = torch.cat([torch.arange(n) + starts[r] for r, n in enumerate(counts)])
        ok = torch.equal(q[real].view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s[real], want_s)
        if not compact:
            pad = torch.ones(q.shape[0], dtype=torch.bool)
            pad[real] = False
            ok = ok and bool((q[pad].view(torch.uint8) == 0).all()) and bool((s[pad] == fmt.pad_scale).all())
        out[f"compact={compact}"] = ok and list(s.shape) == [q.shape[0], 3]
    dist.barrier()
    return out


def test_a_format_added_as_one_row_is_served():
    from dist_harness import run_world

    for world, counts in ((2, [3, 0]), (3, [2, 5, 1])):
        results = run_world(world, "gloo", _added_format_worker, {"counts": counts}, timeout_s=300)
        for rank, got in enumerate(results):
            assert got == {"compact=False": True, "compact=True": True}, (world, rank, got)
