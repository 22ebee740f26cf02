"""What the P2P call fingerprint costs: the same gathers and reduce-scatters on two transports of one group,
``check_layout=True`` and ``False``, interleaved round by round, medians.

Per call: device time (CUDA events around a batch of back-to-back calls, divided by the batch) and host
time (the enqueueing of that batch, perf_counter, divided by the batch). World 1 is one rank on its GPU;
at worlds 2+ on a machine with fewer GPUs the ranks share GPU 0 (gloo + CUDA IPC), which time-slices
their kernels: the device figure there is the total work of the group per call, not a call's latency.

    python3 scripts/p2p_fingerprint_cost.py --worlds 1 2 --M 16 256 --rounds 15 --calls 50
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def _bench(rank: int, world: int, payload: dict):
    import torch
    import torch.distributed as dist

    import nsa_cp
    from dist_harness import rank_device
    from nsa_cp.transport import p2p

    device = rank_device(rank)
    torch.cuda.set_device(device)
    hidden, calls, rounds = payload["hidden"], payload["calls"], payload["rounds"]
    transports = {on: p2p.P2PTransport(None, max(payload["M"]), hidden, torch.bfloat16, device, timeout_ms=60_000,
                                       check_layout=on) for on in (True, False)}
    rows = []
    for m in payload["M"]:
        layout = nsa_cp.ShardLayout([m - (q % 2) * (m // 5) for q in range(world)])
        x = torch.randn(layout.count(rank), hidden, device=device).bfloat16()
        runs = {}
        for on, t in transports.items():
            buf = t.reduce_buffer(layout, True)
            buf.copy_(torch.randn(buf.shape, device=device).bfloat16())
            runs[("gather", on)] = (lambda g=t.gather_runner(layout, True, (hidden,), engine="sm"): g(x))
            runs[("scatter", on)] = (lambda s=t.reduce_scatter_runner(layout, True, (hidden,)), b=buf: s(b))
        samples = {k: ([], []) for k in runs}
        for r in range(rounds + 2):  # two warm-up rounds
            order = list(runs) if r % 2 == 0 else list(reversed(list(runs)))
            for key in order:
                run = runs[key]
                torch.cuda.synchronize()
                dist.barrier()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                h0 = time.perf_counter()
                for _ in range(calls):
                    run()
                h1 = time.perf_counter()
                end.record()
                end.synchronize()
                if r >= 2:
                    samples[key][0].append(start.elapsed_time(end) * 1000 / calls)
                    samples[key][1].append((h1 - h0) * 1e6 / calls)
        for t in transports.values():
            t.check_error()
        for op in ("gather", "scatter"):
            dev = {on: statistics.median(samples[(op, on)][0]) for on in (True, False)}
            host = {on: statistics.median(samples[(op, on)][1]) for on in (True, False)}
            rows.append((m, op, dev[False], dev[True], host[False], host[True]))
    for t in transports.values():
        t.close()
    return {"rows": rows}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--M", type=int, nargs="+", default=[16, 256])
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=50)
    args = ap.parse_args()
    import torch

    from dist_harness import run_world

    gpus = torch.cuda.device_count()
    print(f"{torch.cuda.get_device_name(0)} x{gpus}, torch {torch.__version__}, hidden {args.hidden} bf16, compact, "
          f"{args.calls} calls per sample, {args.rounds} rounds interleaved, medians; max over ranks")
    print("world  M      op       dev us off  dev us on  ratio   host us off  host us on  ratio")
    for world in args.worlds:
        backend = "nccl" if world <= gpus else "gloo-shared-gpu"
        payload = {"M": args.M, "hidden": args.hidden, "calls": args.calls, "rounds": args.rounds}
        per_rank = run_world(world, backend, _bench, payload, timeout_s=600)
        for i, (m, op, d0, d1, h0, h1) in enumerate(per_rank[0]["rows"]):
            d0, d1, h0, h1 = (max(r["rows"][i][k] for r in per_rank) for k in (2, 3, 4, 5))
            shared = " (shared GPU: total work)" if backend != "nccl" and world > 1 else ""
            print(f"{world:<6} {m:<6} {op:<8} {d0:10.2f} {d1:10.2f} {d1 / d0:6.3f}   {h0:10.2f} {h1:10.2f} {h1 / h0:6.3f}{shared}")


if __name__ == "__main__":
    main()
