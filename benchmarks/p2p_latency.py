"""Where the microseconds of a small P2P gather go (2 GPUs): the sync floor against the push.

    python benchmarks/p2p_latency.py [--M 256] [--rounds 50]

Times on the device (CUDA events; the GPU sleeps first so the host has enqueued the whole round; methods
interleaved; median over rounds, max over ranks), for bf16 rows of 7168:
  * one-block barrier pair (entry + done): the cross-GPU signalling alone;
  * the gather kernel with zero rows (device counts 0): launch + geometry + both barriers at full grid;
  * the gather of M rows per rank at several grid sizes (the transport's choice marked);
  * NCCL's even all-gather of M rows, for scale.
A diagnostic for the small-size latency target, not part of the results tables.
"""

import argparse
import statistics

import torch
import torch.distributed as dist

from _ranks import init_nccl_rank, spawn_ranks


HIDDEN = 7168


def worker(rank, world, args):
    init_nccl_rank(rank, world, args.store)
    import nsa_cp

    m = args.M
    transport = nsa_cp.init_p2p(None, m, HIDDEN, torch.bfloat16)
    layout = nsa_cp.ShardLayout([m] * world)
    x = torch.randn(m, HIDDEN, device="cuda").bfloat16()
    out = torch.empty(world * m, HIDDEN, device="cuda", dtype=torch.bfloat16)
    zeros = (torch.zeros(world, dtype=torch.int32, device="cuda"),  # compact counts and offsets: all 0
             torch.zeros(world, dtype=torch.int32, device="cuda"))
    chosen = transport._blocks(m * transport._row_bytes * world)
    default_blocks = transport._blocks

    def pair():
        pads, channel, seq, arrive, timeout, err = transport._signal_args(0)
        stream = torch.cuda.current_stream().cuda_stream
        transport._C.barrier(pads, rank, world, channel, 0, seq, False, timeout, err, stream)
        transport._C.barrier(pads, rank, world, channel, 1, seq, True, timeout, err, stream)

    def gather_with(blocks, device_counts=None):
        def call():
            transport._blocks = (lambda total: blocks) if blocks else default_blocks
            transport.all_gather(x, layout, compact=True, engine="sm", device_counts=device_counts)
        return call

    methods = {"barrier pair, 1 block": pair,
               f"gather 0 rows, {chosen} blocks": gather_with(None, zeros)}
    for blocks in sorted({8, 16, 33, 66, chosen, 2 * chosen}):
        methods[f"gather {m} rows, {blocks} blocks" + (" (chosen)" if blocks == chosen else "")] = gather_with(blocks)
    methods[f"NCCL even all-gather, {m} rows"] = lambda: dist.all_gather_into_tensor(out, x)

    names = list(methods)
    samples = {n: [] for n in names}
    for r in range(args.warmup + args.rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        dist.barrier()
        torch.cuda._sleep(2_000_000 * len(order))
        events = []
        for name in order:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            methods[name]()
            stop.record()
            events.append((name, start, stop))
        torch.cuda.synchronize()
        transport.check_error()
        if r >= args.warmup:
            for name, start, stop in events:
                samples[name].append(start.elapsed_time(stop) * 1e3)
    medians = torch.tensor([statistics.median(samples[n]) for n in names], dtype=torch.float64, device="cuda")
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"device microseconds, median of {args.rounds} rounds, max over {world} ranks "
              f"(M={m}, H={HIDDEN}, bf16, {m * HIDDEN * 2 / 1e6:.2f} MB pushed to each peer)")
        for name, us in zip(names, medians.tolist()):
            print(f"  {name:<40}{us:8.1f}")
    transport._blocks = default_blocks
    nsa_cp.destroy_p2p(None)
    dist.barrier()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--M", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    spawn_ranks(worker, parser.parse_args(), "p2p_latency.py", min_gpus=2)


if __name__ == "__main__":
    main()
