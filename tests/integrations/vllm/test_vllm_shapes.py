"""nsa_cp's side of the vLLM plugin with vLLM-shaped layouts, without vLLM: the moves of
``nsa_cp.integrations.vllm.moe`` on DualChunkSwap counts (prefills in 2P chunks, rank r taking chunks r
and 2P-1-r, decodes round-robin; every rank padded to M = max(counts), or to a CUDA-graph bucket),
three MoE layers back to back (an odd number: both P2P gather buffers, then the first again).

* On CPU (gloo, worlds 2, 4 and 8): nsa_cp's torch.distributed path; runs everywhere.
* On one GPU (worlds 2, 4 and 8 ranks sharing it; a gloo group and the P2P transport over CUDA IPC,
  NSA_CP_P2P_MEMORY=cuda_ipc): the P2P path of the uneven steps, as in a vLLM worker with the plugin's
  transport (the router logits' compact gather on CPU tensors there). Skips cleanly without CUDA or
  nsa_cp._C.

vLLM's runtime lookups (forward context, PCP group) are replaced by stand-ins with vLLM's field names:
tests/integrations/vllm/test_vllm_moe.py runs the same moves against vLLM's own code on gloo. Checked per
layer: every rank's real rows gathered exactly (padding rows zero, compact rows at their offsets), the
reduce-scatter against a float64 sum, rows past the real count zero, the routers' mask swapped for the
compact rows during the MoE and vLLM's own after, and earlier results unchanged by later layers. The ``-fp8``
cases take vLLM 0.34's contract with experts quantized before the gather: the gather returns
``(q, logits, scale)`` with every real row's FP8 bytes and scales those of the reference quantizer (on the GPU:
nsa_cp's quantizer fused into the P2P gather), padding rows ``q = 0`` and the pad scale.
"""

from __future__ import annotations

import types

import pytest
import torch

import vllm_env
from dist_harness import case_failures, rank_device, run_cases, run_world
from nsa_cp.rows import _native

