"""P2P gathers inside a process group: sequences of random layouts on both engines, stress, strided rows,
the fused norm and fp8 stages, ordered destinations, and the communicator over P2P. Each check returns None
or an error text; data compared exactly (torch.equal) with an oracle from every rank's seeded inputs."""

from __future__ import annotations

import random
from typing import Optional

import torch
import torch.distributed as dist

import nsa_cp
from nsa_cp.rows import reference
from nsa_cp.geometry.wire import FORMATS

from oracles import check_sum, expected_gather, gen
from p2p_common import (
    EPS, close_to, layout_cases, norm_inputs, poison, random_layout, random_positions, run_gather, run_scatter,
)


def _gather_once(transport, layout, compact, engine, rank, hidden, dtype, seed, device):
    shards = [gen(seed, q, n, (hidden,), dtype, "cpu") for q, n in enumerate(layout.per_rank_actual_token)]
    x = shards[rank].to(device)
    poison(*transport._gathers)
    got = run_gather(transport, x, layout, compact, engine).clone()
    return got, expected_gather(shards, layout, compact)


def check_gather_sequence(transport, rank, world, device, engine, compact, calls=7, seed=0) -> Optional[str]:
    """An odd number of back-to-back gathers with random layouts, each result checked exactly."""
    rng = random.Random(seed)
    for i in range(calls):
        layout = random_layout(rng, world, transport.max_tokens_per_rank)
        got, want = _gather_once(transport, layout, compact, engine, rank, transport.hidden_size,
                                 transport.dtype, seed * 100 + i, device)
        transport.check_error()
        if not torch.equal(got.cpu(), want):
            return f"call {i} {layout}: gathered rows differ ({engine}, compact={compact})"
    return None


def check_stress(transport, rank, world, device, calls=40, seed=7) -> Optional[str]:
    """Back-to-back gathers and reduce-scatters with random layouts, engines and delays on rank 1."""
    rng = random.Random(seed)
    delay_rng = random.Random(seed + rank)
    hidden, dtype = transport.hidden_size, transport.dtype
    pending = []
    for i in range(calls):
        layout = random_layout(rng, world, transport.max_tokens_per_rank)
        compact = rng.random() < 0.5
        if rank == 1 and delay_rng.random() < 0.5:
            torch.cuda._sleep(delay_rng.randint(10_000, 2_000_000))  # this rank arrives late on the GPU
        if rng.random() < 0.5:
            shards = [gen(seed * 1000 + i, q, n, (hidden,), dtype, "cpu") for q, n in enumerate(layout.per_rank_actual_token)]
            got = run_gather(transport, shards[rank].to(device), layout, compact, rng.choice(["sm", "ce"])).clone()
            pending.append(("gather", i, layout, got, expected_gather(shards, layout, compact)))
        else:
            rows = layout.global_len(compact)
            partials = [gen(seed * 1000 + i, q, rows, (hidden,), dtype, "cpu") for q in range(world)]
            buf = transport.reduce_buffer(layout, compact)
            buf.copy_(partials[rank].to(device))
            got = run_scatter(transport, buf, layout, compact)
            start, stop = layout.rows(rank, compact)
            pending.append(("scatter", i, layout, got, [p[start:stop] for p in partials]))
    torch.cuda.synchronize()
    transport.check_error()
    for op, i, layout, got, want in pending:
        if op == "gather" and not torch.equal(got.cpu(), want):
            return f"stress call {i} (gather, {layout}) differs"
        if op == "scatter":
            problem = check_sum(got.cpu(), want, dtype)
            if problem:
                return f"stress call {i} (reduce-scatter, {layout}): {problem}"
    return None


