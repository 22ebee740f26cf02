"""Checks of cp_overlapped_boundary inside a process group (gloo on CPU tensors), against independent oracles
and the serialized boundary run in the same case.

Every rank derives every rank's rows from the case seed (oracles.gen). The consumer is per-row and
differs by the rank that runs it (each rank holds other experts): ``f_q(x) = x * (q + 1) + sin(x)``
computed in fp32 and rounded once, so rank r's expected result is ``sum_q f_q(rows of r)`` in fp64
(oracles.check_sum). The consumer also records what it was handed, so the data movement is checked
bitwise (the rows, or the FP8 bytes and scales, equal the serialized ``cp_all_gather``'s) and the order
(this rank's rows first, then ``rank - 1``, ``rank - 2``, ... without the empty ranks).

On a GPU (``gpu_cases``, ranks sharing one GPU over gloo, CUDA tensors): the serialized boundary runs on
nsa_cp's P2P transport, whose reduce-scatter sums in fp32 in rank order as the overlapped one does, so the
two results must be equal bit for bit for this row-independent consumer (besides the fp64 oracle).
"""

from __future__ import annotations

import random
import time
import traceback
from typing import Dict, List, Optional

import torch

from boundary_cases import _expect_value_error
from oracles import check_sum, gen

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
QUANT = "fp8_e4m3_g128"
FAULTS = ("wrong_shape", "wrong_topk", "dies")  # how run_fault's last rank fails


def make_cases(world: int, seed: int = 0) -> List[dict]:
    rng = random.Random(seed * 1000 + world)
    layouts = [
        ([0] * world, 1),  # all empty
        ([5] * world, 1),  # even
        ([6] * world, 8),  # even counts, padded by align
        ([7] + [0] * (world - 1), 1),  # only rank 0 holds rows
        ([0] * (world - 1) + [3], 2),  # only the last rank
        ([i + 1 for i in range(world)], 1),
        ([rng.choice([0, rng.randint(1, 11)]) for _ in range(world)], rng.choice([1, 4])),  # zero-token ranks
        ([rng.randint(1, 13) for _ in range(world)], 1),
    ]
    cases = []
    for li, (counts, align) in enumerate(layouts):
        for variant in ("plain", "quant", "padded_rows", "late", "chunked", "chunked_quant", "topk"):
            dtype = "bf16" if variant in ("quant", "late", "chunked_quant") else rng.choice(["bf16", "fp32"])
            quant = "quant" in variant
            cases.append({"id": f"l{li}-{variant}-{dtype}", "counts": counts, "align": align, "dtype": dtype,
                          "quant": QUANT if quant else None, "padded_rows": variant == "padded_rows",
                          "late": variant == "late", "rest": (128,) if quant else (rng.choice([8, 24]),),
                          "chunk_rows": rng.choice([1, 2, 3, 5, 64]) if "chunked" in variant else None,
                          "topk": variant == "topk",
                          "seed": 1000 * world + 10 * li + len(cases)})
    for li, counts in enumerate(([4] * world, [0] + [i + 2 for i in range(world - 1)], None)):
        for mode, quant in (("full", None), ("full", QUANT), ("scattered", None)):
            cases.append({"id": f"comm{li}-{mode}-{'fp8' if quant else 'bf16'}", "counts": counts, "mode": mode,
                          "quant": quant, "communicator": True, "seed": 77 * world + li,
                          "chunk_rows": 3 if li == 1 else None})
        for mode in ("full", "scattered"):  # TopK consumer + shared_mlp
            cases.append({"id": f"comm{li}-{mode}-topk-shared", "counts": counts, "mode": mode, "quant": None,
                          "communicator": True, "seed": 91 * world + li, "chunk_rows": None, "topk": True})
    cases.append({"id": "errors", "counts": [3] * world, "align": 1, "dtype": "fp32", "errors": True})
    return cases


GPU_HIDDEN = 256  # one P2P transport row for every GPU case (a multiple of 128 for the FP8 wire)


