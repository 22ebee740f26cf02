"""SGLang 0.5.23's MoE boundary per side: SGLang's own path against nsa_cp's plugin path, without SGLang.

Usage::

    python benchmarks/sglang_boundary.py                       # 2+ GPUs: one per rank, M in 256 2048 8192 32768
    python benchmarks/sglang_boundary.py --counts 8192,6000 --compact --csv sb.csv --json sb.json
    python benchmarks/sglang_boundary.py                       # 1 GPU: ranks share it (plugin rows, total work)
    python benchmarks/sglang_boundary.py --cpu-ranks 2 --M 16 --hidden 128 --rounds 2   # CPU/gloo smoke run

SGLang's shapes, per rank: every shard is padded up front to ``physical`` rows (the longest real shard
rounded up to a multiple of ``2 * cp``, ``cp/padding.pad_logical_token_to_physical``), of which ``n_r`` are
real (counts ``[M, round(0.8 M), ...]`` cycling over the ranks, ``--imbalance``, or ``--counts``); hidden
``H`` (7168), bf16. The plugin's layout is ``ShardLayout(counts, align=physical)`` (``max_rank_len =
physical``). SGLang's steps are emulated with the kernels and collectives it runs (no SGLang import):

* gather, ``sglang``: the read step, residual add + RMSNorm IN PLACE on all ``physical`` local rows
  (``nsa_cp.rows.norm.fused_add_rmsnorm_into(x, res, w, eps, out=x)``: flashinfer's ``fused_add_rmsnorm`` where
  it imports, else nsa_cp's Triton kernel; the torch reference on the CPU; the output says which), then
  ``all_gather_into_tensor`` of the equal shards into a fresh ``[physical * cp, H]``.
* gather, ``plugin``: ``CpMovesAdapter.gather_rows``' fused path: ``residual[n:physical].add_(x[n:physical])``
  for the padding rows, then ONE ``fused_add_rmsnorm_all_gather(x[:n], residual[:n], ...)``
  (``--compact``: also ``plugin_compact``, the ``[T, H]`` gather).
* scatter, ``sglang``: ``reduce_scatter_tensor`` of the padded ``[physical * cp, H]`` partials into a fresh
  ``[physical, H]``.
* scatter, ``plugin``: ``CpMovesAdapter.reduce_scatter``: ``out = new_empty([physical, H])``,
  ``out[n:].zero_()``, ``cp_reduce_scatter(partials, ..., out=out[:n])``, the partials where the MoE wrote
  them: ``plugin``, the buffer the plugin hands the MoE (``cp_reduce_scatter_buffer``, the P2P transport's
  reduce buffer: no copy in; staged once, untimed, as layer_tail.py's boundary rows do); ``plugin_inplace``,
  the tensor the plugin's gather returned (SGLang's default in-place MoE: the transport copies it into
  its reduce buffer first).

The plugin rows take the P2P transport (``nsa_cp.init_p2p(group, physical, H, dtype, device)`` per
configuration, ``harness.p2p_prepare``: what the plugin's scheduler hook creates); where the transport
cannot be made on a GPU they are skipped, saying why. On the CPU they take nsa_cp's gloo path.

Columns, per method: ``device ms`` (harness.time_methods: warm-up, rounds of the side's methods in a
per-round order, CUDA events after an untimed aligner, the host enqueuing ahead; median over rounds, MAX
over ranks), ``x sglang`` (device ms over the sglang row of the same side, same run), ``host ms`` (the
time the call took to return on the host, the same calls; SGLang's eager time is about the larger of the
two), ``GPU ops`` (kernels + memcpys + memsets per call, torch.profiler's CUDA events over
``--profile-calls`` calls, the most of any rank; n/a on the CPU), ``MB/call`` (HBM bytes by the formulas
below), ``floor ms`` (those bytes over the device-to-device copy rate measured in the same run, a copy of
at least as many bytes as the largest method moves, at least 256 MiB, as stages.py measures its floor) and
``x floor`` (device ms / floor ms). Every method is first checked once on fresh seeded inputs (P2P gather
buffers poisoned with NaN) against its float32 reference (relative L2 <= 1e-2; the plugin's padding rows
zero); any mismatch aborts the run.

HBM bytes per call: rows of ``H * element size`` bytes that one rank's own calls read and write (a write
into a peer's buffer counts once, where issued; the weight's H elements are left out). ``P = physical``,
``n`` = the rank's real rows, ``T = sum(n)``, ``cp`` ranks:

* gather ``sglang``:  norm ``4 P`` (read x, residual; write residual, y) + all-gather ``P + cp P``
  (read the shard, write the output)                                                 = ``(5 + cp) P``
* gather ``plugin``:  padding add ``3 (P - n)`` (read x, residual; write residual) + fused ``3 n``
  (read x, residual; write residual) + ``cp n`` (the normed rows pushed to every rank) + padded only:
  ``cp P - T`` (the padding rows of its own gather buffer zeroed)       = ``3 P + cp n (+ cp P - T)``
* scatter ``sglang``: read the ``cp P`` partial rows, write ``P``                       = ``(cp + 1) P``
* scatter ``plugin``: ``P - n`` (zero the padding rows) + ``cp n`` (pull its rows from every rank) + ``n``
  (write them); ``plugin_inplace`` adds ``2 cp P`` (compact ``2 T``), the copy into the reduce buffer
                                                                                 = ``P + cp n (+ copy)``

The floor takes the busiest rank's bytes with one GPU per rank, and every rank's together when the ranks
share one GPU (they share its memory). The plugin formulas are the P2P transport's.

Modes, and what each can say:

* 2+ GPUs (``nccl``, one process per GPU, ``--gpus N``): every row runs; ``x sglang`` is the plugin's
  device time over SGLang's on the same side; this is the comparison.
* 1 GPU (``--shared-gpu N``, default 2 ranks on cuda:0): gloo for control, the P2P transport over CUDA IPC
  (``NSA_CP_P2P_MEMORY=cuda_ipc``) for data. Only the plugin rows run, against the floor: the sglang rows'
  gloo collective is not SGLang's NCCL, so the plugin / sglang comparison is NOT run, and the output says
  so. The GPU time-slices the ranks' kernels: each time is the total work of every rank, not a latency.
* no GPU (``--cpu-ranks N``, default 2): gloo ranks on the CPU, a smoke run of this script and of nsa_cp's
  CPU path; its numbers say nothing about GPUs, and it says so.

This file holds the command line, the run and the report; ``sglang_boundary_methods.py`` (its part,
imported by it alone) the methods, their checks, the byte formulas, the copy rate and the GPU operation
count. ``--csv`` / ``--json``: one row per (configuration, method), tagged as every benchmark tags its rows.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402  spawn, seeds, the timing protocol, env tags, writers
from sglang_boundary_methods import (SIDES, BoundaryCtx, Method, check_methods, copy_gbps, gpu_ops,  # noqa: E402
                                     hbm_bytes, make_bufs, make_methods, physical_of, set_bytes)

SHARED_NOTE = ("ranks SHARE ONE GPU (gloo for control, P2P over CUDA IPC for data): each time is the total work of "
               "every rank, not a latency, and the floor counts every rank's bytes. The two-GPU comparison "
               "(plugin / sglang) was NOT run: the sglang rows would time gloo, not SGLang's NCCL. On 1x H200 "
               "(2026-12-01) every row read 4.5-4.9 ms at M = 2048 and 8192 alike: a P2P kernel spins until "
               "the peer process has launched its own, so these device times hold the processes' skew, not "
               "the kernels' work; read the GPU ops and bytes here, and time the stages one process at a time "
               "(benchmarks/stages.py)")


def norm_label(device: torch.device, dtype: torch.dtype) -> str:
    """Which kernel ``nsa_cp.rows.norm.fused_add_rmsnorm_into(x, res, w, eps, out=x)`` runs for SGLang's read step."""
    if device.type != "cuda":
        return "torch reference (nsa_cp.rows.reference, CPU)"
    from nsa_cp.rows.norm import flashinfer_norm_module

    if dtype in (torch.bfloat16, torch.float16) and flashinfer_norm_module() is not None:
        return "flashinfer fused_add_rmsnorm (in place)"
    return "nsa_cp Triton add + RMSNorm (in place; flashinfer does not import here)"


