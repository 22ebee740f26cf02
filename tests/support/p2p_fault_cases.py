"""P2P faults and refusals: bad device geometry or positions, calls after close, over capacity (errors
and the auto fallback), timeouts, a peer that dies or never arrives or comes late, ranks that disagree on
a setting. Every surviving rank gets the documented error within the timeout, nothing wrong is written,
the broken transport refuses further calls, and a new one works."""

from __future__ import annotations

import contextlib
import time
from typing import Dict, Optional

import torch
import torch.distributed as dist

import nsa_cp
from nsa_cp.transport import p2p
from nsa_cp.transport.p2p import memory as p2p_memory

from oracles import expected_gather, gen
from dist_harness import rank_device, rank_log
from p2p_common import fault_layout, fault_transport, good_gather, poison, raises, run_gather, run_scatter


@contextlib.contextmanager
def _meeting_then_closing(transport):
    """Run a check on ``transport``; then, whatever happened, every rank meets and closes it."""
    try:
        yield transport
    finally:
        torch.cuda.synchronize()
        dist.barrier()
        transport.close()


def _geometry_error(transport, what: str):
    """After a call with bad device-side geometry: ``(the P2PError check_error raises, None)``, ``(None,
    problem)`` when it came as a timeout, ``(None, None)`` when nothing was raised."""
    torch.cuda.synchronize()
    try:
        transport.check_error()
    except p2p.P2PTimeoutError as err:
        return None, f"a bad {what} was reported as a timeout: {err}"
    except p2p.P2PError as err:
        return err, None
    return None, None


def check_bad_positions(rank, world, device) -> Optional[str]:
    """A position outside [0, T): nothing outside the buffers is touched (the value is clamped) and the
    next check raises P2PError (not a timeout) naming the positions."""
    transport = p2p.P2PTransport(None, 8, 64, torch.bfloat16, device, timeout_ms=20_000)
    with _meeting_then_closing(transport):
        layout = nsa_cp.ShardLayout([4] * world)
        pos = torch.arange(layout.total_len, dtype=torch.int64, device=device)
        pos[0] = layout.total_len + 1000  # out of range: rank 0's first row
        x = torch.randn(4, 64, device=device).bfloat16()
        transport.gather_runner(layout, True, (64,), ordered=True)(x, positions=pos)
        err, problem = _geometry_error(transport, "position")
        if problem or err is None:
            return problem or (None if rank != 0 else "a position outside [0, T) raised nothing")
        if rank == 0 and "positions" not in str(err):
            return f"the error does not name the positions: {err}"
        return None


def check_runner_after_close(rank, world, device) -> Optional[str]:
    """A runner kept past its transport's close (init_p2p again, destroy_p2p) raises instead of touching
    freed memory; init_p2p and destroy_p2p each change the group registries' generation."""
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
    x.copy_(gen(5, rank, x.shape[0], (transport.hidden_size,), transport.dtype, device))
    shards = [gen(5, q, n, (transport.hidden_size,), transport.dtype, "cpu") for q, n in enumerate(too_big.per_rank_actual_token)]
    got = nsa_cp.cp_all_gather(x, too_big)
    if not torch.equal(got.cpu(), expected_gather(shards, too_big, False)):
        return "auto backend's fallback to NCCL for an oversized layout gathered the wrong rows"
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
    with _meeting_then_closing(transport):
        if transport.device != device:
            return f"device 'cuda' became {transport.device}, expected {device}"
        layout = nsa_cp.ShardLayout([8] * world)
        x = torch.randn(8, 64, device=device).bfloat16()
        verdict = transport.support(layout, tuple(x.shape[1:]), x.dtype, x.device)
        if not verdict:
            return f"a tensor on the transport's device does not fit: {verdict.reason}"
        counts = torch.full((world,), 9, dtype=torch.int32, device=device)
        offsets = torch.arange(world, dtype=torch.int32, device=device) * 8
        run_gather(transport, x, layout, False, "sm", (counts, offsets))
        err, problem = _geometry_error(transport, "geometry")
        if problem or err is None:
            return problem or "counts above max_rank_len raised nothing"
        if "device_counts" not in str(err) or "No rows were moved" not in str(err):
            return f"the geometry error does not say what was wrong: {err}"
        return None