def gpu_cases(world: int, seed: int = 0, layouts: Optional[int] = None) -> List[dict]:
    """The layouts of make_cases on CUDA tensors: bf16 rows of GPU_HIDDEN, the variants that move data
    differently (plain, FP8, chunked, chunked FP8, TopK + shared, late); ``layouts``: the first that many."""
    cases = []
    for case in make_cases(world, seed):
        variant = case["id"].split("-")[1] if not case.get("communicator") and not case.get("errors") else None
        if variant in ("plain", "quant", "chunked", "chunked_quant", "topk", "late"):
            if layouts is None or int(case["id"].split("-")[0][1:]) < layouts:
                cases.append(dict(case, dtype="bf16", rest=(GPU_HIDDEN,), gpu=True,
                                  id=f"{case['id'].rsplit('-', 1)[0]}-bf16"))
    return cases


def _f(q: int, rows: torch.Tensor, dtype) -> torch.Tensor:
    """Rank q's per-row consumer: ``x * (q + 1) + sin(x)`` in fp32, rounded once to ``dtype``."""
    x = rows.float()
    return (x * (q + 1) + torch.sin(x)).to(dtype)


TOPK, SCALE = 3, 2.5


def _experts(q: int, rows: torch.Tensor):
    """Rank q's routed experts as a TopK consumer output: ``out [k, TOPK, ...]`` (fp32, ``rows * (q + j + 1)
    + cos(rows)``) and weights from the rows' first column; returns ``(out, weights)``."""
    x = rows.float()
    out = torch.stack([x * (q + j + 1) + torch.cos(x) for j in range(TOPK)], dim=1)
    w = torch.sigmoid(x.flatten(1)[:, :1] + torch.arange(TOPK, device=x.device))
    return out, w


def _topk_partial(q: int, rows: torch.Tensor, dtype) -> torch.Tensor:
    """What rank q's TopK output becomes, computed here in fp64 and rounded once (the partial that travels)."""
    out, w = _experts(q, rows)
    return ((out.double() * w.double().view(*w.shape, *([1] * (out.dim() - 2)))).sum(1) * SCALE).to(dtype)


