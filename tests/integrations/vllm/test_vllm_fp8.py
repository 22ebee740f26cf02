"""vLLM 0.34's quantized PCP gather with nsa_cp's plugin on and off, on CPU / gloo, worlds 2, 3 and 4.

vLLM 0.34 quantizes each rank's rows before the PCP all-gather when its experts take dynamic per-token-group
FP8 input (``_quantizes_before_pcp_gather``), then gathers the FP8 rows and their scales. With the plugin on,
nsa_cp's gather quantizes the real rows inside the gather (``quant="fp8_e4m3_g128"``, or with vLLM's UE8M0
scales ``"fp8_e4m3_g128_ue8m0"``). Each step is vLLM's
own (parallel state, ``PCPManager.partition_batch``, ``_maybe_dispatch`` / ``_maybe_combine``, its
``_quantize_input`` -> ``moe_kernel_quantize_input`` -> ``per_token_group_quant_fp8`` chain and its
``FusedMoEQuantConfig``), except the quantizer's arithmetic: a CPU has no vLLM CUDA kernel, so the kernel
that ``per_token_group_quant_fp8`` launches on a CUDA GPU is transcribed in torch (``vllm_env.cuda_group_quant``),
and gloo, which carries no float8, moves vLLM's FP8 rows as their bytes (``_fp8_over_gloo``).

* served (e4m3, groups of 128, fp32 row-major scales, as they come or UE8M0): on every real row the FP8 bytes and the scales the
  experts receive are bitwise vLLM's own, padded and compact; nsa_cp's padding rows hold ``q = 0`` and the
  pad scale; the combine's real rows match vLLM's (an fp32 sum) and the routers' mask is vLLM's again after;
* not served (groups of 32): vLLM's own moves, bitwise, the reason in ``status()``. Column-major
  scales at quantization (the TRTLLM monolithic experts) are served: test_vllm_trtllm.py.

Only where vLLM 0.34 (a contract with a quantized dispatch) is installed: 0.33 never quantizes before the
gather, so these cases are not generated there (its venv runs the other vLLM tests).
"""

from __future__ import annotations

import functools
import types
import zlib

import torch

import vllm_env
from dist_harness import run_cases

H, E = 256, 8
STEPS = {
    "uneven": ([37, 1, 1, 1, 10], [True, False, False, False, True], None),
    "zero-token-ranks": ([1], [False], None),
    "even": ([48], [True], None),
    "graph-bucket": ([37, 1, 1, 1, 10], [True, False, False, False, True], 48),
}
QUANTIZES_FIRST = str(vllm_env.version() or "").startswith("0.34")


def _hidden(step, rank, rows):
    g = torch.Generator().manual_seed(zlib.crc32(f"fp8:{step}:{rank}".encode()))
    x = torch.randn(rows, H, generator=g) * torch.logspace(-3, 3, H)  # groups of very different ranges
    x[: min(rows, 1), :128] = 0.0  # an all-zero group: the amax floor
    return x.to(torch.bfloat16)


def _quantizer(ue8m0: bool):
    """vLLM's quantizer with its CUDA kernel's arithmetic (module docstring), bound where vLLM calls it."""
    import vllm.model_executor.layers.fused_moe.utils as moe_utils
    from vllm.model_executor.layers.quantization.utils import fp8_utils

    moe_utils.per_token_group_quant_fp8 = functools.partial(vllm_env.cuda_group_quant, use_ue8m0=ue8m0)
    fp8_utils.is_deep_gemm_e8m0_used = lambda: ue8m0  # vLLM's own answer, which nsa_cp's plugin asks


def _fp8_over_gloo(pcp_group) -> None:
    """gloo carries no float8 (NCCL does): vLLM's PCP all-gather moves FP8 rows as their bytes here."""
    gather = pcp_group.all_gather

    def all_gather(t, dim=0):
        if t.dtype == torch.float8_e4m3fn:
            return gather(t.view(torch.uint8), dim).view(t.dtype)
        return gather(t, dim)

    pcp_group.all_gather = all_gather


