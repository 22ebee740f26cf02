"""What every rank does for tests/collectives/test_plan.py: the plan cache never serves a stale plan.

``run_checks`` (one world, named checks): a repeated call hits its plan; an equal layout built anew
finds the same plan; every change of what a plan is keyed on (layout, row shape, dtype, compact, out=
given, an environment variable, init_p2p / destroy_p2p) gets another plan, and every result is checked
against an oracle written here.

``handle`` (a WorldPool handler, one payload = a sequence of calls drawn by hypothesis): runs the calls
in order with validation off (the cached hot path), each with its own layout, row shape, dtype, compact,
out and environment, and checks every result.
"""

from __future__ import annotations

import traceback
from typing import Dict, List, Optional

import torch

from dist_harness import scoped_env

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _gen(seed: int, rank: int, rows: int, rest, dtype, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 131 + rank)
    return torch.randn((rows, *rest), generator=g).to(dtype).to(device)


def _expected_gather(shards, m: int, compact: bool) -> torch.Tensor:
    if compact:
        return torch.cat(shards)
    return torch.cat([torch.cat([s, s.new_zeros((m - s.shape[0], *s.shape[1:]))]) for s in shards])


def one_call(call: dict, rank: int, world: int, group, device) -> Optional[str]:
    """Run one described call and compare it with the oracle; None when it matches."""
    import nsa_cp

    dtype, rest = DTYPES[call["dtype"]], tuple(call["rest"])
    layout = nsa_cp.ShardLayout(list(call["counts"]), call["align"])
    m, compact = layout.max_rank_len, call["compact"]
    with scoped_env(call.get("env") or {}):  # the call's environment, for this call only
        if call["op"] == "gather":
            shards = [_gen(call["seed"], q, n, rest, dtype, "cpu") for q, n in enumerate(layout.per_rank_actual_token)]
            want = _expected_gather(shards, m, compact)
            out = torch.full(want.shape, float("nan"), dtype=dtype, device=device) if call["out"] else None
            got = nsa_cp.cp_all_gather(shards[rank].to(device), layout, group, compact=compact, out=out)
            if out is not None and got is not out:
                return "out= given, another tensor returned"
            if tuple(got.shape) != tuple(want.shape) or not torch.equal(got.cpu(), want):
                return f"gather differs from the oracle ({layout}, compact={compact}, rest={rest}, {dtype})"
            return None
        rows = layout.global_len(compact)
        partials = [_gen(call["seed"], q, rows, rest, dtype, "cpu") for q in range(world)]
        start = layout.offsets[rank] if compact else rank * m
        n = layout.count(rank)
        mine = torch.stack([p[start:start + n].double() for p in partials])
        out = torch.full((n, *rest), float("nan"), dtype=dtype, device=device) if call["out"] else None
        got = nsa_cp.cp_reduce_scatter(partials[rank].to(device), layout, group, compact=compact, out=out)
        unit = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}[dtype]
        bound = world * unit * mine.abs().sum(0) + 1e-30
        if tuple(got.shape) != (n, *rest) or bool(((got.cpu().double() - mine.sum(0)).abs() > bound).any()):
            return f"reduce-scatter differs from the fp64 sum ({layout}, compact={compact}, rest={rest}, {dtype})"
        return None


def handle(rank: int, world: int, payload: dict) -> List[Optional[str]]:
    import torch.distributed as dist

    device = torch.device("cuda", rank) if payload.get("device") == "cuda" else torch.device("cpu")
    results = []
    for call in payload["calls"]:
        try:
            results.append(one_call(call, rank, world, dist.group.WORLD, device))
        except Exception:
            results.append(traceback.format_exc())
    return results


# --------------------------------------------------------------------------- named checks
def _plan_of(x, layout, group, compact=False, out=None):
    from nsa_cp.planning import plan
    from nsa_cp.planning.request import Request

    return plan.lookup(Request.of("cp_all_gather", x, layout, group, compact, out=out))


