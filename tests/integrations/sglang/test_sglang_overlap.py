"""The overlapped boundary inside SGLang (NSA_CP_SGLANG_OVERLAP=1) against SGLang 0.5.23's own code, on CPU /
gloo: two of SGLang's ``DeepseekV2DecoderLayer``s with SGLang's own ``DeepseekV2MoE`` (tests/support/
sglang_layer.py: its stages from the class's ``_build_stages``, a stand-in attention), worlds 2, 3 and 4,
SGLang's zigzag metadata with uneven counts, zero-token ranks and an even split, fp32 and bf16, padded and
compact, the shared expert TP-sharded (SGLang's default) and replicated (``SGLANG_SHARED_EXPERT_TP1=1``).

The MoE path driven: ``DeepseekV2MoE.forward`` -> ``forward_normal`` -> ``FusedMoE`` with
``UnquantizedFusedMoEMethod.forward_cpu`` -> ``moe_forward_native``, the one that runs on a CPU; on GPUs users
run ``forward_normal`` with the Triton / FlashInfer runner, the same structure with other expert kernels
(mega-MoE, DeepEP and the dual-stream paths are declined: ``test_configurations_keep_serialized``).

Three runs per case, on the same weights and inputs: the plugin off (SGLang's own moves), the serialized
plugin (``install()``), and the overlap (``install()`` with NSA_CP_SGLANG_OVERLAP=1):

* the overlap ran (``status()["overlap"]["layers"]``) and the MoE got each rank's real rows per chunk, never
  the gathered tensor; with NSA_CP_SGLANG_OVERLAP_CHUNK_ROWS the chunks are at most that many rows;
* overlap == serialized plugin BIT FOR BIT where the MoE is row-independent in value and order and both sum
  alike: the TP-sharded shared expert (its partial joins the routed one in the consumer, as in the
  serialized MoE), 2 ranks (one add of two partials, rounded once, in both; gloo's reduce-scatter of 3 or
  more rounds per add, the overlap sums in fp32 and rounds once, as the P2P reduce-scatter does), and
  SGLang's MoE giving every real row the same bits on the chunks as on the serialized input
  (``sglang_layer.row_independent``, probed per case on random rows: on this CPU bf16 is, fp32 is not:
  ``moe_forward_native``'s per-expert fp32 matmuls block by the rows each expert gets);
* otherwise within 4 roundings of the dtype relative to the rows' size (fp32 4 * 2e-6, bf16 4 * 2^-7,
  sglang_stack.ROUNDING): per layer one rounding of the sum and one of the shared add apart, carried into
  the second layer;
* with the replicated shared expert the overlap adds it once, in fp32, before the one rounding, where the
  serialized MoE adds it on rank 0 in the dtype before the sum: within that bound;
* the overlap against the plugin off within the same bound as the serialized plugin against it (SGLang
  sums in its own collective's order and norms with its own kernel: one more rounding each), and all three
  against each other on the residual.

The FP8 wire: the serialized plugin does not use it inside SGLang (docs/sglang.md, "FP8 wire: not used inside
SGLang"), and the overlap keeps that: ``test_overlap_keeps_bf16_wire`` checks the boundary is called
without ``quant``.

Skipped where SGLang does not import (failed instead with NSA_TEST_REQUIRE_SGLANG=1, as in CI).
"""

from __future__ import annotations

import os
import traceback
from unittest import mock

import pytest
import torch

import sglang_env
from dist_harness import case_failures, run_world

SPLITS = {2: {"uneven": [37, 64, 21], "zero-token-rank": [1], "even": [8]},
          3: {"uneven": [37, 64, 21], "zero-token-ranks": [1]},
          4: {"uneven": [37, 64, 21], "zero-token-ranks": [2]}}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _run(rank, world, kw, *, plugin: bool, overlap: bool, compact: bool, chunk_rows=None, min_rows=0):
    import nsa_cp.integrations.sglang as nsa_sglang
    import sglang_layer
    from nsa_cp.integrations.sglang import overlap as ov
    from nsa_cp.integrations.sglang import state

    if not plugin:
        return sglang_layer.run_layers(rank, world, **kw), None
    env = {"NSA_CP_SGLANG_COMPACT": "1" if compact else "0", "NSA_CP_SGLANG_OVERLAP": "1" if overlap else "0",
           "NSA_CP_SGLANG_OVERLAP_MIN_ROWS": str(min_rows)}  # 0: these small batches overlap too
    if chunk_rows:
        env["NSA_CP_SGLANG_OVERLAP_CHUNK_ROWS"] = str(chunk_rows)
    with mock.patch.dict(os.environ, env):
        state.reset()
        ov.reset()
        handle = nsa_sglang.install()
        try:  # status() while installed: what this run did
            return sglang_layer.run_layers(rank, world, **kw), nsa_sglang.status()
        finally:
            handle.uninstall()


