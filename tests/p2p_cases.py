"""Checks of the intranode P2P transport that run inside a process group: NCCL with one GPU per rank, or
gloo with every rank on one shared GPU ("gloo-shared-gpu", see dist_harness), where the NCCL comparisons
(reduce-scatter error, the auto fallback) cannot run and are left out by the caller.

Each check returns None or an error text; ``run_p2p_checks`` runs all of them on every rank and also
returns measured facts under "__info__" (reduce-scatter error of P2P vs NCCL against fp64).
Gathered data is compared exactly (torch.equal) with an oracle built from every rank's inputs, which
every rank derives from seeds; sums against fp64. Outputs are poisoned with NaN before each call.
"""

from __future__ import annotations

import random
import time
import traceback
import zlib
from typing import Dict, Optional

import torch
import torch.distributed as dist

import nsa_cp
from nsa_cp import reference
from nsa_cp.transport import p2p
from nsa_cp.transport.p2p import memory as p2p_memory

from dist_cases import _check_sum, _expected_gather, _gen
from dist_harness import rank_device, rank_log, shared_gpu


def _random_layout(rng: random.Random, world: int, max_tokens: int) -> "nsa_cp.ShardLayout":
    kind = rng.choice(["random", "zeros", "even", "empty", "full"])
    if kind == "random":
        counts = [rng.randint(0, max_tokens) for _ in range(world)]
    elif kind == "zeros":
        counts = [rng.choice([0, rng.randint(1, max_tokens)]) for _ in range(world)]
    elif kind == "even":
        counts = [rng.randint(1, max_tokens)] * world
    elif kind == "empty":
        counts = [0] * world
    else:
        counts = [max_tokens] + [rng.randint(0, max_tokens) for _ in range(world - 1)]
    return nsa_cp.ShardLayout(counts)


def _poison(*tensors) -> None:
    """Fill with NaN, so that every row of the next result must be written by that call. Then every
    rank syncs and meets on the host: with double buffering a peer may write into our gather buffer
    without waiting for our entry signal (nothing of ours reads it any more), so a fill still queued on
    our stream could land on its rows. Real callers never write into the gather buffers."""
    for t in tensors:
        t.fill_(float("nan"))
    torch.cuda.synchronize()
    dist.barrier()


def _gather(transport, x, layout, compact, engine="auto", device_counts=None):
    """One gather through a runner built for this call (what the plan layer caches)."""
    return transport.gather_runner(layout, compact, tuple(x.shape[1:]), engine=engine)(x, device_counts)


def _scatter(transport, y, layout, compact, out=None, device_counts=None):
    return transport.reduce_scatter_runner(layout, compact, tuple(y.shape[1:]))(y, out, device_counts)


def _gather_once(transport, layout, compact, engine, rank, hidden, dtype, seed, device):
    shards = [_gen(seed, q, n, (hidden,), dtype, "cpu") for q, n in enumerate(layout.per_rank_actual_token)]
    x = shards[rank].to(device)
    _poison(*transport._gathers)
    got = _gather(transport, x, layout, compact, engine).clone()
    return got, _expected_gather(shards, layout, compact)


def check_gather_sequence(transport, rank, world, device, engine, compact, calls=7, seed=0) -> Optional[str]:
    """An odd number of back-to-back gathers with random layouts, each result checked exactly."""
    rng = random.Random(seed)
    for i in range(calls):
        layout = _random_layout(rng, world, transport.max_tokens_per_rank)
        got, want = _gather_once(transport, layout, compact, engine, rank, transport.hidden_size,
                                 transport.dtype, seed * 100 + i, device)
        transport.check_error()
        if not torch.equal(got.cpu(), want):
            return f"call {i} {layout}: gathered rows differ ({engine}, compact={compact})"
    return None


def check_reduce_scatter_sequence(transport, rank, world, device, compact, calls=7, seed=0, info=None) -> Optional[str]:
    rng = random.Random(seed)
    dtype = transport.dtype
    with_nccl = not shared_gpu()
    errors = {"p2p": 0.0, "nccl": 0.0 if with_nccl else "not measured: ranks share one GPU"}
    problems = []  # keep going after a failure: every rank must make the same NCCL calls
    for i in range(calls):
        layout = _random_layout(rng, world, transport.max_tokens_per_rank)
        rows = layout.global_len(compact)
        partials = [_gen(seed * 100 + i, q, rows, (transport.hidden_size,), dtype, "cpu") for q in range(world)]
        start, stop = layout.rows(rank, compact)
        if with_nccl:
            nccl_got = nsa_cp.cp_reduce_scatter(partials[rank].to(device), layout, compact=compact, backend="nccl")
        buf = transport.reduce_buffer(layout, compact)
        buf.copy_(partials[rank].to(device))  # the MoE writes here
        out = torch.full((layout.count(rank), transport.hidden_size), float("nan"), dtype=dtype, device=device)
        got = _scatter(transport, buf, layout, compact, out)
        torch.cuda.synchronize()
        transport.check_error()
        problem = _check_sum(got.cpu(), [p[start:stop] for p in partials], dtype)
        if problem:
            problems.append(f"call {i} {layout}: {problem}")
        exact = torch.stack([p[start:stop].double() for p in partials]).sum(0)
        if exact.numel():
            scale = exact.abs().max().item() or 1.0
            errors["p2p"] = max(errors["p2p"], (got.cpu().double() - exact).abs().max().item() / scale)
            if with_nccl:
                errors["nccl"] = max(errors["nccl"], (nccl_got.cpu().double() - exact).abs().max().item() / scale)
    if info is not None:
        info.setdefault("rs_max_rel_err", {})[f"{dtype}-compact={compact}"] = errors
    return problems[0] if problems else None


def check_stress(transport, rank, world, device, calls=40, seed=7) -> Optional[str]:
    """Back-to-back gathers and reduce-scatters with random layouts, engines and delays on rank 1."""
    rng = random.Random(seed)
    delay_rng = random.Random(seed + rank)
    hidden, dtype = transport.hidden_size, transport.dtype
    pending = []
    for i in range(calls):
        layout = _random_layout(rng, world, transport.max_tokens_per_rank)
        compact = rng.random() < 0.5
        if rank == 1 and delay_rng.random() < 0.5:
            torch.cuda._sleep(delay_rng.randint(10_000, 2_000_000))  # this rank arrives late on the GPU
        if rng.random() < 0.5:
            shards = [_gen(seed * 1000 + i, q, n, (hidden,), dtype, "cpu") for q, n in enumerate(layout.per_rank_actual_token)]
            got = _gather(transport, shards[rank].to(device), layout, compact, rng.choice(["sm", "ce"])).clone()
            pending.append(("gather", i, layout, got, _expected_gather(shards, layout, compact)))
        else:
            rows = layout.global_len(compact)
            partials = [_gen(seed * 1000 + i, q, rows, (hidden,), dtype, "cpu") for q in range(world)]
            buf = transport.reduce_buffer(layout, compact)
            buf.copy_(partials[rank].to(device))
            got = _scatter(transport, buf, layout, compact)
            start, stop = layout.rows(rank, compact)
            pending.append(("scatter", i, layout, got, [p[start:stop] for p in partials]))
    torch.cuda.synchronize()
    transport.check_error()
    for op, i, layout, got, want in pending:
        if op == "gather" and not torch.equal(got.cpu(), want):
            return f"stress call {i} (gather, {layout}) differs"
        if op == "scatter":
            problem = _check_sum(got.cpu(), want, dtype)
            if problem:
                return f"stress call {i} (reduce-scatter, {layout}): {problem}"
    return None