def transport_label(c: BoundaryCtx) -> str:
    if c.device.type != "cuda":
        return "nsa_cp's gloo path (CPU)"
    t = c.nsa.transport.get_p2p(c.group)
    return f"P2P ({t.memory}, {t.max_tokens_per_rank} rows/rank)" if t is not None else "no P2P transport"


# ============================================================================ the run
def run_config(c: BoundaryCtx, methods: List[Method], args, cfg: int, log) -> Tuple[List[dict], Dict[str, str]]:
    L = c.layout
    log(f"[{cfg + 1}] counts {list(c.counts)}  physical {c.physical}  padded {L.padded_len} rows, real {L.total_len}")
    active, skipped = harness.runnable(c, methods)
    seed = harness.seed_of(args.seed, cfg)
    skipped.update(check_methods(c, active, seed, log))
    active = [m for m in active if m.name not in skipped]
    nbytes = {m.name: hbm_bytes(c, m) for m in methods}
    floor_mib = 256 if c.device.type == "cuda" else 8
    gbps = copy_gbps(c, max([floor_mib << 20] + list(nbytes.values())), args.rounds)
    nbuf = harness.rotating_sets(c.device, set_bytes(c), args.max_bufs)
    bufsets = [make_bufs(c, c.rank, harness.seed_of(seed, 100 + k)) for k in range(nbuf)]
    stats, ops = {}, {}
    for side in SIDES:  # gather first: the scatter's staged partials may live in the gather buffer
        ms = [m for m in active if m.side == side]
        if not ms:
            continue
        for stage in dict.fromkeys(m.stage for m in ms if m.stage):
            stage(c, bufsets[0])
        stats.update(harness.time_methods(c, ms, bufsets, args.rounds, args.warmup, ahead=not args.cold))
        ops.update(gpu_ops(c, ms, bufsets[0], args.profile_calls, log if cfg == 0 else None))
    transport = transport_label(c)
    del bufsets
    harness.release_memory(c.device, c.extra)
    rows = []
    for m in active:
        st, base = stats[m.name], stats.get(f"{m.side}/sglang")
        floor_ms = nbytes[m.name] / (gbps * 1e9) * 1e3 if gbps > 0 else float("nan")
        rows.append({
            "config": cfg, "counts": "/".join(map(str, c.counts)), "physical": c.physical, "cp": c.world,
            "padded_len": L.padded_len, "total_len": L.total_len, "hidden": c.hidden, "dtype": args.dtype,
            "side": m.side, "method": m.label, "what": m.what,
            "device_ms": st["ms"], "min_ms": st["min_ms"], "spread": st["spread"], "host_ms": st["host_ms"],
            "x_sglang": st["ms"] / base["ms"] if base and m.plugin and base["ms"] > 0 else float("nan"),
            "gpu_ops_per_call": ops.get(m.name), "hbm_bytes": nbytes[m.name],
            "hbm_rule": "every rank (shared GPU)" if c.shared_gpu else "busiest rank",
            "copy_GBps": gbps, "floor_ms": floor_ms, "x_floor": st["ms"] / floor_ms if floor_ms > 0 else float("nan"),
            "rounds": args.rounds, "warmup": args.warmup, "nbuf": nbuf,
            "timing": ("cold" if args.cold else "ahead") + "+aligned", "transport": transport,
        })
    return rows, skipped


