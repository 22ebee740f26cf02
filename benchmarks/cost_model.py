"""A cost model of the MoE boundary (gather + consumer + reduce-scatter), serialized and overlapped, at cp 2,
4 and 8: a PROJECTION from stage costs measured on H200s, not a measurement of several GPUs.

Usage::

    python benchmarks/cost_model.py                          # calibration check, then the projection
    python benchmarks/cost_model.py --slowdown 0.06          # the slowdown overlap.py measured on 1x H200
    python benchmarks/cost_model.py --mechanism ce           # project with the copy-engine mechanism's slowdown
    python benchmarks/cost_model.py --slowdown 0.21 --slowdown-ce 0.04   # both mechanisms' exposed shares
    python benchmarks/cost_model.py --tflops 700 --csv projection.csv

What it does, in order:

1. Calibration: the serialized P2P gather and reduce-scatter of the 2x H200 tables (docs/performance.md,
   "Measured", counts [M, 0.8M], bf16, H = 7168, M = 2048 / 8192 / 32768, padded and compact), predicted
   from the link rate and the per-call latency below, each within 15% of the measured device time. It
   prints measured, predicted, ratio and pass / FAIL, and exits with status 1 (predicting nothing) if any
   fails.
2. The projection: counts [M, 0.8M, ...] over cp ranks, H = 7168 bf16, per-rank M 2048 / 8192 / 32768;
   the consumer a DeepSeek-V3 MoE layer split over the cp ranks (256 routed experts EP-split with balanced
   top-8 routing, the shared expert TP-split; each rank runs its share over all T gathered rows), its
   time from FLOPs at ``--tflops`` or from its weight bytes at the HBM rate, whichever is longer.
   Serialized: gather, one consumer call, reduce-scatter. Overlapped: docs/design.md's "The overlapped boundary"
   simulated on every rank (cost_model_sim.py says how): the local rows first, the peers' slots as they
   land, each finished chunk's partials pushed while the next computes, the consumer slowed by
   ``--slowdown`` while its rank's link moves rows. ``exposed`` = overlapped - one consumer call: what the
   communication still costs; the goal compares it with the serialized boundary's communication.

Every input is in ``INPUTS`` below with where it was measured. What is not measured is said so: the
consumer's achieved TFLOP/s and the slowdown defaults (overlap.py measures each mechanism's on 1x H200 with
the link emulated: the SM-driven copy's goes in as ``--slowdown``, the copy-engine pulls' as
``--slowdown-ce``). ``--mechanism`` picks whose slowdown the projection uses; the goal's exposed share at
cp 8, M 8192 is printed for it and for each mechanism whose slowdown is on the command line.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
import cost_model_sim as sim  # noqa: E402  (this script's part)

# ============================================================================ inputs, with where they come from
PERF = "docs/performance.md"
INPUTS = [  # (Inputs field, value, unit, source)
    ("link_gbs", 356.0, "GB/s", f"{PERF}, 'Where the time goes' (2x H200): the P2P push kernel at 470 MB, "
                                "352-361 GB/s"),
    ("call_us", 9.2, "us", f"{PERF}, 'Small calls are latency-bound' (2x H200): the zero-row gather kernel, "
                           "8.9-9.4 us"),
    ("step_us", 4.0, "us", f"{PERF}, floors (2x H200): a one-block signal round trip between the GPUs, 3.5-4 us"),
    ("launch_us", 4.4, "us", f"{PERF}, floors (2x H200): an empty kernel between two events"),
    ("hbm_gbs", 4137.0, "GB/s", f"{PERF}, 'One GPU: each stage against the HBM floor' (1x H200): device copy, "
                                "read + write"),
    ("tflops", 600.0, "TFLOP/s", "NOT MEASURED here: assumed for a balanced bf16 grouped GEMM (about 3/4 of a dense "
                                 "bf16 GEMM on an H200); overlap.py prints its stand-in's rate; --tflops"),
    ("slowdown", 0.20, "", "NOT MEASURED: conservative default (twice overlap.py's 10% goal; an SM-driven copy holds "
                           "~15% of the SMs); overlap.py's 'slowdown while copying' goes in as --slowdown"),
    ("slowdown_ce", 0.20, "", f"{PERF}, 'The mechanism on one GPU' (1x H200, link emulated): overlap.py's ce s/copy "
                              "at cp 8, M 8192, the larger of gather 0.17 and reduce-scatter 0.20; --slowdown-ce"),
    ("launches", 6, "", "kernels per consumer call (permute, gate_up, activation, down, combine, shared expert)"),
]
MOE_SOURCE = ("DeepSeek-V3 config.json: hidden_size 7168, moe_intermediate_size 2048, n_routed_experts 256, "
              "num_experts_per_tok 8, n_shared_experts 1; bf16")
# the measured serialized collectives the model must reproduce: 2x H200, device ms, counts [M, 0.8M]
ANCHORS = [  # (what, M, measured ms) from docs/performance.md's 'Measured' tables, P2P transport (auto)
    ("gather padded", 2048, 0.094), ("gather padded", 8192, 0.336), ("gather padded", 32768, 1.312),
    ("gather compact", 2048, 0.093), ("gather compact", 8192, 0.334), ("gather compact", 32768, 1.296),
    ("reduce-scatter padded", 2048, 0.099), ("reduce-scatter padded", 8192, 0.357),
    ("reduce-scatter padded", 32768, 1.381), ("reduce-scatter compact", 2048, 0.100),
    ("reduce-scatter compact", 8192, 0.357), ("reduce-scatter compact", 32768, 1.381),
]
TOLERANCE = 0.15
GOAL = (8, 8192, 0.25)  # at cp = 8, M = 8192: exposed communication <= a quarter of the serialized boundary's


SLOWDOWN_INPUT = {"sm": "slowdown", "ce": "slowdown_ce"}  # mechanism -> its INPUTS row (and flag)


def input_values(args) -> dict:
    """INPUTS' values, with those given on the command line."""
    values = {name: value for name, value, _, _ in INPUTS}
    for name, flag in (("link_gbs", "rate_gbs"), ("tflops", "tflops"), ("slowdown", "slowdown"),
                       ("slowdown_ce", "slowdown_ce")):
        if getattr(args, flag) is not None:
            values[name] = getattr(args, flag)
    return values