def check_graph_replay(transport, rank, world, device, replays=5, seed=3) -> Optional[str]:
    """Capture one gather + one reduce-scatter (padded, fixed max_rank_len) in a CUDA graph and replay
    it an odd number of times with per-rank counts changed in the device tensors the kernels read."""
    m = transport.max_tokens_per_rank
    hidden, dtype = transport.hidden_size, transport.dtype
    bucket = nsa_cp.ShardLayout([m] * world)
    counts_dev = torch.full((world,), m, dtype=torch.int32, device=device)
    offsets_dev = torch.arange(world, dtype=torch.int32, device=device) * m
    x = torch.zeros((m, hidden), dtype=dtype, device=device)
    y = transport.reduce_buffer(bucket, False)
    rs_out = torch.zeros((m, hidden), dtype=dtype, device=device)
    gather = transport.gather_runner(bucket, False, (hidden,), engine="sm")
    scatter = transport.reduce_scatter_runner(bucket, False, (hidden,))
    dc = (counts_dev, offsets_dev)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):  # warm up (loads kernels) outside capture
        gather(x, dc)
        scatter(y, rs_out, dc)
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gathered = gather(x, dc)
        scatter(y, rs_out, dc)
    rng = random.Random(seed)
    for replay in range(replays):
        counts = [rng.randint(0, m) for _ in range(world)]
        shards = [_gen(seed * 10 + replay, q, n, (hidden,), dtype, "cpu") for q, n in enumerate(counts)]
        partials = [_gen(seed * 10 + replay + 5, q, world * m, (hidden,), dtype, "cpu") for q in range(world)]
        counts_dev.copy_(torch.tensor(counts, dtype=torch.int32))
        x.fill_(float("nan"))
        x[: counts[rank]].copy_(shards[rank].to(device))
        y.copy_(partials[rank].to(device))
        _poison(gathered, rs_out)
        graph.replay()
        torch.cuda.synchronize()
        transport.check_error()
        # the bucket's geometry (slot size m), this replay's counts, zero padding
        want = torch.cat([torch.cat([s, torch.zeros((m - s.shape[0], hidden), dtype=dtype)]) for s in shards])
        if not torch.equal(gathered.cpu(), want):
            return f"graph replay {replay} counts {counts}: gathered rows differ"
        problem = _check_sum(rs_out[: counts[rank]].cpu(), [p[rank * m: rank * m + counts[rank]] for p in partials], dtype)
        if problem:
            return f"graph replay {replay} counts {counts}: {problem}"
    return None


def check_slow_readers(transport, rank, world, device, calls=9, seed=5) -> Optional[str]:
    """Reuse safety of the gather buffers against a slow reader: rank 1 sleeps before it reads each
    result (a clone queued behind the sleep), so rank 0 runs ahead into the next gathers. First eager
    gathers back to back, then CUDA-graph replays of a captured gather alternating with eager gathers:
    the host never sees the replays, so its choice of buffer and the device's record of the last one
    written disagree, and only the device-side check keeps a peer from writing into a buffer whose
    result rank 1 has not read yet. Fresh random rows every call, so a clobbered result shows."""
    m = transport.max_tokens_per_rank
    if transport.double_buffer_tokens:  # small enough to alternate buffers (the case under test)
        m = min(m, transport.double_buffer_tokens)
    hidden, dtype = transport.hidden_size, transport.dtype
    rng = random.Random(seed)
    pending = []

    def read_late(tag, result, want):
        if rank == 1:
            torch.cuda._sleep(1_000_000)  # ~0.5 ms on the GPU before this rank reads its result
        pending.append((tag, result.clone(), want))

    def eager(tag, i):
        layout = nsa_cp.ShardLayout([rng.randint(0, m) for _ in range(world)])
        compact = rng.random() < 0.5
        shards = [_gen(seed * 1000 + i, q, n, (hidden,), dtype, "cpu") for q, n in enumerate(layout.per_rank_actual_token)]
        got = _gather(transport, shards[rank].to(device), layout, compact, "sm")
        read_late(f"{tag} {layout} compact={compact}", got, _expected_gather(shards, layout, compact))

    for i in range(calls):
        eager(f"eager call {i}", i)

    bucket = nsa_cp.ShardLayout([m] * world)
    counts_dev = torch.full((world,), m, dtype=torch.int32, device=device)
    offsets_dev = torch.arange(world, dtype=torch.int32, device=device) * m
    x = torch.zeros((m, hidden), dtype=dtype, device=device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    gather = transport.gather_runner(bucket, False, (hidden,), engine="sm")
    with torch.cuda.stream(stream):
        gather(x, (counts_dev, offsets_dev))
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gathered = gather(x, (counts_dev, offsets_dev))
    for j in range(calls):
        counts = [rng.randint(0, m) for _ in range(world)]
        shards = [_gen(seed * 1000 + calls + j, q, n, (hidden,), dtype, "cpu") for q, n in enumerate(counts)]
        counts_dev.copy_(torch.tensor(counts, dtype=torch.int32))
        x[: counts[rank]].copy_(shards[rank].to(device))
        graph.replay()
        want = torch.cat([torch.cat([s, torch.zeros((m - s.shape[0], hidden), dtype=dtype)]) for s in shards])
        read_late(f"replay {j} counts {counts}", gathered, want)
        eager(f"eager call after replay {j}", 2 * calls + j)
    torch.cuda.synchronize()
    transport.check_error()
    for tag, got, want in pending:
        if not torch.equal(got.cpu(), want):
            return f"{tag}: the result read late differs (a peer overwrote it before rank 1 read it)"
    return None


# --------------------------------------------------------------------------- runners: strides, copy-in, fused stages, order

_LAYOUT_KINDS = ("random", "zeros", "even", "empty", "full")


def _layouts(world: int, max_tokens: int, seed: int):
    """One layout of every kind (zero-token ranks, even, empty, at capacity), then random ones."""
    rng = random.Random(seed)
    out = [nsa_cp.ShardLayout([rng.randint(0, max_tokens) for _ in range(world)]),
           nsa_cp.ShardLayout([0] + [rng.randint(1, max_tokens) for _ in range(world - 1)]),
           nsa_cp.ShardLayout([rng.randint(1, max_tokens)] * world),
           nsa_cp.ShardLayout([0] * world),
           nsa_cp.ShardLayout([max_tokens] + [rng.randint(0, max_tokens) for _ in range(world - 1)])]
    return out + [_random_layout(rng, world, max_tokens) for _ in range(2)]


def check_strided_rows(transport, rank, world, device, seed=31) -> Optional[str]:
    """Source rows with a row stride larger than the row (a column slice of a wider tensor, 16-byte
    aligned and not), and an output with a row stride of its own for the reduce-scatter."""
    hidden, dtype = transport.hidden_size, transport.dtype
    for i, (extra, compact) in enumerate([(8, False), (8, True), (1, False)]):
        layout = _layouts(world, transport.max_tokens_per_rank, seed + i)[0]
        shards = [_gen(seed + i, q, n, (hidden,), dtype, "cpu") for q, n in enumerate(layout.per_rank_actual_token)]
        wide = torch.full((layout.count(rank), hidden + extra), float("nan"), dtype=dtype, device=device)
        wide[:, :hidden].copy_(shards[rank].to(device))
        _poison(*transport._gathers)
        got = _gather(transport, wide[:, :hidden], layout, compact, "sm").clone()
        transport.check_error()
        if not torch.equal(got.cpu(), _expected_gather(shards, layout, compact)):
            return f"gather of rows with stride {hidden + extra} (compact={compact}, {layout}) differs"
        partials = [_gen(seed + 50 + i, q, layout.global_len(compact), (hidden,), dtype, "cpu") for q in range(world)]
        out_wide = torch.full((layout.count(rank), hidden + extra), float("nan"), dtype=dtype, device=device)
        _scatter(transport, partials[rank].to(device), layout, compact, out_wide[:, :hidden])
        torch.cuda.synchronize()
        transport.check_error()
        start, stop = layout.rows(rank, compact)
        problem = _check_sum(out_wide[:, :hidden].cpu(), [q[start:stop] for q in partials], dtype)
        if problem:
            return f"reduce-scatter into rows of stride {hidden + extra} (compact={compact}): {problem}"
        if layout.count(rank) and not torch.isnan(out_wide[:, hidden:].float()).all():
            return "the reduce-scatter wrote past the end of its output rows"
    return None


def check_reduce_copy_in(transport, rank, world, device, seed=41) -> Optional[str]:
    """The reduce-scatter runner with the handed-out reduce buffer (no copy), another view object of the
    same memory (no copy either), and a separate tensor (copied in); reduce_buffer hands out the same
    object for an equal-but-new layout."""
    hidden, dtype = transport.hidden_size, transport.dtype
    for compact in (False, True):
        layout = _layouts(world, transport.max_tokens_per_rank, seed)[0]
        run = transport.reduce_scatter_runner(layout, compact, (hidden,))
        twin = nsa_cp.ShardLayout(list(layout.per_rank_actual_token))
        start, stop = layout.rows(rank, compact)
        for k, how in enumerate(("handed-out", "another view", "separate")):
            partials = [_gen(seed + 10 * k, q, layout.global_len(compact), (hidden,), dtype, "cpu") for q in range(world)]
            if how == "separate":
                y = partials[rank].to(device)
            else:
                y = transport.reduce_buffer(layout, compact)
                y = y if how == "handed-out" else y[:]
                y.copy_(partials[rank].to(device))
            torch.cuda.synchronize()
            dist.barrier()
            got = run(y)
            torch.cuda.synchronize()
            transport.check_error()
            problem = _check_sum(got.cpu(), [q[start:stop] for q in partials], dtype)
            if problem:
                return f"reduce-scatter with the {how} input (compact={compact}): {problem}"
        if transport.reduce_buffer(layout, compact) is not transport.reduce_buffer(twin, compact):
            return "reduce_buffer hands out another object for an equal layout"
    return None


def _norm_inputs(seed, layout, hidden, dtype, weight_dtype, with_residual):
    """Every rank's x and residual (derived from seeds on every rank), the weight, and the reference:
    (y rows per rank, residual after the call per rank)."""
    xs = [_gen(seed, q, n, (hidden,), dtype, "cpu") for q, n in enumerate(layout.per_rank_actual_token)]
    rs = [_gen(seed + 1, q, n, (hidden,), dtype, "cpu") if with_residual else None
          for q, n in enumerate(layout.per_rank_actual_token)]
    weight = (1.0 + 0.25 * _gen(seed + 2, 0, 1, (hidden,), torch.float32, "cpu")[0]).to(weight_dtype)
    ys, r_after = [], []
    for x, r in zip(xs, rs):
        r_ref = None if r is None else r.clone()
        y, _ = reference.fused_add_rmsnorm(x, r_ref, weight, _EPS)
        ys.append(y)
        r_after.append(r_ref)
    return xs, rs, weight, ys, r_after


_EPS = 1e-6


def _close(got: torch.Tensor, want: torch.Tensor, dtype) -> Optional[str]:
    """y of the fused stage against the reference: one rounding of the same fp32 value, up to the order
    of the sum of squares (a relative error of about one ulp of the dtype)."""
    rtol = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10, torch.float32: 1e-5}[dtype]
    got, want = got.double(), want.double()
    if not torch.isfinite(got).all():
        return "non-finite values (unwritten rows?)"
    err = ((got - want).abs() - rtol * want.abs()).max().item() if got.numel() else 0.0
    return None if err <= 1e-6 else f"max error beyond rtol {rtol}: {err:.3g}"


