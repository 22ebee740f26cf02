"""Rank agreement: the call fingerprint (tests/transports/test_p2p_faults.py). Ranks that disagree on a call raise
LayoutMismatchError naming both sides before a wrong row is read; with check_layout=False they do not."""

from __future__ import annotations

import traceback
from typing import Dict, Optional

import torch
import torch.distributed as dist

import nsa_cp
from nsa_cp.transport import p2p

from oracles import gen
from dist_harness import rank_device
from p2p_common import fault_layout, fault_transport, good_gather, poison, raises


# ---- rank agreement: the call fingerprint (tests/transports/test_p2p_faults.py)
def _mismatch_expect(transport, rank, world, deviant, words=()) -> Optional[str]:
    """Every rank: LayoutMismatchError naming this rank and a peer (the deviant one, or this rank when it
    is the deviant), a subclass of nsa_cp.LayoutMismatchError; then the transport refuses the next call."""
    peer = deviant if rank != deviant else None
    want = [f"rank {rank} assumed"] + ([f"rank {peer} assumed"] if peer is not None else []) + list(words)
    problem = raises(transport.check_error, p2p.LayoutMismatchError, want)
    if problem is None and not issubclass(p2p.LayoutMismatchError, nsa_cp.LayoutMismatchError):
        problem = "p2p.LayoutMismatchError is not an nsa_cp.LayoutMismatchError"
    if problem is None:
        x = torch.zeros(transport.max_tokens_per_rank, 256, dtype=torch.bfloat16, device=transport.device)
        refused = raises(lambda: transport.gather_runner(fault_layout(world), False, (256,))(x[:fault_layout(world).count(rank)]),
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
    good = fault_layout(world)
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
        transport = fault_transport(device, 20_000, double_buffer_tokens, check_layout=check_layout)
        try:
            problem = fn(transport)
        except Exception:  # noqa: BLE001
            problem = traceback.format_exc()
        torch.cuda.synchronize()
        dist.barrier()
        transport.close()
        if name != "check-off":
            fresh = fault_transport(device, 20_000)
            problem = problem or good_gather(fresh, rank, world, device, seed=17)
            fresh.close()
        dist.barrier()
        out[f"fingerprint-{name}"] = problem

    x = gen(19, rank, mine.count(rank), (256,), torch.bfloat16, "cpu").to(device)

    def disagreeing_gather(compact, wrote, says):
        def check(transport):
            poison(*transport._gathers)
            got = transport.gather_runner(mine, compact, (256,))(x)
            torch.cuda.synchronize()
            if not torch.isnan(got.float()).all():
                return wrote
            return _mismatch_expect(transport, rank, world, deviant, [says])
        return check

    # no entry exchange: compared after the done wait
    gather_double_buffered = disagreeing_gather(
        False, "the disagreeing double-buffered gather left rows that are not NaN",
        "Its result on this rank was overwritten with NaN")
    # entry exchange on every call: nothing moves
    gather_entry = disagreeing_gather(True, "the disagreeing gather with an entry exchange wrote rows",
                                      "No row of that call was moved")

    def scatter(transport):  # compared before any row is read
        buf = transport.reduce_buffer(mine, True)
        buf.copy_(gen(23, rank, mine.total_len, (256,), torch.bfloat16, "cpu").to(device))
        res = torch.full((mine.count(rank), 256), float("nan"), dtype=torch.bfloat16, device=device)
        transport.reduce_scatter_runner(mine, True, (256,))(buf, res)
        torch.cuda.synchronize()
        if not torch.isnan(res.float()).all():
            return "the disagreeing reduce-scatter wrote its output"
        return _mismatch_expect(transport, rank, world, deviant, ["reduce-scatter", "No row of that call was read"])

    def stage(transport):  # same layout, but the deviant rank sends fp8 where the others send bf16 rows
        xs = gen(29, rank, good.count(rank), (256,), torch.bfloat16, "cpu").to(device)
        if rank == deviant:
            transport.gather_runner(good, False, (256,), quant="fp8_e4m3_g128")(xs)
        else:
            transport.gather_runner(good, False, (256,))(xs)
        torch.cuda.synchronize()
        return _mismatch_expect(transport, rank, world, deviant, ["fp8" if rank == deviant else "padded"])

    def wire_format(transport):  # same layout and row bytes, both FP8: the deviant rank's scales are ue8m0
        xs = gen(31, rank, good.count(rank), (256,), torch.bfloat16, "cpu").to(device)
        quant = "fp8_e4m3_g128_ue8m0" if rank == deviant else "fp8_e4m3_g128"
        transport.gather_runner(good, False, (256,), quant=quant)(xs)
        torch.cuda.synchronize()
        # every rank's message names the format it assumed; the others' also the deviant's
        words = ["fp8_e4m3_g128_ue8m0"] + (["fp8_e4m3_g128,"] if rank != deviant else [])
        return _mismatch_expect(transport, rank, world, deviant, words)

    def check_off(transport):  # the same disagreement without the check: silently wrong (hence the check)
        poison(*transport._gathers)
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
    case("format", wire_format)
    case("check-off", check_off, check_layout=False)
    return out