def check_strided_rows(transport, rank, world, device, seed=31) -> Optional[str]:
    """Source rows with a row stride larger than the row (a column slice of a wider tensor, 16-byte
    aligned and not), and an output with a row stride of its own for the reduce-scatter."""
    hidden, dtype = transport.hidden_size, transport.dtype
    for i, (extra, compact) in enumerate([(8, False), (8, True), (1, False)]):
        layout = layout_cases(world, transport.max_tokens_per_rank, seed + i)[0]
        shards = [gen(seed + i, q, n, (hidden,), dtype, "cpu") for q, n in enumerate(layout.per_rank_actual_token)]
        wide = torch.full((layout.count(rank), hidden + extra), float("nan"), dtype=dtype, device=device)
        wide[:, :hidden].copy_(shards[rank].to(device))
        poison(*transport._gathers)
        got = run_gather(transport, wide[:, :hidden], layout, compact, "sm").clone()
        transport.check_error()
        if not torch.equal(got.cpu(), expected_gather(shards, layout, compact)):
            return f"gather of rows with stride {hidden + extra} (compact={compact}, {layout}) differs"
        partials = [gen(seed + 50 + i, q, layout.global_len(compact), (hidden,), dtype, "cpu") for q in range(world)]
        out_wide = torch.full((layout.count(rank), hidden + extra), float("nan"), dtype=dtype, device=device)
        run_scatter(transport, partials[rank].to(device), layout, compact, out_wide[:, :hidden])
        torch.cuda.synchronize()
        transport.check_error()
        start, stop = layout.rows(rank, compact)
        problem = check_sum(out_wide[:, :hidden].cpu(), [q[start:stop] for q in partials], dtype)
        if problem:
            return f"reduce-scatter into rows of stride {hidden + extra} (compact={compact}): {problem}"
        if layout.count(rank) and not torch.isnan(out_wide[:, hidden:].float()).all():
            return "the reduce-scatter wrote past the end of its output rows"
    return None


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
    for i, layout in enumerate(layout_cases(world, transport.max_tokens_per_rank, seed)):
        for compact in (False, True):
            with_residual = (i + compact) % 3 != 2
            wdt = weight_dtypes[(i + compact) % 2]
            xs, rs, weight, ys, r_after = norm_inputs(seed + i, layout, hidden, dtype, wdt, with_residual)
            x = xs[rank].to(device)
            r = None if rs[rank] is None else rs[rank].to(device)
            x_before = x.clone()
            poison(*transport._gathers)
            run = transport.norm_gather_runner(layout, compact, (hidden,))
            got = run(x, r, weight.to(device), EPS).clone()
            torch.cuda.synchronize()
            transport.check_error()
            tag = f"{layout} compact={compact} residual={with_residual} weight={wdt}"
            want = expected_gather(ys, layout, compact)
            problem = close_to(got.cpu(), want, dtype) or _same_on_every_rank(got)
            if problem:
                return f"norm gather {tag}: {problem}"
            if not compact:
                mask = expected_gather([torch.ones(n, hidden) for n in layout.per_rank_actual_token], layout, False) == 0
                if not torch.equal(got.cpu()[mask].float(), torch.zeros(int(mask.sum()))):
                    return f"norm gather {tag}: padding rows are not zero"
            if r is not None and not torch.equal(r.cpu(), r_after[rank]):
                return f"norm gather {tag}: the residual was not updated to x + residual rounded"
            if not torch.equal(x, x_before):
                return f"norm gather {tag}: x was written"
    return None


def _fp8_expected(rows_per_rank, layout, compact, fmt=FORMATS["fp8_e4m3_g128"]):
    """(q, scale) of the gathered rows by the format's reference quantizer; padding rows as the transport
    writes them (q = 0, the scale of a zero group)."""
    gathered = expected_gather(rows_per_rank, layout, compact)
    q, scale = fmt.quantize_reference(gathered)
    if not compact:
        real = expected_gather([torch.ones(n, 1) for n in layout.per_rank_actual_token], layout, False)[:, 0] == 1
        q.view(torch.uint8)[~real] = 0  # fp8 has no masked_fill: +0.0 is the zero byte
        scale[~real] = fmt.pad_scale
    return q, scale


def check_fp8_gather(transport, rank, world, device, seed=71) -> Optional[str]:
    """Every wire format (nsa_cp.geometry.wire.FORMATS): quantize-only (bitwise equal to the format's reference
    quantizer of the gathered rows: the same IEEE operations per element) and norm + quantize (y itself may
    differ by one ulp: scales within one ulp of the dtype, or for power-of-two scales the same or the next
    power; the dequantized values within one fp8 step)."""
    for quant in FORMATS:
        problem = _check_format_gather(transport, rank, world, device, seed, FORMATS[quant])
        if problem:
            return f"{quant}: {problem}"
    return None


