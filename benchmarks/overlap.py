"""One-GPU benchmark of the overlapped boundary's mechanism, with the link EMULATED: the peers' rows are
copied from separate allocations on the same GPU by a copy paced to NVLink's rate, while a DeepSeek-shaped
consumer runs chunk by chunk. Nothing crosses NVLink: the speed-up of several GPUs is cost_model.py's
projection; this measures whether the mechanism hides a link-rate copy and what the copy costs the consumer.

Usage::

    python benchmarks/overlap.py                                  # 1x H200: cp 2 4 8, M 2048 4096 8192
    python benchmarks/overlap.py --M 8192 --cp 8 --rate-gbs 388 --csv overlap.csv
    python benchmarks/overlap.py --mechanism ce --piece-mib 4      # copy-engine pulls alone, 4 MiB sleep-paced pieces
    python benchmarks/overlap.py --cp 8 --M 8192 --mechanism all   # sm, ce and ceb side by side
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

The copy-engine mechanisms (``ce``, ``ceb``; by default sm and ce side by side, ``--mechanism all`` adds ceb;
their methods interleaved in one timing): copy-engine pulls. Each chunk moves as ``copy_`` of contiguous pieces (cudaMemcpyAsync D2D) on
the side stream, one event per chunk, the consumer waiting for its chunk's event only, and no carveout (the
copy takes no SMs). A copy engine on one GPU runs at HBM speed, so the link's rate is emulated, two ways that
err on opposite sides (overlap_copy.py):

* ``ce``, PACED PIECES (``calibrate_pieces``): pieces of 1-16 MiB, each after a 1-thread ``torch.cuda._sleep``
  kernel sized so the copy alone averages ``--rate-gbs``. The memory traffic is the real copy's; but each
  sleep kernel needs a free SM slot, and beside a GEMM that fills every SM it waits for a wave to end, so
  the pieces land later than a link's would: pessimistic on how much is hidden.
* ``ceb``, BALLAST (``calibrate_ballast``): 16 MiB pieces, each followed by copy-engine copies between two
  L2-resident 8 MiB scratch buffers, sized so the copy alone averages ``--rate-gbs``. No kernel at all, as a
  pull over NVLink: nothing waits for an SM. The ballast's traffic stays in the L2 (some reaches HBM as the
  consumer evicts it): at worst pessimistic on the consumer's slowdown.

The real pull lies between the two: no SM wait, and only the piece's bytes in HBM.

Methods, per shape, mechanism and direction:

* gather (``ag``): ``copy`` (the peers' slots alone), ``consumer`` (every chunk, no copy), ``serial`` (all
  copies, then the consumer), ``overlap`` (the local chunk at once; chunk i waits for its copy's event while
  later chunks copy), ``consumer+copy`` (the same copies and consumer with no waits: the slowdown alone),
  ``consumer 1 call`` (all rows in one call: what cutting into chunks costs), ``consumer carved`` (the
  chunks that run beside a copy carved as in ``overlap``, no copy);
* reduce-scatter (``rs``): the peers' chunks first, the local chunk last; ``copy`` (the partials out alone),
  ``consumer``, ``serial`` (consumer, then the copies), ``overlap`` (chunk j's partials copied out while
  chunk j + 1 computes).

The consumer-only methods (``consumer``, ``consumer 1 call``) are shared by the mechanisms; ``consumer
carved`` is timed for sm alone (ce has no carveout: its ``carve`` is "-"). Reported per (cp, M, dir, mech):
``hidden`` = (serial - overlap) / copy, the share of the copy's time hidden; ``slowdown`` =
consumer beside the copy / consumer alone - 1 (reduce-scatter: overlap / consumer - 1, an upper bound);
``carve`` = the same chunks carved with no copy / consumer alone - 1, the carveout's own share of the
slowdown (the rest is the copy's contention for memory); ``s/copy`` = the consumer time lost per unit of
copy time, cost_model.py's ``--slowdown`` (sm) or ``--slowdown-ce`` (ce, ceb). Goal: at least 80% hidden
behind a consumer at least as long as the copy, with the consumer at most 10% slower.

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
from overlap_methods import (CARVE_MARGIN, CONSUMER_ONLY, Carveout, Mechanism, Setup, Streams, carve_plan,  # noqa: E402
                             check, make_methods)

EMULATED = ("link EMULATED ({mech}): one GPU, one process; each peer's memory is a separate allocation on this GPU "
            "and the link {how}; nothing crosses NVLink")
GOAL_HIDDEN, GOAL_SLOWDOWN = 0.80, 0.10


@dataclasses.dataclass
class Method:  # what harness.time_methods times: a name and fn(ctx, buffer set)
    name: str
    fn: Callable


MECH_COLUMNS = ("copy_grid", "copy_block", "copy_warps", "carveout_sms", "piece_MiB", "sleep_cycles", "sleep_us",
                "ballast_MiB")
MECHANISMS = {"sm": ("sm",), "ce": ("ce",), "ceb": ("ceb",), "both": ("sm", "ce"), "all": ("sm", "ce", "ceb")}


def emulated(mech: Mechanism, rate: float) -> str:
    how = (f"an SM-driven copy paced to {rate:.0f} GB/s ({mech.copy.describe()})" if mech.takes_sms
           else mech.copy.describe())
    carve = f"the consumer's GEMMs leave it {mech.carve.sms} SMs" if mech.carve.sms else "no SM carveout"
    return EMULATED.format(mech=mech.name, how=f"{how}, {carve}")


def measure(S: Setup, consumer: harness.MoeStandIn, mechs: List[Mechanism], streams: Streams, args, ctx,
            log) -> List[dict]:
    """Every mechanism's methods, checked, then timed together (rounds interleave them); a row per
    (direction, mechanism)."""
    fails = [f"{mech.name}: {f}" for mech in mechs for f in check(S, make_methods(S, consumer, mech, streams, set()))]
    if fails:
        for f in fails:
            print(f"CHECK FAILED cp={S.cp} M={S.M}: {f}", file=sys.stderr, flush=True)
        return [{"cp": S.cp, "M": S.M, "dir": d, "mech": mech.name, "check": "; ".join(fails)}
                for d in ("ag", "rs") for mech in mechs]
    timed = {}
    for mech in mechs:
        carve_ag = carve_plan(S, make_methods(S, consumer, mech, streams, set()), consumer, mech.carve,
                              args.carve_margin)
        timed.update({name if name in CONSUMER_ONLY else f"{mech.name} {name}": fn
                      for name, fn in make_methods(S, consumer, mech, streams, carve_ag).items()})
        log(f"  check {mech.name}: rows bit for bit, partials match the serialized run; "
            + (f"carveout of {mech.carve.sms} SMs on gather chunks {sorted(carve_ag)}, reduce-scatter chunks "
               f"1..{len(S.rs) - 1}" if mech.carve.sms else "no carveout"))
    methods = [Method(name, lambda c, b, fn=fn: fn()) for name, fn in timed.items()]
    st = {k: v["ms"] for k, v in harness.time_methods(ctx, methods, [None], args.rounds, args.warmup).items()}
    tflops = consumer.flops(S.T) / (st["ag consumer 1 call"] * 1e-3) / 1e12
    log(f"  consumer in one call {st['ag consumer 1 call']:.3f} ms ({tflops:.0f} TFLOP/s), per chunk "
        f"{st['ag consumer']:.3f} ms; copy alone "
        + ", ".join(f"{m.name} {st[m.name + ' ag copy']:.3f} ms ({S.copy_bytes / st[m.name + ' ag copy'] / 1e6:.0f} "
                    f"GB/s)" for m in mechs))
    rows = []
    for d in ("ag", "rs"):
        for mech in mechs:
            rows.append(_row(S, d, mech, st, tflops, args))
    return rows


def _row(S: Setup, d: str, mech: Mechanism, st: dict, tflops: float, args) -> dict:
    cp_ms, ser, ovl = (st[f"{mech.name} {d} {k}"] for k in ("copy", "serial", "overlap"))
    con = st[f"{d} consumer"]
    carved = st.get(f"{mech.name} {d} consumer carved")  # None: a mechanism with no carveout
    beside = st[f"{mech.name} ag consumer+copy"] if d == "ag" else ovl
    row = {"cp": S.cp, "M": S.M, "dir": d, "mech": mech.name, "counts": "/".join(map(str, S.counts)), "rank": S.r,
           "T": S.T, "chunks": len(S.ag), "copy_bytes": S.copy_bytes, "copy_ms": cp_ms,
           "copy_GBps": S.copy_bytes / cp_ms / 1e6,
           "consumer_ms": con, "serial_ms": ser, "overlap_ms": ovl, "beside_copy_ms": beside,
           "hidden": (ser - ovl) / cp_ms, "slowdown": beside / con - 1.0, "s_per_copy": (beside - con) / cp_ms,
           "carved_ms": carved, "carve_cost": None if carved is None else carved / con - 1.0,
           "consumer_1call_ms": st["ag consumer 1 call"], "consumer_tflops": tflops,
           "rate_target_GBps": args.rate_gbs, **dict.fromkeys(MECH_COLUMNS), **mech.columns,
           "carve_margin": args.carve_margin, "rounds": args.rounds, "check": "ok"}
    row["goal"] = ("smoke run: none" if args.smoke else "n/a: consumer shorter than the copy" if con < cp_ms
                   else "ok" if row["hidden"] >= GOAL_HIDDEN and row["slowdown"] <= GOAL_SLOWDOWN else "MISS")
    return row


def format_table(rows: List[dict], tags: dict, lines_emulated: List[str]) -> str:
    smoke = harness.smoke_note(tags)
    lines = [smoke] if smoke else []
    lines += [f"{tags['gpu']} | torch {tags['torch']} | triton {tags['triton']} | nsa_cp {tags['nsa_cp']} "
              f"(git {tags['git_rev']}) | {tags['date']}", *lines_emulated,
              f"  {'cp':>3}{'M':>6} {'dir':<4}{'mech':<5}{'copy ms':>9}{'GB/s':>6}{'consumer':>10}{'serial':>9}"
              f"{'overlap':>9}{'hidden':>8}{'slowdown':>10}{'carve':>7}{'s/copy':>8}  goal (>= {GOAL_HIDDEN:.0%} "
              f"hidden, <= {GOAL_SLOWDOWN:.0%})"]
    for r in rows:
        head = f"  {r['cp']:>3}{r['M']:>6} {r['dir']:<4}{r['mech']:<5}"
        if r["check"] != "ok":
            lines.append(f"{head}CHECK FAILED: {r['check'][:150]}")
            continue
        goal = "-" if smoke else r["goal"]
        carve = "-" if r["carve_cost"] is None else f"{r['carve_cost']:.1%}"
        lines.append(f"{head}{r['copy_ms']:>9.3f}{r['copy_GBps']:>6.0f}"
                     f"{r['consumer_ms']:>10.3f}{r['serial_ms']:>9.3f}{r['overlap_ms']:>9.3f}{r['hidden']:>8.0%}"
                     f"{r['slowdown']:>10.1%}{carve:>7}{r['s_per_copy']:>8.2f}  {goal}")
    return "\n".join(lines)


def parse_args(argv=None):
    p = harness.arg_parser(__doc__)
    p.add_argument("--M", type=int, nargs="+", help="per-rank max_rank_len (GPU: 2048 4096 8192; smoke: 16)")
    p.add_argument("--cp", type=int, nargs="+", help="emulated ranks (GPU: 2 4 8; smoke: 2 4)")
    p.add_argument("--rate-gbs", type=float, default=356.0, help="the emulated link's rate, GB/s one way")
    p.add_argument("--mechanism", choices=tuple(MECHANISMS), default="both",
                   help="the link's copy: sm (an SM-driven Triton copy), ce (copy-engine pieces paced by a sleep "
                        "kernel), ceb (copy-engine pieces paced by L2-resident ballast copies), both (sm and ce, the "
                        "default) or all, side by side")
    p.add_argument("--piece-mib", type=float, help="ce, ceb: the copy-engine piece in MiB (default, ce: the smallest of "
                                                   "1 2 4 8 16 that keeps up, calibrated; ceb: 16)")
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
    if args.rounds < 1 or args.warmup < 0 or args.rate_gbs <= 0 or args.carve_margin <= 0 or (args.piece_mib or 1) <= 0:
        p.error("--rounds >= 1, --warmup >= 0, --rate-gbs > 0, --carve-margin > 0, --piece-mib > 0")
    if args.cp and min(args.cp) < 2:
        p.error("--cp: at least 2 emulated ranks")
    if args.carveout not in ("auto", "off") and not args.carveout.isdigit():
        p.error("--carveout: auto, off or a number of SMs")
    return args


SLOWDOWN_FLAG = {"sm": "--slowdown", "ce": "--slowdown-ce", "ceb": "--slowdown-ce"}  # cost_model.py's input


def make_mechanism(name: str, dev: torch.device, args, log) -> Mechanism:
    """The emulated link's copy for ``name``, calibrated to ``--rate-gbs``: sm with its carveout, ce and ceb with none."""
    import overlap_copy  # noqa: E402  (imports Triton: after main sets the interpreter for a smoke run)

    if name == "ceb":
        ce = overlap_copy.calibrate_ballast(dev, args.rate_gbs, log, args.piece_mib)
        return Mechanism("ceb", ce, Carveout(None, 0), False,
                         {"piece_MiB": ce.piece_mib, "ballast_MiB": ce.ballast_bytes / (1 << 20)})
    if name == "ce":
        ce = overlap_copy.calibrate_pieces(dev, args.rate_gbs, log, args.piece_mib)
        return Mechanism("ce", ce, Carveout(None, 0), False,
                         {"piece_MiB": ce.piece_mib, "sleep_cycles": ce.sleep_cycles,
                          "sleep_us": ce.sleep_cycles / ce.cycles_per_us if ce.sleep_cycles else 0.0})
    copy, _ = overlap_copy.calibrate(dev, args.rate_gbs, log)
    log(f"paced copy: {copy.describe()}")
    setter = overlap_copy.carveout_setter() if not args.smoke else None
    sms = (0 if args.carveout == "off" or setter is None
           else copy.grid if args.carveout == "auto" else int(args.carveout))
    if sms:
        torch.backends.cuda.preferred_blas_library("cublaslt")  # torch applies the carveout to cuBLASLt only
        log(f"consumer GEMMs: cuBLASLt; beside an sm copy they target all SMs but {sms}")
    elif not args.smoke:
        log("consumer GEMMs: no SM carveout (a persistent GEMM beside the copy may run in two waves)")
    carve = Carveout(setter, sms)
    return Mechanism("sm", copy, carve, True, {"copy_grid": copy.grid, "copy_block": copy.block,
                                               "copy_warps": copy.warps, "carveout_sms": carve.sms})