def _same_on_every_rank(t: torch.Tensor) -> Optional[str]:
    """Data movement is exact: every rank's gathered result is the same bytes."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, t.cpu().view(torch.uint8) if t.dtype != torch.uint8 else t.cpu())
    for q, other in enumerate(everyone):
        if not torch.equal(other, everyone[0]):
            return f"rank {q}'s gathered result differs from rank 0's"
    return None


def check_norm_gather(transport, rank, world, device, seed=61) -> Optional[str]:
    """Fused add + RMSNorm + push: padded and compact, with and without a residual, bf16/fp16/fp32
    weights; y against the reference (one rounding), the residual updated in place exactly, padding rows
    exactly zero, and every rank's result the same bytes."""
    hidden, dtype = transport.hidden_size, transport.dtype
    verdict = transport.support(nsa_cp.ShardLayout([1] * world), (hidden,), dtype, device, norm=True)
    if not verdict:  # rows the norm stage cannot hold: the runner refuses with the same reason
        try:
            transport.norm_gather_runner(nsa_cp.ShardLayout([1] * world), False, (hidden,))
        except ValueError as err:
            return None if verdict.reason in str(err) else f"refusal without the reason: {err}"
        return f"norm_gather_runner accepted rows that support() refuses ({verdict.reason})"
    weight_dtypes = [dtype, torch.float32] if dtype != torch.float32 else [torch.float32, torch.bfloat16]
    for i, layout in enumerate(_layouts(world, transport.max_tokens_per_rank, seed)):
        for compact in (False, True):
            with_residual = (i + compact) % 3 != 2
            wdt = weight_dtypes[(i + compact) % 2]
            xs, rs, weight, ys, r_after = _norm_inputs(seed + i, layout, hidden, dtype, wdt, with_residual)
            x = xs[rank].to(device)
            r = None if rs[rank] is None else rs[rank].to(device)
            x_before = x.clone()
            _poison(*transport._gathers)
            run = transport.norm_gather_runner(layout, compact, (hidden,))
            got = run(x, r, weight.to(device), _EPS).clone()
            torch.cuda.synchronize()
            transport.check_error()
            tag = f"{layout} compact={compact} residual={with_residual} weight={wdt}"
            want = _expected_gather(ys, layout, compact)
            problem = _close(got.cpu(), want, dtype) or _same_on_every_rank(got)
            if problem:
                return f"norm gather {tag}: {problem}"
            if not compact:
                mask = _expected_gather([torch.ones(n, hidden) for n in layout.per_rank_actual_token], layout, False) == 0
                if not torch.equal(got.cpu()[mask].float(), torch.zeros(int(mask.sum()))):
                    return f"norm gather {tag}: padding rows are not zero"
            if r is not None and not torch.equal(r.cpu(), r_after[rank]):
                return f"norm gather {tag}: the residual was not updated to x + residual rounded"
            if not torch.equal(x, x_before):
                return f"norm gather {tag}: x was written"
    return None


def _fp8_expected(rows_per_rank, layout, compact):
    """(q, scale) of the gathered rows by the reference quantizer; padding rows as the transport
    writes them (q = 0, scale = 1e-10/448)."""
    gathered = _expected_gather(rows_per_rank, layout, compact)
    q, scale = reference.quant_fp8_g128(gathered)
    if not compact:
        real = _expected_gather([torch.ones(n, 1) for n in layout.per_rank_actual_token], layout, False)[:, 0] == 1
        q.view(torch.uint8)[~real] = 0  # fp8 has no masked_fill: +0.0 is the zero byte
        scale[~real] = reference.FP8_PAD_SCALE
    return q, scale


