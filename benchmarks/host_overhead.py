"""Host-side cost of one call (Python + launches), per piece, on 2 GPUs (or 1): where do the microseconds go?

    python benchmarks/host_overhead.py [--M 256] [--calls 300]

Times (perf_counter, median of --calls rounds that call every piece once, in turn) the public calls
and their pieces: the input checks, the pack and compact launches (Triton and native), the bare NCCL
collective, the checks and backend choice alone (data movement stubbed out); then prints a
cProfile of the uneven padded gather; with 2+ GPUs and nsa_cp._C the same for the P2P backend (rows
"P2P: ..."). Numbers are host microseconds, not device time. With one GPU the
group has one rank (the layout is made uneven by align padding): the validation all-reduce then has no
peer, so its row is a lower bound of the cost on 2 GPUs.
"""

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch
import torch.distributed as dist

from _ranks import init_nccl_rank, spawn_ranks


def _interleaved_medians_us(pieces, calls):
    """Median host microseconds of every piece over ``calls`` rounds that call each piece once, in
    turn: drift of the machine during the run (seen at up to 2x between runs, runs 25-27) and the code
    that ran just before reach every piece alike, so rows compare within a run. The GPU is synced every
    5 rounds, outside the timed calls, so no launch queue fills."""
    samples = {name: [] for name in pieces}
    for i in range(calls):
        for name, fn in pieces.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append((time.perf_counter() - t0) * 1e6)
        if i % 5 == 4:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return {name: statistics.median(s) for name, s in samples.items()}


def _time_and_profile(pieces, profiled, calls):
    """Median host microseconds of every piece (after 5 warm-up calls each, interleaved), then a
    cProfile of ``calls`` calls of ``profiled``."""
    for fn in pieces.values():
        for _ in range(5):
            fn()
    torch.cuda.synchronize()
    results = _interleaved_medians_us(pieces, calls)
    prof = cProfile.Profile()
    prof.enable()
    for i in range(calls):
        profiled()
        if i % 20 == 19:
            torch.cuda.synchronize()
    prof.disable()
    torch.cuda.synchronize()
    return results, prof


def _flags_setitem(world, rank, device):
    flags = torch.zeros(2 + world, dtype=torch.int64, device=device)
    flags[0] = 1
    flags[1] = -1
    flags[2 + rank] = 0
    return flags


def _pack_and_gather(x, layout, rank, collectives, torch_pack=False):
    """What the uneven padded gather does, without the API around it (checks, backend choice); with
    ``torch_pack`` the slot is filled by two torch kernels (copy_, zero_) instead of nsa_cp's pack."""
    out = x.new_empty((layout.padded_len, *x.shape[1:]))
    if not torch_pack:
        collectives._gather_padded(x, layout, rank, out, None, None)
        return out
    m, n = layout.max_rank_len, x.shape[0]
    slot = out[rank * m:(rank + 1) * m]
    slot[:n].copy_(x)
    slot[n:].zero_()
    collectives.nccl.all_gather_equal(out, slot, None)
    return out


def _wrapper_only(collectives, call):
    """``call`` with the data movement of cp_all_gather replaced by nothing: what the API's checks and
    backend choice cost on their own."""

    def run():
        moved, collectives._all_gather = collectives._all_gather, lambda *a, **k: None
        try:
            call()
        finally:
            collectives._all_gather = moved

    return run


