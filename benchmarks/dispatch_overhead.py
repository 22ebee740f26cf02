"""Host cost of the torch.library dispatcher that eager calls skip (nsa_cp/api/ops.py's eager bypass).

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
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402


def op_arguments(op, x, counts, group, rank):
    """The custom op's positional arguments, by name from its schema: a parameter this script does not
    know fails here, naming it, instead of a TypeError deep in the timing loop."""
    known = {"counts": counts, "align": 1, "group_name": group.group_name, "rank": rank, "compact": False,
             "algo": "auto", "backend": "auto", "validate": None, "device_counts": None, "device_offsets": None,
             "positions": None}
    names = [a.name for a in op.default._schema.arguments][1:]  # after the tensor
    missing = [n for n in names if n not in known]
    if missing:
        raise SystemExit(f"dispatch_overhead.py: the op takes {missing}, which this script does not set; update "
                         f"op_arguments")
    return tuple(known[n] for n in names)


def worker(rank, world, args, result_path):
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    store = dist.FileStore(args.store, world)
    kwargs = {"device_id": torch.device("cuda", rank)} if cuda else {}
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=world, **kwargs)
    import nsa_cp
    from nsa_cp.api import ops

    group = dist.group.WORLD
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    m = args.M
    gather_body = ops.body("cp_all_gather")  # the implementations without the dispatcher
    scatter_body = ops.body("cp_reduce_scatter")
    methods = {("is_compiling()", "eager"): torch.compiler.is_compiling}
    # "empty": every rank holds 0 rows, so no call communicates: host cost alone, no collective noise
    for kind, counts in (("empty", [0] * world), ("uneven", [m] + [int(m * 0.8)] * (world - 1))):
        layout = nsa_cp.ShardLayout(counts)
        x = torch.randn(counts[rank], args.H, device=device, dtype=dtype)
        y = torch.randn(layout.padded_len, args.H, device=device, dtype=dtype)
        a = op_arguments(torch.ops.nsa_cp.cp_all_gather, x, counts, group, rank)
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
        with open(result_path, "w") as f:  # keys "method|row"
            json.dump({"|".join(key): max(g[key] for g in gathered) for key in medians}, f)
    dist.barrier()
    dist.destroy_process_group()


def run(world, args):
    """One world's medians; harness.spawn ends the run at the first failing rank, with its traceback."""
    tmp = tempfile.mkdtemp()
    args.store = os.path.join(tmp, "store")
    result_path = os.path.join(tmp, "result.json")
    harness.spawn(worker, world, (args, result_path), what=f"dispatch_overhead.py (world {world})")
    with open(result_path) as f:
        result = {tuple(k.split("|")): v for k, v in json.load(f).items()}
    for name in os.listdir(tmp):
        os.unlink(os.path.join(tmp, name))
    os.rmdir(tmp)
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
    if args.device == "cpu":
        print(f"*** {harness.SMOKE} (host times of the CPU path) ***")
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
    harness.run_main(main)
