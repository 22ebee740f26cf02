"""P2P calls in CUDA graphs and across double buffers: graph replays with device counts (plain and
with the norm stage), and slow readers of a result while the next gathers alternate buffers."""

from __future__ import annotations

import random
from typing import Optional

import torch

import nsa_cp

from oracles import check_sum, expected_gather, gen
from p2p_common import EPS, close_to, norm_inputs, poison, run_gather


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
        shards = [gen(seed * 10 + replay, q, n, (hidden,), dtype, "cpu") for q, n in enumerate(counts)]
        partials = [gen(seed * 10 + replay + 5, q, world * m, (hidden,), dtype, "cpu") for q in range(world)]
        counts_dev.copy_(torch.tensor(counts, dtype=torch.int32))
        x.fill_(float("nan"))
        x[: counts[rank]].copy_(shards[rank].to(device))
        y.copy_(partials[rank].to(device))
        poison(gathered, rs_out)
        graph.replay()
        torch.cuda.synchronize()
        transport.check_error()
        # the bucket's geometry (slot size m), this replay's counts, zero padding
        want = torch.cat([torch.cat([s, torch.zeros((m - s.shape[0], hidden), dtype=dtype)]) for s in shards])
        if not torch.equal(gathered.cpu(), want):
            return f"graph replay {replay} counts {counts}: gathered rows differ"
        problem = check_sum(rs_out[: counts[rank]].cpu(), [p[rank * m: rank * m + counts[rank]] for p in partials], dtype)
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
        shards = [gen(seed * 1000 + i, q, n, (hidden,), dtype, "cpu") for q, n in enumerate(layout.per_rank_actual_token)]
        got = run_gather(transport, shards[rank].to(device), layout, compact, "sm")
        read_late(f"{tag} {layout} compact={compact}", got, expected_gather(shards, layout, compact))

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
        shards = [gen(seed * 1000 + calls + j, q, n, (hidden,), dtype, "cpu") for q, n in enumerate(counts)]
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
        run(x, r, weight, EPS, (counts_dev, offsets_dev))
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gathered = run(x, r, weight, EPS, (counts_dev, offsets_dev))
    rng = random.Random(seed)
    for replay in range(replays):
        counts = [rng.randint(0, m) for _ in range(world)]
        layout = nsa_cp.ShardLayout(counts)
        xs, rs, w, ys, r_after = norm_inputs(seed + replay, layout, hidden, dtype, dtype, True)
        counts_dev.copy_(torch.tensor(counts, dtype=torch.int32))
        x.fill_(float("nan"))
        x[: counts[rank]].copy_(xs[rank].to(device))
        r[: counts[rank]].copy_(rs[rank].to(device))
        weight.copy_(w.to(device))
        poison(gathered)
        graph.replay()
        torch.cuda.synchronize()
        transport.check_error()
        want = torch.cat([torch.cat([y, torch.zeros((m - y.shape[0], hidden), dtype=dtype)]) for y in ys])
        problem = close_to(gathered.cpu(), want, dtype)
        if problem:
            return f"norm graph replay {replay} counts {counts}: {problem}"
        if not torch.equal(r[: counts[rank]].cpu(), r_after[rank]):
            return f"norm graph replay {replay} counts {counts}: residual not updated"
    return None
