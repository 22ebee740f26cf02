"""The SGLang adapter's moves on real CUDA over the P2P transport, with an in-place MoE (SGLang's default:
the MoE writes its output into the tensor the gather returned, which then goes to reduce_scatter).

Ranks share one GPU (a gloo group; the P2P transport maps the peers' buffers through CUDA IPC,
NSA_CP_P2P_MEMORY=cuda_ipc), worlds 2 and 3, both layouts, both P2P gather engines, bf16 and fp32. A P2P
gather's result is a view of the transport's gather buffer, so this checks that the reduce-scatter reads
the MoE's output from there correctly, that its result and take_back's survive the next gathers (no view
of a reused buffer leaks out), and that odd numbers of back-to-back layers keep the double buffer in step.
SGLang is not needed: the metadata is duck-typed with SGLang 0.5.23's field names (tests/integrations/sglang/test_sglang_real.py
checks those moves against SGLang's own on gloo). Skips cleanly without CUDA or nsa_cp._C.
"""

from __future__ import annotations

import os
import traceback
from types import SimpleNamespace as NS

import pytest
import torch

from dist_harness import case_failures, rank_device, run_world
from nsa_cp.rows import _native

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS < 1, reason=f"needs a CUDA GPU, found {GPUS}"),
    pytest.mark.skipif(not _native.available(), reason=f"nsa_cp._C unavailable: {_native.unavailable_reason()}"),
]

H = 256
LAYERS = 3  # an odd number of back-to-back gathers: both gather buffers, and back to the first
# per-rank logical counts, padded up to a multiple of 2 * cp as SGLang's zigzag padding does
COUNTS = {2: {"uneven": [13, 7], "zero-token-rank": [5, 0], "even": [8, 8]},  # empty: tests/integrations/sglang/test_sglang_real.py (never on P2P)
          3: {"uneven": [9, 4, 11], "zero-token-ranks": [0, 6, 0], "even": [6, 6, 6]}}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _md(counts):
    align = 2 * len(counts)
    physical = -(-max(counts) // align) * align if max(counts) else 0
    return NS(per_rank_logical_token=list(counts), per_rank_actual_token=[physical] * len(counts),
              max_rank_len=[physical] * len(counts))


def _rand(seed, rows, dtype, device):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, H, generator=g).to(dtype).to(device)


def _read_step(hidden_states, residual, forward_batch, norm, *, update=None, cache=None, **call):
    """Stand-in for SGLang's read step: residual add (rounded to the dtype) and the norm."""
    summed = hidden_states + residual
    return norm(summed), summed


def _close(got, want, dtype, what):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if want.numel():
        tol = TOL[dtype]
        err = (got.double() - want).abs().max().item()
        assert err <= tol * (1 + want.abs().max().item()), f"{what}: max diff {err}"


def _check(rank, world, counts, dtype, compact, device, backend="p2p"):
    import nsa_cp
    from nsa_cp.integrations import sglang as nsa_sglang

    md = _md(counts)
    fb = NS(attn_cp_metadata=md)
    P, n = md.per_rank_actual_token[0], counts
    off = [sum(n[:q]) for q in range(world)]
    adapter = nsa_sglang.CpMovesAdapter(None, compact=compact, backend=backend)
    norm = nsa_cp.RMSNorm(H).to(device=device, dtype=dtype)
    kept = []  # (tensor returned to SGLang, its expected value): must survive the later layers
    for layer in range(LAYERS):
        hs = [_rand(100 * layer + q, P, dtype, device) for q in range(world)]
        res = [_rand(100 * layer + 50 + q, P, dtype, device) for q in range(world)]
        for q in range(world):  # what a layer computes on SGLang's padding rows: garbage, never zeros
            hs[q][n[q]:] = 1e3
            res[q][n[q]:] = -3e2
        normed = [norm(hs[q] + res[q])[: n[q]] for q in range(world)]
        g, r = adapter.gather(hs[rank], res[rank], fb, norm, gather=_read_step)
        rows = sum(n) if compact else P * world
        assert g.shape == (rows, H), g.shape
        for q in range(world):
            start = off[q] if compact else q * P
            assert torch.equal(g[start : start + n[q]], normed[q]), f"layer {layer}: rank {q}'s gathered rows"
        # the in-place MoE: output over input, in the gathered tensor (a view of the P2P gather buffer)
        scale = float(rank + 2 + layer)
        g.mul_(scale).add_(1.0)
        out, r2 = adapter.reduce_scatter(g, r, fb)
        assert out.shape == (P, H) and r2 is r
        want = sum(normed[rank].mul(float(q + 2 + layer)).add(1.0).double() for q in range(world))
        _close(out[: n[rank]], want, dtype, f"layer {layer}: in-place reduce_scatter")
        assert not out[n[rank]:].any(), f"layer {layer}: rows past the real count"
        kept.append((out, out.clone()))
        # take_back of a complete output that lives in the gather buffer (the in-place MoE's)
        back, _ = adapter.take_back(g, r, fb)
        start = off[rank] if compact else rank * P
        own = g[start : start + n[rank]].clone()
        assert torch.equal(back[: n[rank]], own), f"layer {layer}: take_back"
        kept.append((back, back.clone()))
    if device.type == "cuda":
        torch.cuda.synchronize()
    for i, (t, want) in enumerate(kept):
        assert torch.equal(t, want), f"result {i} changed after later layers' collectives (a reused buffer?)"


def _worker(rank, world, payload):
    import torch.distributed as dist

    import nsa_cp

    device = rank_device(rank)
    torch.cuda.set_device(device)
    reason = nsa_cp.p2p_unavailable_reason(None, device)
    if reason is not None:
        return {"__world__": f"P2P unavailable here: {reason}"}
    results = {}
    for dname, dtype in DTYPES.items():
        max_tokens = max(_md(c).per_rank_actual_token[0] for c in payload.values())
        nsa_cp.init_p2p(None, max(max_tokens, 1), H, dtype, device, timeout_ms=20_000)
        for engine in ("sm", "ce"):
            os.environ["NSA_CP_P2P_ENGINE"] = engine
            for case_id, counts in payload.items():
                for compact in (False, True):
                    key = f"{case_id}-{dname}-{engine}-{'compact' if compact else 'padded'}"
                    try:
                        _check(rank, world, counts, dtype, compact, device)
                        results[key] = None
                    except Exception:  # noqa: BLE001
                        results[key] = traceback.format_exc()
                    torch.cuda.synchronize()
                    dist.barrier()
        nsa_cp.transport.destroy_p2p(None)
    return results


_WORLDS = {}


def _world(world):
    if world not in _WORLDS:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("NSA_CP_P2P_MEMORY", "cuda_ipc")  # inherited by the spawned ranks, then restored
            _WORLDS[world] = run_world(world, "gloo-shared-gpu", _worker, COUNTS[world], timeout_s=600)
    return _WORLDS[world]


@pytest.mark.parametrize("world,key", [
    (w, f"{c}-{d}-{e}-{lay}") for w in COUNTS for c in COUNTS[w] for d in DTYPES for e in ("sm", "ce")
    for lay in ("padded", "compact")
])
def test_in_place_moe_on_p2p(world, key):
    errors = case_failures(_world(world), key)
    assert not errors, "\n".join(errors)
