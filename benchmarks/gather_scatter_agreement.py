"""gather_scatter.py --agreement: the cost of the torch.distributed path's agreement check (a fingerprint
gathered beside the rows, checked on the device: nsa_cp/transport/dist/agreement.py), the same call with it
off, on (``auto``: in the rows' NCCL group) and ``separate`` (a tiny all-gather first), side by side.

NCCL, one rank per GPU; one GPU is enough (world 1: what the check adds to a call, in launches and bytes, is
there; the link's time is not, so the ratio is also given against a reference gather time, ``--ref-ms``).
Per M and call: every variant checked once on NaN-poisoned outputs (all three bitwise equal), then timed
interleaved: each round, per variant, a GPU sleep (the host enqueues ahead), an event, the call, an event;
median over rounds of the max over ranks. Rows: off / auto / separate in ms, and auto / off - 1.
``--cpu-ranks N``: a gloo smoke run of the same (host time; the check there is the host-visible one).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Dict, List

import torch
import torch.distributed as dist

import harness

harness.part_of("gather_scatter.py", __name__)  # run as a script, it says which script to run

VARIANTS = ("off", "auto", "separate")
_SLEEP_CYCLES = 2_000_000  # ~1 ms at 2 GHz: the host has enqueued the call before the device reaches it


def _calls(nsa, world: int, m: int, hidden: int, dtype, device) -> Dict[str, tuple]:
    """name -> (layout, fn(x, y, outs) -> result tensors); world 1 pads its one rank (align) to reach the
    padded movement."""
    uneven = (nsa.ShardLayout([m] + [int(m * 0.8)] * (world - 1)) if world > 1
              else nsa.ShardLayout([m - 1], align=m))
    even = nsa.ShardLayout([m] * world)
    return {
        "ag even": (even, lambda lay, x, y: (nsa.cp_all_gather(x, lay),)),
        "ag padded": (uneven, lambda lay, x, y: (nsa.cp_all_gather(x, lay),)),
        "ag fp8": (uneven, lambda lay, x, y: nsa.cp_all_gather(x, lay, quant="fp8_e4m3_g128")),
        "rs padded": (uneven, lambda lay, x, y: (nsa.cp_reduce_scatter(y, lay),)),
    }


def _one(fn, layout, x, y, variant):
    os.environ["NSA_CP_AGREEMENT"] = variant  # read per call (the plan cache keys on it)
    return fn(layout, x, y)


def worker(rank: int, world: int, mode: str, port: int, args, out_path: str) -> None:
    device = harness.init_rank(rank, world, mode, port)
    gpu = device.type == "cuda"
    nsa = harness.import_nsa_cp()
    dtype = harness.DTYPES[args.dtype]
    rows: List[dict] = []
    for m in args.M:
        for name, (layout, fn) in _calls(nsa, world, m, args.hidden, dtype, device).items():
            g = torch.Generator(device=device).manual_seed(args.seed + m + rank)  # drawn where they are used
            sets = [(torch.randn(layout.count(rank), args.hidden, generator=g, device=device).to(dtype),
                     torch.randn(layout.padded_len, args.hidden, generator=g, device=device).to(dtype))
                    for _ in range(2)]
            results = {v: [r.clone() for r in _one(fn, layout, *sets[0], v)] for v in VARIANTS}
            same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                       for v in VARIANTS[1:] for a, b in zip(results["off"], results[v]))
            finite = all(bool(torch.isfinite(r.float()).all()) for r in results["auto"])
            for _ in range(args.warmup):
                for v in VARIANTS:
                    _one(fn, layout, *sets[0], v)
            times = {v: [] for v in VARIANTS}
            for i in range(args.rounds):
                order = VARIANTS[i % 3:] + VARIANTS[:i % 3]  # interleaved, rotating which goes first
                events = []
                for v in order:
                    if not gpu:  # the CPU smoke run (--cpu-ranks): host time
                        start = time.perf_counter()
                        _one(fn, layout, *sets[i % 2], v)
                        times[v].append((time.perf_counter() - start) * 1e3)
                        continue
                    torch.cuda._sleep(_SLEEP_CYCLES)
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    _one(fn, layout, *sets[i % 2], v)
                    end.record()
                    events.append((v, start, end))
                if gpu:
                    torch.cuda.synchronize()
                for v, start, end in events:
                    times[v].append(start.elapsed_time(end))
            medians = torch.tensor([statistics.median(times[v]) for v in VARIANTS], dtype=torch.float64,
                                   device=device)
            dist.all_reduce(medians, op=dist.ReduceOp.MAX)
            rows.append({"M": m, "call": name, **{v: float(t) for v, t in zip(VARIANTS, medians.tolist())},
                         "bitwise": same, "finite": finite, "world": world})
    if rank == 0:
        import json

        with open(out_path, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def run(args) -> None:
    """Spawn one rank per GPU (``--gpus``), print the table last."""
    import json
    import tempfile

    mode, world = ("cpu", args.cpu_ranks) if args.cpu_ranks else ("nccl", args.gpus or torch.cuda.device_count())
    if world < 1:
        raise SystemExit("--agreement: needs a CUDA GPU (NCCL), found none (--cpu-ranks N: a gloo smoke run)")
    args.M = args.M or ([2048, 8192, 32768] if mode == "nccl" else [64])
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    harness.spawn(worker, world, (mode, harness.free_port(), args, path), what="gather_scatter.py --agreement")
    with open(path) as f:
        rows = json.load(f)
    os.unlink(path)
    ref = args.ref_ms or {}
    lines = [f"agreement check cost: {mode}, world {world}, H {args.hidden}, {args.dtype}, {args.rounds} rounds "
             f"(device ms, median, max over ranks)",
             f"{'M':>6} {'call':<10} {'off':>8} {'auto':>8} {'separate':>9} {'auto/off-1':>10} {'sep/off-1':>9} "
             f"{'added us':>8} {'vs ref':>7} ok"]
    for r in rows:
        added = (r["auto"] - r["off"]) * 1e3
        vs_ref = f"{added / (ref[r['M']] * 1e3):7.1%}" if r["M"] in ref else f"{'-':>7}"
        ok = "yes" if r["bitwise"] and r["finite"] else "NO"
        lines.append(f"{r['M']:>6} {r['call']:<10} {r['off']:8.4f} {r['auto']:8.4f} {r['separate']:9.4f} "
                     f"{r['auto'] / r['off'] - 1:10.1%} {r['separate'] / r['off'] - 1:9.1%} {added:8.1f} {vs_ref} {ok}")
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("M,call,off_ms,auto_ms,separate_ms,bitwise,world\n")
            for r in rows:
                f.write(f"{r['M']},{r['call']},{r['off']},{r['auto']},{r['separate']},{r['bitwise']},{r['world']}\n")
    print("\n".join(lines), flush=True)