def _same(a, b, what):
    assert torch.equal(a, b), f"{what}: not bit for bit (max diff {(a.double() - b.double()).abs().max().item()})"


def _close(a, b, tol, what):
    err = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    scale = 1 + (b.double().abs().max().item() if b.numel() else 0.0)
    assert err <= tol * scale, f"{what}: max diff {err} > {tol} * {scale}"


def _check(rank, world, seq_lens, dtype, compact, shared_tp1, chunk_rows):
    import sglang_layer
    import sglang_stack

    kw = dict(seq_lens=seq_lens, strategy="zigzag", dtype=dtype, layers=2, shared_tp1=shared_tp1)
    off, _ = _run(rank, world, kw, plugin=False, overlap=False, compact=compact)
    ser, _ = _run(rank, world, kw, plugin=True, overlap=False, compact=compact)
    on, status = _run(rank, world, kw, plugin=True, overlap=True, compact=compact, chunk_rows=chunk_rows)
    n, physical, logical = off["n_real"], off["physical"], off["logical"]
    overlap = status["overlap"]
    assert overlap["declined"] is None and overlap["layers"] == 2, overlap
    assert status["gathers"].get("fused_add_rmsnorm_overlapped") == 2, status["gathers"]
    # the MoE saw each rank's real rows (in chunks of at most chunk_rows), never the gathered tensor
    per_layer = sorted(c for q in logical for c in _chunks(q, chunk_rows))
    assert sorted(on["moe_rows"]) == sorted(per_layer * 2), (on["moe_rows"], per_layer)
    assert ser["moe_rows"] == [sum(logical) if compact else physical * world] * 2, ser["moe_rows"]
    rounding = sglang_stack.ROUNDING[dtype]
    # gloo sums 3 or more ranks' partials with a rounding per add; the overlap (and the P2P reduce-scatter)
    # in fp32, rounded once: the same only for 2 ranks
    bitwise = world == 2 and not shared_tp1 and sglang_layer.row_independent(
        rank, world, dtype=dtype, shared_tp1=shared_tp1, logical=logical, physical=physical, compact=compact,
        chunks=[c for q in logical for c in _chunks(q, chunk_rows)])
    for key in ("hidden", "residual"):
        a, b, c = on[key][:n], ser[key][:n], off[key][:n]
        if not bitwise:
            _close(a, b, 4 * rounding, f"{key}: overlap vs serialized plugin")
        else:
            _same(a, b, f"{key}: overlap vs serialized plugin")
        _close(a, c, 4 * rounding, f"{key}: overlap vs plugin off")
        _close(b, c, 4 * rounding, f"{key}: serialized plugin vs plugin off")
        assert torch.isfinite(a).all(), f"{key}: overlap not finite"


def _chunks(rows, chunk_rows):
    if rows == 0:
        return []
    if not chunk_rows:
        return [rows]
    return [min(chunk_rows, rows - s) for s in range(0, rows, chunk_rows)]


def _worker(rank, world, payload):
    import sglang_stack

    sglang_stack.ensure_parallel(rank, world)
    results = {}
    for key, args in payload.items():
        try:
            _check(rank, world, *args)
            results[key] = None
        except Exception:  # noqa: BLE001
            results[key] = traceback.format_exc()
    return results


def _cases(world):
    out = {}
    for case, lens in SPLITS[world].items():
        for dname, dtype in DTYPES.items():
            for layout in ("padded", "compact"):
                for shared in ("tp-shared", "tp1-shared"):
                    out[f"{case}-{dname}-{layout}-{shared}"] = (lens, dtype, layout == "compact",
                                                                shared == "tp1-shared", None)
    out["uneven-bf16-padded-tp-shared-chunk5"] = (SPLITS[world]["uneven"], torch.bfloat16, False, False, 5)
    return out


CASES = {w: _cases(w) for w in SPLITS}
_RESULTS = {}  # world -> every case's outcome, one spawned world per size


@pytest.mark.parametrize("world,key", [(w, k) for w in CASES for k in CASES[w]])
def test_overlap_equals_serialized_and_sglang(world, key):
    sglang_env.require_sglang()
    if world not in _RESULTS:
        _RESULTS[world] = run_world(world, "gloo", _worker, CASES[world], timeout_s=1200)
    errors = case_failures(_RESULTS[world], key)
    assert not errors, "\n".join(errors)


