"""gather_scatter.py's command line: its arguments, the mode a machine runs (ranks over NCCL, ranks sharing
one GPU, CPU ranks, or the stages on one GPU), the configurations swept and the arguments handed to
stages.py. A part of gather_scatter.py (no other benchmark imports it).
"""

from __future__ import annotations

import argparse

import os
import sys
from typing import List, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402  spawn, seeds, poisoning, the timing protocol, env tags, writers
harness.part_of("gather_scatter.py", __name__)  # run as a script, it says which script to run


def parse_args(argv=None, doc: str = ""):
    """gather_scatter.py's arguments (``doc``: its docstring, the --help text)."""
    p = harness.arg_parser(doc)
    p.add_argument("--M", type=int, nargs="+", help="max_rank_len sweep (GPU: 256 2048 8192 32768; CPU: 64 256)")
    p.add_argument("--imbalance", type=float, nargs="+", default=[0.0, 0.2, 0.5],
                   help="s: counts [M, round(M*(1-s)), M, ...] cycling over ranks; 0 is the even case")
    p.add_argument("--counts", action="append", metavar="a,b,...",
                   help="explicit per-rank counts (repeatable); replaces the M x imbalance sweep")
    p.add_argument("--seq-lens", action="append", metavar="L*n,...",
                   help="a prefill batch (e.g. '700*64' or '32768,1024*8'), split with nsa_cp.in_seq_split over "
                        "the ranks and --page-size (repeatable); replaces the M x imbalance sweep")
    p.add_argument("--page-size", type=int, default=64, help="page size of --seq-lens batches")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--dtype", choices=sorted(harness.DTYPES), default="bf16")
    p.add_argument("--align", type=int, default=1, help="ShardLayout align")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--cold", action="store_true",
                   help="no GPU sleep before a round: launch-bound methods are timed at their host time")
    p.add_argument("--warmup", type=int, default=5, help="calls of every method before timing")
    p.add_argument("--methods", help="comma-separated names or globs (even_ag/even_rs always kept)")
    p.add_argument("--gpus", type=int, help="ranks on GPU (default: every visible GPU)")
    p.add_argument("--cpu-ranks", type=int, help="run N gloo ranks on the CPU (default 2 when no GPU)")
    p.add_argument("--shared-gpu", type=int, metavar="N",
                   help="N ranks (2-8) sharing cuda:0: gloo for control, P2P over CUDA IPC for data; only the P2P "
                        "rows run, and their times are the total work of every rank, not latency")
    p.add_argument("--max-bufs", type=int, default=8, help="most rotating buffer sets per configuration")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--symm", choices=("auto", "off"), default="auto",
                   help="auto: also time NCCL on symmetric buffers (symm_ag/symm_rs, separate processes); off: don't")
    p.add_argument("--symm-timeout", type=float, default=120.0,
                   help="seconds the symmetric-buffer processes may take before they are terminated")
    p.add_argument("--native-nccl", choices=("auto", "off"), default="auto",
                   help="auto: nsa_cp.init_nccl before the sweep, so the nsa_* NCCL rows use nsa_cp's own NCCL "
                        "communicator (the nsa_*_torch rows go through torch's); off: torch's everywhere")
    p.add_argument("--agreement", action="store_true",
                   help="time the agreement check's cost instead (gather_scatter_agreement.py): the same calls with "
                        "NSA_CP_AGREEMENT off, auto and separate; NCCL, one rank per GPU, one GPU is enough")
    p.add_argument("--ref-ms", type=_ref_ms, metavar="M=ms,...",
                   help="--agreement: a gather's time per M (e.g. 2048=0.141: 2 ranks' even all-gather) to give "
                        "the check's added time as a share of")
    p.add_argument("--csv", help="write one row per (configuration, method)")
    p.add_argument("--json", help="same rows as JSON")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0:
        p.error("--rounds must be >= 1 and --warmup >= 0")
    return args


def _ref_ms(text: str):
    try:
        return {int(m): float(ms) for m, ms in (item.split("=") for item in text.split(",") if item.strip())}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected M=ms,..., got {text!r}") from None


def choose_mode(args) -> Tuple[str, int]:
    """``(mode, world)``: "nccl" with one process per GPU (2+ GPUs), "shared-gpu" (``--shared-gpu N``),
    "cpu" (``--cpu-ranks N``, or no GPU: 2 ranks), or ("stages", 1) on a machine with one GPU."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.cpu_ranks is not None:
        return "cpu", args.cpu_ranks
    if args.shared_gpu is not None:
        if gpus < 1:
            raise SystemExit(f"--shared-gpu {args.shared_gpu}: needs a CUDA GPU, found none")
        if not 2 <= args.shared_gpu <= 8:
            raise SystemExit(f"--shared-gpu {args.shared_gpu}: expected 2 to 8 ranks (the P2P kernels serve up to 8)")
        return "shared-gpu", args.shared_gpu
    if gpus == 0:
        return "cpu", 2
    world = args.gpus or gpus
    if world > gpus:
        raise SystemExit(f"--gpus {world}: only {gpus} visible")
    return ("nccl", world) if world >= 2 else ("stages", 1)


def stage_argv(args) -> List[str]:
    """The stage benchmark's arguments (stages.py) from this script's: sizes, rounds and outputs."""
    argv = ["--hidden", str(args.hidden), "--dtype", args.dtype, "--rounds", str(args.rounds),
            "--warmup", str(args.warmup), "--max-bufs", str(args.max_bufs), "--seed", str(args.seed)]
    if args.M:
        argv += ["--M", *map(str, args.M)]
    for flag, value in (("--csv", args.csv), ("--json", args.json)):
        if value:
            argv += [flag, value]
    return argv


def parse_seq_lens(spec: str) -> List[int]:
    """'700*64' -> 64 requests of 700 tokens; '1000,32000,4096*3' -> 5 requests."""
    lens = []
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        length, _, repeat = item.partition("*")
        try:
            lens += [int(length)] * (int(repeat) if repeat else 1)
        except ValueError:
            raise SystemExit(f"--seq-lens {spec!r}: expected items L or L*count, got {item!r}") from None
    return lens


def make_configs(args, world) -> List[Tuple[int, ...]]:
    if args.counts or args.seq_lens:
        configs = []
        for spec in args.counts or []:
            counts = tuple(int(v) for v in spec.split(",") if v.strip())
            if len(counts) != world:
                raise SystemExit(f"--counts {spec!r}: {len(counts)} counts for {world} ranks")
            configs.append(counts)
        if args.seq_lens:
            from nsa_cp.geometry.split import in_seq_split  # the split rule of the package itself

            for spec in args.seq_lens:  # a prefill batch, split the way a model splits it
                configs.append(tuple(in_seq_split(parse_seq_lens(spec), world, args.page_size)))
        return configs
    configs = []
    for M in args.M:
        for s in args.imbalance:
            if not 0.0 <= s <= 1.0:
                raise SystemExit(f"--imbalance {s}: expected 0 <= s <= 1")
            pair = (M, int(round(M * (1.0 - s))))
            configs.append(tuple(pair[r % 2] for r in range(world)))
    return configs
