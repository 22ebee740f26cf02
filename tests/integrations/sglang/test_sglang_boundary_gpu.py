"""SGLang 0.5.23's own code on a GPU, with the plugin as SGLang loads it: ranks sharing one GPU (a gloo
group; the P2P transport maps the peers' buffers through CUDA IPC), worlds 2, 4 and 8.

In every rank, as in a scheduler: SGLang's own ``load_plugins()`` (nsa_cp's entry point) applies the
plugin's hooks; the plugin's ``ModelRunner.initialize`` hook body creates the attention-CP P2P transport,
sized from a stand-in runner's SGLang limits (``chunked_prefill_size`` / ``max_prefill_tokens``, hidden
size, dtype); then the DeepSeek-V3.2-like stack SGLang binds (tests/support/sglang_stack.py) runs a
prefill-CP extend on CUDA. No nsa_cp call in between. Checked:

* ``status()``: the hooks applied, P2P on with its bytes, the MoE gathers fused (add + RMSNorm + gather);
* the MoE input is the P2P transport's gather buffer (P2P moved it), and no batch took the NCCL path for
  size or SGLang's own move. The even batch runs with NSA_CP_BACKEND=p2p: in production it keeps the
  plain NCCL collective (the contract), but NCCL refuses two ranks on one GPU and gloo has no CUDA
  reduce-scatter;
* hidden states and residuals of every real row against the plugin-off run (SGLang's own moves restored;
  on the CPU over the same gloo group, since SGLang's collectives take CPU tensors on gloo) within
  ``world`` roundings of the dtype (gloo sums the bf16 partials with a rounding per add, the P2P
  reduce-scatter in fp32 with one), and both against a float64 per-row reference;
* compact: the MoE gets only real rows, a full-row attention stage always SGLang's padded rows.

Skips cleanly without CUDA, nsa_cp._C or SGLang (SGLang is carried to the GPU machine as wheels: see
scripts/gpu_sglang.sh). scripts/gpu_test_line.sh's "sglang_gpu" shard.
"""

from __future__ import annotations

import importlib
import os
import traceback
from types import SimpleNamespace as NS
from unittest import mock

import pytest
import torch

import sglang_stack
import sglang_env
from dist_harness import case_failures, rank_device, run_world
from nsa_cp.rows import _native

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS < 1, reason=f"needs a CUDA GPU, found {GPUS}"),
    pytest.mark.skipif(not _native.available(), reason=f"nsa_cp._C unavailable: {_native.unavailable_reason()}"),
]
SEQS = {"uneven": [37, 64, 21], "zero-token-ranks": [1], "even": None}  # even: 2 * cp tokens per rank
DTYPE = torch.bfloat16  # the serving dtype; the P2P transport holds one


def _own_moves():
    """SGLang's ``_cp_moves`` back in its three modules (the plugin-off run), as a context."""
    from sglang.srt.layers.layer_boundary import boundary, construction, factories

    original = getattr(boundary._cp_moves, "__wrapped__", boundary._cp_moves)
    stack = [mock.patch.object(m, "_cp_moves", original) for m in (boundary, construction, factories)]
    for p in stack:
        p.start()
    return stack