def main(argv=None):
    args = parse_args(argv)
    harness.check_output_paths([("--csv", args.csv)])
    smoke = args.smoke = args.smoke or not torch.cuda.is_available()
    if smoke:  # Triton's interpreter runs the copy kernel on CPU tensors; set before Triton is imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
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
    mechs = [make_mechanism(name, dev, args, log) for name in MECHANISMS[args.mechanism]]
    lines_emulated = [emulated(m, args.rate_gbs) for m in mechs]
    for line in lines_emulated:
        log(line)
    streams, rows = Streams(dev), []
    for cp in args.cp:
        consumer = harness.MoeStandIn(shape, cp, dev, seed=args.seed)
        log(f"cp={cp}: consumer weights {consumer.weight_bytes / 1e9:.2f} GB ({consumer.experts} routed experts + "
            f"the shared one, H={shape.hidden}, I={shape.inter})")
        for M in args.M:
            S = Setup(cp, M, shape.hidden, dev, args.seed * 1000 + cp * 100 + M)
            log(S.label())
            rows += measure(S, consumer, mechs, streams, args, ctx, log)
            del S
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        del consumer
    good = [r for r in rows if r["check"] == "ok"]
    if good and not smoke:
        met = sum(r["goal"] == "ok" for r in good)
        log(f"goal (>= {GOAL_HIDDEN:.0%} of the copy hidden, consumer <= {GOAL_SLOWDOWN:.0%} slower, where the "
            f"consumer is at least as long as the copy): {met} of "
            f"{sum(not r['goal'].startswith('n/a') for r in good)} rows ok")
        worst = {}  # each cost-model flag: the largest s/copy of the mechanisms it stands for
        for r in good:
            flag = SLOWDOWN_FLAG[r["mech"]]
            worst[flag] = max(worst.get(flag, 0.0), r["s_per_copy"])
        flags = "".join(f" {flag} {s:.2f}" for flag, s in worst.items())
        flags += " --mechanism ce" if list(worst) == ["--slowdown-ce"] else ""
        log(f"for the projection: python benchmarks/cost_model.py{flags} --tflops "
            f"{max(r['consumer_tflops'] for r in good):.0f}   (each mechanism's largest s/copy; the consumer's rate "
            f"where it is compute-bound)")
    print(format_table(rows, tags, lines_emulated), flush=True)  # the table last, files after
    harness.write_rows(tags, good, args.csv, None)
    dist.destroy_process_group()
    if len(good) < len(rows):
        raise SystemExit(f"{len(rows) - len(good)} row(s) failed their check (see CHECK FAILED above)")


if __name__ == "__main__":
    harness.run_main(main)