def _dequant(pair) -> torch.Tensor:
    q, scale = pair
    return q.float() * scale.repeat_interleave(q.shape[1] // scale.shape[1], dim=1)


def _run_case(case, rank, world, group, nsa_cp) -> Optional[str]:
    layout = nsa_cp.ShardLayout(case["counts"], align=case["align"])
    dtype, quant, rest = DTYPES[case["dtype"]], case["quant"], tuple(case["rest"])
    counts, m = layout.per_rank_actual_token, layout.max_rank_len
    device = torch.device("cuda", torch.cuda.current_device()) if case.get("gpu") else torch.device("cpu")
    serial_backend = "p2p" if case.get("gpu") else "auto"
    shards = [gen(case["seed"], q, counts[q], rest, dtype, device) for q in range(world)]
    x = shards[rank]
    if case["padded_rows"]:  # the engine's physical [M, ...] rows, padding last holding garbage
        x = torch.cat([x, torch.full((m - counts[rank], *rest), float("nan"), dtype=dtype, device=device)])
    out_dtype = torch.bfloat16 if quant else dtype
    seen = []

    def consumer(rows, chunk):
        seen.append((chunk, tuple(t.clone() for t in rows) if quant else rows.clone()))
        if case["topk"]:
            return nsa_cp.TopK(*_experts(rank, rows), scale=SCALE)
        return _f(rank, _dequant(rows) if quant else rows, out_dtype)

    f = _f
    shared = None
    if case["topk"]:  # the routed experts' top-k reduce in nsa_cp, this rank's shared expert added at the end
        f = _topk_partial
        shared = gen(case["seed"] + 5, rank, counts[rank], rest, torch.float32, device)

    if case["late"] and rank == world - 1:
        time.sleep(0.3)  # a late peer: the others wait for its rows, nothing else changes
    chunk_rows = case["chunk_rows"]
    if case.get("gpu"):  # the copy-engine pulls serve it, on buffers poisoned with NaN
        how = nsa_cp.explain(x, layout, group, quant=quant, chunk_rows=chunk_rows, shared=shared is not None)
        if not how.startswith("cp_overlapped_boundary: backend 'p2p'"):
            return f"not served by the P2P pulls: {how}"
        from nsa_cp import transport

        p2p = transport.get_p2p(group)
        p2p._gathers[0].fill_(float("nan"))
        p2p._buffers.reduce.fill_(float("nan"))
    got = nsa_cp.cp_overlapped_boundary(x, layout, consumer, group, quant=quant, chunk_rows=chunk_rows,
                                        shared=shared)

    # the serialized boundary in the same group (every collective before any check, so that a failing
    # check on one rank leaves no other waiting): its gather is what the consumer must have been handed
    gathered = nsa_cp.cp_all_gather(shards[rank], layout, group, compact=True, quant=quant, backend=serial_backend)
    full = gathered if not quant else _dequant(gathered)
    serial = nsa_cp.cp_reduce_scatter(f(rank, full, out_dtype), layout, group, compact=True, backend=serial_backend)
    order = [(c.source, c.first, c.rows, c.step) for c, _ in seen]
    size = chunk_rows or max(*counts, 1)
    want_order = [((rank - k) % world, a, min(size, counts[(rank - k) % world] - a), k)
                  for k in range(world) for a in range(0, counts[(rank - k) % world], size)]
    if order != want_order:
        return (f"consumer calls (source, first, rows, step) {order}, expected {want_order} (own rows first, "
                f"then rank - k, each slot in chunks of at most {chunk_rows} rows in row order)")
    for chunk, rows in seen:
        lo, hi = chunk.compact_offset, chunk.compact_offset + chunk.rows
        src, a = chunk.source, chunk.first
        if (chunk.padded_offset, chunk.compact_offset) != (src * m + a, layout.offsets[src] + a):
            return f"chunk {chunk} does not describe rows {a}.. of rank {src}'s slot"
        if quant:
            if not (torch.equal(rows[0].view(torch.uint8), gathered[0][lo:hi].view(torch.uint8))
                    and torch.equal(rows[1], gathered[1][lo:hi])):
                return f"FP8 rows or scales of rank {chunk.source} differ from the serialized gather's"
        elif not torch.equal(rows, shards[src][a:a + chunk.rows]) or not torch.equal(rows, gathered[lo:hi]):
            return f"rows of rank {chunk.source} differ from its shard / the serialized gather"
    if got.shape != (counts[rank], *rest) or got.dtype != out_dtype:
        return f"result {tuple(got.shape)} {got.dtype}, expected {(counts[rank], *rest)} {out_dtype}"
    mine = gathered[0][layout.offsets[rank]:layout.offsets[rank] + counts[rank]] if quant else None
    base = _dequant((mine, gathered[1][layout.offsets[rank]:layout.offsets[rank] + counts[rank]])) if quant else x[:counts[rank]]
    partials = [f(q, base, out_dtype).cpu() for q in range(world)]
    problem = check_sum(got.cpu(), partials + ([shared.cpu()] if shared is not None else []), out_dtype)
    if problem:
        return problem
    if case.get("gpu") and shared is None and not torch.equal(got, serial):
        return (f"overlapped result differs from the P2P serialized boundary's (both fp32 in rank order): "
                f"{(got.float() - serial.float()).abs().max().item()} max")
    # the serialized boundary against the same oracle (its reduce-scatter sums in its backend's order)
    return check_sum(serial.cpu(), partials, out_dtype)


def _run_communicator(case, rank, world, group, nsa_cp) -> Optional[str]:
    """``overlapped_mlp`` against ``prepare_mlp`` -> the MLP on the gathered rows -> ``postprocess_layer`` of a
    twin communicator: the same residual bit for bit, the same sum within the fp64 oracle's bound."""
    hidden, dtype, quant = 128, torch.bfloat16, case["quant"]
    g = torch.Generator().manual_seed(case["seed"])
    weight = torch.rand(hidden, generator=g) + 0.5
    comms = []
    for _ in range(2):
        norm = nsa_cp.RMSNorm(hidden, eps=1e-5)
        with torch.no_grad():
            norm.weight.copy_(weight)
        comms.append(nsa_cp.NSACPLayerCommunicator(group, nsa_cp.RMSNorm(hidden), norm, mlp_mode=case["mode"],
                                                   quant=quant, compact=True))
    layout = nsa_cp.ShardLayout(case["counts"]) if case["counts"] is not None else None
    n = layout.per_rank_actual_token[rank] if layout is not None else 3
    h, res = (gen(case["seed"] + i, rank, n, (hidden,), dtype, "cpu") for i in (0, 1))

    def mlp(rows, chunk=None):
        return _f(rank, _dequant(rows) if isinstance(rows, tuple) else rows, dtype)

    full = case["mode"] == "full" and layout is not None
    if case.get("topk"):  # the routed experts as a TopK, the shared expert on the rank's normed rows
        seen_normed = []

        def shared_mlp(normed):
            seen_normed.append(normed.clone())
            return (normed.float() * 0.5 + 1).to(dtype)

        out, res_a = comms[0].overlapped_mlp(h.clone(), res.clone(), layout,
                                             lambda rows, chunk: nsa_cp.TopK(*_experts(rank, rows), scale=SCALE),
                                             shared_mlp=shared_mlp)
        hs, res_b = comms[1].prepare_mlp(h.clone(), res.clone(), layout)
        if not torch.equal(res_a, res_b):
            return "overlapped_mlp's residual differs from prepare_mlp's"
        mine = hs[layout.offsets[rank]:layout.offsets[rank] + n] if full else hs
        if not torch.equal(seen_normed[0], mine):
            return "shared_mlp was not handed this rank's normed rows"
        partials = [_topk_partial(q, mine, dtype) for q in (range(world) if full else [rank])]
        return check_sum(out, partials + [shared_mlp(mine)], dtype)
    res_a = res.clone()
    out_a, res_a = comms[0].overlapped_mlp(h.clone(), res_a, layout, mlp, chunk_rows=case["chunk_rows"])
    hs, res_b = comms[1].prepare_mlp(h.clone(), res.clone(), layout)
    out_b, res_b = comms[1].postprocess_layer(mlp(hs), res_b, layout)
    if not torch.equal(res_a, res_b):
        return "overlapped_mlp's residual differs from prepare_mlp's"
    normed = hs if not full else None
    if full:  # this rank's normed rows, as the gather carried them
        lo = layout.offsets[rank]
        normed = (hs[0][lo:lo + n], hs[1][lo:lo + n]) if quant else hs[lo:lo + n]
    partials = [_f(q, _dequant(normed) if quant and full else normed, dtype) for q in (range(world) if full else [rank])]
    return check_sum(out_a, partials, dtype) or check_sum(out_b, partials, dtype)


def _run_errors(case, rank, world, group, nsa_cp) -> Optional[str]:
    layout = nsa_cp.ShardLayout(case["counts"])
    x = torch.randn(3, 8)
    never = _never
    for fn, words in (
        (lambda: nsa_cp.cp_overlapped_boundary(torch.randn(2, 8), layout, never, group), ["x", "[3, ...]", "[2, 8]"]),
        (lambda: nsa_cp.cp_overlapped_boundary(x, [3] * world, never, group), ["layout", "ShardLayout"]),
        (lambda: nsa_cp.cp_overlapped_boundary(x, layout, None, group), ["consumer", "callable"]),
        (lambda: nsa_cp.cp_overlapped_boundary(x, layout, never, group, quant="fp4"), ["quant", "'fp4'"]),
        (lambda: nsa_cp.cp_overlapped_boundary(x, layout, never, group, quant=QUANT), ["x", "128"]),
        (lambda: nsa_cp.cp_overlapped_boundary(x, layout, never, group, chunk_rows=0), ["chunk_rows", "positive", "0"]),
        (lambda: nsa_cp.cp_overlapped_boundary(x, layout, never, group, chunk_rows=2.0), ["chunk_rows", "2.0"]),
        (lambda: nsa_cp.cp_overlapped_boundary(x, layout, never, group, shared=torch.randn(2, 8)),
         ["shared", "[3, 8]", "[2, 8]"]),
        (lambda: nsa_cp.NSACPLayerCommunicator(group, nsa_cp.RMSNorm(8), nsa_cp.RMSNorm(8), mlp_mode="scattered")
         .overlapped_mlp(x, torch.randn(3, 8), None, lambda rows, chunk: rows[:, :2].clone()),
         ["consumer output", "[3, 8]", "[3, 2]"]),
        (lambda: nsa_cp.cp_overlapped_boundary(x, nsa_cp.ShardLayout([3] * (world + 1)), never, group),
         ["group", f"{world + 1} ranks", f"got {world}"]),
    ):
        problem = _expect_value_error(fn, words)
        if problem:
            return problem
    return None


def _never(rows, chunk):
    raise AssertionError("the consumer ran on input that should have been refused")


def run_cases(rank: int, world: int, payload: dict) -> Dict[str, Optional[str]]:
    import torch.distributed as dist

    import nsa_cp

    group = dist.group.WORLD
    results: Dict[str, Optional[str]] = {}
    if payload.get("gpu"):  # the serialized boundary's P2P transport (CUDA IPC between ranks sharing the GPU)
        nsa_cp.init_p2p(None, payload["max_tokens"], GPU_HIDDEN, torch.bfloat16, torch.device("cuda", 0),
                        timeout_ms=20_000)
    for case in payload["cases"]:
        try:
            run = _run_errors if case.get("errors") else _run_communicator if case.get("communicator") else _run_case
            results[case["id"]] = run(case, rank, world, group, nsa_cp)
        except Exception:
            results[case["id"]] = traceback.format_exc()
        if payload.get("gpu"):
            torch.cuda.synchronize()
        dist.barrier()
    return results


def run_fault(rank: int, world: int, payload: dict) -> Dict[str, Optional[str]]:
    """A peer that fails mid-pipeline (its consumer returns the wrong shape, or its process dies): it raises
    ValueError naming the consumer output (or exits); every other rank gets P2PTimeoutError, never a hang.
    ``payload["gpu"]``: the rows are CUDA tensors (ranks sharing one GPU)."""
    import os

    import nsa_cp

    layout = nsa_cp.ShardLayout([4, 0, 3, 5][:world])
    bad = world - 1

    def consumer(rows, chunk):
        if rank == bad:
            if payload["kind"] == "dies" and chunk.step == 1:
                os._exit(3)
            if payload["kind"] == "wrong_shape":
                return rows[:, :1].clone()
            if payload["kind"] == "wrong_topk":  # expert outputs of the wrong row shape
                return nsa_cp.TopK(rows[:, None, :1].clone())
        return rows.clone()

    x = torch.randn(layout.per_rank_actual_token[rank], 8, device="cuda" if payload.get("gpu") else "cpu")
    try:
        nsa_cp.cp_overlapped_boundary(x, layout, consumer, timeout_ms=payload["timeout_ms"])
        if payload.get("gpu"):
            torch.cuda.synchronize()
    except nsa_cp.P2PTimeoutError as e:
        return {"fault": "timeout" if rank != bad else f"the failing rank timed out: {e}"}
    except ValueError as e:
        return {"fault": "value" if rank == bad and "consumer output" in str(e) else f"ValueError: {e}"}
    return {"fault": "returned"}


def fault_failures(results: List[dict], kind: str) -> List[str]:
    """What :func:`run_fault`'s ranks got that they should not: the last rank ValueError (or exit 3 where it
    dies), every other rank P2PTimeoutError."""
    bad = len(results) - 1
    failures = []
    for rank, result in enumerate(results):
        want = ({"__exited__": 3} if kind == "dies" else {"fault": "value"}) if rank == bad else {"fault": "timeout"}
        if result != want:
            failures.append(f"rank {rank}: got {result}, want {want}")
    return failures


def run_compiled(rank: int, world: int, payload: dict) -> Dict[str, Optional[str]]:
    """cp_overlapped_boundary inside a function compiled with ``payload["backend"]`` (not a custom op: it
    takes a callable, so Dynamo breaks the graph around it): the result equals the eager call's, twice
    (the second call reuses the compiled graphs), on an uneven layout with a zero-token rank."""
    import nsa_cp

    counts = [5, 0, 3, 7][:world]
    layout = nsa_cp.ShardLayout(counts)
    x = gen(11, rank, counts[rank], (24,), torch.float32, "cpu")

    def layer(x):
        y = nsa_cp.cp_overlapped_boundary(x * 2, layout, lambda rows, chunk: torch.tanh(rows) * 3, chunk_rows=2)
        return y + 1

    eager = layer(x)
    compiled = torch.compile(layer, backend=payload["backend"])
    failures = [f"call {i}: differs from eager" for i in range(2) if not torch.equal(compiled(x), eager)]
    return {"compiled": "; ".join(failures) or None}


def run_started(rank: int, world: int, payload: dict) -> Dict[str, Optional[str]]:
    """A non-gloo group gets one all-reduce on its first overlapped boundary (NCCL creates communicators
    lazily), never again on that group, and again on a new group. The backend is reported as NCCL to the
    overlapped boundary's transport module (the transfers still run on gloo, CPU tensors)."""
    import torch.distributed as dist

    import nsa_cp
    from nsa_cp.transport.dist import pipeline as overlap

    layout = nsa_cp.ShardLayout([3, 0, 2, 4][:world])
    x = gen(5, rank, layout.per_rank_actual_token[rank], (8,), torch.float32, "cpu")
    calls = []
    real_all_reduce, real_backend = dist.all_reduce, dist.get_backend
    overlap.dist.all_reduce = lambda t, *a, **kw: calls.append(kw.get("group")) or real_all_reduce(t, *a, **kw)
    overlap.dist.get_backend = lambda group=None: "nccl"
    problems = []
    try:
        second = dist.new_group(list(range(world)), backend="gloo")
        for group, want in ((None, 1), (None, 1), (second, 2), (second, 2)):
            y = nsa_cp.cp_overlapped_boundary(x, layout, lambda rows, chunk: rows * 2, group)
            ref = nsa_cp.cp_reduce_scatter(nsa_cp.cp_all_gather(x, layout, group) * 2, layout, group)
            if not torch.allclose(y, ref):
                problems.append(f"group {group}: result differs from the serialized boundary's")
            if len(calls) != want:
                problems.append(f"after a call on group {group}: {len(calls)} all-reduces, expected {want}")
    finally:
        overlap.dist.all_reduce, overlap.dist.get_backend = real_all_reduce, real_backend
    return {"started": "; ".join(problems) or None}


DISAGREEMENTS = ("layout", "quant", "chunk_rows", "shared", "out_dtype", "TopK")


def _disagreeing_call(nsa_cp, field, rank, world, group, device, validate=True, hidden=GPU_HIDDEN):
    """One overlapped boundary where the last rank passes another ``field`` than the others."""
    odd = rank == world - 1
    counts = [3, 0] + [2] * (world - 2)
    if field == "layout" and odd:
        counts = [2, 1] + [2] * (world - 2)  # the same max_rank_len and total: only the counts differ
    layout = nsa_cp.ShardLayout(counts)
    n = counts[rank]
    x = gen(7, rank, n, (hidden,), torch.bfloat16, device)
    kw = {"quant": QUANT if field == "quant" and odd else None, "chunk_rows": 1 if field == "chunk_rows" and odd else None,
          "shared": torch.randn(n, hidden, device=device) if field == "shared" and odd else None,
          "out_dtype": torch.float32 if field == "out_dtype" and odd else None}

    def consumer(rows, chunk):
        rows = _dequant(rows) if isinstance(rows, tuple) else rows
        if field == "TopK" and odd:  # the same partial, reduced by nsa_cp: only the kind of output differs
            return nsa_cp.TopK(rows[:, None].to(torch.bfloat16))
        return rows.to(kw["out_dtype"] or torch.bfloat16)

    return nsa_cp.cp_overlapped_boundary(x, layout, consumer, group, validate=validate, **kw)


def run_disagreements(rank: int, world: int, payload: dict) -> Dict[str, Optional[str]]:
    """With ``validate=True`` ranks that disagree on an argument all raise LayoutMismatchError naming it,
    before anything moves; then an agreeing call is exact (nothing was left half-done)."""
    import torch.distributed as dist

    import nsa_cp

    device = torch.device("cuda", 0) if payload.get("gpu") else torch.device("cpu")
    if payload.get("gpu"):
        nsa_cp.init_p2p(None, 8, GPU_HIDDEN, torch.bfloat16, device, timeout_ms=20_000)
    results = {}
    for field in DISAGREEMENTS:
        try:
            _disagreeing_call(nsa_cp, field, rank, world, dist.group.WORLD, device)
            results[field] = "no error"
        except nsa_cp.LayoutMismatchError as e:
            results[field] = None if field in str(e) else f"LayoutMismatchError not naming {field}: {e}"
        except Exception:
            results[field] = traceback.format_exc()
    layout = nsa_cp.ShardLayout([3, 0] + [2] * (world - 2))
    x = gen(9, rank, layout.per_rank_actual_token[rank], (GPU_HIDDEN,), torch.bfloat16, device)
    got = nsa_cp.cp_overlapped_boundary(x, layout, lambda rows, chunk: rows * 2, validate=True)
    want = nsa_cp.cp_reduce_scatter(nsa_cp.cp_all_gather(x, layout) * 2, layout)
    results["after"] = None if torch.equal(got, want) else "an agreeing call after the disagreements is not exact"
    if payload.get("gpu"):
        results["explain"] = None if "'p2p'" in nsa_cp.explain(x, layout) else nsa_cp.explain(x, layout)
    else:
        text = nsa_cp.explain(x, layout)
        results["explain"] = None if "'nccl'" in text else text
    return results


def run_p2p_faults(rank: int, world: int, payload: dict) -> Dict[str, Optional[str]]:
    """On the P2P pulls (ranks sharing one GPU), without validation: ranks that pass different ``chunk_rows``
    get a NaN result and LayoutMismatchError from the transport on every rank; a peer whose consumer raises
    mid-call leaves every other rank a NaN result and P2PTimeoutError; a re-created transport is exact."""
    import torch.distributed as dist

    import nsa_cp
    from nsa_cp import transport

    device, group = torch.device("cuda", 0), dist.group.WORLD
    results = {}

    def fresh():
        transport.destroy_p2p(None)
        nsa_cp.init_p2p(None, 8, GPU_HIDDEN, torch.bfloat16, device, timeout_ms=payload["timeout_ms"])

    def outcome(fn, want_error):
        try:
            got = fn()
            torch.cuda.synchronize()
            nan = bool(torch.isnan(got.float()).all()) if got.numel() else True
            transport.get_p2p(group).check_error()
            return f"no error (result all NaN: {nan})"
        except want_error as e:
            return None if want_error is not ValueError or "consumer output" in str(e) else f"ValueError: {e}"
        except Exception:
            return traceback.format_exc()

    fresh()
    results["chunk_rows"] = outcome(lambda: _disagreeing_call(nsa_cp, "chunk_rows", rank, world, group, device,
                                                               validate=False), nsa_cp.LayoutMismatchError)
    fresh()
    layout = nsa_cp.ShardLayout([4, 0, 3, 5][:world])
    x = gen(13, rank, layout.per_rank_actual_token[rank], (GPU_HIDDEN,), torch.bfloat16, device)

    def consumer(rows, chunk):
        if rank == world - 1 and chunk.step == 1:
            return rows[:, :1].clone()
        return rows * 3

    want = ValueError if rank == world - 1 else nsa_cp.P2PTimeoutError
    results["raises"] = outcome(lambda: nsa_cp.cp_overlapped_boundary(x, layout, consumer, group), want)
    dist.barrier()
    fresh()
    got = nsa_cp.cp_overlapped_boundary(x, layout, lambda rows, chunk: rows * 3, group)
    ref = nsa_cp.cp_reduce_scatter(nsa_cp.cp_all_gather(x, layout, group, backend="p2p") * 3, layout, group,
                                   backend="p2p")
    results["recreated"] = None if torch.equal(got, ref) else "a re-created transport's result differs"
    return results


def run_env_validated(rank: int, world: int, payload: dict) -> Dict[str, Optional[str]]:
    """NSA_CP_VALIDATE=1 (the environment, no validate= argument) and divergent layouts: every rank raises
    LayoutMismatchError naming the layout (it used to abort inside gloo)."""
    import nsa_cp

    counts = [2, 1] if rank == world - 1 else [3, 0]
    layout = nsa_cp.ShardLayout(counts + [2] * (world - 2))
    x = gen(3, rank, layout.per_rank_actual_token[rank], (8,), torch.float32, "cpu")
    try:
        nsa_cp.cp_overlapped_boundary(x, layout, lambda rows, chunk: rows * 2)
    except nsa_cp.LayoutMismatchError as e:
        return {"env": None if "layout" in str(e) else f"not naming the layout: {e}"}
    return {"env": "no error"}
