"""The plugin's fast path against SGLang 0.5.23's own code, on CPU / gloo:

* which of SGLang's read steps run as nsa_cp's one-kernel add + RMSNorm + gather (``readstep``), and which
  keep SGLang's step (a transformed, quantizing or bound read, a residual update that is not a plain add,
  an RMSNorm with options that change its arithmetic, attention TP > 1);
* the fused gather against SGLang's own move (its read step ``_update_read`` with its real ``RMSNorm``, then
  its all-gather), worlds 2, 3 and 4, both layouts: the residual equal bit for bit (its padding rows
  included), the gathered rows within one rounding of the dtype;
* every batch the adapter declines runs SGLang's own move (graph capture, attention DP, a row count the
  metadata does not describe, before and after the read step), logged once per reason and counted in
  ``status()``; compact is bound for FFN stages only;
* the scheduler hook: the transport's size from SGLang's limits, and its decision on a CPU (P2P off, with
  the reason) in ``status()``;
* the registration log: a target module that does not import is reported with its cause, and nothing is
  registered.

Skipped where SGLang does not import (failed instead with NSA_TEST_REQUIRE_SGLANG=1, as in CI).
"""

from __future__ import annotations

import os
import traceback
from functools import partial
from types import SimpleNamespace as NS
from unittest import mock

import pytest
import torch

import sglang_env
from dist_harness import case_failures, run_world

H = 32
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# world -> case -> seq_lens for SGLang's own zigzag / interleave split
SPLITS = {2: {"uneven": [37, 64, 21], "zero-token-rank": [1], "even": [8], "empty": []},
          3: {"uneven": [37, 64, 21], "zero-token-ranks": [1], "even": [6]},
          4: {"uneven": [37, 64, 21], "zero-token-ranks": [2], "even": [16]}}


def _rand(seed, rows, dtype, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(rows, H, generator=g)).to(dtype)


def _sglang_bits():
    from sglang.srt.layers.layer_boundary import prepare
    from sglang.srt.layers.layer_boundary.contracts import SumGroup
    from sglang.srt.layers.layer_boundary.residual import add_norm
    from sglang.srt.layers.layernorm import RMSNorm

    return prepare, SumGroup, add_norm, RMSNorm


def _norm(RMSNorm, dtype, **kw):
    norm = RMSNorm(H, eps=1e-6, **kw).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(H, generator=torch.Generator().manual_seed(5)))
    return norm


# --------------------------------------------------------------------------- which read steps fuse
def test_read_step_verdicts():
    sglang_env.require_sglang()
    from nsa_cp.integrations.sglang import readstep

    prepare, SumGroup, add_norm, RMSNorm = _sglang_bits()
    x, r = _rand(1, 6, torch.bfloat16), _rand(2, 6, torch.bfloat16)
    norm = _norm(RMSNorm, torch.bfloat16)
    plain = partial(prepare._update_read, pre_move=None, enters_stack=False, read=add_norm.NORM_READOUT)
    reduce = partial(prepare._reduce_update_read, gathers_residual=False, fusions=(), group=SumGroup.ATTN_TP,
                     read=add_norm.NORM_READOUT)

    def verdict(step=plain, hs=x, res=r, nm=norm, update=add_norm.PLAIN_ADD, call=None):
        return readstep.plain_add_rmsnorm(step, hs, res, nm, update, call or {})

    with mock.patch.object(readstep.runtime, "attn_tp_size", return_value=1):
        for step in (plain, reduce):
            got = verdict(step)
            assert not isinstance(got, readstep.NotFusable), got
            assert got[0] is norm.weight and got[1] == pytest.approx(1e-6)
        assert not isinstance(verdict(update=None), readstep.NotFusable)  # update not passed: SGLang's default
        refused = {
            "unfused read": verdict(partial(prepare._update_read, pre_move=None, enters_stack=False,
                                            read=add_norm.UNFUSED_NORM_READOUT)),
            "quantizing read": verdict(partial(prepare._update_read, pre_move=None, enters_stack=False,
                                               read=add_norm.NORM_QUANT_READOUT)),
            "pre-move": verdict(partial(prepare._update_read, pre_move=lambda h, r: (h, r), enters_stack=False,
                                        read=add_norm.NORM_READOUT)),
            "other step": verdict(lambda *a, **k: None),
            "residual gathered": verdict(partial(reduce, gathers_residual=True)),
            "update": verdict(update=add_norm.REPLACE_AT_EXIT),
            "quant_format": verdict(call={"quant_format": "fp8"}),
            "post_residual_addition": verdict(call={"post_residual_addition": r}),
            "no residual": verdict(res=None),
            "non-contiguous": verdict(hs=x.t().contiguous().t()),
            "residual dtype": verdict(res=r.float()),
            "hf-cast norm": verdict(nm=_norm(RMSNorm, torch.bfloat16, cast_x_before_out_mul=True)),
            "fp32-residual norm": verdict(nm=_norm(RMSNorm, torch.bfloat16, fp32_residual=True)),
            "other norm": verdict(nm=torch.nn.LayerNorm(H)),
        }
    with mock.patch.object(readstep.runtime, "attn_tp_size", return_value=2):
        refused["attention TP 2"] = verdict(reduce)
    for what, got in refused.items():
        assert isinstance(got, readstep.NotFusable) and str(got), f"{what}: {got!r}"


