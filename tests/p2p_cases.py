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
from nsa_cp.transport import p2p, p2p_memory

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


def _gather_once(transport, layout, compact, engine, rank, hidden, dtype, seed, device):
    shards = [_gen(seed, q, n, (hidden,), dtype, "cpu") for q, n in enumerate(layout.per_rank_actual_token)]
    x = shards[rank].to(device)
    _poison(*transport._gathers)
    got = transport.all_gather(x, layout, compact=compact, engine=engine).clone()
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
        got = transport.reduce_scatter(buf, layout, compact=compact, out=out)
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
            got = transport.all_gather(shards[rank].to(device), layout, compact=compact,
                                       engine=rng.choice(["sm", "ce"])).clone()
            pending.append(("gather", i, layout, got, _expected_gather(shards, layout, compact)))
        else:
            rows = layout.global_len(compact)
            partials = [_gen(seed * 1000 + i, q, rows, (hidden,), dtype, "cpu") for q in range(world)]
            buf = transport.reduce_buffer(layout, compact)
            buf.copy_(partials[rank].to(device))
            got = transport.reduce_scatter(buf, layout, compact=compact)
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
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):  # warm up (loads kernels) outside capture
        transport.all_gather(x, bucket, compact=False, engine="sm", device_counts=(counts_dev, offsets_dev))
        transport.reduce_scatter(y, bucket, compact=False, out=rs_out, device_counts=(counts_dev, offsets_dev))
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gathered = transport.all_gather(x, bucket, compact=False, engine="sm", device_counts=(counts_dev, offsets_dev))
        transport.reduce_scatter(y, bucket, compact=False, out=rs_out, device_counts=(counts_dev, offsets_dev))
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
        got = transport.all_gather(shards[rank].to(device), layout, compact=compact, engine="sm")
        read_late(f"{tag} {layout} compact={compact}", got, _expected_gather(shards, layout, compact))

    for i in range(calls):
        eager(f"eager call {i}", i)

    bucket = nsa_cp.ShardLayout([m] * world)
    counts_dev = torch.full((world,), m, dtype=torch.int32, device=device)
    offsets_dev = torch.arange(world, dtype=torch.int32, device=device) * m
    x = torch.zeros((m, hidden), dtype=dtype, device=device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        transport.all_gather(x, bucket, compact=False, engine="sm", device_counts=(counts_dev, offsets_dev))
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gathered = transport.all_gather(x, bucket, compact=False, engine="sm", device_counts=(counts_dev, offsets_dev))
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
        local, _ = comm.prepare_mlp(h, r, None)
        shards = [None] * world
        dist.all_gather_object(shards, local.cpu())
        want = _expected_gather(shards, layout, compact)
        _poison(*transport._gathers)
        full, res = comm.prepare_mlp(h, r, layout)
        partial = comm.mlp_output_buffer(layout, full)
        if partial.data_ptr() != transport.reduce_buffer(layout, compact).data_ptr():
            return "mlp_output_buffer is not the transport's reduce buffer on the P2P backend"
        if not torch.equal(full.cpu(), want):
            return f"communicator gather differs from the oracle ({layout}, compact={compact})"
        torch.mul(full, rank + 1, out=partial)  # the MoE writes its partials in place
        out, _ = comm.postprocess_layer(partial, res, layout)
        start, stop = layout.rows(rank, compact)
        problem = _check_sum(out.cpu(), [want[start:stop] * (q + 1) for q in range(world)], dtype)
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
        if not transport.fits(x, layout):
            return "a tensor on the transport's device does not fit"
        counts = torch.full((world,), 9, dtype=torch.int32, device=device)
        offsets = torch.arange(world, dtype=torch.int32, device=device) * 8
        transport.all_gather(x, layout, compact=False, engine="sm", device_counts=(counts, offsets))
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
    transport.all_gather(torch.randn(8, 256, device=device).bfloat16(), layout, compact=False, engine="sm")
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
        transport.all_gather(torch.randn(8, 256, device=device).bfloat16(), layout, compact=False)
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
    got = transport.all_gather(shards[rank].to(device), layout, compact=False, engine="sm").cpu()
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

    def run(name, fn, *args, **kwargs):
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
        p2p.destroy_p2p(None)
    run("bad-geometry", check_bad_geometry, rank, world, device)
    if world > 1:
        run("timeout", check_timeout, rank, world, device)
    results["__info__"] = info
    return results