def worker(rank, world, mode, port, args, configs, result_path):
    device = harness.init_rank(rank, world, mode, port)
    torch.set_grad_enabled(False)
    nsa = harness.import_nsa_cp()
    from nsa_cp.rows.norm import fused_add_rmsnorm_into

    dtype = harness.DTYPES[args.dtype]
    w = (1.0 + 0.1 * harness.randn((args.hidden,), harness.seed_of(args.seed, 21), torch.float32, device)).to(dtype)
    log = harness.rank_log(rank)
    label = norm_label(device, dtype)
    log(f"SGLang's read step: {label}")
    methods = make_methods(args.compact)

    def make_ctx(layout):  # SGLang's layout: every shard padded to physical rows
        counts = layout.per_rank_actual_token
        P = physical_of(counts, world)
        return BoundaryCtx(nsa, nsa.ShardLayout(counts, align=P), None, rank, world, device, dist.get_backend(),
                           args.hidden, dtype, physical=P, w=w, norm=fused_add_rmsnorm_into)

    harness.run_rank(rank, device, nsa, configs, args, make_ctx, lambda c, i: run_config(c, methods, args, i, log),
                     {"tags": None, "rows": [], "skipped": {}, "norm": label}, result_path)


# ============================================================================ report
def format_table(result: dict, mode: str) -> str:
    tags, lines = result["tags"], []
    smoke = harness.smoke_note(tags)
    lines.append(smoke or (f"*** {SHARED_NOTE} ***" if mode == "shared-gpu" else
                           "x sglang: the plugin's device ms over SGLang's, same side, same run"))
    lines.append(harness.header_line(tags))
    lines.append(f"SGLang's read step: {result['norm']}; floor: HBM bytes per call (docstring) / the copy rate "
                 f"measured in this run")
    hdr = (f"{'side':<8}{'method':<24}{'device ms':>10}{'x sglang':>9}{'host ms':>9}{'GPU ops':>8}{'MB/call':>9}"
           f"{'floor ms':>10}{'x floor':>9}")

    def head(r0):
        return [f"counts [{r0['counts'].replace('/', ', ')}]  physical {r0['physical']}  cp {r0['cp']}  "
                f"H {r0['hidden']} {r0['dtype']}  plugin: {r0['transport']}  copy {r0['copy_GBps']:.0f} GB/s "
                f"({r0['rounds']} rounds, bytes of the {r0['hbm_rule']})", hdr]

    def line(r):
        return (f"{r['side']:<8}{r['method']:<24}{r['device_ms']:>10.4f}{harness.cell(r['x_sglang'], '.2f'):>9}"
                f"{r['host_ms']:>9.4f}{harness.cell(r['gpu_ops_per_call'], 'g'):>8}{r['hbm_bytes'] / 1e6:>9.2f}"
                f"{r['floor_ms']:>10.3g}{r['x_floor']:>9.3g}")

    lines += harness.config_sections(result, head, line, 32)
    return "\n".join(lines)