# --------------------------------------------------------------------------- fused gather == SGLang's move
def _check_fused(rank, world, strategy, seq_lens, dtype, compact):
    import nsa_cp.integrations.sglang as nsa_sglang
    from nsa_cp.integrations.sglang import state

    prepare, SumGroup, add_norm, RMSNorm = _sglang_bits()
    md, n = sglang_env.build_metadata(seq_lens, world, strategy)
    P = md.per_rank_actual_token[0]
    fb = NS(attn_cp_metadata=md)
    norm = _norm(RMSNorm, dtype)
    step = partial(prepare._update_read, pre_move=None, enters_stack=False, read=add_norm.NORM_READOUT)
    hs = [_rand(100 + q, P, dtype) for q in range(world)]
    res = [_rand(200 + q, P, dtype, 4.0) for q in range(world)]
    for q in range(world):  # what a layer leaves on SGLang's padding rows: garbage, never zeros
        hs[q][n[q]:], res[q][n[q]:] = 3e2, -7.0
    # SGLang's own step on every rank's rows (local, deterministic): the residuals and the rows it gathers
    theirs = [step(hs[q].clone(), res[q].clone(), fb, norm) for q in range(world)]
    before = dict(state.STATE.gathers)
    adapter = nsa_sglang.CpMovesAdapter(compact=compact)
    mine_res = res[rank].clone()
    g, r = adapter.gather(hs[rank].clone(), mine_res, fb, norm, gather=step, update=add_norm.PLAIN_ADD)
    assert state.STATE.gathers.get("fused_add_rmsnorm_all_gather", 0) == before.get("fused_add_rmsnorm_all_gather", 0) + 1
    assert r is mine_res and torch.equal(r, theirs[rank][1]), "residual (padding rows included) differs from SGLang's"
    rows = sum(n) if compact else P * world
    assert g.shape == (rows, H), g.shape
    off = [sum(n[:q]) for q in range(world)]
    tol = {torch.float32: 1e-6, torch.bfloat16: 2 ** -8}[dtype]  # one rounding of the dtype
    for q in range(world):
        start = off[q] if compact else q * P
        got, want = g[start : start + n[q]].double(), theirs[q][0][: n[q]].double()
        assert torch.allclose(got, want, rtol=tol, atol=tol), f"rank {q}'s rows: max diff {(got - want).abs().max()}"
        if not compact:
            assert not g[q * P + n[q] : (q + 1) * P].any(), f"rank {q}'s padding rows are not zero"


def _fused_worker(rank, world, payload):
    sglang_env.setup_parallel(rank, world)
    results = {}
    for case_id, (strategy, seq_lens) in payload.items():
        for dname, dtype in DTYPES.items():
            for layout in ("padded", "compact"):
                key = f"{case_id}-{dname}-{layout}"
                try:
                    _check_fused(rank, world, strategy, seq_lens, dtype, layout == "compact")
                    results[key] = None
                except Exception:  # noqa: BLE001
                    results[key] = traceback.format_exc()
    return results


CASES = {w: {f"{s}-{c}": (s, lens) for s in ("zigzag", "interleave") for c, lens in cases.items()}
         for w, cases in SPLITS.items()}
_WORLDS = {}


def _world(fn, world):
    sglang_env.require_sglang()
    if (fn, world) not in _WORLDS:
        _WORLDS[fn, world] = run_world(world, "gloo", fn, CASES[world], timeout_s=300)
    return _WORLDS[fn, world]


@pytest.mark.parametrize("world,key", [(w, f"{c}-{d}-{lay}") for w in CASES for c in CASES[w] for d in DTYPES
                                       for lay in ("padded", "compact")])
def test_fused_gather_equals_sglangs_move(world, key):
    errors = case_failures(_world(_fused_worker, world), key)
    assert not errors, "\n".join(errors)


