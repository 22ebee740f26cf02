"""vLLM 0.34's Blackwell DeepSeek-V3.2 FP8 path (``TrtLlmFp8ExpertsMonolithic``) through nsa_cp's FP8 wire, on
CPU / gloo, worlds 2, 3 and 4.

For FP8 128x128 block weights vLLM's selector on Blackwell picks ``FLASHINFER_TRTLLM``, and its quant config
(``oracle/fp8.py`` ``make_fp8_moe_quant_config``, called here as vLLM calls it) sets ``is_scale_transposed``:
``_quantize_input`` -> ``moe_kernel_quantize_input`` -> ``_fp8_quantize`` -> ``per_token_group_quant_fp8(x,
128, column_major_scales=True)`` before the PCP gather, UE8M0 (power-of-two) scales where
``is_deep_gemm_e8m0_used()`` (the default on Blackwell) and fp32 scales as they come otherwise. vLLM's CUDA
all-gather (``cuda_communicator.py`` ``all_gather``, the pynccl path) makes its input contiguous, so the
experts receive row-major ``[P*M, H/128]`` scales, which ``TrtLlmFp8ExpertsMonolithic`` transposes itself
(``a1q_scale.t().contiguous()``).

What is vLLM's own here: the quant config, parallel state, ``PCPManager.partition_batch``,
``_maybe_dispatch`` / ``_maybe_combine`` and the quantizer chain. What stands in for the CUDA build:

* the quantizer's arithmetic: vLLM's CPU path is its Triton fallback (it multiplies by ``1 / 448``, and the
  Triton interpreter's fp8 cast does not round to nearest even), which a CUDA worker never takes. The CUDA
  kernel's arithmetic and allocation (``column_major_scales`` included) are transcribed in
  ``vllm_env.cuda_group_quant``: the comparison is against the CUDA arithmetic;
* the all-gather: gloo carries no float8, and the CUDA communicator's ``.contiguous()`` is mirrored
  (``vllm_env.cuda_like_gather``);
* the experts: a per-row stand-in that consumes what the monolithic experts consume (it transposes the scales
  as they do, routes from the gathered logits, computes every row, padding rows included).

Checked: with the plugin on, ``(q, logits, scale)`` is bitwise vLLM's own ``_maybe_dispatch`` run on the same
rows with zero padding rows (every row: nsa_cp writes what vLLM's quantizer gives a zero row), and on the real
rows bitwise vLLM's on the unmodified rows; ``scale`` is fp32, row-major contiguous; the combine's real rows
match vLLM's within an fp32 sum's rounding; compact gives the real rows alone; ``status()`` names the path.
"""

from __future__ import annotations

import functools
import zlib

import torch

import vllm_env
from dist_harness import run_cases

H, E, TOPK = 512, 8, 2
STEPS = {
    "uneven": ([37, 1, 1, 1, 10], [True, False, False, False, True], None),
    "zero-token-ranks": ([1], [False], None),
    "even": ([48], [True], None),
    "graph-bucket": ([37, 1, 1, 1, 10], [True, False, False, False, True], 48),
}
QUANTIZES_FIRST = vllm_env.quantizes_first()


def _hidden(step, rank, rows):
    g = torch.Generator().manual_seed(zlib.crc32(f"trtllm:{step}:{rank}".encode()))
    x = torch.randn(rows, H, generator=g) * torch.logspace(-3, 3, H)
    x[: min(rows, 1), :128] = 0.0  # an all-zero group: the amax floor
    return x.to(torch.bfloat16)


def _quantizer(ue8m0: bool):
    import vllm.model_executor.layers.fused_moe.utils as moe_utils
    from vllm.model_executor.layers.quantization.utils import fp8_utils

    moe_utils.per_token_group_quant_fp8 = functools.partial(vllm_env.cuda_group_quant, use_ue8m0=ue8m0)
    fp8_utils.is_deep_gemm_e8m0_used = lambda: ue8m0


def monolithic_stand_in(rank):
    """The per-row work of ``TrtLlmFp8ExpertsMonolithic`` as far as its inputs go: the scales transposed as it
    transposes them, each row dequantized, routed from its logits (top-2 softmax) and sent through this
    rank's experts. Row-independent, so padding rows change nothing but their own outputs."""
    experts = torch.randn(E, H, H, generator=torch.Generator().manual_seed(7 + rank)) / H**0.5

    def run(q, logits, scale):
        s = scale.t().contiguous()  # [G, rows], what the kernel receives
        x = (q.float().reshape(q.shape[0], -1, 128) * s.t().float().reshape(q.shape[0], -1, 1)).reshape(q.shape)
        w, ids = torch.softmax(logits.float(), -1).topk(TOPK, dim=-1)
        out = torch.zeros_like(x)
        for k in range(TOPK):
            out += w[:, k : k + 1] * torch.einsum("rh,rhk->rk", x, experts[ids[:, k]])
        return out

    return run


