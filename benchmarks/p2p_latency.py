"""Where the microseconds of a small P2P gather go (2 GPUs): the sync floor against the push.

    python benchmarks/p2p_latency.py [--M 256 [1024 ...]] [--rounds 50] [--cold 16] [--align]

Times on the device (CUDA events; the GPU sleeps first so the host has enqueued the whole round; methods
interleaved; median over rounds, max over ranks), for bf16 rows of 7168:
  * an empty kernel between two events: the floor of any method here;
  * one one-block barrier (one signal round trip), and a pair of them (entry + done);
  * the gather kernel with zero rows (device counts 0): launch + geometry + the barriers at full grid,
    on a single-buffered transport (entry wait every call) and a double-buffered one (no entry wait);
  * the gather of M rows per rank, single- and double-buffered, at the native state's grid size;
  * the double-buffered gather of counts [M, 0.8M] (the benchmark's), padded and compact;
  * NCCL's even all-gather of M rows, for scale.
``--cold K`` gives every data call the next of K source tensors (NCCL also the next of K outputs), so
that a call's source was last read K calls ago and is no longer in L2, as in gather_scatter.py's rotating buffer sets;
``--align`` releases the ranks together before every method with the transport's one-block barrier
(untimed), as gather_scatter.py does. Without them the source stays hot and each method inherits the
skew its predecessor leaves.
A diagnostic for the small-size latency target, not part of the results tables.
"""

import argparse
import statistics

import torch
import torch.distributed as dist

import harness
from harness import init_nccl_rank, spawn_ranks


HIDDEN = 7168


def worker(rank, world, args):
    init_nccl_rank(rank, world, args.store)
    for m in args.M:
        measure(rank, world, m, args)
    dist.barrier()
    dist.destroy_process_group()


def measure(rank, world, m, args):
    import nsa_cp
    from nsa_cp.transport import p2p

    double = nsa_cp.init_p2p(None, m, HIDDEN, torch.bfloat16, double_buffer_tokens=m)
    single = p2p.P2PTransport(None, m, HIDDEN, torch.bfloat16, double_buffer_tokens=0)
    layout = nsa_cp.ShardLayout([m] * world)
    sources = [torch.randn(m, HIDDEN, device="cuda").bfloat16() for _ in range(max(1, args.cold))]
    outs = [torch.empty(world * m, HIDDEN, device="cuda", dtype=torch.bfloat16) for _ in range(max(1, args.cold))]
    turn = [0]  # calls so far: every data call takes the next source, so it was last read K calls ago

    def x():
        turn[0] += 1
        return sources[turn[0] % len(sources)]

    def nccl_gather():
        src = x()
        dist.all_gather_into_tensor(outs[turn[0] % len(outs)], src)

    zeros = (torch.zeros(world, dtype=torch.int32, device="cuda"),  # compact counts and offsets: all 0
             torch.zeros(world, dtype=torch.int32, device="cuda"))

    def barriers(count):
        def call():  # the transport's one-block barrier: one signal round trip each
            for _ in range(count):
                double.barrier()
        return call

    def gather_with(transport, device_counts=None, on=layout, compact=True):
        run, n = transport.gather_runner(on, compact, (HIDDEN,), engine="sm"), on.count(rank)

        def call():  # the grid size is the native state's choice (every SM from 4 MB up)
            run(x()[:n], device_counts)
        return call

    methods = {
        "empty kernel": lambda: torch.cuda._sleep(0),
        "one barrier, 1 block": barriers(1),
        "barrier pair, 1 block": barriers(2),
        "gather 0 rows, single buffer": gather_with(single, zeros),
        "gather 0 rows, double buffer": gather_with(double, zeros),
        f"gather {m} rows, single": gather_with(single),
        f"gather {m} rows, double": gather_with(double),
    }
    uneven = nsa_cp.ShardLayout([m] + [round(0.8 * m)] * (world - 1))  # the benchmark's counts [M, 0.8M]
    methods[f"gather [{m}, {round(0.8 * m)}] padded, double"] = gather_with(double, None, uneven, False)
    methods[f"gather [{m}, {round(0.8 * m)}] compact, double"] = gather_with(double, None, uneven, True)
    methods[f"NCCL even all-gather, {m} rows"] = nccl_gather

    names = list(methods)
    samples = {n: [] for n in names}
    for r in range(args.warmup + args.rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        dist.barrier()
        torch.cuda._sleep(2_000_000 * len(order))
        events = []
        for name in order:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if args.align:
                double.barrier()
            start.record()
            methods[name]()
            stop.record()
            events.append((name, start, stop))
        torch.cuda.synchronize()
        single.check_error()
        double.check_error()
        if r >= args.warmup:
            for name, start, stop in events:
                samples[name].append(start.elapsed_time(stop) * 1e3)
    medians = torch.tensor([statistics.median(samples[n]) for n in names], dtype=torch.float64, device="cuda")
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    if rank == 0:
        setting = (f"sources rotated among {args.cold}" if args.cold > 1 else "one hot source") + (
            ", ranks aligned before each method" if args.align else "")
        print(f"device microseconds, median of {args.rounds} rounds, max over {world} ranks "
              f"(M={m}, H={HIDDEN}, bf16, {m * HIDDEN * 2 / 1e6:.2f} MB pushed to each peer; {setting})")
        for name, us in zip(names, medians.tolist()):
            print(f"  {name:<48}{us:8.1f}")
    single.close()
    nsa_cp.transport.destroy_p2p(None)
    dist.barrier()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--M", type=int, nargs="+", default=[256])
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--cold", type=int, default=1, help="rotate among this many sources (1: one hot source)")
    parser.add_argument("--align", action="store_true", help="release the ranks together before every method")
    spawn_ranks(worker, parser.parse_args(), "p2p_latency.py", min_gpus=2)


if __name__ == "__main__":
    harness.run_main(main)