# --------------------------------------------------------------------------- declined batches: SGLang's move
class _Recorder:
    """SGLang's own moves, recording which ran (the real ones would gather; what matters is who ran)."""

    def __init__(self, CpMoves):
        self.calls = []

        def record(name):
            def move(hidden_states, residual, forward_batch, *args, **kwargs):
                self.calls.append(name)
                if name == "gather":  # SGLang's gather runs its read step first
                    hidden_states, residual = kwargs["gather"](hidden_states, residual, forward_batch, *args)
                return ("sglang", name, hidden_states), residual
            return move

        self.moves = CpMoves(gather=record("gather"), take_back=record("take_back"),
                             reduce_scatter=record("reduce_scatter"), reduce_scatter_group=lambda: None)


def _check_declines(rank, world):
    from sglang.srt.layers.layer_boundary.contracts import CpMoves

    os.environ["NSA_CP_FIRST_USE_CHECKS"] = "0"  # the recorder stands in for SGLang's moves: nothing to compare

    import nsa_cp.integrations.sglang as nsa_sglang
    from nsa_cp.integrations.sglang import plugin, runtime, state

    state.reset()
    md, n = sglang_env.build_metadata([37, 64, 21], world, "zigzag")
    P = md.per_rank_actual_token[0]
    rec = _Recorder(CpMoves)
    adapter = nsa_sglang.CpMovesAdapter(compact=True)
    ours = plugin._moves_on(rec.moves, lambda: adapter, compact_ok=True)
    x, res = _rand(1, P, torch.float32), _rand(2, P, torch.float32)

    def step(h, r, fb, norm, **kw):
        return h + r, h + r

    # served by nsa_cp: a compact gather (an FFN stage's moves), then its reduce-scatter
    g, _ = ours.gather(x, res, NS(attn_cp_metadata=md), None, gather=step)
    assert isinstance(g, torch.Tensor) and g.shape == (sum(n), H) and rec.calls == [], (g, rec.calls)
    out, _ = ours.reduce_scatter(g, res, NS(attn_cp_metadata=md))
    assert out.shape == (P, H) and rec.calls == []
    # an attention stage's moves (compact_ok False) stay padded under NSA_CP_SGLANG_COMPACT
    padded = plugin._moves_on(rec.moves, lambda: adapter, compact_ok=False)
    g2, _ = padded.gather(x, res, NS(attn_cp_metadata=md), None, gather=step)
    assert g2.shape == (P * world, H), g2.shape
    expected = []
    graph = NS(**{**vars(md), "graph_num_tokens": 64})
    for what, call, name in [
        ("graph", lambda: ours.gather(x, res, NS(attn_cp_metadata=graph), None, gather=step), "gather"),
        ("graph", lambda: ours.reduce_scatter(g, res, NS(attn_cp_metadata=graph)), "reduce_scatter"),
        ("rows", lambda: ours.reduce_scatter(torch.cat([g, g[:1]]), res, NS(attn_cp_metadata=md)), "reduce_scatter"),
        ("rows", lambda: ours.take_back(torch.cat([g, g, g[:1]]), res, NS(attn_cp_metadata=md)), "take_back"),
        ("no metadata", lambda: ours.take_back(g, res, NS(attn_cp_metadata=None)), "take_back"),
    ]:
        got, _ = call()
        expected.append(name)
        assert got[:2] == ("sglang", name) and rec.calls == expected, (what, rec.calls)
    # rows the metadata does not describe, seen after SGLang's read step ran: its gather moves them as they are
    got, _ = ours.gather(x[:-2], res[:-2], NS(attn_cp_metadata=md), None, gather=step)
    assert got[:2] == ("sglang", "gather") and torch.equal(got[2], (x + res)[:-2]), got
    with mock.patch.object(runtime, "attn_dp_size", return_value=2):  # read once per adapter: a fresh one
        dp = nsa_sglang.CpMovesAdapter(compact=True)
        got, _ = plugin._moves_on(rec.moves, lambda: dp, compact_ok=True).gather(x, res, NS(attn_cp_metadata=md),
                                                                                 None, gather=step)
        assert got[:2] == ("sglang", "gather"), "attention DP"
    # a replicated shared expert (SGLANG_SHARED_EXPERT_TP1) is served like any other batch: no decline
    with mock.patch.dict(os.environ, {"SGLANG_SHARED_EXPERT_TP1": "1"}):
        reason, _ = nsa_sglang.CpMovesAdapter(compact=True).admit("gather", x, NS(attn_cp_metadata=md))
        assert reason is None, ("replicated shared expert", reason)
    declined = nsa_sglang.status()["declined"]
    assert declined == {"a batch under SGLang's breakable CUDA graph": 2, "reduce_scatter input rows not the metadata's": 1,
                        "take_back input rows not the metadata's": 1, "no attn_cp_metadata on the batch": 1,
                        "local rows not the metadata's": 1, "attention DP": 1}, declined
    return {"declines": None}


