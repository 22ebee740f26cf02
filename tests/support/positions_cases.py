"""Ordered calls with ``positions`` that are not a permutation (tests/collectives/test_positions_check.py).

The documented result (nsa_cp.planning.checks.ordered_rows): the first entry holding a value in [0, T) keeps it;
every other entry (a repeat, a value out of range) takes, in entry order, one of the rows no entry holds,
in increasing order. ``want_rows`` writes that rule out in plain Python, independently of the library.
Every case checks, on every rank: the result is exactly the rule's (torch.equal), every row of a
NaN-poisoned ``out`` was written, and every rank holds the same result.
"""

from __future__ import annotations

import traceback


def want_rows(pos, total):
    seen, rows, moved = set(), [None] * len(pos), []
    for i, p in enumerate(pos):
        if 0 <= p < total and p not in seen:
            seen.add(p)
            rows[i] = p
        else:
            moved.append(i)
    free = [r for r in range(total) if r not in seen]
    for i, r in zip(moved, free):
        rows[i] = r
    return rows


def bad_positions(kind: str, total: int, seed: int):
    import random

    rng = random.Random(seed)
    perm = list(range(total))
    rng.shuffle(perm)
    if kind == "permutation":
        return perm
    if kind == "repeats":
        return [perm[i] if i % 3 else perm[(i + 1) % total] for i in range(total)]
    if kind == "out-of-range":
        return [(-1 - i if i % 2 else total + i) if i % 4 == 0 else perm[i] for i in range(total)]
    if kind == "all-zero":
        return [0] * total
    raise ValueError(kind)


def make_cases(world: int):
    layouts = {2: ([5, 3], [0, 6], [4, 4]), 3: ([4, 0, 2], [3, 3, 3])}[world]
    cases = []
    for counts in layouts:
        for kind in ("permutation", "repeats", "out-of-range", "all-zero"):
            for compact in (False, True):
                cases.append({"id": f"c{'-'.join(map(str, counts))}-{kind}-{'compact' if compact else 'padded'}",
                              "counts": counts, "kind": kind, "compact": compact})
    return cases


def _gen(seed, rows, hidden, dtype):
    import torch

    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, hidden, generator=g) + 0.5).to(dtype)


def _same_on_every_rank(t, group) -> bool:
    import torch
    import torch.distributed as dist

    flat = t.reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1).to(torch.float32)
    got = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(got, flat.contiguous(), group=group)
    return all(torch.equal(g, got[0]) for g in got)


