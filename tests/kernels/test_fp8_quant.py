"""nsa_cp.rows.quant: the public FP8 per-token-group quantizer (SGLang's per_token_group_quant_fp8 convention).

The reference against hand-computed values; the public function against the reference (bitwise, on CPU and,
through the Triton kernel, on CUDA); its argument errors; dequantization; the round-trip bound; the layout
flashinfer's FP8 block-scale MoE takes (scales transposed to [H/128, T]).
"""

import pytest
import torch

from nsa_cp.rows import quant, reference

CUDA = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if CUDA else [])
FP8 = torch.float8_e4m3fn


def randn(shape, dtype, seed, device="cpu", scale=1.0):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(shape, generator=g, dtype=torch.float64)
    v = torch.where(v.abs() < 0.05, torch.copysign(torch.full_like(v, 0.05), v), v)
    return (v * scale).to(dtype).to(device)


def test_reference_by_hand():
    """One row, two groups: amax 448 (scale 1, q = round(x)) and amax 1e-12 (floored to 1e-10)."""
    x = torch.zeros(1, 256, dtype=torch.float32)
    # e4m3 spacing is 2 in [16, 32): -17 is a tie -> -16 (even mantissa), 17.5 -> 18; 0.3 -> 0.3125 (spacing 1/32)
    x[0, 0], x[0, 1], x[0, 2], x[0, 3] = 448.0, -17.0, 17.5, 0.3
    x[0, 128], x[0, 129] = 1e-12, -5e-13
    q, scale = reference.quant_fp8_g128(x)
    assert scale.shape == (1, 2) and scale.dtype == torch.float32
    assert scale[0, 0].item() == 1.0
    assert scale[0, 1].item() == reference.FP8_PAD_SCALE == float(torch.tensor(1e-10, dtype=torch.float32) / 448)
    assert q[0, :4].float().tolist() == [448.0, -16.0, 18.0, 0.3125]
    assert q[0, 4:128].float().abs().sum().item() == 0
    # 1e-12 / (1e-10/448) = 4.48 -> 4.5 in e4m3 (spacing 0.5 between 4 and 8)
    assert q[0, 128].float().item() == 4.5 and q[0, 129].float().item() == -2.25


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("rows,h", [(7, 384), (1, 128), (0, 256), (5, 1152), (33, 7168)])
def test_public_quant_matches_reference(device, dtype, rows, h):
    x = randn((rows, h), dtype, rows + h, device)
    if rows > 2:
        x[1, :128] = randn((128,), dtype, 1, device, scale=1e-12 if dtype != torch.float16 else 1e-7)
        x[2] = randn((h,), dtype, 2, device, scale=1e3)
    q, scale = quant.quant_fp8_g128(x)
    want_q, want_scale = reference.quant_fp8_g128(x.cpu())
    assert q.device == x.device and q.dtype == FP8 and scale.dtype == torch.float32
    assert q.shape == (rows, h) and scale.shape == (rows, h // 128)
    assert torch.equal(q.cpu().view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scale.cpu(), want_scale)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_round_trip_bound(device, dtype):
    """|x - dequant(q, scale)| <= 2^-4 |x| + 2^-10 scale (nearest e4m3: 3 mantissa bits; subnormal spacing 2^-9),
    plus one rounding to the output dtype."""
    x = randn((9, 512), dtype, 3, device)
    x[4] = randn((512,), dtype, 4, device, scale=1e-4)
    q, scale = quant.quant_fp8_g128(x)
    back32 = quant.dequant_fp8_g128(q, scale, torch.float32).double()
    xs = x.double()
    bound = xs.abs() * 2.0**-4 + scale.double().repeat_interleave(128, dim=1) * 2.0**-10
    assert bool(((back32 - xs).abs() <= bound * (1 + 1e-6)).all())
    back = quant.dequant_fp8_g128(q, scale)  # bf16 by default, one rounding of the fp32 product
    assert back.dtype == torch.bfloat16 and torch.equal(back, back32.float().to(torch.bfloat16))


def test_padding_rows_dequantize_to_zero():
    q = torch.zeros(3, 256, dtype=torch.uint8).view(FP8)
    scale = torch.full((3, 2), reference.FP8_PAD_SCALE)
    assert torch.equal(quant.dequant_fp8_g128(q, scale), torch.zeros(3, 256, dtype=torch.bfloat16))
    got_q, got_scale = quant.quant_fp8_g128(torch.zeros(3, 256))
    assert torch.equal(got_q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(got_scale, scale)


def test_quantizing_before_the_gather_equals_quantizing_the_gathered_rows():
    """Per row: quantizing each rank's shard and stacking equals quantizing the stacked rows."""
    shards = [randn((n, 256), torch.bfloat16, 10 + n) for n in (5, 0, 3)]
    parts = [quant.quant_fp8_g128(s) for s in shards]
    q_all, s_all = quant.quant_fp8_g128(torch.cat(shards))
    assert torch.equal(torch.cat([p[0] for p in parts]).view(torch.uint8), q_all.view(torch.uint8))
    assert torch.equal(torch.cat([p[1] for p in parts]), s_all)


def test_flashinfer_scale_layout():
    """trtllm_fp8_block_scale_moe takes hidden_states_scale as fp32 [H/128, T], contiguous: scale.t().contiguous()."""
    x = randn((5, 384), torch.bfloat16, 20)
    q, scale = quant.quant_fp8_g128(x)
    handed = scale.t().contiguous()
    assert handed.shape == (3, 5) and handed.is_contiguous()
    for t in range(5):
        for g in range(3):
            assert handed[g, t] == x[t, g * 128 : (g + 1) * 128].float().abs().max() / 448


@pytest.mark.parametrize(
    "x,words",
    [
        (torch.randn(4, 200), r"x: fp8_e4m3_g128 needs H a multiple of 128, got shape \[4, 200\]"),
        (torch.randn(4, 2, 128), r"x: expected a 2-D \[rows, H\] tensor for fp8_e4m3_g128, got shape \[4, 2, 128\]"),
        (torch.ones(4, 128, dtype=torch.int32), r"x: fp8_e4m3_g128 expects bfloat16, float16 or float32, got torch.int32 \(shape \[4, 128\]\)"),
        (torch.randn(4, 128, dtype=torch.float64), r"x: fp8_e4m3_g128 expects .* got torch.float64"),
    ],
)
def test_bad_input(x, words):
    with pytest.raises(ValueError, match=words):
        quant.quant_fp8_g128(x)


def test_dequant_bad_input():
    q = torch.zeros(2, 256, dtype=torch.uint8).view(FP8)
    with pytest.raises(ValueError, match=r"scale: expected float32 \[2, 2\] \(q's groups\), got torch.float32 \[2, 3\]"):
        quant.dequant_fp8_g128(q, torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"q: expected float8_e4m3fn \[rows, H\]"):
        quant.dequant_fp8_g128(torch.zeros(2, 256), torch.ones(2, 2))


def test_autograd_history_is_ignored():
    x = randn((2, 128), torch.float32, 30).requires_grad_(True)
    q, scale = quant.quant_fp8_g128(x * 2)
    assert not q.requires_grad and not scale.requires_grad


@pytest.mark.parametrize("device", DEVICES)
def test_wire_views(device):
    """q and scale as views of one uint8 row buffer: written by the quantizer's reference, read back intact."""
    h, rows = 384, 5
    assert quant.fp8_wire_row_bytes(h) == 384 + 12 and quant.fp8_wire_row_bytes(7168) == 7168 + 224
    wire = torch.full((2 * rows, quant.fp8_wire_row_bytes(h)), 0xEE, dtype=torch.uint8, device=device)
    q, scale = quant.fp8_wire_views(wire[rows:], h)
    assert q.shape == (rows, h) and scale.shape == (rows, 3) and q.dtype == FP8 and scale.dtype == torch.float32
    assert q.data_ptr() == wire[rows:].data_ptr() and scale.data_ptr() == wire[rows:].data_ptr() + h
    x = randn((rows, h), torch.bfloat16, 40, device)
    want_q, want_scale = quant.quant_fp8_g128(x)
    q.copy_(want_q)
    scale.copy_(want_scale)
    assert torch.equal(wire[:rows], torch.full_like(wire[:rows], 0xEE))
    got_q, got_scale = quant.fp8_wire_views(wire[rows:], h)
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(got_scale, want_scale)
    with pytest.raises(ValueError, match=r"wire: expected uint8 \[rows, 396\] for H=384"):
        quant.fp8_wire_views(wire[:, :390], h)
    with pytest.raises(ValueError, match="h: fp8_e4m3_g128 needs H a multiple of 128, got 200"):
        quant.fp8_wire_row_bytes(200)
