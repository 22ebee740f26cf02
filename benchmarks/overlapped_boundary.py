"""The overlapped MoE boundary against the serialized one, over real links: ``cp_overlapped_boundary``
beside ``cp_all_gather`` -> MoE -> ``cp_reduce_scatter``, the same MoE stand-in, the same uneven layout.

Usage::

    python benchmarks/overlapped_boundary.py                    # 2+ GPUs, one per rank: M in 2048 4096 8192
    python benchmarks/overlapped_boundary.py --M 8192 --chunk-rows 0 2048 --csv ob.csv --json ob.json
    python benchmarks/overlapped_boundary.py --cpu-ranks 2      # CPU/gloo smoke run, tiny shapes

Per rank: real counts ``[M, round(0.8 M), M, ...]`` (``--imbalance``), ``x [n_r, H]`` bf16 (H = 7168); the
consumer is overlap.py's DeepSeek-V3-shaped MoE stand-in (``harness.MoeStandIn``: the shared expert whole
and the rank's 256 / cp routed experts, top-8 balanced routing, a grouped GEMM as two ``bmm``), with weights
of its own on every rank, so the reduce-scatter sums real partials. Methods, each one call of the whole
boundary:

* ``serialized``: ``cp_all_gather(x, compact=True)`` -> the MoE on all ``T`` rows into
  ``cp_reduce_scatter_buffer`` -> ``cp_reduce_scatter(compact=True)``: what a user writes with nsa_cp (the
  P2P transport where ``init_p2p`` works, else NCCL; the output says which);
* ``overlapped[c]``: ``cp_overlapped_boundary(x, layout, moe, chunk_rows=c)`` (``--chunk-rows``, 0: one
  chunk per rank's slot), over torch.distributed point-to-point (NCCL);
* ``comm``: the serialized gather and reduce-scatter with no MoE between (the communication alone);
* ``moe``: the MoE on all ``T`` rows in one call (the compute alone).

Derived, per configuration: ``hidden`` = (serialized - overlapped) / comm, the share of the communication
the overlap hid (over 100%: the chunked MoE also ran faster than one call); ``exp/comm`` = (overlapped -
moe) / comm, the communication left exposed (the issue's goal at cp 8, M 8192: at most 0.25).

Protocol: the boundary is checked once first, with the stand-in's shared expert alone as the consumer (a
per-row function; the routed stand-in routes by chunk size, so its sums depend on the chunking):
``serialized`` and every ``overlapped[c]`` agree within a relative L2 of 2e-2 in bf16, every value finite,
the P2P gather buffers NaN before; a mismatch aborts the run. Then
``harness.time_methods`` (warm-up, methods interleaved in a per-round order, CUDA events, the host
enqueuing ahead, medians over rounds, MAX over ranks). Device ms and host ms per method.

Modes: 2+ GPUs (``nccl``, one process per GPU): the comparison. One GPU: refused, since ranks sharing a GPU
have no NCCL, and the overlapped boundary on gloo stages its rows through host memory (a check, not a
link: ``benchmarks/overlap.py`` measures the mechanism on one GPU with the link emulated). No GPU
(``--cpu-ranks N``, default 2 without a GPU): a smoke run with tiny shapes; its numbers say nothing.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402  spawn, seeds, the timing protocol, env tags, writers

TOLERANCE = 2e-2  # bf16 GEMMs block differently per row count: per row in value, not bitwise


@dataclasses.dataclass
class Method:
    name: str
    fn: Callable  # fn(ctx, bufs)
    needs: Optional[Callable] = None
    prepare: Optional[Callable] = None


def shared_expert(moe: harness.MoeStandIn) -> Callable:
    """``fn(rows, out)``: the stand-in's shared expert alone, a per-row function (its routed experts route by
    chunk size, so they are not: the check uses this one)."""
    inter = moe.shape.inter

    def fn(rows: torch.Tensor, out: torch.Tensor) -> None:
        gu = torch.mm(rows, moe.w_gate_up)
        torch.mm(torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:], moe.w_down, out=out)

    return fn


def make_methods(c: harness.Ctx, moe: Callable, chunk_rows: List[int]) -> Tuple[List[Method], Dict[str, Callable]]:
    """The timed methods with ``moe(rows, out)`` as the consumer, and the boundary calls among them
    (name -> fn(x) -> out [n, H])."""
    nsa, L, g = c.nsa, c.layout, c.group

    def moe_into(rows: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(rows)  # the stand-in writes its shared expert there, then adds the routed rows
        moe(rows, out)
        return out

    def serialized(x):
        rows = nsa.cp_all_gather(x, L, g, compact=True)
        partials = nsa.cp_reduce_scatter_buffer(rows, L, g, compact=True)
        moe(rows, partials)
        return nsa.cp_reduce_scatter(partials, L, g, compact=True)

    def overlapped(chunk):
        return lambda x: nsa.cp_overlapped_boundary(x, L, lambda rows, ch: moe_into(rows), g,
                                                    chunk_rows=chunk or None)

    checked = {"serialized": serialized}
    checked.update({f"overlapped[{ch or 'slot'}]": overlapped(ch) for ch in dict.fromkeys(chunk_rows)})

    def comm(c_, b):
        rows = nsa.cp_all_gather(b["x"], L, g, compact=True)
        return nsa.cp_reduce_scatter(rows, L, g, compact=True)

    prepare = harness.p2p_prepare if c.device.type == "cuda" else None
    methods = [Method(name, (lambda f: lambda c_, b: f(b["x"]))(f), prepare=prepare) for name, f in checked.items()]
    methods += [Method("comm", comm, prepare=prepare), Method("moe", lambda c_, b: moe(b["all"], b["out"]))]
    return methods, checked


def check(c: harness.Ctx, checked: Dict[str, Callable], x: torch.Tensor) -> None:
    """Every checked method once on ``x``: finite and within TOLERANCE of ``serialized``; else abort. The P2P
    transport's gather buffers are NaN first (a row the serialized gather failed to write shows)."""
    harness.poison(c, [])
    ref = checked["serialized"](x).float()
    status = torch.zeros(len(checked), dtype=torch.int64, device=c.control)
    notes = {}
    for i, (name, fn) in enumerate(checked.items()):
        y = ref if name == "serialized" else fn(x).float()  # serialized: its finiteness only
        err = ((y - ref).norm() / ref.norm().clamp_min(1e-30)).item() if y.shape == ref.shape else math.inf
        if y.shape != ref.shape or not torch.isfinite(y).all() or err > TOLERANCE:
            status[i] = harness.BAD
            notes[name] = f"shape {list(y.shape)} vs {list(ref.shape)}, relative L2 {err:.3g} (tolerance {TOLERANCE})"
    harness.verdicts(c, list(checked), status, notes)