def _case(rank, world, strategy, seq_lens, compact, full_row, device):
    import nsa_cp.integrations.sglang as nsa_sglang
    from nsa_cp.transport import get_p2p

    kw = dict(seq_lens=seq_lens, strategy=strategy, dtype=DTYPE, full_row_attention=full_row, layers=2, device=device)
    os.environ["NSA_CP_SGLANG_COMPACT"] = "1" if compact else "0"
    even = seq_lens is None
    if even:
        os.environ["NSA_CP_BACKEND"] = "p2p"
        kw["seq_lens"] = [2 * world * world]
    before = dict(nsa_sglang.status()["gathers"])
    try:
        on = sglang_stack.run_stack(rank, world, **kw)
    finally:
        os.environ.pop("NSA_CP_SGLANG_COMPACT")
        os.environ.pop("NSA_CP_BACKEND", None)
    torch.cuda.synchronize()
    patches = _own_moves()
    try:
        off = sglang_stack.run_stack(rank, world, **{**kw, "device": "cpu"})
    finally:
        for p in patches:
            p.stop()
    assert "nsa_cp" in on["cp_gather"] and off["cp_gather"].endswith("_then_attn_cp_gather"), (on, off)
    kw.pop("device")
    # the plugin-off run sums the MoE partials over gloo in bf16 (world - 1 roundings, measured: 2 bf16 ulps
    # at 4 ranks, 2026-12-02), the P2P reduce-scatter in fp32 rounded once: world roundings apart at most
    sglang_stack.compare(on, off, sglang_stack.reference_rows(rank, world, **kw), DTYPE, "stack on the GPU",
                            roundings=world)
    physical, total = off["physical"], sum(off["logical"])
    assert on["moe_rows"] == [total if compact else physical * world] * 2, on["moe_rows"]
    assert on["full_row_rows"] == ([physical * world] if full_row else []), on["full_row_rows"]
    after = nsa_sglang.status()["gathers"]
    fused = after.get("fused_add_rmsnorm_all_gather", 0) - before.get("fused_add_rmsnorm_all_gather", 0)
    assert fused == 2, (before, after)
    transport = get_p2p(sglang_stack.ensure_parallel(rank, world).device_group)
    # the MoE's input is the gathered tensor: a view of a P2P gather buffer
    spans = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in transport._gathers]
    assert all(any(lo <= p < hi for lo, hi in spans) for p in on["moe_ptrs"]), "the MoE input is not P2P's"


def _worker(rank, world, payload):
    import logging

    from sglang.srt.plugins import load_plugins

    device = rank_device(rank)
    torch.cuda.set_device(device)
    logging.getLogger("nsa_cp").setLevel(logging.INFO)
    coordinator = sglang_stack.ensure_parallel(rank, world)
    load_plugins()  # SGLang's own: nsa_cp's entry point registers, SGLang applies the hooks
    import nsa_cp.integrations.sglang as nsa_sglang
    from nsa_cp.integrations.sglang import plugin

    results = {}
    try:
        runner = NS(server_args=NS(chunked_prefill_size=256, max_prefill_tokens=512, enable_symm_mem=False),
                    model_config=NS(hidden_size=sglang_stack.H, dtype=DTYPE))
        with sglang_stack.sglang_runtime("zigzag"):
            plugin._initialize_hook(lambda r: None, runner)  # what SGLang's patched initialize runs after loading
        for name in plugin.BOUNDARY_MODULES:  # the model's construction imports them
            importlib.import_module(name)
        status = nsa_sglang.status()
        assert status["active"] and status["plugin_registered"] and status["hooks_applied"], status
        assert status["p2p"]["on"] and status["p2p"]["bytes"] > 0, status["p2p"]
        assert coordinator.device_group is not None
        results["setup"] = None
    except Exception:  # noqa: BLE001
        return {"setup": traceback.format_exc()}
    for key, (strategy, seq_lens, compact, full_row) in payload.items():
        try:
            _case(rank, world, strategy, seq_lens, compact, full_row, device)
            results[key] = None
        except Exception:  # noqa: BLE001
            results[key] = traceback.format_exc()
        torch.cuda.synchronize()
    status = nsa_sglang.status()
    results["status"] = None if status["nccl_batches"] == 0 and not status["declined"] else repr(status)
    return results


# both strategies x the batches x both layouts, and a full-row (KDA-like) attention stage on one of them
CASES = {f"{s}-{c}-{lay}": (s, lens, lay == "compact", False)
         for s in ("zigzag", "interleave") for c, lens in SEQS.items() for lay in ("padded", "compact")}
CASES.update({f"zigzag-uneven-{lay}-fullrow": ("zigzag", SEQS["uneven"], lay == "compact", True)
              for lay in ("padded", "compact")})
WORLDS = (2, 4, 8)
_WORLDS = {}


def _world(world):
    sglang_env.require_sglang()
    if world not in _WORLDS:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("NSA_CP_P2P_MEMORY", "cuda_ipc")  # inherited by the spawned ranks, then restored
            _WORLDS[world] = run_world(world, "gloo-shared-gpu", _worker, CASES, timeout_s=600)
    return _WORLDS[world]


@pytest.mark.parametrize("world,key", [(w, k) for w in WORLDS for k in ["setup", *CASES, "status"]])
def test_sglang_stack_on_gpu_with_the_plugin(world, key):
    errors = case_failures(_world(world), key)
    assert not errors, "\n".join(errors)
