"""P2P reduce-scatters inside a process group: sequences of random layouts, the copy into the reduce
buffer, and the fused add + RMSNorm epilogue. Each check returns None or an error text; sums against fp64."""

from __future__ import annotations

import random
from typing import Optional

import torch
import torch.distributed as dist

import nsa_cp
from nsa_cp.rows import reference

from oracles import check_sum, gen
from dist_harness import shared_gpu
from p2p_common import EPS, close_to, layout_cases, random_layout, random_positions, run_scatter


def check_reduce_scatter_sequence(transport, rank, world, device, compact, calls=7, seed=0, info=None) -> Optional[str]:
    rng = random.Random(seed)
    dtype = transport.dtype
    with_nccl = not shared_gpu()
    errors = {"p2p": 0.0, "nccl": 0.0 if with_nccl else "not measured: ranks share one GPU"}
    problems = []  # keep going after a failure: every rank must make the same NCCL calls
    for i in range(calls):
        layout = random_layout(rng, world, transport.max_tokens_per_rank)
        rows = layout.global_len(compact)
        partials = [gen(seed * 100 + i, q, rows, (transport.hidden_size,), dtype, "cpu") for q in range(world)]
        start, stop = layout.rows(rank, compact)
        if with_nccl:
            nccl_got = nsa_cp.cp_reduce_scatter(partials[rank].to(device), layout, compact=compact, backend="nccl")
        buf = transport.reduce_buffer(layout, compact)
        buf.copy_(partials[rank].to(device))  # the MoE writes here
        out = torch.full((layout.count(rank), transport.hidden_size), float("nan"), dtype=dtype, device=device)
        got = run_scatter(transport, buf, layout, compact, out)
        torch.cuda.synchronize()
        transport.check_error()
        problem = check_sum(got.cpu(), [p[start:stop] for p in partials], dtype)
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


def check_reduce_copy_in(transport, rank, world, device, seed=41) -> Optional[str]:
    """The reduce-scatter runner with the handed-out reduce buffer (no copy), another view object of the
    same memory (no copy either), and a separate tensor (copied in); reduce_buffer hands out the same
    object for an equal-but-new layout."""
    hidden, dtype = transport.hidden_size, transport.dtype
    for compact in (False, True):
        layout = layout_cases(world, transport.max_tokens_per_rank, seed)[0]
        run = transport.reduce_scatter_runner(layout, compact, (hidden,))
        twin = nsa_cp.ShardLayout(list(layout.per_rank_actual_token))
        start, stop = layout.rows(rank, compact)
        for k, how in enumerate(("handed-out", "another view", "separate")):
            partials = [gen(seed + 10 * k, q, layout.global_len(compact), (hidden,), dtype, "cpu") for q in range(world)]
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
            problem = check_sum(got.cpu(), [q[start:stop] for q in partials], dtype)
            if problem:
                return f"reduce-scatter with the {how} input (compact={compact}): {problem}"
        if transport.reduce_buffer(layout, compact) is not transport.reduce_buffer(twin, compact):
            return "reduce_buffer hands out another object for an equal layout"
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
    for i, layout in enumerate(layout_cases(world, transport.max_tokens_per_rank, seed)):
        for mode in ("padded", "compact", "ordered"):
            compact, ordered = mode != "padded", mode == "ordered"
            rows = layout.global_len(compact)
            partials = [gen(seed + i, q, rows, (hidden,), dtype, "cpu") for q in range(world)]
            start, stop = layout.rows(rank, compact)
            pos = random_positions(seed + i, layout.total_len, device) if ordered else None
            mine = pos.cpu()[start:stop] if ordered else torch.arange(start, stop)
            acc = partials[0][mine].float()
            for q in range(1, world):
                acc = acc + partials[q][mine].float()
            residual = gen(seed + i + 7, rank, layout.count(rank), (hidden,), dtype, "cpu")
            weight = (1.0 + 0.25 * gen(seed + i + 8, 0, 1, (hidden,), torch.float32, "cpu")[0]).to(dtype)
            r_ref = residual.clone()
            want, _ = reference.fused_add_rmsnorm(acc.to(dtype), r_ref, weight, EPS)
            y = transport.reduce_buffer(layout, compact)
            y.copy_(partials[rank].to(device))
            r = residual.to(device)
            out = torch.full((layout.count(rank), hidden), float("nan"), dtype=dtype, device=device)
            torch.cuda.synchronize()
            dist.barrier()
            run = transport.reduce_scatter_runner(layout, compact, (hidden,), ordered=ordered, norm=True)
            got, got_r = run(y, r, weight.to(device), EPS, out, positions=pos)
            torch.cuda.synchronize()
            transport.check_error()
            tag = f"{layout} {mode}"
            if got is not out or got_r is not r:
                return f"fused reduce-scatter {tag}: did not return (out, residual)"
            if not torch.equal(r.cpu(), r_ref):
                return f"fused reduce-scatter {tag}: residual is not the rounded sum + residual"
            problem = close_to(got.cpu(), want, dtype)
            if problem:
                return f"fused reduce-scatter {tag}: {problem}"
    return None