def run_config(c: harness.Ctx, moe: harness.MoeStandIn, args, cfg: int, log) -> Tuple[List[dict], Dict[str, str]]:
    L = c.layout
    log(f"[{cfg + 1}] counts {list(c.counts)}  T {L.total_len}  H {c.hidden}")
    methods, _ = make_methods(c, moe, args.chunk_rows)
    active, skipped = harness.runnable(c, methods)
    seed = harness.seed_of(args.seed, cfg, c.rank)
    check(c, make_methods(c, shared_expert(moe), args.chunk_rows)[1],
          harness.randn((c.n, c.hidden), seed, c.dtype, c.device))
    set_bytes = (c.n + 2 * L.total_len) * c.hidden * c.dtype.itemsize
    bufsets = [{"x": harness.randn((c.n, c.hidden), harness.seed_of(seed, k), c.dtype, c.device),
                "all": harness.randn((L.total_len, c.hidden), harness.seed_of(seed, 50 + k), c.dtype, c.device),
                "out": torch.empty((L.total_len, c.hidden), dtype=c.dtype, device=c.device)}
               for k in range(harness.rotating_sets(c.device, set_bytes, args.max_bufs))]
    stats = harness.time_methods(c, active, bufsets, args.rounds, args.warmup)
    transport = ("P2P" if c.device.type == "cuda" and c.nsa.transport.get_p2p(c.group) is not None
                 else dist.get_backend(c.group))
    del bufsets
    harness.release_memory(c.device)
    comm_ms, moe_ms, ser_ms = stats["comm"]["ms"], stats["moe"]["ms"], stats["serialized"]["ms"]
    rows = []
    for m in active:
        st = stats[m.name]
        over = m.name.startswith("overlapped")
        rows.append({
            "config": cfg, "counts": "/".join(map(str, c.counts)), "cp": c.world, "total_len": L.total_len,
            "hidden": c.hidden, "dtype": args.dtype, "method": m.name, "device_ms": st["ms"], "min_ms": st["min_ms"],
            "spread": st["spread"], "host_ms": st["host_ms"],
            "x_serialized": st["ms"] / ser_ms if ser_ms > 0 else float("nan"),
            "hidden_frac": (ser_ms - st["ms"]) / comm_ms if over and comm_ms > 0 else float("nan"),
            "exposed_over_comm": (st["ms"] - moe_ms) / comm_ms if over and comm_ms > 0 else float("nan"),
            "serialized_transport": transport, "rounds": args.rounds, "warmup": args.warmup,
        })
    return rows, skipped


def worker(rank, world, mode, port, args, configs, result_path):
    device = harness.init_rank(rank, world, mode, port)
    torch.set_grad_enabled(False)
    nsa = harness.import_nsa_cp()
    dtype = harness.DTYPES[args.dtype]
    shape = harness.MOE_DEEPSEEK_V3 if mode == "nccl" else harness.MOE_SMOKE
    shape = dataclasses.replace(shape, hidden=args.hidden or shape.hidden)
    # every rank's own experts (and shared-expert weights): the reduce-scatter sums distinct partials
    moe = harness.MoeStandIn(shape, world, device, dtype, seed=harness.seed_of(args.seed, 7, rank))
    log = harness.rank_log(rank)
    log(f"MoE stand-in per rank: H {shape.hidden}, shared expert {shape.inter}, {shape.routed // world} of "
        f"{shape.routed} routed experts, top-{shape.topk}")

    def make_ctx(layout):
        return harness.Ctx(nsa, layout, None, rank, world, device, dist.get_backend(), shape.hidden, dtype)

    harness.run_rank(rank, device, nsa, configs, args, make_ctx, lambda c, i: run_config(c, moe, args, i, log),
                     {"tags": None, "rows": [], "skipped": {}}, result_path)