H = 256
LAYERS = 3
STEPS = {  # name -> (query lens, prefilling, extra rows of a CUDA-graph bucket or None)
    "uneven": ([37, 1, 1, 1, 10], [True, False, False, False, True], None),
    "graph-bucket": ([37, 1, 1, 1, 10], [True, False, False, False, True], 5),
    "zero-token-ranks": ([1], [False], None),
    "even": ([128], [True], None),
}
# an even step takes the plain collective, not P2P (backend "auto"): on the GPU that is NCCL, which ranks sharing
# one GPU cannot run, so the shared-GPU world runs the uneven steps (the gloo worlds run them all)
STEPS_ON = {False: tuple(STEPS), True: tuple(s for s in STEPS if s != "even")}
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def dual_chunk_swap_counts(lens, prefilling, pcp):
    """vLLM 0.33.0's per-rank counts (``PCPManager._iter_rank_chunks`` with sharded decodes, no DCP)."""
    counts, decode = [0] * pcp, 0
    for length, prefill in zip(lens, prefilling):
        if prefill:
            chunk = -(-length // (2 * pcp))
            for r in range(pcp):
                for index in (r, 2 * pcp - 1 - r):
                    counts[r] += max(0, min(chunk, length - index * chunk))
        else:
            counts[decode % pcp] += length
            decode += 1
    return counts


class _PCPGroup:
    """vLLM's PCP GroupCoordinator, as far as the moves read it (its all_gather: the padded logits)."""

    def __init__(self, world):
        import torch.distributed as dist

        self.world_size, self.rank_in_group, self.device_group = world, dist.get_rank(), None

    def all_gather(self, x, dim=0):
        import torch.distributed as dist

        parts = [torch.empty_like(x.cpu()) for _ in range(self.world_size)]
        dist.all_gather(parts, x.cpu())
        return torch.cat(parts, dim=dim).to(x.device)


def _rand(seed, rows, cols, dtype, device):
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


FP8_CONFIG = types.SimpleNamespace(quant_dtype=torch.float8_e4m3fn, block_shape=[128, 128], is_scale_transposed=False,
                                   use_nvfp4_w4a4=False)


def _fp8_rows(x):
    """The reference quantizer on the CPU: ``(q bytes, scale)`` of ``x``'s rows."""
    from nsa_cp.geometry.wire import FP8_E4M3_G128

    q, scale = FP8_E4M3_G128.quantize_reference(x.cpu())
    return q.view(torch.uint8), scale


def _check(rank, world, name, dtype, compact, device, fp8=False):
    from nsa_cp.integrations.vllm import contract, moe, runtime, step
    from nsa_cp.geometry.wire import FP8_PAD_SCALE

    lens, prefilling, extra = STEPS[name]
    counts = dual_chunk_swap_counts(lens, prefilling, world)
    m = max(counts) + (extra or 0)
    n, total, off = counts[rank], sum(counts), [sum(counts[:q]) for q in range(world)]
    mask = (torch.arange(m)[None, :] >= torch.tensor(counts)[:, None]).reshape(-1).to(device)
    context = types.SimpleNamespace(is_padding=mask)
    group = _PCPGroup(world)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runtime, "forward_context", lambda: context)
        mp.setattr(runtime, "pcp_group", lambda: group)
        mp.setattr(runtime, "pcp_device_group", lambda: None)
        mp.setattr(runtime, "pcp_rank", lambda: rank)
        mp.setattr(runtime, "pcp_size", lambda: world)
        mp.setenv("NSA_CP_VLLM_COMPACT", "1" if compact else "0")
        if fp8:  # vLLM 0.34's contract, experts that take per-token-group FP8 quantized before the gather
            mp.setattr(moe, "CONTRACT", [contract.V0_34])
            mp.setattr(runtime, "fp8_scales_ue8m0", lambda: False)
            mp.setattr(runtime, "fp8_max", lambda: 448.0)
        step.set_current(step.StepLayout.from_counts(counts, m, mask))
        runner = vllm_env.runner(world, quant_config=FP8_CONFIG if fp8 else None)
        kept = []
        for layer in range(LAYERS):
            hs = [_rand(100 * layer + q, m, H, dtype, device) for q in range(world)]
            # on the shared GPU the logits stay on the CPU: their gather is nsa_cp's torch.distributed path, which
            # the ranks' gloo group serves on CPU tensors (a vLLM worker's NCCL group serves them on its GPU)
            logits = [_rand(100 * layer + 50 + q, m, 8, torch.float32, "cpu") for q in range(world)]
            for q in range(world):  # vLLM's padding rows carry computed values, never zeros
                hs[q][counts[q]:] = 1e3
            hg, lg, *scale = moe.dispatch(None, runner, hs[rank], logits[rank])
            rows = total if compact else world * m
            assert hg.shape == (rows, H) and lg.shape[0] == rows, (hg.shape, lg.shape)
            if fp8:  # the bytes and scales of the reference quantizer on every real row; padding q = 0
                scale = scale[0]
                assert hg.dtype == torch.float8_e4m3fn and scale.shape == (rows, H // 128), (hg.dtype, scale.shape)
                for q in range(world):
                    start = off[q] if compact else q * m
                    want_q, want_s = _fp8_rows(hs[q][: counts[q]])
                    assert torch.equal(hg[start : start + counts[q]].view(torch.uint8).cpu(), want_q), f"rank {q}'s q"
                    assert torch.equal(scale[start : start + counts[q]].cpu(), want_s), f"rank {q}'s scales"
                    if not compact:
                        assert not hg[start + counts[q] : (q + 1) * m].view(torch.uint8).any(), f"rank {q}'s padding"
                        assert (scale[start + counts[q] : (q + 1) * m] == FP8_PAD_SCALE).all()
                hg = (hg.float().reshape(rows, -1, 128) * scale.reshape(rows, -1, 1)).reshape(rows, H).to(dtype)
                hs = [hs[q].clone() for q in range(world)]
                hs[rank][:n] = hg[(off[rank] if compact else rank * m):][:n]  # the MoE sees the dequantized rows
            for q in range(world):
                start = off[q] if compact else q * m
                assert torch.equal(lg[start : start + counts[q]], logits[q][: counts[q]]), f"layer {layer}: logits {q}"
                if fp8:  # checked above, as bytes
                    continue
                assert torch.equal(hg[start : start + counts[q]], hs[q][: counts[q]]), f"layer {layer}: rank {q}'s rows"
                if not compact:
                    assert not hg[start + counts[q] : (q + 1) * m].any(), f"layer {layer}: rank {q}'s padding rows"
            if compact:
                assert context.is_padding.shape == (total,) and not context.is_padding.any(), "the compact rows' mask"
            else:
                assert context.is_padding is mask
            partial = hg * float(rank + 2 + layer)  # this rank's partial of every gathered row (a fresh tensor)
            out = moe.combine(None, runner, None, partial)
            assert context.is_padding is mask, f"layer {layer}: vLLM's mask after the combine"
            assert out.shape == (m, H), out.shape
            want = sum(hs[rank][:n].double() * float(q + 2 + layer) for q in range(world))
            err = (out[:n].double() - want).abs().max().item() if n else 0.0
            assert err <= TOL[dtype] * (1 + (want.abs().max().item() if n else 0.0)), f"layer {layer}: {err}"
            assert not out[n:].any(), f"layer {layer}: rows past the real count"
            kept.append((out, out.clone()))
        if device.type == "cuda":
            torch.cuda.synchronize()
        for i, (t, want) in enumerate(kept):
            assert torch.equal(t, want), f"layer {i}'s result changed after later layers (a reused buffer?)"
        step.set_current(None)


def _refused(rank, world):
    """A call nsa_cp's checks refuse (1-D rows) takes vLLM's own dispatch, on every rank alike."""
    from nsa_cp.integrations.vllm import moe, runtime, step

    counts = dual_chunk_swap_counts(*STEPS["uneven"][:2], world)
    m = max(counts)
    mask = (torch.arange(m)[None, :] >= torch.tensor(counts)[:, None]).reshape(-1)
    runner = vllm_env.runner(world)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runtime, "forward_context", lambda: types.SimpleNamespace(is_padding=mask))
        mp.setattr(runtime, "pcp_device_group", lambda: None)
        mp.setattr(runtime, "pcp_rank", lambda: rank)
        mp.setattr(runtime, "pcp_size", lambda: world)
        step.set_current(step.StepLayout.from_counts(counts, m, mask))
        moe.STATE.reset()
        hidden, logits = torch.ones(m), torch.ones(m, 8)
        vllms = (lambda runner, h, lg: ("vllm's", h, lg))
        assert moe.dispatch(vllms, runner, hidden, logits) == ("vllm's", hidden, logits)
        assert any(k.startswith("nsa_cp refused the call") for k in moe.STATE.declined), moe.STATE.declined
        assert id(runner) not in moe.PENDING
        step.set_current(None)