def check_fp8_gather(transport, rank, world, device, seed=71) -> Optional[str]:
    """The FP8 wire: quantize-only (bitwise equal to the reference quantizer of the gathered rows: the
    same IEEE operations per element) and norm + quantize (scales within one ulp of the dtype, q within
    one fp8 step, since y itself may differ by one ulp)."""
    hidden, dtype = transport.hidden_size, transport.dtype
    verdict = transport.support(nsa_cp.ShardLayout([1] * world), (hidden,), dtype, device, quant=nsa_cp_quant())
    if not verdict:
        try:
            transport.gather_runner(nsa_cp.ShardLayout([1] * world), False, (hidden,), quant=nsa_cp_quant())
        except ValueError as err:
            return None if verdict.reason in str(err) else f"refusal without the reason: {err}"
        return f"an fp8 gather runner was built where support() refuses ({verdict.reason})"
    for i, layout in enumerate(_layouts(world, transport.max_tokens_per_rank, seed)):
        for compact in (False, True):
            xs, rs, weight, ys, _ = _norm_inputs(seed + i, layout, hidden, dtype, dtype, True)
            tag = f"{layout} compact={compact}"
            # quantize only
            _poison(*transport._gathers)
            q, scale = transport.gather_runner(layout, compact, (hidden,), quant=nsa_cp_quant())(xs[rank].to(device))
            q, scale = q.clone(), scale.clone()
            torch.cuda.synchronize()
            transport.check_error()
            want_q, want_s = _fp8_expected(xs, layout, compact)
            if q.dtype != torch.float8_e4m3fn or scale.dtype != torch.float32 or not (q.is_contiguous() and scale.is_contiguous()):
                return f"fp8 gather {tag}: views are {q.dtype}/{scale.dtype}, contiguous {q.is_contiguous()}/{scale.is_contiguous()}"
            if not torch.equal(q.cpu().view(torch.uint8), want_q.view(torch.uint8)) or not torch.equal(scale.cpu(), want_s):
                bad = (q.cpu().view(torch.uint8) != want_q.view(torch.uint8)).sum().item()
                return f"fp8 gather {tag}: {bad} q bytes differ, scales equal: {torch.equal(scale.cpu(), want_s)}"
            problem = _same_on_every_rank(q) or _same_on_every_rank(scale)
            if problem:
                return f"fp8 gather {tag}: {problem}"
            # norm + quantize
            r = rs[rank].to(device)
            _poison(*transport._gathers)
            q, scale = transport.norm_gather_runner(layout, compact, (hidden,), quant=nsa_cp_quant())(
                xs[rank].to(device), r, weight.to(device), _EPS)
            q, scale = q.clone().cpu(), scale.clone().cpu()
            torch.cuda.synchronize()
            transport.check_error()
            want_q, want_s = _fp8_expected(ys, layout, compact)
            rtol = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10, torch.float32: 1e-5}[dtype]
            if not torch.isfinite(scale).all() or ((scale - want_s).abs() > rtol * want_s.abs() * 2).any():
                return f"norm + fp8 gather {tag}: scales beyond {2 * rtol} relative"
            dq, wq = q.float(), want_q.float()
            if ((dq - wq).abs() > 0.125 * wq.abs() + 2 ** -9).any():
                return f"norm + fp8 gather {tag}: q more than one fp8 step from the reference"
    return None


def nsa_cp_quant() -> str:
    return "fp8_e4m3_g128"