# ============================================================================ command line
def parse_args(argv=None):
    p = argparse.ArgumentParser(description="\n\n".join(__doc__.split("\n\n")[:3]),
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="What is measured, the byte formulas and what each mode can say: the "
                                       "module docstring of benchmarks/sglang_boundary.py.")
    p.add_argument("--M", type=int, nargs="+", help="longest real shard sweep (GPUs: 256 2048 8192 32768; one GPU: "
                   "256 2048; CPU: 16 64)")
    p.add_argument("--imbalance", type=float, default=0.2, help="s: real counts [M, round(M*(1-s)), M, ...]")
    p.add_argument("--counts", action="append", metavar="a,b,...", help="explicit real counts per rank (repeatable); "
                   "replaces --M")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--compact", action="store_true", help="also the plugin's compact rows (NSA_CP_SGLANG_COMPACT=1)")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--cold", action="store_true", help="no GPU sleep before a round (launch-bound rows at host time)")
    p.add_argument("--max-bufs", type=int, default=8, help="most rotating buffer sets per configuration")
    p.add_argument("--profile-calls", type=int, default=3, help="calls per method under torch.profiler for the GPU "
                   "operation count (0: no count)")
    p.add_argument("--gpus", type=int, help="ranks on GPUs of their own (default: every visible GPU)")
    p.add_argument("--shared-gpu", type=int, metavar="N", help="N ranks (2-8) sharing cuda:0 (the default on one GPU, "
                   "N = 2): plugin rows only, total work")
    p.add_argument("--cpu-ranks", type=int, metavar="N", help="N gloo ranks on the CPU (default 2 without a GPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--csv", help="one row per (configuration, method)")
    p.add_argument("--json", help="the same rows as JSON")
    p.set_defaults(align=1)  # harness.run_rank's layout; each configuration then takes SGLang's (align=physical)
    args = p.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0 or args.profile_calls < 0:
        p.error("--rounds must be >= 1, --warmup and --profile-calls >= 0")
    return args