# --------------------------------------------------------------------------- a broken contract; configurations
def _check_drift(rank, world, kind):
    import logging

    import sglang_drift

    lens = SPLITS[world]["uneven"]
    kw = dict(seq_lens=lens, strategy="zigzag", dtype=torch.bfloat16, layers=2)
    ser, _ = _run(rank, world, kw, plugin=True, overlap=False, compact=False)
    says = sglang_drift.apply_overlap(kind)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("nsa_cp").addHandler(handler)
    try:
        drifted, status = _run(rank, world, kw, plugin=True, overlap=True, compact=False)
        off, _ = _run(rank, world, kw, plugin=False, overlap=False, compact=False)
    finally:
        logging.getLogger("nsa_cp").removeHandler(handler)
        sglang_drift.undo_overlap()
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and says in warnings[0] and "overlapped boundary declined" in warnings[0], warnings
    overlap = status["overlap"]
    assert overlap["on"] and says in (overlap["declined"] or "") and overlap["layers"] == 0, overlap
    # the serialized moves stay on: both MoE gathers ran as nsa_cp's fused gather
    assert status["contract"]["served"] and status["gathers"] == {"fused_add_rmsnorm_all_gather": 2}, status
    physical = ser["physical"]
    assert drifted["moe_rows"] == ser["moe_rows"] == [physical * world] * 2, drifted["moe_rows"]
    n = ser["n_real"]
    for key in ("hidden", "residual"):  # SGLang's forward exact: the serialized plugin's, bit for bit
        _same(drifted[key][:n], ser[key][:n], f"{key}: drifted ({kind}) vs serialized plugin")
    sglang_stack_bound = 4 * 2 ** -7  # and SGLang's own moves within the serialized plugin's bound of it
    for key in ("hidden", "residual"):
        _close(drifted[key][:n], off[key][:n], sglang_stack_bound, f"{key}: drifted ({kind}) vs plugin off")


def _check_configurations(rank, world):
    """Each configuration whose path a chunked call would change keeps the serialized boundary, with its reason
    (``layer_reason``), on SGLang's built layer and a real batch."""
    import sglang_layer
    import sglang_stack
    from nsa_cp.integrations.sglang import overlap as ov

    from sglang.srt.layers.layer_boundary import layer_stack

    lens = SPLITS[world]["uneven"]
    with sglang_layer.moe_runtime("zigzag"), torch.no_grad():
        md, _ = sglang_env.build_metadata(lens, world, "zigzag")
        fb = sglang_stack.forward_batch(lens, md)
        with layer_stack():
            layer = sglang_layer.build_layer(rank, 0, torch.bfloat16, 0, False)
        x = torch.zeros(md.per_rank_actual_token[0], sglang_layer.H, dtype=torch.bfloat16)
        mlp = layer.mlp
        # with SGLang's moves bound (no plugin), the exit's move is SGLang's reduce-scatter
        with mock.patch.dict(os.environ, {"NSA_CP_SGLANG_OVERLAP_MIN_ROWS": "0"}):
            assert "not nsa_cp's" in ov.layer_reason(layer, fb, x)
        v2 = "sglang.srt.models.deepseek_v2"
        cases = {
            "A2A": mock.patch.object(mlp, "_enable_a2a_moe", True),
            "not in place": mock.patch.object(mlp.experts.moe_runner_config, "inplace", False),
            "AMX": mock.patch(f"{v2}.use_intel_amx_backend", return_value=True),
            "single-batch overlap": mock.patch.object(mlp, "_fuse_shared_experts_inside_sbo", True),
            "hash or vision": mock.patch.object(mlp, "is_hash", True, create=True),
            "mega-MoE": mock.patch("sglang.srt.layers.moe.mega_moe.should_use_mega_moe", return_value=True),
            "dual-stream": mock.patch.object(type(mlp), "_can_dual_stream_graph", return_value=True),
            "CUDA graph capture": mock.patch(f"{v2}.get_is_capture_mode", return_value=True),
            "graph_num_tokens": mock.patch.object(md, "graph_num_tokens", 8, create=True),
            "not a MoE layer": mock.patch.object(layer, "mlp", torch.nn.Identity()),
        }
        with mock.patch.dict(os.environ, {"NSA_CP_SGLANG_OVERLAP_MIN_ROWS": "0"}):
            for what, patch in cases.items():
                with patch:
                    reason = ov.layer_reason(layer, fb, x)
                assert reason and "MIN_ROWS" not in reason, f"{what}: the overlap would serve it ({reason!r})"
        # a replicated shared expert is no reason to stay serialized, on CUDA rows as on CPU ones: the only
        # reason left is the (unbound) exit move's
        class _CudaRows:
            is_cuda = True

            def new_empty(self, *args, **kwargs):
                return x.new_empty(*args, **kwargs)

        with mock.patch.dict(os.environ, {"NSA_CP_SGLANG_OVERLAP_MIN_ROWS": "0"}):
            with mock.patch.object(mlp, "_shared_expert_tp1", True):
                for rows in (_CudaRows(), x):
                    assert "not nsa_cp's" in ov.layer_reason(layer, fb, rows), type(rows).__name__
        # the threshold: a batch whose max_rank_len is under it stays serialized, one at it is not held back
        from nsa_cp.integrations.sglang.metadata import layout_from_cp_metadata

        m = layout_from_cp_metadata(md).max_rank_len
        for min_rows, held in ((m + 1, True), (m, False)):
            with mock.patch.dict(os.environ, {"NSA_CP_SGLANG_OVERLAP_MIN_ROWS": str(min_rows)}):
                reason = ov.layer_reason(layer, fb, x)
            assert ("NSA_CP_SGLANG_OVERLAP_MIN_ROWS" in reason) == held, (min_rows, m, reason)
        assert ov.layer_reason(layer, sglang_stack.forward_batch(lens, None), x) == ""  # not a CP batch: silent


