"""One-GPU benchmark of the overlapped boundary's mechanism, with the link EMULATED: the peers' rows are
copied from separate allocations on the same GPU by a copy paced to NVLink's rate, while a DeepSeek-shaped
consumer runs chunk by chunk. Nothing crosses NVLink: the speed-up of several GPUs is cost_model.py's
projection; this measures whether the mechanism hides a link-rate copy and what the copy costs the consumer.

Usage::

    python benchmarks/overlap.py                                  # 1x H200: cp 2 4 8, M 2048 4096 8192
    python benchmarks/overlap.py --M 8192 --cp 8 --rate-gbs 388 --csv overlap.csv
    python benchmarks/overlap.py --smoke                          # tiny sizes on CPU tensors (no GPU needed)

Shapes: counts [M, 0.8M, ...] over cp emulated ranks; this GPU plays rank 1 (0.8M rows, the rank that
receives the most), H = 7168 bf16, gathered rows compact. Chunks: the local rows, then one chunk per peer
slot (uneven). The consumer per chunk (``harness.MoeStandIn``): DeepSeek-V3's shared expert whole (gate_up
[rows, 7168] x [7168, 2*2048], SiLU * up, down) and its 256 / cp routed experts with balanced top-8 routing
as a grouped GEMM (two torch.bmm between a permutation and a weighted combine).

The copy (overlap_copy.py): a Triton kernel on a small grid, the grid and step calibrated at start so the
copy alone runs at ``--rate-gbs`` (default 356 GB/s, the 2x H200 P2P push; one P2P copy measured 388), on
a high-priority side stream. While a copy may run, the consumer's cuBLASLt GEMMs leave the copy's SMs free
(torch's SM carveout, ``--carveout``), as a GEMM beside an SM-driven NVLink kernel must.

Methods, per shape, in each direction:

* gather (``ag``): ``copy`` (the peers' slots alone), ``consumer`` (every chunk, no copy), ``serial`` (all
  copies, then the consumer), ``overlap`` (the local chunk at once; chunk i waits for its copy's event while
  later chunks copy), ``consumer+copy`` (the same copies and consumer with no waits: the slowdown alone),
  ``consumer 1 call`` (all rows in one call: what cutting into chunks costs), ``consumer carved`` (the
  chunks that run beside a copy carved as in ``overlap``, no copy);
* reduce-scatter (``rs``): the peers' chunks first, the local chunk last; ``copy`` (the partials out alone),
  ``consumer``, ``serial`` (consumer, then the copies), ``overlap`` (chunk j's partials copied out while
  chunk j + 1 computes).

Reported: ``hidden`` = (serial - overlap) / copy, the share of the copy's time hidden; ``slowdown`` =
consumer beside the copy / consumer alone - 1 (reduce-scatter: overlap / consumer - 1, an upper bound);
``carve`` = the same chunks carved with no copy / consumer alone - 1, the carveout's own share of the
slowdown (the rest is the copy's contention for memory); ``s/copy`` = the consumer time lost per unit of
copy time, the ``--slowdown`` of cost_model.py. Goal: at least 80% hidden behind a consumer at least as
long as the copy, with the consumer at most 10% slower.

Protocol (docs/performance.md): every method that moves rows is checked once on NaN-poisoned
destinations (rows bit for bit, partials all written and within 2e-2 of the serialized run's), then
``harness.time_methods``: warm-up, rounds of every method in an order permuted per round, the GPU asleep
while the host enqueues the round, CUDA events, the median over rounds. The consumer's weights (GBs) pass
through L2 between methods, so no buffer is served from it. Without CUDA (or with ``--smoke``) the same
code runs tiny shapes on CPU tensors: a smoke run, its timings mean nothing.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Callable, List

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
# this benchmark's parts
from overlap_methods import CARVE_MARGIN, Carveout, Setup, Streams, carve_plan, check, make_methods  # noqa: E402

EMULATED = ("link EMULATED: one GPU, one process; each peer's memory is a separate allocation on this GPU and the "
            "link a copy paced to {rate:.0f} GB/s; nothing crosses NVLink")
GOAL_HIDDEN, GOAL_SLOWDOWN = 0.80, 0.10


@dataclasses.dataclass
class Method:  # what harness.time_methods times: a name and fn(ctx, buffer set)
    name: str
    fn: Callable


def measure(S: Setup, consumer: harness.MoeStandIn, copy, streams: Streams, carve: Carveout, args, ctx,
            log) -> List[dict]:
    methods = make_methods(S, consumer, copy, streams, carve, set())
    fails = check(S, methods)
    if fails:
        for f in fails:
            print(f"CHECK FAILED cp={S.cp} M={S.M}: {f}", file=sys.stderr, flush=True)
        return [{"cp": S.cp, "M": S.M, "dir": d, "check": "; ".join(fails)} for d in ("ag", "rs")]
    carve_ag = carve_plan(S, methods, consumer, carve, args.carve_margin)
    methods = make_methods(S, consumer, copy, streams, carve, carve_ag)
    log(f"  check: rows bit for bit, partials match the serialized run; carveout of {carve.sms} SMs on gather chunks "
        f"{sorted(carve_ag)}, reduce-scatter chunks 1..{len(S.rs) - 1}")
    timed = [Method(name, lambda c, b, fn=fn: fn()) for name, fn in methods.items()]
    st = {k: v["ms"] for k, v in harness.time_methods(ctx, timed, [None], args.rounds, args.warmup).items()}
    tflops = consumer.flops(S.T) / (st["ag consumer 1 call"] * 1e-3) / 1e12
    log(f"  consumer in one call {st['ag consumer 1 call']:.3f} ms ({tflops:.0f} TFLOP/s), per chunk "
        f"{st['ag consumer']:.3f} ms; copy alone {st['ag copy']:.3f} ms "
        f"({S.copy_bytes / st['ag copy'] / 1e6:.0f} GB/s)")
    rows = []
    for d in ("ag", "rs"):
        cp_ms, con, ser, ovl, carved = (st[f"{d} {k}"] for k in ("copy", "consumer", "serial", "overlap",
                                                                   "consumer carved"))
        beside = st["ag consumer+copy"] if d == "ag" else ovl
        row = {"cp": S.cp, "M": S.M, "dir": d, "counts": "/".join(map(str, S.counts)), "rank": S.r, "T": S.T,
               "chunks": len(S.ag), "copy_bytes": S.copy_bytes, "copy_ms": cp_ms,
               "copy_GBps": S.copy_bytes / cp_ms / 1e6,
               "consumer_ms": con, "serial_ms": ser, "overlap_ms": ovl, "beside_copy_ms": beside,
               "hidden": (ser - ovl) / cp_ms, "slowdown": beside / con - 1.0, "s_per_copy": (beside - con) / cp_ms,
               "carved_ms": carved, "carve_cost": carved / con - 1.0,
               "consumer_1call_ms": st["ag consumer 1 call"], "consumer_tflops": tflops,
               "rate_target_GBps": args.rate_gbs, "copy_grid": copy.grid, "copy_block": copy.block,
               "copy_warps": copy.warps,
               "carveout_sms": carve.sms, "carve_margin": args.carve_margin, "rounds": args.rounds, "check": "ok"}
        row["goal"] = ("smoke run: none" if args.smoke else "n/a: consumer shorter than the copy" if con < cp_ms
                       else "ok" if row["hidden"] >= GOAL_HIDDEN and row["slowdown"] <= GOAL_SLOWDOWN else "MISS")
        rows.append(row)
    return rows


def format_table(rows: List[dict], tags: dict, rate: float) -> str:
    smoke = harness.smoke_note(tags)
    lines = [smoke] if smoke else []
    lines += [f"{tags['gpu']} | torch {tags['torch']} | triton {tags['triton']} | nsa_cp {tags['nsa_cp']} "
              f"(git {tags['git_rev']}) | {tags['date']}", EMULATED.format(rate=rate),
              f"  {'cp':>3}{'M':>6} {'dir':<4}{'copy ms':>9}{'GB/s':>6}{'consumer':>10}{'serial':>9}{'overlap':>9}"
              f"{'hidden':>8}{'slowdown':>10}{'carve':>7}{'s/copy':>8}  goal (>= {GOAL_HIDDEN:.0%} hidden, <= {GOAL_SLOWDOWN:.0%})"]
    for r in rows:
        if r["check"] != "ok":
            lines.append(f"  {r['cp']:>3}{r['M']:>6} {r['dir']:<4}CHECK FAILED: {r['check'][:150]}")
            continue
        goal = "-" if smoke else r["goal"]
        lines.append(f"  {r['cp']:>3}{r['M']:>6} {r['dir']:<4}{r['copy_ms']:>9.3f}{r['copy_GBps']:>6.0f}"
                     f"{r['consumer_ms']:>10.3f}{r['serial_ms']:>9.3f}{r['overlap_ms']:>9.3f}{r['hidden']:>8.0%}"
                     f"{r['slowdown']:>10.1%}{r['carve_cost']:>7.1%}{r['s_per_copy']:>8.2f}  {goal}")
    return "\n".join(lines)


def parse_args(argv=None):
    p = harness.arg_parser(__doc__)
    p.add_argument("--M", type=int, nargs="+", help="per-rank max_rank_len (GPU: 2048 4096 8192; smoke: 16)")
    p.add_argument("--cp", type=int, nargs="+", help="emulated ranks (GPU: 2 4 8; smoke: 2 4)")
    p.add_argument("--rate-gbs", type=float, default=356.0, help="the emulated link's rate, GB/s one way")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--carveout", default="auto", help="SMs the consumer's GEMMs leave to the copy while it may run: "
                                                      "auto (the copy's grid), off, or a number")
    p.add_argument("--carve-margin", type=float, default=CARVE_MARGIN,
                   help="a gather chunk gets the carveout if it starts before this many times the copy's time alone")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU tensors (automatic without CUDA)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--csv")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0 or args.rate_gbs <= 0 or args.carve_margin <= 0:
        p.error("--rounds >= 1, --warmup >= 0, --rate-gbs > 0, --carve-margin > 0")
    if args.cp and min(args.cp) < 2:
        p.error("--cp: at least 2 emulated ranks")
    if args.carveout not in ("auto", "off") and not args.carveout.isdigit():
        p.error("--carveout: auto, off or a number of SMs")
    return args


def main(argv=None):
    args = parse_args(argv)
    harness.check_output_paths([("--csv", args.csv)])
    smoke = args.smoke = args.smoke or not torch.cuda.is_available()
    if smoke:  # Triton's interpreter runs the copy kernel on CPU tensors; set before Triton is imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import overlap_copy  # noqa: E402  (imports Triton)

    dev = torch.device("cpu") if smoke else torch.device("cuda", torch.cuda.current_device())
    shape = harness.MOE_SMOKE if smoke else harness.MOE_DEEPSEEK_V3
    args.M = args.M or ([16] if smoke else [2048, 4096, 8192])
    args.cp = args.cp or ([2, 4] if smoke else [2, 4, 8])
    if smoke:
        args.rounds, args.warmup = min(args.rounds, 2), min(args.warmup, 1)
    torch.set_grad_enabled(False)
    nsa = harness.import_nsa_cp()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # harness.time_methods' barrier
    ctx = harness.Ctx(nsa, None, None, 0, 1, dev, "gloo", hidden=shape.hidden)
    tags = harness.env_tags(dev, "none", 1, nsa, None if smoke else "one GPU, one process: link EMULATED (paced copy)")

    def log(msg):
        print(msg, flush=True)

    if smoke:
        log("smoke run: tiny shapes on CPU tensors through the same code path; its timings mean nothing")
    log(EMULATED.format(rate=args.rate_gbs))
    copy, _ = overlap_copy.calibrate(dev, args.rate_gbs, log)
    log(f"paced copy: {copy.describe()}")
    setter = overlap_copy.carveout_setter() if not smoke else None
    sms = (0 if args.carveout == "off" or setter is None
           else copy.grid if args.carveout == "auto" else int(args.carveout))
    if sms:
        torch.backends.cuda.preferred_blas_library("cublaslt")  # torch applies the carveout to cuBLASLt only
        log(f"consumer GEMMs: cuBLASLt; beside a copy they target all SMs but {sms}")
    elif not smoke:
        log("consumer GEMMs: no SM carveout (a persistent GEMM beside the copy may run in two waves)")
    carve, streams, rows = Carveout(setter, sms), Streams(dev), []
    for cp in args.cp:
        consumer = harness.MoeStandIn(shape, cp, dev, seed=args.seed)
        log(f"cp={cp}: consumer weights {consumer.weight_bytes / 1e9:.2f} GB ({consumer.experts} routed experts + "
            f"the shared one, H={shape.hidden}, I={shape.inter})")
        for M in args.M:
            S = Setup(cp, M, shape.hidden, dev, args.seed * 1000 + cp * 100 + M)
            log(S.label())
            rows += measure(S, consumer, copy, streams, carve, args, ctx, log)
            del S
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        del consumer
    good = [r for r in rows if r["check"] == "ok"]
    if good and not smoke:
        worst = max(r["s_per_copy"] for r in good)
        met = sum(r["goal"] == "ok" for r in good)
        log(f"goal (>= {GOAL_HIDDEN:.0%} of the copy hidden, consumer <= {GOAL_SLOWDOWN:.0%} slower, where the "
            f"consumer is at least as long as the copy): {met} of "
            f"{sum(not r['goal'].startswith('n/a') for r in good)} rows ok")
        log(f"for the projection: python benchmarks/cost_model.py --slowdown {max(0.0, worst):.2f} --tflops "
            f"{max(r['consumer_tflops'] for r in good):.0f}   (the largest s/copy; the consumer's rate where it is "
            f"compute-bound)")
    print(format_table(rows, tags, args.rate_gbs), flush=True)  # the table last, files after
    harness.write_rows(tags, good, args.csv, None)
    dist.destroy_process_group()
    if len(good) < len(rows):
        raise SystemExit(f"{len(rows) - len(good)} row(s) failed their check (see CHECK FAILED above)")


if __name__ == "__main__":
    harness.run_main(main)