def _declines_worker(rank, world, payload):
    sglang_env.setup_parallel(rank, world)
    try:
        return _check_declines(rank, world)
    except Exception:  # noqa: BLE001
        return {"declines": traceback.format_exc()}


@pytest.mark.parametrize("world", [2, 3])
def test_declined_batches_take_sglangs_moves(world):
    sglang_env.require_sglang()
    errors = case_failures(run_world(world, "gloo", _declines_worker, None, timeout_s=300), "declines")
    assert not errors, "\n".join(errors)


# --------------------------------------------------------------------------- the scheduler's transport
def test_transport_size_from_sglang_limits():
    from nsa_cp.integrations.sglang.scheduler import max_tokens_per_rank

    args = NS(chunked_prefill_size=8192, max_prefill_tokens=16384)
    # 16384 over 4 ranks + one alignment unit (8), rounded up to 8
    assert max_tokens_per_rank(args, 4, 8) == 4104
    assert max_tokens_per_rank(NS(chunked_prefill_size=-1, max_prefill_tokens=16384), 8, 8) == 2056
    assert max_tokens_per_rank(NS(chunked_prefill_size=8191, max_prefill_tokens=None), 3, 3) == 2736
    assert max_tokens_per_rank(NS(chunked_prefill_size=-1, max_prefill_tokens=0), 2, 4) is None


def _scheduler_worker(rank, world, payload):
    try:
        coordinator = sglang_env.setup_parallel(rank, world)
        import nsa_cp.integrations.sglang as nsa_sglang
        from nsa_cp.integrations.sglang import runtime, scheduler, state

        state.reset()
        runner = NS(server_args=NS(chunked_prefill_size=8192, max_prefill_tokens=16384, enable_symm_mem=False),
                    model_config=NS(hidden_size=H, dtype=torch.bfloat16))
        with mock.patch.object(runtime, "cp_gathers_over_attn_cp", return_value=False):
            off = scheduler.setup_transport(runner)
        assert not off["on"] and "not a DSA/MLA" in off["reason"], off
        state.reset()
        nsa_sglang.configure(coordinator.device_group)
        with mock.patch.object(runtime, "cp_gathers_over_attn_cp", return_value=True):
            decision = scheduler.setup_transport(runner)
        # a CPU-only gloo group: P2P off, with nsa_cp's own reason, on every rank alike
        assert not decision["on"] and decision["reason"] and decision["max_tokens_per_rank"], decision
        assert nsa_sglang.status()["p2p"] == decision
        return {"scheduler": None}
    except Exception:  # noqa: BLE001
        return {"scheduler": traceback.format_exc()}


def test_scheduler_transport_decision_on_cpu():
    sglang_env.require_sglang()
    errors = case_failures(run_world(2, "gloo", _scheduler_worker, None, timeout_s=300), "scheduler")
    assert not errors, "\n".join(errors)


# --------------------------------------------------------------------------- the registration log
def _blocked_probe(queue):
    """A scheduler whose SGLang layer_boundary cannot import (torchvision missing, as once seen)."""
    try:
        import logging
        import sys

        sglang_env.prepare_process()
        sys.modules["torchvision"] = None  # `import torchvision` now raises ImportError
        records = []
        handler = logging.Handler()
        handler.emit = lambda record: records.append(record.getMessage())
        logging.getLogger("nsa_cp").addHandler(handler)
        logging.getLogger("nsa_cp").setLevel(logging.INFO)
        from sglang.srt.plugins import load_plugins

        load_plugins()
        import nsa_cp.integrations.sglang as nsa_sglang

        queue.put({"status": nsa_sglang.status(), "log": records})
    except BaseException:  # noqa: BLE001
        queue.put({"error": traceback.format_exc()})


def test_registration_log_names_the_cause():
    sglang_env.require_sglang()
    out = sglang_env.run_spawned(_blocked_probe)
    log = "\n".join(out["log"])
    assert "NOT registered" in log and "torchvision" in log, log
    assert "registered:" not in log and "handed" not in log, log
    status = out["status"]
    assert not status["plugin_registered"] and "torchvision" in status["register_error"], status