def _check_min_rows(rank, world):
    """NSA_CP_SGLANG_OVERLAP_MIN_ROWS above the batch's rows per rank: the overlap on, yet both layers keep
    the serialized boundary (counted by reason), and the forward is the serialized plugin's bit for bit."""
    kw = dict(seq_lens=SPLITS[world]["uneven"], strategy="zigzag", dtype=torch.bfloat16, layers=2)
    ser, _ = _run(rank, world, kw, plugin=True, overlap=False, compact=False)
    held, status = _run(rank, world, kw, plugin=True, overlap=True, compact=False, min_rows=1 << 20)
    overlap = status["overlap"]
    assert overlap["declined"] is None and overlap["layers"] == 0, overlap
    assert [v for k, v in overlap["serialized"].items() if "NSA_CP_SGLANG_OVERLAP_MIN_ROWS" in k] == [2], overlap
    assert held["moe_rows"] == ser["moe_rows"], (held["moe_rows"], ser["moe_rows"])
    n = ser["n_real"]
    for key in ("hidden", "residual"):
        _same(held[key][:n], ser[key][:n], f"{key}: held back by the threshold vs serialized plugin")


def test_min_rows_keeps_small_batches_serialized():
    errors = case_failures(_drift_world(), "min-rows")
    assert not errors, "\n".join(errors)


def _drift_worker(rank, world, payload):
    import sglang_stack

    sglang_stack.ensure_parallel(rank, world)
    results = {}
    for key in payload:
        try:
            if key == "configurations":
                _check_configurations(rank, world)
            elif key == "min-rows":
                _check_min_rows(rank, world)
            else:
                _check_drift(rank, world, key)
            results[key] = None
        except Exception:  # noqa: BLE001
            results[key] = traceback.format_exc()
    return results


DRIFT_CASES = ("signature", "renamed", "configurations", "min-rows")
_DRIFT = {}


def _drift_world():
    sglang_env.require_sglang()
    if not _DRIFT:
        _DRIFT["r"] = run_world(2, "gloo", _drift_worker, {k: None for k in DRIFT_CASES}, timeout_s=600)
    return _DRIFT["r"]


@pytest.mark.parametrize("kind", DRIFT_CASES[:2])
def test_broken_contract_declines_overlap_and_keeps_sglang_exact(kind):
    errors = case_failures(_drift_world(), kind)
    assert not errors, "\n".join(errors)


def test_configurations_keep_serialized():
    errors = case_failures(_drift_world(), "configurations")
    assert not errors, "\n".join(errors)


def test_overlap_keeps_bf16_wire():
    """The serialized plugin moves bf16 inside SGLang (docs/sglang.md): so does the overlap (no ``quant=``)."""
    sglang_env.require_sglang()
    import inspect

    from nsa_cp.integrations.sglang import overlap as ov

    source = inspect.getsource(ov._run)
    assert "cp_overlapped_boundary(" in source and "quant=" not in source
