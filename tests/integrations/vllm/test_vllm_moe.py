"""vLLM's own PCP MoE boundary (0.33.0 or 0.34.0) with nsa_cp's plugin on and off, on CPU / gloo, worlds 2, 3, 4.

Each step is vLLM's own: its parallel state (``initialize_model_parallel`` with a PCP group), its
``PCPManager.partition_batch`` (DualChunkSwap, decodes round-robin, padding rows last, the MoE padding
mask), its ``MoERunner._maybe_dispatch`` / ``_maybe_combine`` bodies, its forward context and its routers'
padding-mask read (0.33: ``fused_topk_router._get_padding_mask``, 0.34: ``get_moe_padding_mask``). Between them a stand-in MoE: top-2 routing on
the router logits, each rank holding its own shard of every expert (so the reduce-scatter sums partials).
Every rank's hidden rows past its real count carry random values, as vLLM's do.

* padded and compact (``NSA_CP_VLLM_COMPACT=1``): plugin on and off agree on every real row, both match a
  float64 reference, and the rows the routers route are exactly the real rows in both;
* compact: the MoE gets ``sum(counts)`` rows, ``forward_context.is_padding`` describes those rows while it
  runs and is vLLM's mask again after the combine;
* a CUDA-graph-shaped batch (PIECEWISE bucket larger than every rank's count): M is the bucket's;
* a forward whose padding mask is not the step's (a dummy or micro-batched run) takes vLLM's own moves;
* shared experts: the combine hands ``shared_output`` back as vLLM's does;
* vLLM's code drifted from every contract nsa_cp knows (a changed signature) before the entry point runs:
  nothing is patched and the layer's output is bit-equal to the plugin-off run.

Skipped where vLLM does not import (failed instead with NSA_TEST_REQUIRE_VLLM=1, as in CI).
"""

from __future__ import annotations

import os
import zlib

import torch

import vllm_env
from dist_harness import run_cases

H, E, K = 32, 8, 2
# name -> (query lens, is_prefilling, CUDA-graph bucket or None)
STEPS = {
    "uneven": ([37, 1, 1, 1, 10], [True, False, False, False, True], None),
    "zero-token-ranks": ([1], [False], None),
    "even": ([48], [True], None),  # 48 = 2P * k at P = 2, 3, 4: every rank 48 / P rows
    "long-mix": ([700, 301, 37, 1], [True, True, True, False], None),
    "graph-bucket": ([37, 1, 1, 1, 10], [True, False, False, False, True], 48),
}


def _experts(rank_of_shard: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank_of_shard)
    return torch.randn(E, H, H, generator=g, dtype=torch.float64) / H**0.5


def _gate() -> torch.Tensor:
    return torch.randn(H, E, generator=torch.Generator().manual_seed(7), dtype=torch.float64)


def _hidden(step: str, rank: int, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(f"{step}:{rank}".encode()))
    return torch.randn(rows, H, generator=g, dtype=torch.float64)


def _stand_in_moe(h, logits, experts, seen):
    """Top-K routing with vLLM's own padding-mask read, then this rank's shard of the chosen experts."""
    mask = vllm_env.padding_mask(h.shape[0])
    weights, ids = torch.softmax(logits.double(), dim=-1).topk(K, dim=-1)
    if mask is not None:
        weights = weights.masked_fill(mask[:, None], 0.0)
    seen.append((h.shape[0], int((weights.sum(-1) > 0).sum())))
    out = torch.zeros(h.shape, dtype=torch.float64)
    for j in range(K):
        out += weights[:, j : j + 1] * torch.einsum("th,thd->td", h.double(), experts[ids[:, j]])
    return out.to(h.dtype)


def _reference(h_real: torch.Tensor, world: int) -> torch.Tensor:
    logits = h_real @ _gate()
    weights, ids = torch.softmax(logits, dim=-1).topk(K, dim=-1)
    out = torch.zeros_like(h_real)
    for q in range(world):
        w = _experts(q)
        for j in range(K):
            out += weights[:, j : j + 1] * torch.einsum("th,thd->td", h_real, w[ids[:, j]])
    return out