def _positions(seed: int, total: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(total, generator=g).to(torch.int64).to(device)


def check_ordered(transport, rank, world, device, seed=81) -> Optional[str]:
    """Ordered gather (plain and fused norm) and ordered reduce-scatter: compact row i lands at batch row
    positions[i]; rank r sums rows positions[offsets[r] + i]. Exact movement, fp64 sums."""
    hidden, dtype = transport.hidden_size, transport.dtype
    norm_ok = bool(transport.support(nsa_cp.ShardLayout([1] * world), (hidden,), dtype, device, norm=True))
    for i, layout in enumerate(_layouts(world, transport.max_tokens_per_rank, seed)):
        total = layout.total_len
        pos = _positions(seed + i, total, device)
        xs, rs, weight, ys, _ = _norm_inputs(seed + i, layout, hidden, dtype, dtype, True)
        inverse_order = torch.empty(total, dtype=torch.int64)
        inverse_order[pos.cpu()] = torch.arange(total)
        _poison(*transport._gathers)
        got = transport.gather_runner(layout, True, (hidden,), ordered=True)(xs[rank].to(device), positions=pos).clone()
        torch.cuda.synchronize()
        transport.check_error()
        want = torch.cat(xs)[inverse_order] if total else torch.empty((0, hidden), dtype=dtype)
        if tuple(got.shape) != (total, hidden) or not torch.equal(got.cpu(), want):
            return f"ordered gather {layout}: rows differ from batch order"
        if norm_ok:
            _poison(*transport._gathers)
            run = transport.norm_gather_runner(layout, True, (hidden,), ordered=True)
            got = run(xs[rank].to(device), rs[rank].to(device), weight.to(device), _EPS, positions=pos).clone()
            torch.cuda.synchronize()
            transport.check_error()
            want = torch.cat(ys)[inverse_order] if total else torch.empty((0, hidden), dtype=dtype)
            problem = _close(got.cpu(), want, dtype)
            if problem:
                return f"ordered norm gather {layout}: {problem}"
        partials = [_gen(seed + 90 + i, q, total, (hidden,), dtype, "cpu") for q in range(world)]
        y = transport.reduce_buffer(layout, True)
        y.copy_(partials[rank].to(device))
        torch.cuda.synchronize()
        dist.barrier()
        out = torch.full((layout.count(rank), hidden), float("nan"), dtype=dtype, device=device)
        transport.reduce_scatter_runner(layout, True, (hidden,), ordered=True)(y, out, positions=pos)
        torch.cuda.synchronize()
        transport.check_error()
        start, stop = layout.rows(rank, True)
        mine = pos.cpu()[start:stop]
        problem = _check_sum(out.cpu(), [p[mine] for p in partials], dtype)
        if problem:
            return f"ordered reduce-scatter {layout}: {problem}"
    return None


def check_reduce_scatter_norm(transport, rank, world, device, seed=101) -> Optional[str]:
    """The reduce-scatter fused with the next add + RMSNorm (padded, compact, ordered): the residual
    becomes exactly (rank-ordered fp32 sum rounded) + residual rounded; the output is the norm of that
    (one rounding, sum-of-squares order aside)."""
    hidden, dtype = transport.hidden_size, transport.dtype
    probe = nsa_cp.ShardLayout([1] * world)
    verdict = transport.support(probe, (hidden,), dtype, device, norm=True)
    if not verdict:
        try:
            transport.reduce_scatter_runner(probe, False, (hidden,), norm=True)
        except ValueError as err:
            return None if verdict.reason in str(err) else f"refusal without the reason: {err}"
        return f"a fused reduce-scatter runner was built where support() refuses ({verdict.reason})"
    for i, layout in enumerate(_layouts(world, transport.max_tokens_per_rank, seed)):
        for mode in ("padded", "compact", "ordered"):
            compact, ordered = mode != "padded", mode == "ordered"
            rows = layout.global_len(compact)
            partials = [_gen(seed + i, q, rows, (hidden,), dtype, "cpu") for q in range(world)]
            start, stop = layout.rows(rank, compact)
            pos = _positions(seed + i, layout.total_len, device) if ordered else None
            mine = pos.cpu()[start:stop] if ordered else torch.arange(start, stop)
            acc = partials[0][mine].float()
            for q in range(1, world):
                acc = acc + partials[q][mine].float()
            residual = _gen(seed + i + 7, rank, layout.count(rank), (hidden,), dtype, "cpu")
            weight = (1.0 + 0.25 * _gen(seed + i + 8, 0, 1, (hidden,), torch.float32, "cpu")[0]).to(dtype)
            r_ref = residual.clone()
            want, _ = reference.fused_add_rmsnorm(acc.to(dtype), r_ref, weight, _EPS)
            y = transport.reduce_buffer(layout, compact)
            y.copy_(partials[rank].to(device))
            r = residual.to(device)
            out = torch.full((layout.count(rank), hidden), float("nan"), dtype=dtype, device=device)
            torch.cuda.synchronize()
            dist.barrier()
            run = transport.reduce_scatter_runner(layout, compact, (hidden,), ordered=ordered, norm=True)
            got, got_r = run(y, r, weight.to(device), _EPS, out, positions=pos)
            torch.cuda.synchronize()
            transport.check_error()
            tag = f"{layout} {mode}"
            if got is not out or got_r is not r:
                return f"fused reduce-scatter {tag}: did not return (out, residual)"
            if not torch.equal(r.cpu(), r_ref):
                return f"fused reduce-scatter {tag}: residual is not the rounded sum + residual"
            problem = _close(got.cpu(), want, dtype)
            if problem:
                return f"fused reduce-scatter {tag}: {problem}"
    return None


def check_norm_graph_replay(transport, rank, world, device, replays=5, seed=91) -> Optional[str]:
    """The fused norm gather captured once (padded bucket, device counts) and replayed an odd number of
    times with new counts: y, the residual and the zero padding follow every replay."""
    hidden, dtype = transport.hidden_size, transport.dtype
    m = transport.max_tokens_per_rank
    bucket = nsa_cp.ShardLayout([m] * world)
    if not transport.support(bucket, (hidden,), dtype, device, norm=True):
        return None  # check_norm_gather covers the refusal
    run = transport.norm_gather_runner(bucket, False, (hidden,))
    counts_dev = torch.full((world,), m, dtype=torch.int32, device=device)
    offsets_dev = torch.arange(world, dtype=torch.int32, device=device) * m
    x = torch.zeros((m, hidden), dtype=dtype, device=device)
    r = torch.zeros((m, hidden), dtype=dtype, device=device)
    weight = torch.ones(hidden, dtype=dtype, device=device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        run(x, r, weight, _EPS, (counts_dev, offsets_dev))
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gathered = run(x, r, weight, _EPS, (counts_dev, offsets_dev))
    rng = random.Random(seed)
    for replay in range(replays):
        counts = [rng.randint(0, m) for _ in range(world)]
        layout = nsa_cp.ShardLayout(counts)
        xs, rs, w, ys, r_after = _norm_inputs(seed + replay, layout, hidden, dtype, dtype, True)
        counts_dev.copy_(torch.tensor(counts, dtype=torch.int32))
        x.fill_(float("nan"))
        x[: counts[rank]].copy_(xs[rank].to(device))
        r[: counts[rank]].copy_(rs[rank].to(device))
        weight.copy_(w.to(device))
        _poison(gathered)
        graph.replay()
        torch.cuda.synchronize()
        transport.check_error()
        want = torch.cat([torch.cat([y, torch.zeros((m - y.shape[0], hidden), dtype=dtype)]) for y in ys])
        problem = _close(gathered.cpu(), want, dtype)
        if problem:
            return f"norm graph replay {replay} counts {counts}: {problem}"
        if not torch.equal(r[: counts[rank]].cpu(), r_after[rank]):
            return f"norm graph replay {replay} counts {counts}: residual not updated"
    return None


def check_bad_positions(rank, world, device) -> Optional[str]:
    """A position outside [0, T): nothing outside the buffers is touched (the value is clamped) and the
    next check raises P2PError (not a timeout) naming the positions."""
    transport = p2p.P2PTransport(None, 8, 64, torch.bfloat16, device, timeout_ms=20_000)
    try:
        layout = nsa_cp.ShardLayout([4] * world)
        pos = torch.arange(layout.total_len, dtype=torch.int64, device=device)
        pos[0] = layout.total_len + 1000  # out of range: rank 0's first row
        x = torch.randn(4, 64, device=device).bfloat16()
        transport.gather_runner(layout, True, (64,), ordered=True)(x, positions=pos)
        torch.cuda.synchronize()
        try:
            transport.check_error()
        except p2p.P2PTimeoutError as err:
            return f"a bad position was reported as a timeout: {err}"
        except p2p.P2PError as err:
            if rank == 0 and "positions" not in str(err):
                return f"the error does not name the positions: {err}"
            return None
        return None if rank != 0 else "a position outside [0, T) raised nothing"
    finally:
        torch.cuda.synchronize()
        dist.barrier()
        transport.close()


def check_runner_after_close(rank, world, device) -> Optional[str]:
    """A runner kept past its transport's close (init_p2p again, destroy_p2p) raises instead of touching
    freed memory; init_p2p and destroy_p2p each change the registry generation."""
    before = p2p.generation()
    transport = nsa_cp.init_p2p(None, 8, 64, torch.bfloat16, device)
    after_init = p2p.generation()
    run = transport.gather_runner(nsa_cp.ShardLayout([2] * world), False, (64,))
    p2p.destroy_p2p(None)
    after_destroy = p2p.generation()
    if len({before, after_init, after_destroy}) != 3:
        return f"generation did not change: {before}, {after_init}, {after_destroy}"
    try:
        run(torch.zeros(2, 64, dtype=torch.bfloat16, device=device))
    except RuntimeError as err:
        return None if "closed" in str(err) else f"unexpected error: {err}"
    return "a runner of a closed transport launched"


def _over_capacity(transport, rank, world, device):
    too_big = nsa_cp.ShardLayout([transport.max_tokens_per_rank + 1] + [1] * (world - 1))
    return too_big, torch.zeros((too_big.count(rank), transport.hidden_size), dtype=transport.dtype, device=device)


def check_capacity_errors(transport, rank, world, device) -> Optional[str]:
    too_big, x = _over_capacity(transport, rank, world, device)
    try:
        nsa_cp.cp_all_gather(x, too_big, backend="p2p")
    except ValueError as err:
        text = str(err)
        for word in (str(transport.max_tokens_per_rank + 1), str(transport.max_tokens_per_rank), "max_tokens_per_rank"):
            if word not in text:
                return f"capacity error {text!r} does not mention {word}"
    else:
        return "a layout over capacity did not raise ValueError"
    return None


def check_capacity_fallback(transport, rank, world, device) -> Optional[str]:
    """Backend auto falls back to NCCL for a layout over capacity, and stays exact (needs NCCL)."""
    too_big, x = _over_capacity(transport, rank, world, device)
    x.copy_(_gen(5, rank, x.shape[0], (transport.hidden_size,), transport.dtype, device))
    shards = [_gen(5, q, n, (transport.hidden_size,), transport.dtype, "cpu") for q, n in enumerate(too_big.per_rank_actual_token)]
    got = nsa_cp.cp_all_gather(x, too_big)
    if not torch.equal(got.cpu(), _expected_gather(shards, too_big, False)):
        return "auto backend's fallback to NCCL for an oversized layout gathered the wrong rows"
    return None


@torch.no_grad()  # inference, as in serving: the norm's weight requires grad, the MoE writes with out=
def check_communicator(transport, rank, world, device, seed=11) -> Optional[str]:
    """The communicator on the P2P backend: gather, an MoE stand-in writing into the handed-out reduce
    buffer, reduce-scatter. The oracle: every rank's locally normed rows (the same communicator without a
    layout, so no communication) exchanged on the host, packed by the pure-torch rule; sums against fp64."""
    hidden, dtype = transport.hidden_size, transport.dtype
    rng = random.Random(seed)
    for compact in (False, True):
        counts = [rng.randint(0, transport.max_tokens_per_rank) for _ in range(world)]
        counts[0] = max(counts) + (1 if max(counts) < transport.max_tokens_per_rank else 0)  # uneven
        layout = nsa_cp.ShardLayout(counts)
        norm = nsa_cp.RMSNorm(hidden).to(device=device, dtype=dtype)
        comm = nsa_cp.NSACPLayerCommunicator(None, norm, norm, compact=compact, backend="p2p")
        h = _gen(seed, rank, counts[rank], (hidden,), dtype, device)
        r = _gen(seed + 1, rank, counts[rank], (hidden,), dtype, device)
        local, _ = comm.prepare_mlp(h, r.clone(), None)  # the residual is updated in place
        shards = [None] * world
        dist.all_gather_object(shards, local.cpu())
        want = _expected_gather(shards, layout, compact)
        _poison(*transport._gathers)
        full, res = comm.prepare_mlp(h, r, layout)
        partial = comm.mlp_output_buffer(layout, full)
        if partial.data_ptr() != transport.reduce_buffer(layout, compact).data_ptr():
            return "mlp_output_buffer is not the transport's reduce buffer on the P2P backend"
        # the oracle's norm (the module: flashinfer or Triton) and the fused push kernel may order the sum
        # of squares differently: one unit in the last place apart at most; padding rows exactly zero
        ulp = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10, torch.float32: 2.0 ** -22}[dtype]
        got = full.cpu()
        if got.shape != want.shape or bool(((got.float() - want.float()).abs() > ulp * want.float().abs()).any()):
            return f"communicator gather differs from the oracle ({layout}, compact={compact})"
        torch.mul(full, rank + 1, out=partial)  # the MoE writes its partials in place
        out, _ = comm.postprocess_layer(partial, res, layout)
        start, stop = layout.rows(rank, compact)
        # the partials are what the gather delivered (the same bytes on every rank), not the oracle's rows
        problem = _check_sum(out.cpu(), [got[start:stop] * (q + 1) for q in range(world)], dtype)
        if problem:
            return f"communicator reduce-scatter ({layout}, compact={compact}): {problem}"
    return None


def check_timeout(rank, world, device) -> Optional[str]:
    """Rank 0 calls, the others never do: rank 0's call ends in P2PTimeoutError naming the peer."""
    transport = p2p.P2PTransport(None, 64, 256, torch.bfloat16, device, timeout_ms=1500)
    layout = nsa_cp.ShardLayout([8] * world)
    result = _expect_timeout(transport, layout, device) if rank == 0 else None
    torch.cuda.synchronize()
    dist.barrier()
    transport.close()
    return result


def check_bad_geometry(rank, world, device) -> Optional[str]:
    """Device counts above max_rank_len (a CUDA-graph bucket misused): the kernel moves nothing and the
    next check raises P2PError (not a timeout) naming the rejected geometry. The transport is made with
    device "cuda", which must mean this rank's current device."""
    transport = p2p.P2PTransport(None, 8, 64, torch.bfloat16, "cuda", timeout_ms=20_000)
    try:
        if transport.device != device:
            return f"device 'cuda' became {transport.device}, expected {device}"
        layout = nsa_cp.ShardLayout([8] * world)
        x = torch.randn(8, 64, device=device).bfloat16()
        verdict = transport.support(layout, tuple(x.shape[1:]), x.dtype, x.device)
        if not verdict:
            return f"a tensor on the transport's device does not fit: {verdict.reason}"
        counts = torch.full((world,), 9, dtype=torch.int32, device=device)
        offsets = torch.arange(world, dtype=torch.int32, device=device) * 8
        _gather(transport, x, layout, False, "sm", (counts, offsets))
        torch.cuda.synchronize()
        try:
            transport.check_error()
        except p2p.P2PTimeoutError as err:
            return f"a bad geometry was reported as a timeout: {err}"
        except p2p.P2PError as err:
            if "device_counts" not in str(err) or "No rows were moved" not in str(err):
                return f"the geometry error does not say what was wrong: {err}"
            return None
        return "counts above max_rank_len raised nothing"
    finally:
        torch.cuda.synchronize()
        dist.barrier()
        transport.close()


def _expect_timeout(transport, layout, device, waited_limit_s=30.0) -> Optional[str]:
    """Rank 0's gather whose peer never comes: P2PTimeoutError naming the call and both ranks, in time;
    then the broken transport refuses the next call."""
    t0 = time.time()
    _gather(transport, torch.randn(8, 256, device=device).bfloat16(), layout, False, "sm")
    torch.cuda.synchronize()
    waited = time.time() - t0
    result = None
    try:
        transport.check_error()
        result = "no P2PTimeoutError after a peer never arrived"
    except p2p.P2PTimeoutError as err:
        text = str(err)
        if "rank 1" not in text or "all-gather" not in text or "rank 0" not in text:
            result = f"timeout error does not name the call and ranks: {text}"
        elif waited > waited_limit_s:
            result = f"timed out only after {waited:.1f} s"
    try:
        _gather(transport, torch.randn(8, 256, device=device).bfloat16(), layout, False)
        result = result or "a broken transport accepted another call"
    except p2p.P2PTimeoutError:
        pass
    return result


def run_peer_dies(rank: int, world: int, payload: dict) -> Dict[str, object]:
    """World 2: one good gather, then rank 1's process exits without a word (os._exit) and rank 0's next
    gather must end in P2PTimeoutError, not hang or crash. Only rank 0 reports (under "peer-dies")."""
    import os

    device = rank_device(rank)
    torch.cuda.set_device(device)
    transport = p2p.P2PTransport(None, 64, 256, torch.bfloat16, device, timeout_ms=1500)
    layout = nsa_cp.ShardLayout([8] * world)
    shards = [_gen(21, q, 8, (256,), torch.bfloat16, "cpu") for q in range(world)]
    got = _gather(transport, shards[rank].to(device), layout, False, "sm").cpu()
    transport.check_error()
    first = None if torch.equal(got, _expected_gather(shards, layout, False)) else "the first gather (both alive) differs"
    rank_log(f"peer-dies: memory {transport.memory}, first gather {'ok' if first is None else first}")
    dist.barrier()
    if rank == 1:
        rank_log("peer-dies: exiting now")
        os._exit(0)
    time.sleep(1.0)  # the peer is gone
    problem = first or _expect_timeout(transport, layout, device)
    rank_log(f"peer-dies: {'ok' if problem is None else 'FAILED ' + problem}")
    return {"peer-dies": problem, "__info__": {"memory": transport.memory}}


def run_config_mismatch(rank: int, world: int, payload: dict) -> Dict[str, object]:
    """Ranks that disagree on a transport setting (here double_buffer_tokens) must all raise the same
    ValueError naming the setting and every rank's value, before any allocation. The check is part of
    the transport's survey of the group, so a CPU group shows it."""
    values = [64 * (q + 1) for q in range(world)]
    try:
        p2p_memory.survey(None, None, {"hidden_size": 7168, "double_buffer_tokens": values[rank]})
    except ValueError as err:
        text = str(err)
        ok = "double_buffer_tokens" in text and str(values) in text and "hidden_size" not in text
        return {"config-mismatch": None if ok else f"the error does not name the setting and the values: {text}"}
    return {"config-mismatch": "ranks with different double_buffer_tokens raised nothing"}


def run_p2p_checks(rank: int, world: int, payload: dict) -> Dict[str, object]:
    device = rank_device(rank)
    results: Dict[str, object] = {}
    info: Dict[str, object] = {}
    reason = p2p.p2p_unavailable_reason(None, device)
    if reason is not None:
        return {"__world__": f"P2P unavailable on this machine: {reason}"}

    only = payload.get("only")  # kinds to run (a world's representative subset); None: every check

    def run(name, fn, *args, **kwargs):
        if only is not None and not any(name == k or name.startswith(k + "-") for k in only):
            return
        rank_log(f"{name}: start")
        try:
            results[name] = fn(*args, **kwargs)
        except Exception:
            results[name] = traceback.format_exc()
        rank_log(f"{name}: {'ok' if results[name] is None else 'FAILED ' + str(results[name])[-2000:]}")
        torch.cuda.synchronize()
        dist.barrier()

    for hidden, dtype in payload["shapes"]:
        tag = f"{hidden}-{str(dtype).split('.')[-1]}"
        transport = nsa_cp.init_p2p(None, payload["max_tokens"], hidden, dtype, device, timeout_ms=20_000,
                                    double_buffer_tokens=payload.get("double_buffer_tokens", {}).get(tag))
        for engine in ("sm", "ce"):
            for compact in (False, True):
                run(f"gather-{tag}-{engine}-{'compact' if compact else 'padded'}", check_gather_sequence,
                    transport, rank, world, device, engine, compact, seed=zlib.crc32(f"{hidden}-{engine}-{compact}".encode()) % 1000)
        for compact in (False, True):
            run(f"scatter-{tag}-{'compact' if compact else 'padded'}", check_reduce_scatter_sequence,
                transport, rank, world, device, compact, info=info)
        run(f"stress-{tag}", check_stress, transport, rank, world, device)
        run(f"graph-{tag}", check_graph_replay, transport, rank, world, device)
        run(f"slow-readers-{tag}", check_slow_readers, transport, rank, world, device)
        run(f"capacity-{tag}", check_capacity_errors, transport, rank, world, device)
        if not shared_gpu():
            run(f"capacity-fallback-{tag}", check_capacity_fallback, transport, rank, world, device)
        run(f"communicator-{tag}", check_communicator, transport, rank, world, device)
        run(f"strided-{tag}", check_strided_rows, transport, rank, world, device)
        run(f"copy-in-{tag}", check_reduce_copy_in, transport, rank, world, device)
        run(f"norm-{tag}", check_norm_gather, transport, rank, world, device)
        run(f"fp8-{tag}", check_fp8_gather, transport, rank, world, device)
        run(f"ordered-{tag}", check_ordered, transport, rank, world, device)
        run(f"norm-graph-{tag}", check_norm_graph_replay, transport, rank, world, device)
        run(f"scatter-norm-{tag}", check_reduce_scatter_norm, transport, rank, world, device)
        p2p.destroy_p2p(None)
    run("bad-geometry", check_bad_geometry, rank, world, device)
    run("bad-positions", check_bad_positions, rank, world, device)
    run("closed", check_runner_after_close, rank, world, device)
    if world > 1:
        run("timeout", check_timeout, rank, world, device)
    results["__info__"] = info
    return results


# ---- faults at any world size (tests/test_p2p_faults.py): every surviving rank gets the documented error
# within the timeout, nothing wrong is written, the broken transport refuses further calls, a new one works


def _fault_transport(device, timeout_ms, double_buffer_tokens=None, group=None, check_layout=True):
    return p2p.P2PTransport(group, 32, 256, torch.bfloat16, device, timeout_ms=timeout_ms,
                            double_buffer_tokens=double_buffer_tokens, check_layout=check_layout)


def _fault_layout(world):
    return nsa_cp.ShardLayout([8 + (q % 3) for q in range(world)])


def _raises(fn, cls, words=()) -> Optional[str]:
    """None when fn() raises cls whose text holds every word; else what happened."""
    try:
        fn()
    except cls as err:
        missing = [w for w in words if w not in str(err)]
        return f"{cls.__name__} without {missing}: {err}" if missing else None
    except Exception as err:  # noqa: BLE001 - reported as the wrong error
        return f"expected {cls.__name__}, got {type(err).__name__}: {err}"
    return f"expected {cls.__name__}, nothing raised"


def _good_gather(transport, rank, world, device, seed) -> Optional[str]:
    """One exact gather (both layouts) on a healthy transport."""
    layout = _fault_layout(world)
    for compact in (False, True):
        shards = [_gen(seed, q, n, (256,), torch.bfloat16, "cpu") for q, n in enumerate(layout.per_rank_actual_token)]
        _poison(*transport._gathers)
        got = _gather(transport, shards[rank].to(device), layout, compact, "sm").clone()
        torch.cuda.synchronize()
        transport.check_error()
        if not torch.equal(got.cpu(), _expected_gather(shards, layout, compact)):
            return f"gather (compact={compact}) on a new transport differs"
    return None


def _partial_gather_ok(got, shards, layout, missing) -> Optional[str]:
    """After a call whose peer `missing` never pushed: every other rank's rows exact, `missing`'s slot
    still the NaN poison (nothing else written there)."""
    for q, shard in enumerate(shards):
        start, stop = layout.rows(q, False)
        rows = got[start:stop]
        if q == missing:
            if not torch.isnan(rows.float()).all():
                return f"rank {q}'s slot (it never pushed) holds something other than the poison"
        elif not torch.equal(rows, shard):
            return f"rank {q}'s rows differ after the timed-out call"
    return None


def run_fault_never_arrives(rank: int, world: int, payload: dict) -> Dict[str, object]:
    """The last rank never calls: every other rank's gather and reduce-scatter end in P2PTimeoutError
    naming it, within the timeout; live ranks' rows landed exactly, the absent rank's slot and the
    reduce-scatter's output are untouched; the broken transport refuses the next call; then every rank
    (the absent one included) makes a new transport and it works."""
    device = rank_device(rank)
    torch.cuda.set_device(device)
    absent, timeout_ms = world - 1, payload.get("timeout_ms", 1500)
    out: Dict[str, object] = {}
    layout = _fault_layout(world)
    for op in ("gather", "scatter"):
        transport = _fault_transport(device, timeout_ms)
        problem = None
        _poison(*transport._gathers)  # every rank, the absent one too, before anyone pushes
        if rank != absent:
            shards = [_gen(5, q, n, (256,), torch.bfloat16, "cpu") for q, n in enumerate(layout.per_rank_actual_token)]
            res = torch.full((layout.count(rank), 256), float("nan"), dtype=torch.bfloat16, device=device)
            torch.cuda.synchronize()
            t0 = time.time()
            if op == "gather":
                got = _gather(transport, shards[rank].to(device), layout, False, "sm")
            else:
                buf = transport.reduce_buffer(layout, False)
                buf.copy_(_gen(6, rank, layout.padded_len, (256,), torch.bfloat16, "cpu").to(device))
                got = _scatter(transport, buf, layout, False, out=res)
            torch.cuda.synchronize()
            waited = time.time() - t0
            problem = _raises(transport.check_error, p2p.P2PTimeoutError,
                              [f"rank {absent} never arrived", f"rank {rank}", "all-gather" if op == "gather" else "reduce-scatter"])
            if problem is None and waited > timeout_ms / 1000 + 10:
                problem = f"the timeout came after {waited:.1f} s (timeout {timeout_ms} ms)"
            if problem is None and op == "gather":
                problem = _partial_gather_ok(got.cpu(), shards, layout, absent)
            if problem is None and op == "scatter" and not torch.isnan(res.float()).all():
                problem = "the timed-out reduce-scatter wrote its output"
            if problem is None:
                problem = _raises(lambda: _gather(transport, shards[rank].to(device), layout, False, "sm"),
                                  p2p.P2PTimeoutError)
                problem = problem and f"the broken transport accepted another call: {problem}"
        dist.barrier()  # the absent rank joins again
        transport.close()
        fresh = _fault_transport(device, 20_000)
        problem = problem or _good_gather(fresh, rank, world, device, seed=7)
        fresh.close()
        dist.barrier()
        out[f"never-arrives-{op}"] = problem
    return out


def run_fault_delayed(rank: int, world: int, payload: dict) -> Dict[str, object]:
    """The last rank calls seconds late: within the timeout every rank's result is exact; beyond it
    every other rank raises P2PTimeoutError naming it, and the late rank, whose peers now refuse every
    call, gets P2PTimeoutError at its next call; then a new transport works on every rank."""
    device = rank_device(rank)
    torch.cuda.set_device(device)
    late, delay_s = world - 1, payload.get("delay_s", 3.0)
    layout = _fault_layout(world)
    shards = [_gen(9, q, n, (256,), torch.bfloat16, "cpu") for q, n in enumerate(layout.per_rank_actual_token)]
    out: Dict[str, object] = {}
    # within the timeout: only slower
    transport = _fault_transport(device, 20_000)
    _poison(*transport._gathers)
    if rank == late:
        time.sleep(delay_s)
    got = _gather(transport, shards[rank].to(device), layout, True, "sm").clone()
    torch.cuda.synchronize()
    problem = None
    try:
        transport.check_error()
        if not torch.equal(got.cpu(), _expected_gather(shards, layout, True)):
            problem = "the gather with a late rank differs"
    except p2p.P2PError as err:
        problem = f"a rank {delay_s} s late inside a 20 s timeout raised {err}"
    out["delayed-within-timeout"] = problem
    dist.barrier()
    transport.close()
    # beyond the timeout
    timeout_ms = int(delay_s * 1000) // 3
    transport = _fault_transport(device, timeout_ms)
    dist.barrier()
    if rank == late:
        time.sleep(delay_s)
    _gather(transport, shards[rank].to(device), layout, False, "sm")
    torch.cuda.synchronize()
    if rank != late:
        problem = _raises(transport.check_error, p2p.P2PTimeoutError, [f"rank {late} never arrived"])
    else:
        # its own call found every peer's rows and done counts (they had given up after pushing): it may
        # complete; its next call waits for peers that refuse to launch
        problem = None
        try:
            transport.check_error()
            _gather(transport, shards[rank].to(device), layout, False, "sm")
            torch.cuda.synchronize()
        except p2p.P2PTimeoutError:
            pass
        problem = _raises(transport.check_error, p2p.P2PTimeoutError)
    dist.barrier()
    transport.close()
    fresh = _fault_transport(device, 20_000)
    out["delayed-beyond-timeout"] = problem or _good_gather(fresh, rank, world, device, seed=11)
    fresh.close()
    dist.barrier()
    return out


def run_fault_peer_dies(rank: int, world: int, payload: dict) -> Dict[str, object]:
    """The last rank dies inside a call: it enters a gather (entry barrier on every call: no double buffer)
    and exits before its peers arrive. Every survivor's gather ends in P2PTimeoutError naming it within the
    timeout, the live ranks' rows landed exactly and the dead rank's slot holds the poison; the broken
    transport refuses the next call; a new transport over the survivors' group works."""
    import os

    device = rank_device(rank)
    torch.cuda.set_device(device)
    dead, timeout_ms = world - 1, payload.get("timeout_ms", 1500)
    layout = _fault_layout(world)
    shards = [_gen(13, q, n, (256,), torch.bfloat16, "cpu") for q, n in enumerate(layout.per_rank_actual_token)]
    transport = _fault_transport(device, timeout_ms, double_buffer_tokens=0)
    problem = _good_gather(transport, rank, world, device, seed=12)  # both alive: fine
    survivors = list(range(world - 1))
    dist.barrier()
    if rank == dead:
        _gather(transport, shards[rank].to(device), layout, False, "sm")  # enters, signals, waits for the others
        time.sleep(0.2)
        rank_log("peer-dies: exiting inside a gather")
        os._exit(0)
    sub = dist.new_group(survivors, use_local_synchronization=True)
    time.sleep(1.0)  # the peer is gone, its call never finished
    for t in transport._gathers:  # the dead rank pushed nothing: it never passed its entry wait
        t.fill_(float("nan"))
    torch.cuda.synchronize()
    dist.barrier(group=sub)
    t0 = time.time()
    got = _gather(transport, shards[rank].to(device), layout, False, "sm")
    torch.cuda.synchronize()
    waited = time.time() - t0
    problem = problem or _raises(transport.check_error, p2p.P2PTimeoutError, [f"rank {dead} never arrived"])
    if problem is None and waited > timeout_ms / 1000 + 10:
        problem = f"the timeout came after {waited:.1f} s"
    problem = problem or _partial_gather_ok(got.cpu(), shards, layout, dead)
    if problem is None:
        refused = _raises(lambda: _gather(transport, shards[rank].to(device), layout, False, "sm"), p2p.P2PTimeoutError)
        problem = refused and f"the broken transport accepted another call: {refused}"
    transport.close()
    # a new transport over the survivors
    fresh = p2p.P2PTransport(sub, 32, 256, torch.bfloat16, device, timeout_ms=20_000)
    sub_layout = nsa_cp.ShardLayout([8 + (q % 3) for q in survivors])
    sub_shards = [_gen(14, q, n, (256,), torch.bfloat16, "cpu") for q, n in enumerate(sub_layout.per_rank_actual_token)]
    got = _gather(fresh, sub_shards[rank].to(device), sub_layout, True, "sm").clone()
    torch.cuda.synchronize()
    fresh.check_error()
    if problem is None and not torch.equal(got.cpu(), _expected_gather(sub_shards, sub_layout, True)):
        problem = "a gather on the survivors' new transport differs"
    fresh.close()
    dist.barrier(group=sub)
    return {"peer-dies-mid-call": problem}


# ---- rank agreement: the call fingerprint (tests/test_p2p_faults.py)


def _mismatch_expect(transport, rank, world, deviant, words=()) -> Optional[str]:
    """Every rank: LayoutMismatchError naming this rank and a peer (the deviant one, or this rank when it
    is the deviant), a subclass of nsa_cp.LayoutMismatchError; then the transport refuses the next call."""
    peer = deviant if rank != deviant else None
    want = [f"rank {rank} assumed"] + ([f"rank {peer} assumed"] if peer is not None else []) + list(words)
    problem = _raises(transport.check_error, p2p.LayoutMismatchError, want)
    if problem is None and not issubclass(p2p.LayoutMismatchError, nsa_cp.LayoutMismatchError):
        problem = "p2p.LayoutMismatchError is not an nsa_cp.LayoutMismatchError"
    if problem is None:
        x = torch.zeros(transport.max_tokens_per_rank, 256, dtype=torch.bfloat16, device=transport.device)
        refused = _raises(lambda: transport.gather_runner(_fault_layout(world), False, (256,))(x[:_fault_layout(world).count(rank)]),
                          p2p.LayoutMismatchError)
        problem = refused and f"after the mismatch the transport accepted another call: {refused}"
    return problem


def run_fingerprint_checks(rank: int, world: int, payload: dict) -> Dict[str, object]:
    """Ranks that disagree on a call, without validate=: every rank raises LayoutMismatchError naming both
    sides, before a wrong row is read (the reduce-scatter writes nothing; the gather with an entry exchange
    moves nothing; the double-buffered gather leaves NaN, not misplaced rows); a new transport works.
    With check_layout=False the same call raises nothing (what the check is for)."""
    device = rank_device(rank)
    torch.cuda.set_device(device)
    deviant = world - 1
    good = _fault_layout(world)
    counts = list(good.per_rank_actual_token)
    counts[0] += 1  # same max_rank_len (so the same gather buffer), one more row on rank 0
    bad = nsa_cp.ShardLayout(counts)
    if bad.max_rank_len != good.max_rank_len:
        counts[0] -= 2
        bad = nsa_cp.ShardLayout(counts)
    mine = bad if rank == deviant else good
    out: Dict[str, object] = {}

    def case(name, fn, double_buffer_tokens=None, check_layout=True):
        problem = None
        transport = _fault_transport(device, 20_000, double_buffer_tokens, check_layout=check_layout)
        try:
            problem = fn(transport)
        except Exception:  # noqa: BLE001
            problem = traceback.format_exc()
        torch.cuda.synchronize()
        dist.barrier()
        transport.close()
        if name != "check-off":
            fresh = _fault_transport(device, 20_000)
            problem = problem or _good_gather(fresh, rank, world, device, seed=17)
            fresh.close()
        dist.barrier()
        out[f"fingerprint-{name}"] = problem

    x = _gen(19, rank, mine.count(rank), (256,), torch.bfloat16, "cpu").to(device)

    def gather_double_buffered(transport):  # no entry exchange: compared after the done wait
        _poison(*transport._gathers)
        got = transport.gather_runner(mine, False, (256,))(x)
        torch.cuda.synchronize()
        if not torch.isnan(got.float()).all():
            return "the disagreeing double-buffered gather left rows that are not NaN"
        return _mismatch_expect(transport, rank, world, deviant, ["Its result on this rank was overwritten with NaN"])

    def gather_entry(transport):  # entry exchange on every call: nothing moves
        _poison(*transport._gathers)
        got = transport.gather_runner(mine, True, (256,))(x)
        torch.cuda.synchronize()
        if not torch.isnan(got.float()).all():
            return "the disagreeing gather with an entry exchange wrote rows"
        return _mismatch_expect(transport, rank, world, deviant, ["No row of that call was moved"])

    def scatter(transport):  # compared before any row is read
        buf = transport.reduce_buffer(mine, True)
        buf.copy_(_gen(23, rank, mine.total_len, (256,), torch.bfloat16, "cpu").to(device))
        res = torch.full((mine.count(rank), 256), float("nan"), dtype=torch.bfloat16, device=device)
        transport.reduce_scatter_runner(mine, True, (256,))(buf, res)
        torch.cuda.synchronize()
        if not torch.isnan(res.float()).all():
            return "the disagreeing reduce-scatter wrote its output"
        return _mismatch_expect(transport, rank, world, deviant, ["reduce-scatter", "No row of that call was read"])

    def stage(transport):  # same layout, but the deviant rank sends fp8 where the others send bf16 rows
        xs = _gen(29, rank, good.count(rank), (256,), torch.bfloat16, "cpu").to(device)
        if rank == deviant:
            transport.gather_runner(good, False, (256,), quant=p2p.QUANT_FP8)(xs)
        else:
            transport.gather_runner(good, False, (256,))(xs)
        torch.cuda.synchronize()
        return _mismatch_expect(transport, rank, world, deviant, ["fp8" if rank == deviant else "padded"])

    def check_off(transport):  # the same disagreement without the check: silently wrong (hence the check)
        _poison(*transport._gathers)
        transport.gather_runner(mine, False, (256,))(x)
        torch.cuda.synchronize()
        try:
            transport.check_error()
        except p2p.P2PError as err:
            return f"check_layout=False still raised {err}"
        return None

    case("gather-double-buffered", gather_double_buffered)
    case("gather-entry", gather_entry, double_buffer_tokens=0)
    case("scatter", scatter)
    case("stage", stage)
    case("check-off", check_off, check_layout=False)
    return out