def _layer(config, local, h, runner, partial_of):
    from vllm.forward_context import get_forward_context, set_forward_context
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    logits = h.float() @ torch.ones(H, E) / H
    with set_forward_context(None, config, is_padding=local.is_padding):
        q, lg, scale = vllm_env.dispatch(runner, h, logits)
        out = MoERunner._maybe_combine(runner, None, partial_of(q, scale))
        after = get_forward_context().is_padding
    return q, lg, scale, out, after


def _check(rank, world, config, name, compact, variant):
    import nsa_cp
    import nsa_cp.integrations.vllm as nsa_vllm

    lens, prefill, bucket = STEPS[name]
    _quantizer(ue8m0=variant == "ue8m0")
    runner = vllm_env.runner(world, quant_config=vllm_env.fp8_quant_config(block=(1, 32) if variant == "group32"
                                                                           else (128, 128)))
    weight = torch.randn(H, H, generator=torch.Generator().manual_seed(99 + rank)) / H**0.5

    def partial_of(q, scale):  # this rank's expert shard on the dequantized rows: row-independent
        group = q.shape[1] // scale.shape[1]
        return (q.float().reshape(q.shape[0], -1, group) * scale.reshape(q.shape[0], -1, 1)).reshape(q.shape) @ weight

    local, m, n, counts = vllm_env.step_off(rank, world, lens, prefill, bucket)
    h = _hidden(name, rank, m)
    off = _layer(config, local, h, runner, partial_of)

    with vllm_env.plugin_on(compact):
        local_on = vllm_env.partition(vllm_env.manager(rank, world), lens, prefill, bucket)
        on = _layer(config, local_on, h, runner, partial_of)
        status = nsa_vllm.status()

    assert off[0].dtype == torch.float8_e4m3fn and off[2].dtype == torch.float32, (off[0].dtype, off[2].dtype)
    if variant == "group32":  # a format nsa_cp's wire does not carry: vLLM's own moves, bitwise, the reason said
        for a, b in zip(off[:4], on[:4]):
            assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                               b.view(torch.uint8) if b.element_size() == 1 else b)
        assert any("block [1, 32]" in k for k in status["declined"]), status["declined"]
        assert not status["gathers"], status
        return
    offsets = [sum(counts[:q]) for q in range(world)]
    padding = torch.ones(on[0].shape[0], dtype=torch.bool)
    for q in range(world):
        theirs = slice(q * m, q * m + counts[q])
        mine = slice(offsets[q], offsets[q] + counts[q]) if compact else theirs
        padding[mine] = False
        assert torch.equal(on[0][mine].view(torch.uint8), off[0][theirs].view(torch.uint8)), f"rank {q}'s bytes"
        assert torch.equal(on[2][mine], off[2][theirs]), f"rank {q}'s scales"
    fmt = nsa_cp.geometry.wire.FP8_E4M3_G128_UE8M0 if variant == "ue8m0" else nsa_cp.geometry.wire.FP8_E4M3_G128
    ref_q, ref_s = nsa_cp.quantize(h[:n], fmt.name)
    start = offsets[rank] if compact else rank * m
    assert torch.equal(on[0][start : start + n].view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(on[2][start : start + n], ref_s)
    assert on[0].shape[0] == (sum(counts) if compact else world * m) == on[1].shape[0] == on[2].shape[0]
    assert not on[0][padding].view(torch.uint8).any(), "padding rows: q = 0"
    assert torch.equal(on[2][padding], torch.full_like(on[2][padding], fmt.pad_scale))
    # the same partials summed in fp32 in another order: within a few fp32 ulps of the row's largest value
    largest = float(off[3][:n].abs().amax()) if n else 0.0
    torch.testing.assert_close(on[3][:n], off[3][:n], rtol=1e-5, atol=1e-6 * largest + 1e-12)
    assert not on[3][n:].any(), "rows past the real count are zero"
    assert on[4] is local_on.is_padding, "forward_context.is_padding must be vLLM's again after the combine"
    kind = ("compact" if compact else "padded") + " " + fmt.name
    assert status["gathers"] == {kind: 1} and not status["declined"], status


def _worker(rank, world, payload):
    vllm_env.prepare_process()
    config, pcp = vllm_env.setup_parallel(rank, world)
    _fp8_over_gloo(pcp)
    return run_cases({key: (rank, world, config, *args) for key, args in payload.items()}, _check)


CASES = {
    w: {**{f"{s}-{lay}": (s, lay == "compact", "served") for s in STEPS for lay in ("padded", "compact")},
        **{f"{s}-{lay}-ue8m0": (s, lay == "compact", "ue8m0") for s in ("uneven", "zero-token-ranks")
           for lay in ("padded", "compact")},
        "uneven-group32-declined": ("uneven", False, "group32")}
    for w in (2, 3, 4)
} if QUANTIZES_FIRST else {}


if QUANTIZES_FIRST:  # defined only where vLLM quantizes before the gather: no empty parameter set elsewhere
    test_vllm_fp8_quantized_gather_plugin_on_equals_off = vllm_env.case_test(_worker, CASES)


def test_fp8_wire_declines_what_it_does_not_carry(monkeypatch):
    """nsa_cp's choice from vLLM's quant config alone (no vLLM needed): only e4m3 / 128 / fp32 row-major, its
    scales as they come or UE8M0."""
    from nsa_cp.integrations.vllm import contract, moe, runtime

    monkeypatch.setattr(moe, "CONTRACT", [contract.V0_34])
    monkeypatch.setattr(moe, "_WIRE", {})
    monkeypatch.setattr(runtime, "fp8_scales_ue8m0", lambda: False)
    monkeypatch.setattr(runtime, "fp8_max", lambda: 448.0)
    fp8 = dict(quant_dtype=torch.float8_e4m3fn, block_shape=[128, 128], is_scale_transposed=False, use_nvfp4_w4a4=False)

    def verdict(**changes):
        return moe.fp8_wire(vllm_env.runner(2, quant_config=types.SimpleNamespace(**{**fp8, **changes})))

    assert verdict() == ("fp8_e4m3_g128", None)
    assert "NVFP4" in verdict(use_nvfp4_w4a4=True, quant_dtype="nvfp4")[1]
    assert "block [1, 64]" in verdict(block_shape=[1, 64])[1]
    # TRTLLM's column-major scales at quantization: served (vLLM's CUDA gather hands the experts row-major scales)
    assert verdict(is_scale_transposed=True) == ("fp8_e4m3_g128", None)
    assert "MXFP8" in verdict(quant_dtype="mxfp8", block_shape=[1, 32])[1]
    monkeypatch.setattr(runtime, "fp8_scales_ue8m0", lambda: True)
    assert verdict() == ("fp8_e4m3_g128_ue8m0", None)
    monkeypatch.setattr(runtime, "fp8_scales_ue8m0", lambda: False)
    monkeypatch.setattr(runtime, "fp8_max", lambda: 224.0)
    assert "fp8 max 224.0" in verdict()[1]
    config = types.SimpleNamespace(**fp8)  # decided once per quant config (a layer's is fixed)
    first = moe.fp8_wire(vllm_env.runner(2, quant_config=config))
    monkeypatch.setattr(runtime, "fp8_max", lambda: 448.0)
    assert moe.fp8_wire(vllm_env.runner(2, quant_config=config)) == first
    assert moe.fp8_wire(vllm_env.runner(2)) == (None, None)  # unquantized experts: nothing to quantize
    monkeypatch.setattr(moe, "CONTRACT", [contract.V0_33])
    assert moe.fp8_wire(vllm_env.runner(2, quant_config=types.SimpleNamespace(**fp8))) == (None, None)