# ============================================================================ report
def format_table(result: dict) -> str:
    tags = result["tags"]
    lines = [harness.smoke_note(tags) or "x serialized: device ms over the serialized boundary's, same run; hidden "
             "= (serialized - overlapped) / comm; exp/comm = (overlapped - moe) / comm",
             harness.header_line(tags)]
    hdr = f"{'method':<20}{'device ms':>11}{'host ms':>10}{'x serialized':>14}{'hidden':>9}{'exp/comm':>10}"

    def head(r0):
        return [f"counts [{r0['counts'].replace('/', ', ')}]  cp {r0['cp']}  T {r0['total_len']}  H {r0['hidden']} "
                f"{r0['dtype']}  serialized over {r0['serialized_transport']}  ({r0['rounds']} rounds)", hdr]

    def line(r):
        return (f"{r['method']:<20}{r['device_ms']:>11.4f}{r['host_ms']:>10.4f}{harness.cell(r['x_serialized'], '.3f'):>14}"
                f"{harness.cell(r['hidden_frac'], '.0%'):>9}"
                f"{harness.cell(r['exposed_over_comm'], '.2f'):>10}")

    lines += harness.config_sections(result, head, line, 20)
    return "\n".join(lines)


# ============================================================================ command line
def parse_args(argv=None):
    p = harness.arg_parser(__doc__, epilog="Usage, methods, what is derived and the modes: the module docstring "
                                           "of benchmarks/overlapped_boundary.py.")
    p.add_argument("--M", type=int, nargs="+", help="longest real shard sweep (GPUs: 2048 4096 8192; CPU: 16 40)")
    p.add_argument("--imbalance", type=float, default=0.2, help="s: real counts [M, round(M*(1-s)), M, ...]")
    p.add_argument("--chunk-rows", type=int, nargs="+", default=[0], help="overlapped rows: chunk_rows values "
                   "(0: one chunk per rank's slot)")
    p.add_argument("--hidden", type=int, help="row width (GPUs: 7168, the MoE stand-in's; CPU: 256)")
    p.add_argument("--dtype", choices=("bf16",), default="bf16")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--max-bufs", type=int, default=2, help="most rotating input sets per configuration")
    p.add_argument("--gpus", type=int, help="ranks on GPUs of their own (default: every visible GPU)")
    p.add_argument("--cpu-ranks", type=int, metavar="N", help="N gloo ranks on the CPU (default 2 without a GPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--csv", help="one row per (configuration, method)")
    p.add_argument("--json", help="the same rows as JSON")
    p.set_defaults(align=1)
    args = p.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0 or min(args.chunk_rows) < 0:
        p.error("--rounds must be >= 1, --warmup and --chunk-rows >= 0")
    if not 0.0 <= args.imbalance < 1.0:
        p.error(f"--imbalance {args.imbalance}: expected 0 <= s < 1")
    return args


def choose_mode(args) -> Tuple[str, int]:
    """``(mode, world)``: "nccl" (2+ GPUs, one per rank) or "cpu" (``--cpu-ranks N``, or no GPU: 2)."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.cpu_ranks is not None or gpus == 0:
        return "cpu", args.cpu_ranks or 2
    world = args.gpus or gpus
    if world > gpus:
        raise SystemExit(f"--gpus {world}: only {gpus} visible")
    if world < 2:
        raise SystemExit("overlapped_boundary.py needs 2+ CUDA GPUs, one per rank (NCCL), found 1: ranks sharing "
                         "one GPU would stage the overlapped boundary through host memory. On one GPU, "
                         "benchmarks/overlap.py measures the mechanism with the link emulated")
    return "nccl", world


def main(argv=None):
    args = parse_args(argv)
    harness.check_output_paths([("--csv", args.csv), ("--json", args.json)])  # before anything is measured
    harness.keep_multicast_off()
    mode, world = choose_mode(args)
    if world < 2:
        raise SystemExit(f"need at least 2 ranks, have {world}")
    routed = (harness.MOE_DEEPSEEK_V3 if mode == "nccl" else harness.MOE_SMOKE).routed
    if routed % world:
        raise SystemExit(f"{world} ranks: the MoE stand-in's {routed} routed experts do not split over them")
    args.M = args.M or ([2048, 4096, 8192] if mode == "nccl" else [16, 40])
    configs = harness.imbalanced_counts(args.M, world, args.imbalance)
    if mode == "cpu":
        print(f"*** {harness.SMOKE} ***", flush=True)
    result = harness.run_ranks(worker, world, mode, args, configs, prefix="overlapped_boundary_",
                               what="overlapped_boundary.py")
    print(format_table(result), flush=True)  # the table last; files after
    harness.write_rows(result["tags"], result["rows"], args.csv, args.json, skipped=result["skipped"])


if __name__ == "__main__":
    harness.run_main(main)
