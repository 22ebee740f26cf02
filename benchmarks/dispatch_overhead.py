"""Host cost of the torch.library dispatcher that eager calls skip (nsa_cp/ops.py's eager bypass).

    python benchmarks/dispatch_overhead.py [--worlds 1 2] [--M 64] [--H 128] [--calls 2000] [--rounds 10]

Per call, host microseconds (perf_counter), of:

* ``eager``: ``nsa_cp.cp_all_gather(x, layout, group)``, what eager code calls (one
  ``torch.compiler.is_compiling()`` check, then the direct path);
* ``op body``: the custom op's Python implementation called without the dispatcher (argument conversion:
  layout cache lookup, group resolution, the no-alias check);
* ``dispatcher``: ``torch.ops.nsa_cp.cp_all_gather(...)``, what a compiled graph runs per call.

Same for cp_reduce_scatter; for an "empty" layout (every rank 0 rows: nothing communicates, so the
rows show host cost alone) and an uneven one (counts [M, 0.8 M, ...]). Methods are interleaved within each round, one barrier per round; the
median over all calls, then the MAX over ranks. CUDA GPUs (>= 2) run NCCL with bf16 (syncing every 20
calls so the queue never blocks the host); otherwise gloo on CPU with fp32.
"""

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank, world, args, queue):
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    store = dist.FileStore(args.store, world)
    kwargs = {"device_id": torch.device("cuda", rank)} if cuda else {}
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=world, **kwargs)
    import nsa_cp
    from nsa_cp import ops

    group = dist.group.WORLD
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    m = args.M
    gather_body = ops._cp_all_gather._init_fn  # the undecorated implementations (no dispatcher)
    scatter_body = ops._cp_reduce_scatter._init_fn
    methods = {("is_compiling()", "eager"): torch.compiler.is_compiling}
    # "empty": every rank holds 0 rows, so no call communicates: host cost alone, no collective noise
    for kind, counts in (("empty", [0] * world), ("uneven", [m] + [int(m * 0.8)] * (world - 1))):
        layout = nsa_cp.ShardLayout(counts)
        x = torch.randn(counts[rank], args.H, device=device, dtype=dtype)
        y = torch.randn(layout.padded_len, args.H, device=device, dtype=dtype)
        a = (counts, 1, group.group_name, rank, False, "auto", "auto", None, None, None)
        methods.update({
            (f"cp_all_gather {kind}", "eager"): lambda x=x, layout=layout: nsa_cp.cp_all_gather(x, layout, group),
            (f"cp_all_gather {kind}", "op body"): lambda x=x, a=a: gather_body(x, *a),
            (f"cp_all_gather {kind}", "dispatcher"): lambda x=x, a=a: torch.ops.nsa_cp.cp_all_gather(x, *a),
            (f"cp_reduce_scatter {kind}", "eager"): lambda y=y, layout=layout: nsa_cp.cp_reduce_scatter(y, layout, group),
            (f"cp_reduce_scatter {kind}", "op body"): lambda y=y, a=a: scatter_body(y, *a),
            (f"cp_reduce_scatter {kind}", "dispatcher"): lambda y=y, a=a: torch.ops.nsa_cp.cp_reduce_scatter(y, *a),
        })
    samples = {key: [] for key in methods}
    for fn in methods.values():  # warm-up: caches, first launches
        for _ in range(20):
            fn()
    for _ in range(args.rounds):
        for key, fn in methods.items():
            dist.barrier()
            for i in range(args.calls // args.rounds):
                t0 = time.perf_counter()
                fn()
                samples[key].append((time.perf_counter() - t0) * 1e6)
                if cuda and i % 20 == 19:
                    torch.cuda.synchronize()
            if cuda:
                torch.cuda.synchronize()
    medians = {key: statistics.median(v) for key, v in samples.items()}
    gathered = [None] * world
    dist.all_gather_object(gathered, medians)
    if rank == 0:
        queue.put({key: max(g[key] for g in gathered) for key in medians})
    dist.barrier()
    dist.destroy_process_group()


def run(world, args):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    args.store = os.path.join(tempfile.mkdtemp(), "store")
    procs = [ctx.Process(target=worker, args=(r, world, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    result = queue.get(timeout=600)
    for p in procs:
        p.join()
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=None)
    parser.add_argument("--M", type=int, default=None, help="rows on rank 0 (others 0.8 M)")
    parser.add_argument("--H", type=int, default=None)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    args.device = "cuda" if gpus >= 2 else "cpu"
    worlds = args.worlds or ([2] if args.device == "cuda" else [1, 2])
    args.M = args.M or (256 if args.device == "cuda" else 64)
    args.H = args.H or (7168 if args.device == "cuda" else 128)
    dtype = "bf16" if args.device == "cuda" else "fp32"
    print(f"torch {torch.__version__}, {args.device} ({'NCCL' if args.device == 'cuda' else 'gloo'}), "
          f"M={args.M}, H={args.H}, {dtype}; host us per call, median of {args.calls}, max over ranks")
    print(f"{'world':>5}  {'call (layout)':<26}{'eager':>9}{'op body':>10}{'dispatcher':>12}{'dispatcher - eager':>20}")
    for world in worlds:
        r = run(world, args)
        for kind in ("empty", "uneven"):
            for op in ("cp_all_gather", "cp_reduce_scatter"):
                call = f"{op} {kind}"
                eager, body, disp = r[(call, "eager")], r[(call, "op body")], r[(call, "dispatcher")]
                print(f"{world:>5}  {call:<26}{eager:9.1f}{body:10.1f}{disp:12.1f}{disp - eager:20.1f}")
        print(f"{world:>5}  {'is_compiling()':<26}{r[('is_compiling()', 'eager')]:9.2f}  (the bypass check itself)")


if __name__ == "__main__":
    main()
