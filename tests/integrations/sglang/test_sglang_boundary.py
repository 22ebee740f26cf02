"""A DeepSeek-V3.2-like layer stack as SGLang 0.5.23 itself binds it (tests/support/sglang_stack.py: its
``layer_stack`` / ``append_stages`` / ``declare_attn`` / ``declare_ffn``, its real RMSNorm, stand-in
attention and in-place MoE), run on CPU / gloo with nsa_cp's plugin moves on (``install()``) and off
(SGLang's own), worlds 2, 3 and 4, zigzag and interleave metadata, fp32 and bf16, padded and compact:

* the final hidden states and residual of every real row agree within one rounding of the dtype, and
  both agree with a float64 per-row reference (no communication);
* with the plugin on, the MoE gathers run as nsa_cp's fused add + RMSNorm + gather (``status()``);
* compact reaches the MoE only: the MoE gets ``sum(real)`` rows under NSA_CP_SGLANG_COMPACT=1, while a
  full-row attention stage (GLM-5.3's KDA declaration, ``declare_attn(tp_group=SumGroup.TP)``, whose input
  SGLang gathers with the same CP moves) always gets SGLang's padded ``physical * cp`` rows.

Skipped where SGLang does not import (failed instead with NSA_TEST_REQUIRE_SGLANG=1, as in CI).
"""

from __future__ import annotations

import os
import traceback

import pytest
import torch

import sglang_stack
import sglang_env
from dist_harness import case_failures, run_world

SPLITS = {2: {"uneven": [37, 64, 21], "zero-token-rank": [1], "even": [8]},
          3: {"uneven": [37, 64, 21], "zero-token-ranks": [1], "even": [6]},
          4: {"uneven": [37, 64, 21], "zero-token-ranks": [2], "even": [16]}}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _check(rank, world, strategy, seq_lens, dtype, compact, full_row):
    import nsa_cp.integrations.sglang as nsa_sglang
    from nsa_cp.integrations.sglang import state

    kw = dict(seq_lens=seq_lens, strategy=strategy, dtype=dtype, full_row_attention=full_row, layers=2)
    off = sglang_stack.run_stack(rank, world, **kw)
    assert off["cp_gather"].endswith("_then_attn_cp_gather"), off["cp_gather"]
    os.environ["NSA_CP_SGLANG_COMPACT"] = "1" if compact else "0"
    state.reset()
    handle = nsa_sglang.install()
    try:
        on = sglang_stack.run_stack(rank, world, **kw)
    finally:
        handle.uninstall()
        os.environ.pop("NSA_CP_SGLANG_COMPACT")
    assert "nsa_cp" in on["cp_gather"], on["cp_gather"]
    sglang_stack.compare(on, off, sglang_stack.reference_rows(rank, world, **kw), dtype, "stack")
    physical, total = off["physical"], sum(off["logical"])
    assert off["moe_rows"] == [physical * world] * 2, off["moe_rows"]
    assert on["moe_rows"] == [total if compact else physical * world] * 2, on["moe_rows"]
    full_rows = [physical * world] if full_row else []
    assert on["full_row_rows"] == off["full_row_rows"] == full_rows, (on["full_row_rows"], full_rows)
    gathers = nsa_sglang.status()["gathers"]
    # each layer's MoE gather; a full-row attention's input gather keeps SGLang's quantizing read step
    assert gathers.get("fused_add_rmsnorm_all_gather", 0) == 2, (gathers, nsa_sglang.status()["first_use"])
    first = nsa_sglang.status()["first_use"]  # every move's first call checked against SGLang's own: no difference
    assert not first["declined"] and first["checked"].get(f"gather {'compact' if compact else 'padded'}") == 1, first


def _worker(rank, world, payload):
    sglang_stack.ensure_parallel(rank, world)
    results = {}
    for key, (strategy, seq_lens, dname, layout, full_row) in payload.items():
        try:
            _check(rank, world, strategy, seq_lens, DTYPES[dname], layout == "compact", full_row)
            results[key] = None
        except Exception:  # noqa: BLE001
            results[key] = traceback.format_exc()
    return results


CASES = {
    w: {f"{s}-{c}-{d}-{lay}{'-fullrow' if fr else ''}": (s, lens, d, lay, fr)
        for s in ("zigzag", "interleave") for c, lens in cases.items() for d in DTYPES
        for lay in ("padded", "compact") for fr in (False, True)}
    for w, cases in SPLITS.items()
}
_WORLDS = {}


def _world(world):
    sglang_env.require_sglang()
    if world not in _WORLDS:
        _WORLDS[world] = run_world(world, "gloo", _worker, CASES[world], timeout_s=900)
    return _WORLDS[world]


@pytest.mark.parametrize("world,key", [(w, k) for w in CASES for k in CASES[w]])
def test_built_boundary_plugin_on_equals_off(world, key):
    errors = case_failures(_world(world), key)
    assert not errors, "\n".join(errors)