def _expect_timeout(transport, layout, device, waited_limit_s=30.0) -> Optional[str]:
    """Rank 0's gather whose peer never comes: P2PTimeoutError naming the call and both ranks, in time;
    then the broken transport refuses the next call."""
    t0 = time.time()
    run_gather(transport, torch.randn(8, 256, device=device).bfloat16(), layout, False, "sm")
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
        run_gather(transport, torch.randn(8, 256, device=device).bfloat16(), layout, False)
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
    shards = [gen(21, q, 8, (256,), torch.bfloat16, "cpu") for q in range(world)]
    got = run_gather(transport, shards[rank].to(device), layout, False, "sm").cpu()
    transport.check_error()
    first = None if torch.equal(got, expected_gather(shards, layout, False)) else "the first gather (both alive) differs"
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
    layout = fault_layout(world)
    for op in ("gather", "scatter"):
        transport = fault_transport(device, timeout_ms)
        problem = None
        poison(*transport._gathers)  # every rank, the absent one too, before anyone pushes
        if rank != absent:
            shards = [gen(5, q, n, (256,), torch.bfloat16, "cpu") for q, n in enumerate(layout.per_rank_actual_token)]
            res = torch.full((layout.count(rank), 256), float("nan"), dtype=torch.bfloat16, device=device)
            torch.cuda.synchronize()
            t0 = time.time()
            if op == "gather":
                got = run_gather(transport, shards[rank].to(device), layout, False, "sm")
            else:
                buf = transport.reduce_buffer(layout, False)
                buf.copy_(gen(6, rank, layout.padded_len, (256,), torch.bfloat16, "cpu").to(device))
                got = run_scatter(transport, buf, layout, False, out=res)
            torch.cuda.synchronize()
            waited = time.time() - t0
            problem = raises(transport.check_error, p2p.P2PTimeoutError,
                              [f"rank {absent} never arrived", f"rank {rank}", "all-gather" if op == "gather" else "reduce-scatter"])
            if problem is None and waited > timeout_ms / 1000 + 10:
                problem = f"the timeout came after {waited:.1f} s (timeout {timeout_ms} ms)"
            if problem is None and op == "gather":
                problem = _partial_gather_ok(got.cpu(), shards, layout, absent)
            if problem is None and op == "scatter" and not torch.isnan(res.float()).all():
                problem = "the timed-out reduce-scatter wrote its output"
            if problem is None:
                problem = raises(lambda: run_gather(transport, shards[rank].to(device), layout, False, "sm"),
                                  p2p.P2PTimeoutError)
                problem = problem and f"the broken transport accepted another call: {problem}"
        dist.barrier()  # the absent rank joins again
        transport.close()
        fresh = fault_transport(device, 20_000)
        problem = problem or good_gather(fresh, rank, world, device, seed=7)
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
    layout = fault_layout(world)
    shards = [gen(9, q, n, (256,), torch.bfloat16, "cpu") for q, n in enumerate(layout.per_rank_actual_token)]
    out: Dict[str, object] = {}
    # within the timeout: only slower
    transport = fault_transport(device, 20_000)
    poison(*transport._gathers)
    if rank == late:
        time.sleep(delay_s)
    got = run_gather(transport, shards[rank].to(device), layout, True, "sm").clone()
    torch.cuda.synchronize()
    problem = None
    try:
        transport.check_error()
        if not torch.equal(got.cpu(), expected_gather(shards, layout, True)):
            problem = "the gather with a late rank differs"
    except p2p.P2PError as err:
        problem = f"a rank {delay_s} s late inside a 20 s timeout raised {err}"
    out["delayed-within-timeout"] = problem
    dist.barrier()
    transport.close()
    # beyond the timeout
    timeout_ms = int(delay_s * 1000) // 3
    transport = fault_transport(device, timeout_ms)
    dist.barrier()
    if rank == late:
        time.sleep(delay_s)
    run_gather(transport, shards[rank].to(device), layout, False, "sm")
    torch.cuda.synchronize()
    if rank != late:
        problem = raises(transport.check_error, p2p.P2PTimeoutError, [f"rank {late} never arrived"])
    else:
        # its own call found every peer's rows and done counts (they had given up after pushing): it may
        # complete; its next call waits for peers that refuse to launch
        problem = None
        try:
            transport.check_error()
            run_gather(transport, shards[rank].to(device), layout, False, "sm")
            torch.cuda.synchronize()
        except p2p.P2PTimeoutError:
            pass
        problem = raises(transport.check_error, p2p.P2PTimeoutError)
    dist.barrier()
    transport.close()
    fresh = fault_transport(device, 20_000)
    out["delayed-beyond-timeout"] = problem or good_gather(fresh, rank, world, device, seed=11)
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
    layout = fault_layout(world)
    shards = [gen(13, q, n, (256,), torch.bfloat16, "cpu") for q, n in enumerate(layout.per_rank_actual_token)]
    transport = fault_transport(device, timeout_ms, double_buffer_tokens=0)
    problem = good_gather(transport, rank, world, device, seed=12)  # both alive: fine
    survivors = list(range(world - 1))
    dist.barrier()
    if rank == dead:
        run_gather(transport, shards[rank].to(device), layout, False, "sm")  # enters, signals, waits for the others
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
    got = run_gather(transport, shards[rank].to(device), layout, False, "sm")
    torch.cuda.synchronize()
    waited = time.time() - t0
    problem = problem or raises(transport.check_error, p2p.P2PTimeoutError, [f"rank {dead} never arrived"])
    if problem is None and waited > timeout_ms / 1000 + 10:
        problem = f"the timeout came after {waited:.1f} s"
    problem = problem or _partial_gather_ok(got.cpu(), shards, layout, dead)
    if problem is None:
        refused = raises(lambda: run_gather(transport, shards[rank].to(device), layout, False, "sm"), p2p.P2PTimeoutError)
        problem = refused and f"the broken transport accepted another call: {refused}"
    transport.close()
    # a new transport over the survivors
    fresh = p2p.P2PTransport(sub, 32, 256, torch.bfloat16, device, timeout_ms=20_000)
    sub_layout = nsa_cp.ShardLayout([8 + (q % 3) for q in survivors])
    sub_shards = [gen(14, q, n, (256,), torch.bfloat16, "cpu") for q, n in enumerate(sub_layout.per_rank_actual_token)]
    got = run_gather(fresh, sub_shards[rank].to(device), sub_layout, True, "sm").clone()
    torch.cuda.synchronize()
    fresh.check_error()
    if problem is None and not torch.equal(got.cpu(), expected_gather(sub_shards, sub_layout, True)):
        problem = "a gather on the survivors' new transport differs"
    fresh.close()
    dist.barrier(group=sub)
    return {"peer-dies-mid-call": problem}