def _p2p_pieces(nsa_cp, layout, x, out, rank, world, m, h, args, results):
    """The P2P backend's pieces (2+ GPUs with nsa_cp._C): the public call, the transport's own call and
    its host steps; adds rows to ``results`` and returns a cProfile of the public call (or None)."""
    from nsa_cp import _native

    if world < 2 or not _native.available():
        return None
    transport = nsa_cp.init_p2p(None, m, h, torch.bfloat16)
    from nsa_cp import collectives, envs

    stream_of = lambda: torch.cuda.current_stream(transport.device).cuda_stream  # noqa: E731
    raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    index = transport.device.index
    flat = transport._gather.view(-1)
    rows = transport._gather.view(-1, h)
    pieces = {
        "P2P: cp_all_gather padded uneven": lambda: nsa_cp.cp_all_gather(x, layout),
        "P2P: cp_all_gather padded uneven, out=": lambda: nsa_cp.cp_all_gather(x, layout, out=out),
        "P2P: transport.all_gather (sm)": lambda: transport.all_gather(x, layout, compact=False, engine="sm"),
        "P2P:   check_error": transport.check_error,
        "P2P:   check_fits": lambda: transport.check_fits("x", x, layout),
        "P2P:   current_stream().cuda_stream": stream_of,
        "P2P:   result view": lambda: transport._view(transport._gather, layout, False, x.shape[1:]),
        "P2P:   wrapper only (checks, choice)": _wrapper_only(collectives, lambda: nsa_cp.cp_all_gather(x, layout)),
        "P2P:   select_p2p_transport": lambda: collectives.select_p2p_transport("auto", None, "x", x, layout),
        "P2P:   transport.fits": lambda: transport.fits(x, layout),
        "P2P:   choose_engine": lambda: transport.choose_engine("auto", layout),
        "P2P:   envs.NSA_CP_BACKEND": lambda: envs.NSA_CP_BACKEND,
        "P2P:   torch.compiler.is_compiling": torch.compiler.is_compiling,
        "P2P:   raw stream (torch._C)": (lambda: raw_stream(index)) if raw_stream else (lambda: None),
        "P2P:   _native.current_stream": lambda: _native.current_stream(transport.device),
        "P2P:   flat[:n].view(rows, h)": lambda: flat[: layout.padded_len * h].view(layout.padded_len, h),
        "P2P:   rows[:n] (2-D buffer)": lambda: rows[: layout.padded_len],
        "P2P:   x.reshape + stride check": lambda: x.reshape(x.shape[0], h).stride(1) != 1,
        "P2P:   read_u32 (minimal pybind)": lambda: transport._C.read_u32(transport._err_host, 0),
        "P2P: cp_all_gather padded uneven (again)": lambda: nsa_cp.cp_all_gather(x, layout),
    }
    timed, prof = _time_and_profile(pieces, lambda: nsa_cp.cp_all_gather(x, layout), args.calls)
    results.update(timed)
    nsa_cp.destroy_p2p(None)
    return prof