def choose_mode(args) -> Tuple[str, int]:
    """``(mode, world)``: "nccl" (2+ GPUs, one per rank), "shared-gpu" (one GPU, or ``--shared-gpu N``) or
    "cpu" (``--cpu-ranks N``, or no GPU: 2 ranks)."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.cpu_ranks is not None:
        return "cpu", args.cpu_ranks
    if gpus == 0:
        if args.shared_gpu is not None:
            raise SystemExit(f"--shared-gpu {args.shared_gpu}: needs a CUDA GPU, found none")
        return "cpu", 2
    world = args.gpus or gpus
    if world > gpus:
        raise SystemExit(f"--gpus {world}: only {gpus} visible")
    if args.shared_gpu is None and world >= 2:
        return "nccl", world
    n = args.shared_gpu or 2
    if not 2 <= n <= 8:
        raise SystemExit(f"--shared-gpu {n}: expected 2 to 8 ranks (the P2P kernels serve up to 8)")
    return "shared-gpu", n


def make_configs(args, world: int) -> List[Tuple[int, ...]]:
    if args.counts:
        configs = [tuple(int(v) for v in spec.split(",") if v.strip()) for spec in args.counts]
    else:
        if not 0.0 <= args.imbalance < 1.0:
            raise SystemExit(f"--imbalance {args.imbalance}: expected 0 <= s < 1")
        configs = harness.imbalanced_counts(args.M, world, args.imbalance)
    for cfg in configs:
        if len(cfg) != world or min(cfg) < 0 or max(cfg) < 1:
            raise SystemExit(f"counts {list(cfg)}: expected {world} counts >= 0, one at least 1")
    return configs


def main(argv=None):
    args = parse_args(argv)
    harness.check_output_paths([("--csv", args.csv), ("--json", args.json)])  # before anything is measured
    harness.keep_multicast_off()
    mode, world = choose_mode(args)
    if world < 2:
        raise SystemExit(f"need at least 2 ranks, have {world}")
    args.M = args.M or {"nccl": [256, 2048, 8192, 32768], "shared-gpu": [256, 2048], "cpu": [16, 64]}[mode]
    configs = make_configs(args, world)
    if mode == "shared-gpu":
        os.environ.setdefault("NSA_CP_P2P_MEMORY", "cuda_ipc")  # the ranks' processes inherit it
        print(f"*** {SHARED_NOTE} ***", flush=True)
        even = [c for c in configs if min(c) == physical_of(c, world)]
        configs = [c for c in configs if c not in even]
        if even:  # an even layout takes the plain NCCL collective by contract, which needs a GPU per rank
            print(f"ranks sharing one GPU: even layouts {[list(c) for c in even]} dropped", flush=True)
        if not configs:
            raise SystemExit("ranks sharing one GPU: no uneven layout left to time (--imbalance > 0 or --counts)")
    elif mode == "cpu":
        print(f"*** {harness.SMOKE} ***", flush=True)
    result = harness.run_ranks(worker, world, mode, args, configs,
                               prefix="sglang_boundary_", what="sglang_boundary.py")
    print(format_table(result, mode), flush=True)  # the table last; files after
    harness.write_rows(result["tags"], result["rows"], args.csv, args.json, skipped=result["skipped"],
                       norm=result["norm"])


if __name__ == "__main__":
    harness.run_main(main)