def _moe_layer(rank, world, config, local, h, runner, mask=None, shared=None):
    from vllm.forward_context import get_forward_context, set_forward_context
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    seen = []
    logits = (h.double() @ _gate()).to(h.dtype)
    with set_forward_context(None, config, is_padding=local.is_padding if mask is None else mask):
        hg, lg, scale = vllm_env.dispatch(runner, h, logits)
        assert scale is None, "unquantized experts: no scale"
        partial = _stand_in_moe(hg, lg, _experts(rank), seen)
        out = MoERunner._maybe_combine(runner, shared, partial)
        after = get_forward_context().is_padding
    return out, seen, hg.shape[0], lg.shape[0], after


def _check(rank, world, config, name, compact, declined=False, with_shared=False, drift=None):
    import nsa_cp.integrations.vllm as nsa_vllm
    from nsa_cp.integrations.vllm import moe

    lens, prefill, bucket = STEPS[name]
    runner = vllm_env.runner(world, shared_experts=object() if with_shared else None)
    shared = torch.full((1,), 3.0) if with_shared else None

    local, m, n, counts = vllm_env.step_off(rank, world, lens, prefill, bucket)
    if bucket is not None:
        assert m == bucket > max(counts), (m, counts)
    h = _hidden(name, rank, m).float()
    off = _moe_layer(rank, world, config, local, h, runner, shared=shared)

    os.environ["NSA_CP_VLLM_COMPACT"] = "1" if compact else "0"
    moe.STATE.reset()
    undo = None
    if drift is None:
        nsa_vllm.install()
    else:  # vLLM's code drifts from every known contract before the entry point runs: it patches nothing
        import vllm_drift

        says, undo = vllm_drift.apply(drift)
        nsa_vllm.vllm_plugin()
    try:
        local_on = vllm_env.partition(vllm_env.manager(rank, world), lens, prefill, bucket)
        mask = local_on.is_padding.clone() if declined else None
        on = _moe_layer(rank, world, config, local_on, h, runner, mask=mask, shared=shared)
        status = nsa_vllm.status()
    finally:
        nsa_vllm.uninstall()
        os.environ.pop("NSA_CP_VLLM_COMPACT")
        if undo is not None:
            undo()

    out_off, out_on = (off[0][1], on[0][1]) if with_shared else (off[0], on[0])
    if with_shared:
        assert off[0][0] is shared and on[0][0] is shared
    assert out_on.shape == out_off.shape == (m, H), (out_on.shape, out_off.shape)
    ref = _reference(_hidden(name, rank, m)[:n].float().double(), world)
    torch.testing.assert_close(out_on[:n].double(), ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out_on[:n], out_off[:n], rtol=1e-5, atol=1e-5)
    total = sum(counts)
    assert off[1] == [(world * m, total)], off[1]  # vLLM's mask: every real row routed, no padding row
    if drift is not None:
        assert torch.equal(out_on, out_off), "a drifted vLLM must run its own moves, bit-equal to the plugin off"
        assert status["contract"]["served"] is None and says in status["contract"]["problem"], status
        assert not any(status["bound"].values()) and not status["gathers"], status
        return
    if declined:
        assert torch.equal(out_on, out_off), "a declined call must run vLLM's own moves"
        assert any("not a PCP step" in k for k in status["declined"]), status["declined"]
        assert not status["gathers"], status["gathers"]
        return
    assert torch.equal(out_on[n:], torch.zeros_like(out_on[n:])), "nsa_cp's padding rows are zero"
    rows = total if compact else world * m
    assert on[1] == [(rows, total)], on[1]
    assert on[2] == on[3] == rows, (on[2], on[3])
    assert on[4] is local_on.is_padding, "forward_context.is_padding must be vLLM's again after the combine"
    layout = "compact" if compact else "padded"
    assert status["gathers"] == {layout: 1} and status["reduce_scatters"] == {layout: 1}, status
    assert status["active"] and not status["declined"], status


def _worker(rank, world, payload):
    vllm_env.prepare_process()
    config, _ = vllm_env.setup_parallel(rank, world)
    return run_cases({key: (rank, world, config, *args) for key, args in payload.items()}, _check)


CASES = {
    w: {**{f"{s}-{lay}": (s, lay == "compact", False, False) for s in STEPS for lay in ("padded", "compact")},
        "uneven-padded-shared-experts": ("uneven", False, False, True),
        "uneven-compact-shared-experts": ("uneven", True, False, True),
        "uneven-declined-not-the-steps-mask": ("uneven", True, True, False),
        "uneven-compact-drifted-contract": ("uneven", True, False, False, "signature")}
    for w in (2, 3, 4)
}


test_vllm_moe_boundary_plugin_on_equals_off = vllm_env.case_test(_worker, CASES)  # one world per size