def make_inputs(args, mechanism: str = "") -> sim.Inputs:
    """The model's inputs, the consumer slowed as beside ``mechanism``'s copy (default ``--mechanism``)."""
    values = input_values(args)
    values["slowdown"] = values[SLOWDOWN_INPUT[mechanism or args.mechanism]]
    del values["slowdown_ce"]
    return sim.Inputs(**values)


# ============================================================================ 1. calibration
def calibrate(inp: sim.Inputs, moe: sim.Moe) -> List[dict]:
    rows = []
    for what, M, measured in ANCHORS:
        predicted = sim.collective_s(sim.counts_for(2, M), inp, moe) * 1e3
        ratio = predicted / measured
        rows.append({"what": what, "M": M, "measured_ms": measured, "predicted_ms": predicted, "ratio": ratio,
                     "ok": abs(ratio - 1.0) <= TOLERANCE})
    return rows


def print_calibration(rows: List[dict]) -> None:
    print(f"calibration: the serialized P2P collectives measured on 2x H200 ({PERF}, 'Measured': counts [M, 0.8M], "
          f"bf16, H = 7168, device ms), predicted within {TOLERANCE:.0%}:")
    print(f"  {'collective':<24}{'M':>7}{'measured':>10}{'predicted':>11}{'ratio':>7}  verdict")
    for r in rows:
        print(f"  {r['what']:<24}{r['M']:>7}{r['measured_ms']:>10.3f}{r['predicted_ms']:>11.3f}{r['ratio']:>7.3f}  "
              f"{'pass' if r['ok'] else 'FAIL'}")
    good = sum(r["ok"] for r in rows)
    print(f"calibration: {good} of {len(rows)} within {TOLERANCE:.0%}: {'pass' if good == len(rows) else 'FAIL'}")