def _logits(h):
    return (h.float() @ torch.linspace(-1, 1, H * E).reshape(H, E)) / H


def _layer(config, local, h, runner, consume, logits):
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    with set_forward_context(None, config, is_padding=local.is_padding):
        q, lg, scale = vllm_env.dispatch(runner, h, logits)
        out = MoERunner._maybe_combine(runner, None, consume(q, lg, scale))
    return q, lg, scale, out


def _bytes(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _check(rank, world, config, name, compact, ue8m0):
    import nsa_cp.integrations.vllm as nsa_vllm

    lens, prefill, bucket = STEPS[name]
    _quantizer(ue8m0)
    qc = vllm_env.trtllm_quant_config()
    assert qc.is_scale_transposed and qc.block_shape == [128, 128], "vLLM's TRTLLM config: column-major scales"
    runner = vllm_env.runner(world, quant_config=qc)
    consume = monolithic_stand_in(rank)

    local, m, n, counts = vllm_env.step_off(rank, world, lens, prefill, bucket)
    h = _hidden(name, rank, m)
    off = _layer(config, local, h, runner, consume, _logits(h))
    zeroed = h.clone()
    zeroed[n:] = 0  # the same rows with zero padding rows, the same router logits
    off_zero = _layer(config, local, zeroed, runner, consume, _logits(h))

    with vllm_env.plugin_on(compact):
        local_on = vllm_env.partition(vllm_env.manager(rank, world), lens, prefill, bucket)
        on = _layer(config, local_on, h, runner, consume, _logits(h))
        status = nsa_vllm.status()

    q, lg, scale = on[:3]
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32, (q.dtype, scale.dtype)
    assert scale.is_contiguous() and scale.stride() == (H // 128, 1), ("row-major scales", scale.stride())
    assert off[2].is_contiguous(), "vLLM's own gather returns row-major scales (the CUDA communicator's contiguous)"
    if compact:
        real = torch.cat([torch.arange(r * m, r * m + counts[r]) for r in range(world)])
        for got, want in zip(on[:3], off_zero[:3]):
            assert torch.equal(_bytes(got), _bytes(want[real])), "compact: vLLM's real rows, in rank order"
        assert q.shape[0] == sum(counts)
    else:
        for i, what in enumerate(("q", "router logits", "scale")):  # every row, padding rows included
            assert torch.equal(_bytes(on[i]), _bytes(off_zero[i])), f"{what}: bitwise vLLM's _maybe_dispatch"
        for r in range(world):
            rows = slice(r * m, r * m + counts[r])
            assert torch.equal(_bytes(q[rows]), _bytes(off[0][rows])) and torch.equal(scale[rows], off[2][rows])
    largest = float(off[3][:n].abs().amax()) if n else 0.0
    torch.testing.assert_close(on[3][:n], off[3][:n], rtol=1e-5, atol=1e-6 * largest + 1e-12)
    assert not on[3][n:].any(), "rows past the real count are zero"
    fmt = "fp8_e4m3_g128_ue8m0" if ue8m0 else "fp8_e4m3_g128"
    kind = f"{'compact' if compact else 'padded'} {fmt} (scales column-major at quantization)"
    assert status["gathers"] == {kind: 1} and not status["declined"], status
    assert status["first_use"]["checked"] == {f"dispatch {kind}": 1, f"combine {kind.split()[0]}": 1}, status
    assert not status["first_use"]["declined"], status["first_use"]


def _worker(rank, world, payload):
    vllm_env.prepare_process()
    config, pcp = vllm_env.setup_parallel(rank, world)
    vllm_env.cuda_like_gather(pcp)
    return run_cases({key: (rank, world, config, *args) for key, args in payload.items()}, _check)


CASES = {
    w: {f"{s}-{lay}-{sc}": (s, lay == "compact", sc == "ue8m0") for s in STEPS for lay in ("padded", "compact")
        for sc in ("fp32", "ue8m0")}
    for w in (2, 3, 4)
} if QUANTIZES_FIRST else {}


if QUANTIZES_FIRST:  # vLLM 0.33 never quantizes before the gather: no cases there
    test_vllm_trtllm_monolithic_dispatch_is_vllms = vllm_env.case_test(_worker, CASES)