def _check_format_gather(transport, rank, world, device, seed, fmt) -> Optional[str]:
    hidden, dtype, quant = transport.hidden_size, transport.dtype, fmt.name
    verdict = transport.support(nsa_cp.ShardLayout([1] * world), (hidden,), dtype, device, quant=quant)
    if not verdict:
        try:
            transport.gather_runner(nsa_cp.ShardLayout([1] * world), False, (hidden,), quant=quant)
        except ValueError as err:
            return None if verdict.reason in str(err) else f"refusal without the reason: {err}"
        return f"an fp8 gather runner was built where support() refuses ({verdict.reason})"
    for i, layout in enumerate(layout_cases(world, transport.max_tokens_per_rank, seed)):
        for compact in (False, True):
            xs, rs, weight, ys, _ = norm_inputs(seed + i, layout, hidden, dtype, dtype, True)
            tag = f"{layout} compact={compact}"
            # quantize only
            poison(*transport._gathers)
            q, scale = transport.gather_runner(layout, compact, (hidden,), quant=quant)(xs[rank].to(device))
            q, scale = q.clone(), scale.clone()
            torch.cuda.synchronize()
            transport.check_error()
            want_q, want_s = _fp8_expected(xs, layout, compact, fmt)
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
            poison(*transport._gathers)
            q, scale = transport.norm_gather_runner(layout, compact, (hidden,), quant=quant)(
                xs[rank].to(device), r, weight.to(device), EPS)
            q, scale = q.clone().cpu(), scale.clone().cpu()
            torch.cuda.synchronize()
            transport.check_error()
            want_q, want_s = _fp8_expected(ys, layout, compact, fmt)
            rtol = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10, torch.float32: 1e-5}[dtype]
            if not torch.isfinite(scale).all():
                return f"norm + fp8 gather {tag}: scales that are not finite"
            if fmt.pow2_scales:
                ratio = scale / want_s
                if not ((ratio == 1) | (ratio == 2) | (ratio == 0.5)).all():
                    return f"norm + fp8 gather {tag}: power-of-two scales more than one power from the reference"
            elif ((scale - want_s).abs() > rtol * want_s.abs() * 2).any():
                return f"norm + fp8 gather {tag}: scales beyond {2 * rtol} relative"
            rows, groups = q.shape[0], hidden // fmt.group
            dq = (q.float().view(rows, groups, fmt.group) * scale[..., None]).view(rows, hidden)
            wq = (want_q.float().view(rows, groups, fmt.group) * want_s[..., None]).view(rows, hidden)
            step = (2 ** -7) * torch.maximum(scale, want_s).repeat_interleave(fmt.group, dim=1)
            if ((dq - wq).abs() > 0.125 * wq.abs() + step).any():
                return f"norm + fp8 gather {tag}: dequantized values more than one fp8 step from the reference"
    return None




def check_ordered(transport, rank, world, device, seed=81) -> Optional[str]:
    """Ordered gather (plain and fused norm) and ordered reduce-scatter: compact row i lands at batch row
    positions[i]; rank r sums rows positions[offsets[r] + i]. Exact movement, fp64 sums."""
    hidden, dtype = transport.hidden_size, transport.dtype
    norm_ok = bool(transport.support(nsa_cp.ShardLayout([1] * world), (hidden,), dtype, device, norm=True))
    for i, layout in enumerate(layout_cases(world, transport.max_tokens_per_rank, seed)):
        total = layout.total_len
        pos = random_positions(seed + i, total, device)
        xs, rs, weight, ys, _ = norm_inputs(seed + i, layout, hidden, dtype, dtype, True)
        inverse_order = torch.empty(total, dtype=torch.int64)
        inverse_order[pos.cpu()] = torch.arange(total)
        poison(*transport._gathers)
        got = transport.gather_runner(layout, True, (hidden,), ordered=True)(xs[rank].to(device), positions=pos).clone()
        torch.cuda.synchronize()
        transport.check_error()
        want = torch.cat(xs)[inverse_order] if total else torch.empty((0, hidden), dtype=dtype)
        if tuple(got.shape) != (total, hidden) or not torch.equal(got.cpu(), want):
            return f"ordered gather {layout}: rows differ from batch order"
        if norm_ok:
            poison(*transport._gathers)
            run = transport.norm_gather_runner(layout, True, (hidden,), ordered=True)
            got = run(xs[rank].to(device), rs[rank].to(device), weight.to(device), EPS, positions=pos).clone()
            torch.cuda.synchronize()
            transport.check_error()
            want = torch.cat(ys)[inverse_order] if total else torch.empty((0, hidden), dtype=dtype)
            problem = close_to(got.cpu(), want, dtype)
            if problem:
                return f"ordered norm gather {layout}: {problem}"
        partials = [gen(seed + 90 + i, q, total, (hidden,), dtype, "cpu") for q in range(world)]
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
        problem = check_sum(out.cpu(), [p[mine] for p in partials], dtype)
        if problem:
            return f"ordered reduce-scatter {layout}: {problem}"
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
        h = gen(seed, rank, counts[rank], (hidden,), dtype, device)
        r = gen(seed + 1, rank, counts[rank], (hidden,), dtype, device)
        local, _ = comm.prepare_mlp(h, r.clone(), None)  # the residual is updated in place
        shards = [None] * world
        dist.all_gather_object(shards, local.cpu())
        want = expected_gather(shards, layout, compact)
        poison(*transport._gathers)
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
        problem = check_sum(out.cpu(), [got[start:stop] * (q + 1) for q in range(world)], dtype)
        if problem:
            return f"communicator reduce-scatter ({layout}, compact={compact}): {problem}"
    return None