# ============================================================================ 2. projection
def project(inp: sim.Inputs, moe: sim.Moe, cps, Ms, min_rows: int) -> List[dict]:
    rows = []
    for cp in cps:
        for M in Ms:
            counts = sim.counts_for(cp, M)
            ser = sim.serialized(counts, moe, inp)
            ovl = sim.overlapped(counts, moe, inp, min_rows=min_rows)
            rows.append({
                "cp": cp, "M": M, "counts": "/".join(map(str, counts)), "T": sum(counts),
                "gather_ms": ser.gather * 1e3, "consumer_ms": ser.consumer * 1e3, "rs_ms": ser.rs * 1e3,
                "serialized_ms": ser.total * 1e3, "overlapped_ms": ovl.total * 1e3, "chunks": ovl.chunks,
                "exposed_ms": sim.exposed(ovl) * 1e3, "exposed_ratio": sim.exposed(ovl) / ser.comm,
                "tflops": inp.tflops, "slowdown": inp.slowdown, "link_gbs": inp.link_gbs,
            })
    return rows


def goal_ratio(inp: sim.Inputs, moe: sim.Moe, min_rows: int) -> float:
    """At the goal's cp and M: exposed communication / the serialized boundary's communication."""
    counts = sim.counts_for(*GOAL[:2])
    return sim.exposed(sim.overlapped(counts, moe, inp, min_rows=min_rows)) / sim.serialized(counts, moe, inp).comm


def breakeven_slowdown(inp: sim.Inputs, moe: sim.Moe, min_rows: int) -> float:
    """The largest slowdown at which the goal holds (bisection; 0 if it fails even without slowdown)."""
    limit = GOAL[2]

    def ratio(s):
        return goal_ratio(dataclasses.replace(inp, slowdown=s), moe, min_rows)

    if ratio(0.0) > limit:
        return 0.0
    lo, hi = 0.0, 0.95
    if ratio(hi) <= limit:
        return hi
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ratio(mid) <= limit else (lo, mid)
    return lo


def print_projection(rows: List[dict], inp: sim.Inputs, moe: sim.Moe, min_rows: int, mechanism: str) -> None:
    print()
    print(f"PROJECTION (a model, not a measurement): the boundary at cp ranks, counts [M, 0.8M, ...], H = {moe.hidden} "
          f"bf16; consumer: DeepSeek-V3 MoE split over the ranks at {inp.tflops:.0f} TFLOP/s or HBM {inp.hbm_gbs:.0f} "
          f"GB/s; link {inp.link_gbs:.0f} GB/s per direction per GPU; consumer slowdown while copying "
          f"{inp.slowdown:.0%} (mechanism {mechanism}); chunks of at least "
          f"{'2x the balance rows' if not min_rows else min_rows}; ms")
    print(f"  {'cp':>3}{'M':>7}{'gather':>9}{'consumer':>10}{'RS':>8}{'serialized':>12}{'overlapped':>12}{'chunks':>7}"
          f"{'exposed':>9}{'exp/comm':>10}")
    for r in rows:
        note = "  (serialized is faster)" if r["overlapped_ms"] > r["serialized_ms"] else ""
        print(f"  {r['cp']:>3}{r['M']:>7}{r['gather_ms']:>9.3f}{r['consumer_ms']:>10.3f}{r['rs_ms']:>8.3f}"
              f"{r['serialized_ms']:>12.3f}{r['overlapped_ms']:>12.3f}{r['chunks']:>7}{r['exposed_ms']:>9.3f}"
              f"{r['exposed_ratio']:>10.2f}{note}")
    print("  exposed = overlapped - one consumer call; exp/comm = exposed / (serialized gather + reduce-scatter)")
    cp, M, limit = GOAL
    goal = next((r for r in rows if (r["cp"], r["M"]) == (cp, M)), None)
    if goal is None:
        return
    be = breakeven_slowdown(inp, moe, min_rows)
    print(f"goal (projected): at cp = {cp}, M = {M} the exposed communication <= {limit:.2f} of the serialized "
          f"boundary's communication: {goal['exposed_ratio']:.2f} "
          f"({'met' if goal['exposed_ratio'] <= limit else 'MISS'})")
    print(f"  it holds while the consumer's slowdown under a copy is <= {be:.0%}; overlap.py measures it on 1x H200 "
          f"(--slowdown, --slowdown-ce)")