def worker(rank, world, args):
    init_nccl_rank(rank, world, args.store)
    import nsa_cp
    from nsa_cp import collectives, validation
    from nsa_cp import _native
    from nsa_cp.kernels import compact, pack
    from nsa_cp.transport import nccl

    m, h = args.M, 7168
    if world == 1:  # one rank: padding comes from align, so the pack kernel and the uneven path still run
        counts, layout = [int(m * 0.8)], nsa_cp.ShardLayout([int(m * 0.8)], align=m)
    else:
        counts = [m, int(m * 0.8)] + [m] * (world - 2)
        layout = nsa_cp.ShardLayout(counts)
    even = nsa_cp.ShardLayout([m] * world)
    x = torch.randn(counts[rank], h, device="cuda").bfloat16()
    xe = torch.randn(m, h, device="cuda").bfloat16()
    out = torch.empty(layout.padded_len, h, device="cuda", dtype=torch.bfloat16)
    slot = out[rank * m:(rank + 1) * m]
    count = layout.device_tensors(x.device)[0][rank]
    flags = torch.zeros(2 + world, dtype=torch.int64, device=x.device)
    out_cmp = torch.empty(layout.total_len, h, device="cuda", dtype=torch.bfloat16)
    native = _native.available()
    skip = lambda: None  # noqa: E731  (rows that need nsa_cp._C, without it: ~0)
    pieces = {
        "cp_all_gather padded uneven": lambda: nsa_cp.cp_all_gather(x, layout),
        "cp_all_gather even": lambda: nsa_cp.cp_all_gather(xe, even),
        "cp_all_gather uneven, validate=True": lambda: nsa_cp.cp_all_gather(x, layout, validate=True),
        "cp_all_gather padded uneven, out=": lambda: nsa_cp.cp_all_gather(x, layout, out=out),
        "new_empty + pack + bare all_gather": lambda: _pack_and_gather(x, layout, rank, collectives),
        "cp_reduce_scatter padded uneven": lambda: nsa_cp.cp_reduce_scatter(out, layout),
        "wrapper only (checks, choice)": _wrapper_only(collectives, lambda: nsa_cp.cp_all_gather(x, layout)),
        "x.new_empty([P*M, H])": lambda: x.new_empty((layout.padded_len, h)),
        "pack launch, Triton": lambda: pack.pack_into_slot(x, slot, count, impl="triton"),
        "pack launch, native (_C)": (lambda: pack.pack_into_slot(x, slot, count, impl="native")) if native else skip,
        "compact launch, Triton": lambda: compact.padded_to_compact(out, layout, out_cmp, impl="triton"),
        "compact launch, native (_C)": (lambda: compact.padded_to_compact(out, layout, out_cmp, impl="native")) if native else skip,
        "new_empty + torch copy_/zero_ + bare AG": lambda: _pack_and_gather(x, layout, rank, collectives, torch_pack=True),
        "torch copy_+zero_ (2 kernels)": lambda: (slot[: counts[rank]].copy_(x), slot[counts[rank]:].zero_()),
        "bare all_gather_single": lambda: nccl.all_gather_equal(out, slot, None),
        "F.pad + all_gather": lambda: nccl.all_gather_equal(out, torch.nn.functional.pad(x, (0, 0, 0, m - counts[rank])), None),
        "group_rank_and_size": lambda: nccl.group_rank_and_size(None),
        "input checks": lambda: (collectives._check_layout(layout, world), collectives._check_input("x", x, counts[rank], "rows"), collectives._check_out(out, out.shape, x)),
        "device_tensors lookup": lambda: layout.device_tensors(x.device)[0][rank],
        # the pieces of validate=True (nsa_cp/validation.py): what one agreement costs on the host
        "validation.agree alone": lambda: validation.agree("cp_all_gather", layout, None, rank, world, x.device, None, "sig"),
        "  flags: zeros + 3 setitems": lambda: _flags_setitem(world, rank, x.device),
        "  flags: host list, one copy": lambda: torch.tensor([1, -1] + [0] * world, dtype=torch.int64).to(x.device),
        "  all_reduce int64[2+P]": lambda: dist.all_reduce(flags, op=dist.ReduceOp.MAX),
        "  .tolist() of int64[2+P]": lambda: flags.tolist(),
        # the first row again, last: a control (two identical rows differ by the noise of the run)
        "cp_all_gather padded uneven (again)": lambda: nsa_cp.cp_all_gather(x, layout),
    }
    results, prof = _time_and_profile(pieces, lambda: nsa_cp.cp_all_gather(x, layout), args.calls)
    p2p_prof = _p2p_pieces(nsa_cp, layout, x, out, rank, world, m, h, args, results)
    if rank == 0:
        print(f"host microseconds per call, median of {args.calls} (M={m}, H={h}, bf16, {world} rank(s), {layout})")
        for name, us in results.items():
            print(f"  {name:<34}{us:9.1f}")
        stream = io.StringIO()
        pstats.Stats(prof, stream=stream).sort_stats("tottime").print_stats(18)
        pstats.Stats(prof, stream=stream).sort_stats("cumulative").print_stats(25)
        print(stream.getvalue()[-9000:])
        if p2p_prof is not None:
            stream = io.StringIO()
            pstats.Stats(p2p_prof, stream=stream).sort_stats("cumulative").print_stats(25)
            print("cProfile of cp_all_gather on the P2P backend (auto):")
            print(stream.getvalue()[-6000:])
    dist.barrier()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--M", type=int, default=256)
    parser.add_argument("--calls", type=int, default=300)
    spawn_ranks(worker, parser.parse_args(), "host_overhead.py", min_gpus=1)


if __name__ == "__main__":
    main()