def _check_keys(rank, world, group, device) -> Optional[str]:
    import nsa_cp
    from nsa_cp.planning import plan

    counts = [3 + q for q in range(world)]
    base = dict(op="gather", counts=counts, align=1, rest=(8,), dtype="fp32", compact=False, out=False, seed=1)
    problem = one_call(base, rank, world, group, device)
    x = torch.zeros((counts[rank], 8), device=device)
    layout = nsa_cp.ShardLayout(counts)
    first = _plan_of(x, layout, group)
    if _plan_of(x, layout, group) is not first:
        return "a repeated call did not hit its plan"
    if _plan_of(x, nsa_cp.ShardLayout(list(counts)), group) is not first:
        return "an equal layout built anew did not find the same plan"
    changes = {
        "layout": dict(counts=[2 + q for q in range(world)]),
        "align": dict(align=4),
        "row shape": dict(rest=(2, 4)),
        "dtype": dict(dtype="bf16"),
        "compact": dict(compact=True),
        "out": dict(out=True),
        "env NSA_CP_NCCL_CALL": dict(env={"NSA_CP_NCCL_CALL": "public"}),
        "env NSA_CP_COMPACT_ALGO": dict(compact=True, env={"NSA_CP_COMPACT_ALGO": "padded"}),
    }
    for what, change in changes.items():
        call = {**base, **change, "seed": 2 + len(what)}
        problem = problem or one_call(call, rank, world, group, device)
        if problem:
            return f"after a change of {what}: {problem}"
        # the first call again: still correct, and the change did not evict or replace its plan
        problem = one_call(base, rank, world, group, device)
        if problem:
            return f"the first call after a change of {what}: {problem}"
    with scoped_env({"NSA_CP_NCCL_CALL": "public"}):
        if _plan_of(x, layout, group) is first:
            return "an environment variable changed, yet the same plan was served"
    if _plan_of(x, layout, group) is not first:
        return "the variable's old value did not find its plan again"
    # and the new value takes effect: NSA_CP_NCCL_CALL=public routes the collective through torch's function
    from nsa_cp.transport.dist import collectives as nccl

    public, seen = nccl._all_gather_single, []
    # the rows' calls only (not the agreement's int32 fingerprint words, which take the same path)
    nccl._all_gather_single = lambda *a, **k: (seen.append(1) if a[0].dtype != torch.int32 else None,
                                               public(*a, **k))[1]
    try:
        for value, want in ((None, 0), ("public", 1), (None, 0)):
            seen.clear()
            call = {**base, "env": {} if value is None else {"NSA_CP_NCCL_CALL": value}}
            problem = one_call(call, rank, world, group, device)
            if problem or len(seen) != want:
                return problem or f"NSA_CP_NCCL_CALL={value}: torch's function called {len(seen)} times, expected {want}"
    finally:
        nccl._all_gather_single = public
    out = torch.empty((layout.padded_len, 8), device=device)
    if _plan_of(x, layout, group, out=out) is first:
        return "out= given and not given share a plan"
    # a transport coming or going (init_p2p / destroy_p2p change the group registries' generation) drops every plan
    size = plan.cache_size()
    real = plan.groups.latest_generation
    plan.groups.latest_generation = lambda: ("changed",)
    try:
        if _plan_of(x, layout, group) is first or plan.cache_size() > 1 or size < 2:
            return f"a new P2P generation did not drop the cached plans ({size} before, {plan.cache_size()} after)"
    finally:
        plan.groups.latest_generation = real
    return None


def _check_p2p_reinit(rank, world, group, device) -> Optional[str]:
    """GPU: a gather before init_p2p, after it, after destroy_p2p and after init_p2p again takes the
    transport registered at that moment (never a dropped one) and is exact every time."""
    import nsa_cp

    counts = [5 + 3 * q for q in range(world)]
    layout = nsa_cp.ShardLayout(counts)
    call = dict(op="gather", counts=counts, align=1, rest=(256,), dtype="bf16", compact=False, out=False, seed=3)
    x = torch.zeros((counts[rank], 256), dtype=torch.bfloat16, device=device)
    expect = []
    for step in ("none", "init", "destroy", "init again", "scatter"):
        if step.startswith("init"):
            nsa_cp.init_p2p(group, 64, 256, torch.bfloat16)
        elif step == "destroy":
            nsa_cp.transport.destroy_p2p(group)
        problem = one_call(call if step != "scatter" else {**call, "op": "scatter"}, rank, world, group, device)
        if problem:
            return f"after {step}: {problem}"
        backend = _plan_of(x, layout, group).backend
        expect.append(backend)
    nsa_cp.transport.destroy_p2p(group)
    if expect[:4] != ["nccl", "p2p", "nccl", "p2p"]:
        return f"backends chosen {expect[:4]}, expected nccl, p2p, nccl, p2p"
    return None


CHECKS = {"keys": _check_keys, "p2p_reinit": _check_p2p_reinit}


def run_checks(rank: int, world: int, payload: dict) -> Dict[str, Optional[str]]:
    import torch.distributed as dist

    device = torch.device("cuda", rank) if payload["device"] == "cuda" else torch.device("cpu")
    results = {}
    for name in payload["checks"]:
        try:
            results[name] = CHECKS[name](rank, world, dist.group.WORLD, device)
        except Exception:
            results[name] = traceback.format_exc()
        dist.barrier()
    return results