def print_goal_by_mechanism(args, moe: sim.Moe) -> None:
    """The goal's exposed share for ``--mechanism`` and each mechanism whose slowdown is on the command line."""
    given = {"sm": args.slowdown is not None, "ce": args.slowdown_ce is not None}
    cp, M, limit = GOAL
    for mech in (m for m in SLOWDOWN_INPUT if m == args.mechanism or given[m]):
        inp = make_inputs(args, mech)
        ratio = goal_ratio(inp, moe, args.min_chunk_rows)
        default = next(text for name, _, _, text in INPUTS if name == SLOWDOWN_INPUT[mech])
        source = "set on the command line" if given[mech] else (
            "NOT MEASURED default" if default.startswith("NOT MEASURED") else "the default, measured")
        print(f"exposed share at cp = {cp}, M = {M}, mechanism {mech} (slowdown {inp.slowdown:.2f}, {source}): "
              f"{ratio:.2f} ({'met' if ratio <= limit else 'MISS'}: <= {limit:.2f})")


def parse_args(argv=None):
    p = harness.arg_parser(__doc__)
    p.add_argument("--slowdown", type=float, help="consumer speed lost while a copy runs, a fraction (overlap.py's "
                                                  "'slowdown while copying'; default: the table's conservative 0.20)")
    p.add_argument("--slowdown-ce", type=float, help="the same for copy-engine pulls (overlap.py --mechanism ce; "
                                                     "default: the table's NOT MEASURED placeholder 0.05)")
    p.add_argument("--mechanism", choices=tuple(SLOWDOWN_INPUT), default="sm",
                   help="whose slowdown the projection uses: sm (--slowdown) or ce (--slowdown-ce)")
    p.add_argument("--tflops", type=float, help="the consumer's achieved bf16 TFLOP/s (default 600, assumed)")
    p.add_argument("--rate-gbs", type=float, help="link GB/s per direction (default 356, measured; the calibration "
                                                  "must still pass)")
    p.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--M", type=int, nargs="+", default=[2048, 8192, 32768], help="per-rank max_rank_len")
    p.add_argument("--min-chunk-rows", type=int, default=0, help="smallest consumer chunk (0: twice the rows where "
                                                                 "the MoE's FLOPs equal its weight reads)")
    p.add_argument("--shared", choices=("split", "whole"), default="split",
                   help="the shared expert TP-split over the ranks (default) or whole on every rank")
    p.add_argument("--csv")
    args = p.parse_args(argv)
    if any(v is not None and not 0.0 <= v < 1.0 for v in (args.slowdown, args.slowdown_ce)):
        p.error("--slowdown and --slowdown-ce are fractions in [0, 1)")
    if min(args.cp) < 1 or min(args.M) < 1:
        p.error("--cp and --M must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    harness.check_output_paths([("--csv", args.csv)])
    inp, moe = make_inputs(args), sim.Moe(shared_split=args.shared == "split")
    print("cost model of the overlapped MoE boundary (no GPU is used): calibrated on measured collectives, then "
          "projected")
    print("inputs:")
    values = input_values(args)
    for name, value, unit, source in INPUTS:
        given = values[name]
        print(f"  {name:<10}{given:>9g} {unit:<8}{source if given == value else 'set on the command line'}")
    print(f"  consumer  {MOE_SOURCE}; shared expert {args.shared}")
    print()
    cal = calibrate(inp, moe)
    print_calibration(cal)
    if not all(r["ok"] for r in cal):
        print("calibration FAILED: the model does not reproduce the measured collectives; no projection",
              file=sys.stderr)
        return 1
    rows = project(inp, moe, args.cp, args.M, args.min_chunk_rows)
    print_projection(rows, inp, moe, args.min_chunk_rows, args.mechanism)
    print_goal_by_mechanism(args, moe)
    if args.csv:
        import torch

        tags = harness.env_tags(torch.device("cpu"), "none", 1, None, "cost model: a projection, no device")
        tags["gpu"] = "none (projection from measured inputs)"
        harness.write_rows(tags, rows, args.csv, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