def _worker(rank, world, payload):
    import os

    import nsa_cp

    os.environ["NSA_CP_FIRST_USE_CHECKS"] = "0"  # no vLLM here: nothing of the engine's to check against

    on_gpu = payload["gpu"]
    device = rank_device(rank) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
        reason = nsa_cp.p2p_unavailable_reason(None, device)
        if reason is not None:
            return {"__world__": f"P2P unavailable here: {reason}"}
        rows = max(max(dual_chunk_swap_counts(lens, pf, world)) + (extra or 0) for lens, pf, extra in STEPS.values())
    results = {} if on_gpu else run_cases({"refused": (rank, world)}, _refused)
    for dname in payload["dtypes"]:
        dtype = getattr(torch, dname)
        if on_gpu:
            nsa_cp.init_p2p(None, rows, H, dtype, device, timeout_ms=20_000)
        cases = {f"{name}-{dname}-{'compact' if compact else 'padded'}{'-fp8' if fp8 else ''}":
                 (rank, world, name, dtype, compact, device, fp8)
                 for name in STEPS_ON[on_gpu] for compact in (False, True) for fp8 in FP8[dname]}
        results.update(run_cases(cases, _check, after=lambda: _in_step(on_gpu)))
        if on_gpu:
            nsa_cp.transport.destroy_p2p(None)
    return results


def _in_step(on_gpu):
    import torch.distributed as dist

    if on_gpu:
        torch.cuda.synchronize()
    dist.barrier()


DTYPES = {"cpu": ["float32"], "gpu": ["bfloat16", "float32"]}
FP8 = {"float32": (False, True), "bfloat16": (False, True)}  # vLLM 0.34's quantized gather, per input dtype
WORLDS = (2, 4, 8)
_WORLDS = {}


def _world(where, world):
    if (where, world) not in _WORLDS:
        payload = {"gpu": where == "gpu", "dtypes": DTYPES[where]}
        if where == "gpu":
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("NSA_CP_P2P_MEMORY", "cuda_ipc")  # inherited by the spawned ranks, then restored
                _WORLDS[where, world] = run_world(world, "gloo-shared-gpu", _worker, payload, timeout_s=600)
        else:
            _WORLDS[where, world] = run_world(world, "gloo", _worker, payload, timeout_s=600)
    return _WORLDS[where, world]


def _keys(where):
    return [(w, f"{s}-{d}-{lay}{'-fp8' if fp8 else ''}") for w in WORLDS for s in STEPS_ON[where == "gpu"]
            for d in DTYPES[where] for lay in ("padded", "compact") for fp8 in FP8[d]]


@pytest.mark.parametrize("world", WORLDS)
def test_a_call_nsa_cp_refuses_takes_vllms_dispatch(world):
    errors = case_failures(_world("cpu", world), "refused")
    assert not errors, "\n".join(errors)


def test_dual_chunk_swap_counts_match_the_issue():
    assert dual_chunk_swap_counts([37, 1, 1, 1, 10], [True, False, False, False, True], 2) == [23, 27]


@pytest.mark.parametrize("world,key", _keys("cpu"))
def test_vllm_shaped_moves_on_gloo(world, key):
    errors = case_failures(_world("cpu", world), key)
    assert not errors, "\n".join(errors)


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 1, reason=f"needs a CUDA GPU, found {GPUS}")
@pytest.mark.skipif(not _native.available(), reason=f"nsa_cp._C unavailable: {_native.unavailable_reason()}")
@pytest.mark.parametrize("world,key", _keys("gpu"))
def test_vllm_shaped_moves_on_p2p_sharing_one_gpu(world, key):
    errors = case_failures(_world("gpu", world), key)
    assert not errors, "\n".join(errors)