def _case(rank, world, case):
    import torch

    import nsa_cp

    counts, hidden, dtype = case["counts"], 256, torch.bfloat16
    layout = nsa_cp.ShardLayout(per_rank_actual_token=counts)
    total = layout.total_len
    pos_list = bad_positions(case["kind"], total, seed=sum(counts))
    positions = torch.tensor(pos_list, dtype=torch.int64)
    rows = want_rows(pos_list, total)
    shards = [_gen(100 + q, counts[q], hidden, dtype) for q in range(world)]
    compact_all = torch.cat(shards)
    want = torch.empty_like(compact_all)
    want[torch.tensor(rows, dtype=torch.int64)] = compact_all  # row positions'[i] <- compact row i
    x = shards[rank]

    # the gather: fresh result and a NaN-poisoned out
    got = nsa_cp.cp_all_gather(x, layout, compact=case["compact"], positions=positions)
    if not torch.equal(got, want):
        return f"ordered gather ({case['kind']}): not the documented rows"
    out = torch.full_like(want, float("nan"))
    nsa_cp.cp_all_gather(x, layout, compact=case["compact"], positions=positions, out=out)
    if bool(out.isnan().any()) or not torch.equal(out, want):
        return f"ordered gather into out ({case['kind']}): rows left unwritten or wrong"
    if not _same_on_every_rank(got, None):
        return "ordered gather: ranks disagree"

    # the FP8 wire and the fused norm gather follow the same rows
    q, scale = nsa_cp.cp_all_gather(x, layout, compact=case["compact"], positions=positions, quant="fp8_e4m3_g128")
    wq, ws = nsa_cp.quant_fp8_g128(want)
    if not (torch.equal(q.view(torch.uint8), wq.view(torch.uint8)) and torch.equal(scale, ws)):
        return f"ordered FP8 gather ({case['kind']}): not the documented rows"
    weight = (torch.rand(hidden, generator=torch.Generator().manual_seed(3)) + 0.5).to(dtype)
    normed, _ = nsa_cp.fused_add_rmsnorm_all_gather(x, None, weight, 1e-6, layout, compact=case["compact"],
                                                    positions=positions)
    want_normed = nsa_cp.rows.reference.fused_add_rmsnorm(want, None, weight, 1e-6)[0]
    if not torch.equal(normed, want_normed):
        return f"ordered norm gather ({case['kind']}): not the documented rows"

    # the reduce-scatter reads row rows[offsets[r] + i] of every rank's y: the gather's inverse
    ys = [_gen(200 + q, total, hidden, torch.float32) for q in range(world)]
    mine = torch.tensor(rows[layout.offsets[rank]:layout.offsets[rank] + counts[rank]], dtype=torch.int64)
    want_mine = sum(y.double() for y in ys)[mine].to(torch.float32)
    got_mine = nsa_cp.cp_reduce_scatter(ys[rank], layout, compact=case["compact"], positions=positions)
    if not torch.allclose(got_mine.double(), want_mine.double(), rtol=1e-6, atol=1e-6):
        return f"ordered reduce-scatter ({case['kind']}): not the documented rows"
    back = nsa_cp.cp_reduce_scatter(got.float(), layout, compact=case["compact"], positions=positions)
    if not torch.equal(back, world * x.float()):
        return "ordered reduce-scatter is not the inverse of the ordered gather"

    # validate=True still refuses the input (one all-reduce and a host sync)
    if case["kind"] != "permutation":
        try:
            nsa_cp.cp_all_gather(x, layout, positions=positions, validate=True)
        except ValueError as err:
            if "positions: expected a permutation" not in str(err):
                return f"validate=True: unexpected message {err}"
        else:
            return "validate=True accepted positions that are not a permutation"
    return None


def _in_place_and_inference(rank, world):
    """A positions tensor changed in place is seen (the cache follows its version); inference tensors work."""
    import torch

    import nsa_cp

    layout = nsa_cp.ShardLayout(per_rank_actual_token=[3, 2][:world] if world == 2 else [3, 2, 1])
    total = layout.total_len
    shards = [_gen(300 + q, n, 128, torch.float32) for q, n in enumerate(layout.per_rank_actual_token)]
    compact_all = torch.cat(shards)
    positions = torch.arange(total)
    first = nsa_cp.cp_all_gather(shards[rank], layout, positions=positions)
    if not torch.equal(first, compact_all):
        return "identity positions: not the compact rows"
    positions.copy_(torch.arange(total).flip(0))  # the same tensor, new values
    second = nsa_cp.cp_all_gather(shards[rank], layout, positions=positions)
    if not torch.equal(second, compact_all.flip(0)):
        return "positions changed in place: the old rows were used"
    positions[0] = positions[1]  # a view's write: now a repeat
    third = nsa_cp.cp_all_gather(shards[rank], layout, positions=positions)
    rows = want_rows(positions.tolist(), total)
    want = torch.empty_like(compact_all)
    want[torch.tensor(rows)] = compact_all
    if not torch.equal(third, want):
        return "positions changed through a view: the old rows were used"
    with torch.inference_mode():
        pos_inf = torch.zeros(total, dtype=torch.int64)
        got = nsa_cp.cp_all_gather(shards[rank], layout, positions=pos_inf)
        want = torch.empty_like(compact_all)
        want[torch.tensor(want_rows([0] * total, total))] = compact_all
        if not torch.equal(got, want):
            return "inference-mode positions: not the documented rows"
        pos_inf.copy_(torch.arange(total))
        if not torch.equal(nsa_cp.cp_all_gather(shards[rank], layout, positions=pos_inf), compact_all):
            return "inference-mode positions changed in place: the old rows were used"
    return None


def run_cases(rank, world, payload):
    results = {}
    for case in payload["cases"]:
        try:
            results[case["id"]] = _case(rank, world, case)
        except Exception:
            results[case["id"]] = traceback.format_exc()
    try:
        results["in-place-and-inference"] = _in_place_and_inference(rank, world)
    except Exception:
        results["in-place-and-inference"] = traceback.format_exc()
    return results
