"""The SGLang plugin's first-use checks, with SGLang 0.5.23's own moves on CPU / gloo, worlds 2 and 3.

The plugin's moves (``plugin._moves_on``: what SGLang's patched ``_cp_moves()`` returns) around SGLang's own
``CpMoves`` for the DSA/MLA kind, called as SGLang's layer calls them (the gather with SGLang's read step):

* ``undrifted``: every kind's first call is checked (SGLang's own move run beside nsa_cp's on the same inputs)
  and passes; nsa_cp serves, padded and compact; later calls are not checked again;
* ``mirrored-take-back``: a drift a static contract cannot see: SGLang's ``attn_cp_take_back_output`` returns
  the shard of rank ``cp - 1 - r`` (same signature, same two values). The first take_back is checked, differs,
  and is declined for the process with one warning; that call and the next return SGLang's own result
  (bitwise), counted in ``status()["declined"]``;
* ``unchecked`` (``NSA_CP_FIRST_USE_CHECKS=0``): the same drift is not seen and nsa_cp's take_back differs from
  the drifted SGLang's, which is what the check is for.
"""

from __future__ import annotations

import logging
import os
import traceback
from functools import partial
from types import SimpleNamespace as NS

import pytest
import torch

import engines
import sglang_env
from dist_harness import case_failures, run_world

H = 256


def _rand(seed, rows):
    return torch.randn(rows, H, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _mirrored_take_back(hidden_states, residual, forward_batch):
    """SGLang's take_back returning another rank's shard: the same signature and values, another meaning."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    return hidden_states.tensor_split(parallel.attn_cp_size)[parallel.attn_cp_size - 1 - parallel.attn_cp_rank], \
        residual


def _check(rank, world, variant, log):
    from sglang.srt.layers.layer_boundary.contracts import CpMoves

    import nsa_cp
    import nsa_cp.integrations.sglang as nsa_sglang
    from nsa_cp.integrations.sglang import plugin, state

    state.reset()
    md, n = sglang_env.build_metadata([37, 64, 21], world, "zigzag")
    P, fb = md.per_rank_actual_token[0], NS(attn_cp_metadata=md)
    theirs = sglang_env.sglang_moves()
    if variant != "undrifted":
        theirs = CpMoves(gather=theirs.gather, take_back=_mirrored_take_back, reduce_scatter=theirs.reduce_scatter,
                         reduce_scatter_group=theirs.reduce_scatter_group)
    step = sglang_env.read_step()
    norm = nsa_cp.RMSNorm(H).to(torch.bfloat16)
    padded = plugin._moves_on(theirs, lambda: nsa_sglang.CpMovesAdapter(compact=False), compact_ok=True)
    compact = plugin._moves_on(theirs, lambda: nsa_sglang.CpMovesAdapter(compact=True), compact_ok=True)
    if variant == "unchecked":
        os.environ["NSA_CP_FIRST_USE_CHECKS"] = "0"
    try:
        for call in range(2):
            for moves, lay in ((padded, "padded"), (compact, "compact")):
                hs, res = _rand(10 + rank, P), _rand(20 + rank, P)
                want_g, want_r = partial(theirs.gather, gather=step)(hs.clone(), res.clone(), fb, norm)
                g, r = partial(moves.gather, gather=step)(hs.clone(), res.clone(), fb, norm)
                assert torch.equal(r, want_r), "residual"
                real = torch.cat([want_g[q * P: q * P + n[q]] for q in range(world)])
                assert torch.equal(g if lay == "compact" else torch.cat([g[q * P: q * P + n[q]] for q in range(world)]),
                                   real), f"{lay} gather"
                full = _rand(30, P * world)
                got, _ = moves.take_back(full, res, fb)
                want, _ = theirs.take_back(full, res, fb)
                if variant == "unchecked":  # the middle rank of an odd world takes back its own shard even mirrored
                    assert torch.equal(got, want) == (world - 1 - rank == rank), "unchecked, the drift goes unseen"
                else:
                    assert torch.equal(got, want), f"take_back: SGLang's own result ({variant}, call {call})"
                partials = _rand(40 + rank, P * world)
                out, _ = moves.reduce_scatter(partials.clone(), res, fb)
                ref, _ = theirs.reduce_scatter(partials.clone(), res, fb)
                torch.testing.assert_close(out[: n[rank]].float(), ref[: n[rank]].float(), rtol=2 ** -7, atol=1e-2)
    finally:
        os.environ.pop("NSA_CP_FIRST_USE_CHECKS", None)
    first = nsa_sglang.status()["first_use"]
    warned = [r.getMessage() for r in log if r.levelno == logging.WARNING and "first-use check" in r.getMessage()]
    if variant == "unchecked":
        assert first["checked"] == {} and first["declined"] == {} and not warned, (first, warned)
        return
    kinds = ["gather padded", "gather compact", "take_back padded", "reduce_scatter padded"]  # rows given padded
    if variant == "undrifted":
        assert first["checked"] == {k: 1 for k in kinds} and not first["declined"] and not warned, (first, warned)
        assert not nsa_sglang.status()["declined"], nsa_sglang.status()["declined"]
        return
    assert list(first["declined"]) == ["take_back padded"], first
    # the middle rank of an odd world takes back its own shard even mirrored: it declines because its peers saw it
    seen = "another rank saw a difference" if world - 1 - rank == rank else "take_back (this rank's rows)"
    assert seen in first["declined"]["take_back padded"], first
    assert len(warned) == 1 and "take_back padded" in warned[0], warned
    declined = nsa_sglang.status()["declined"]
    assert sum(v for k, v in declined.items() if "first-use check declined take_back padded" in k) == 4, declined


VARIANTS = ("undrifted", "mirrored-take-back", "unchecked")


def _worker(rank, world, payload):
    torch.set_grad_enabled(False)
    sglang_env.setup_parallel(rank, world)
    log = engines.nsa_cp_records()
    results = {}
    for variant in VARIANTS:
        log.clear()
        try:
            _check(rank, world, variant, log)
            results[variant] = None
        except Exception:  # noqa: BLE001
            results[variant] = traceback.format_exc()
    return results


_WORLDS: dict = {}


@pytest.mark.parametrize("world,variant", [(w, v) for w in (2, 3) for v in VARIANTS])
def test_sglang_first_use_check(world, variant):
    sglang_env.require_sglang()
    if world not in _WORLDS:
        _WORLDS[world] = run_world(world, "gloo", _worker, None, timeout_s=300)
    errors = case_failures(_WORLDS[world], variant)
    assert not errors, "\n".join(errors)
