"""One-GPU benchmark: the stages of nsa_cp's collectives on one GPU, against torch, flashinfer (where
installed) and the HBM floor.

Usage::

    python benchmarks/stages.py                          # the GPU: M in 256 2048 8192 32768, cp 2
    python benchmarks/stages.py --M 8192 --cp 8 --csv stages.csv --json stages.json
    python benchmarks/stages.py --M 16 --hidden 256 --rounds 2    # no GPU: a CPU smoke run
    git show REV:nsa_cp/rows/kernels/norm_rows.py > /tmp/before.py
    python benchmarks/stages.py --M 32768 --kernels-before /tmp/before.py  # REV's row kernels beside today's

``python benchmarks/gather_scatter.py`` runs this on a machine with one GPU. One GPU has no link
between ranks to time (ranks sharing it would move rows through its own memory, not NVLink), so this
times what one GPU can time honestly: the local work around the links, per rank, for counts
``[M, round(0.8 M), ...]`` over ``--cp`` ranks, on a rank holding ``n = round(0.8 M)`` rows:

* ``pack / pad``: ``x [n, H]`` into its ``[M, H]`` slot of the padded gather buffer, padding rows zeroed
  (nsa_cp's row kernel, native where ``nsa_cp._C`` serves the GPU, then its Triton twin too) against
  ``F.pad`` and ``copy_`` + ``zero_``;
* ``add + RMSNorm``: ``s = x + residual`` in fp32, ``residual <- s``, ``y = rmsnorm(s) * weight`` of n
  rows (``nsa_cp.RMSNorm``, its Triton kernel) against the torch formula (SGLang's ``forward_native``)
  and flashinfer's ``fused_add_rmsnorm``;
* ``add + RMSNorm into the slot``: the same written straight into the padded slot (nsa_cp's fused
  kernel, the first step of ``fused_add_rmsnorm_all_gather``) against the torch formula + ``F.pad`` and
  flashinfer + nsa_cp's pack;
* ``FP8 quantization``: n rows to float8_e4m3fn groups of 128 with fp32 scales (``nsa_cp.quant_fp8_g128``)
  against the torch formula of SGLang's ``per_token_group_quant_fp8``; and the fused add + RMSNorm + FP8
  into the slot (``quant="fp8_e4m3_g128"``) against torch's norm + quantization + pad;
* ``compaction``: ``[cp*M, H]`` padded rows to ``[T, H]`` compact (nsa_cp's row kernels) against
  ``torch.cat`` of the slices and ``index_select(out=)``;
* ``fp32 accumulation``: the reduce-scatter's sum of ``cp`` partials ``[n, H]`` in fp32, rounded once
  (``torch.sum(dtype=float32)`` and a loop of fp32 adds). nsa_cp sums inside its P2P reduce-scatter
  kernel, which pulls from its peers: ``gather_scatter.py --shared-gpu N`` times that (total work).

Each stage's methods, their checks and byte floor: ``stages_methods.py`` (this benchmark's part, one
function per stage); this file holds the buffers, the single-process timing, the run and the report.

Floor: the fewest bytes each stage must move (each input read once, each output written once) over the
HBM bandwidth measured in the same run (a device-to-device copy of ``--floor-mib`` MiB, bytes read plus
written). ``x floor`` = time / that floor.

Protocol (docs/performance.md): every method is checked once before timing, on outputs poisoned with
NaN (row copies exactly, ``torch.equal``; norms against the fp32 formula within 2 bf16 ulps relative;
FP8 dequantized within 2e-2 relative; sums against fp64 within 1e-2 relative; NaN never passes); a
method that fails its check is reported and not timed, and the run exits with status 1. Then
``--warmup`` calls of every method, then ``--rounds`` rounds: the GPU sleeps so the host enqueues the
whole round ahead, every method once in an order permuted per round, each between two CUDA events,
inputs rotating among buffer sets (about 4x L2 in all). Median over rounds; ``spread`` is the
interquartile range / median. A CPU run times with ``perf_counter`` and is a smoke run: its numbers
say nothing about GPUs, and it says so.
"""

from __future__ import annotations

import dataclasses
import os
import random
import statistics
import sys
import time
from typing import Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from harness import DTYPES  # noqa: E402
# this benchmark's stages (its part)
from stages_methods import Method, load_row_kernels, methods_for, min_bytes  # noqa: E402

AHEAD_CYCLES_PER_METHOD = 2_000_000  # ~1 ms of GPU sleep per method: the host enqueues the round ahead


# ============================================================================ buffers
@dataclasses.dataclass
class Shape:
    M: int  # max_rank_len: rows of a slot
    n: int  # this rank's rows
    cp: int
    counts: List[int]
    hidden: int
    dtype: torch.dtype
    device: torch.device

    @property
    def T(self) -> int:
        return sum(self.counts)

    @property
    def elem(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


def make_set(s: Shape, seed: int) -> Dict[str, torch.Tensor]:
    """One rotating set of random inputs (never zeros) and outputs."""
    g = torch.Generator(device=s.device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(shape, generator=g, dtype=s.dtype, device=s.device)

    M, n, H, P = s.M, s.n, s.hidden, s.cp
    padded = randn(P * M, H)
    for r, c in enumerate(s.counts):  # padding rows of a padded buffer are zero, as the layout says
        padded[r * M + c:(r + 1) * M].zero_()
    return {
        "x": randn(n, H), "res": randn(n, H), "slot": torch.empty(M, H, dtype=s.dtype, device=s.device),
        "y": torch.empty(n, H, dtype=s.dtype, device=s.device),
        "q": torch.empty(M, H, dtype=torch.float8_e4m3fn, device=s.device),
        "scale": torch.empty(M, H // 128, dtype=torch.float32, device=s.device),
        "padded": padded, "compact": torch.empty(s.T, H, dtype=s.dtype, device=s.device),
        "partials": randn(P, n, H), "out": torch.empty(n, H, dtype=s.dtype, device=s.device),
    }


def set_bytes(s: Shape) -> int:
    M, n, H, P, e = s.M, s.n, s.hidden, s.cp, s.elem
    return H * (e * (4 * n + M + P * M + s.T + P * n) + M + M // 32)


# ============================================================================ torch equivalents
# ============================================================================ timing
def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_methods(methods: List[Method], sets: List[dict], rounds: int, warmup: int, dev) -> Dict[str, dict]:
    cuda = dev.type == "cuda"
    nm, nb = len(methods), len(sets)
    for k in range(warmup):
        for i, m in enumerate(methods):
            m.fn(sets[(k * nm + i) % nb])
    _sync(dev)
    samples: Dict[int, List[float]] = {i: [] for i in range(nm)}
    for r in range(rounds):
        order = random.Random(r).sample(range(nm), nm)
        if cuda:
            torch.cuda._sleep(AHEAD_CYCLES_PER_METHOD * nm)
        events = []
        for k, i in enumerate(order):
            b = sets[(r * nm + k) % nb]
            if cuda:
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                methods[i].fn(b)
                stop.record()
                events.append((i, start, stop))
            else:
                t0 = time.perf_counter()
                methods[i].fn(b)
                samples[i].append((time.perf_counter() - t0) * 1e3)
        if cuda:
            torch.cuda.synchronize(dev)
            for i, start, stop in events:
                samples[i].append(start.elapsed_time(stop))
    stats = {}
    for i, m in enumerate(methods):
        ts = sorted(samples[i])
        med = statistics.median(ts)
        q = statistics.quantiles(ts, n=4) if len(ts) >= 2 else [ts[0]] * 3
        stats[m.key] = {"ms": med, "min_ms": ts[0], "spread": (q[2] - q[0]) / med if med > 0 else 0.0}
    return stats


def hbm_bandwidth(dev, mib: int, rounds: int) -> float:
    """GB/s of a device-to-device copy of ``mib`` MiB (bytes read plus written), median of rounds."""
    src = torch.randn(mib << 18, device=dev)  # float32: 4 bytes each
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    _sync(dev)
    ts = []
    for _ in range(max(5, rounds)):
        if dev.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            stop.record()
            torch.cuda.synchronize(dev)
            ts.append(start.elapsed_time(stop))
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            ts.append((time.perf_counter() - t0) * 1e3)
    return 2 * src.numel() * 4 / (statistics.median(ts) * 1e-3) / 1e9


# ============================================================================ run
def run_size(M: int, args, dev, nsa, hbm_gbps: float, log, before=None) -> List[dict]:
    counts = [(M, round(0.8 * M))[r % 2] for r in range(args.cp)]
    s = Shape(M=M, n=round(0.8 * M), cp=args.cp, counts=counts, hidden=args.hidden, dtype=DTYPES[args.dtype],
              device=dev)
    log(f"M={M}: counts {counts}, this rank's n={s.n}, H={s.hidden} {args.dtype}")
    methods = methods_for(s, nsa, log, before)
    nbuf = harness.rotating_sets(dev, set_bytes(s), args.max_bufs)
    failed, skipped = {}, {}
    for i, m in enumerate(methods):  # each check on a fresh set: a method cannot pass on another's leftovers
        b = make_set(s, args.seed * 1000 + i + 7)
        try:
            why = m.check(b)
            _sync(dev)
        except Exception as e:  # noqa: BLE001 - a call this build refuses: skipped, saying why (not timed)
            skipped[m.key] = f"skipped: raised {type(e).__name__}: {str(e)[:300]}"
            log(f"  {m.key} {skipped[m.key]}")
            why = None
        if why:
            failed[m.key] = why
            print(f"CHECK FAILED M={M} {m.stage} / {m.name}: {why}", file=sys.stderr, flush=True)
        del b
    active = [m for m in methods if m.key not in failed and m.key not in skipped]
    log(f"  check: {len(active)} of {len(methods)} methods match their references"
        + (f", {len(skipped)} skipped" if skipped else ""))
    sets = [make_set(s, args.seed * 1000 + 100 + k) for k in range(nbuf)]
    stats = time_methods(active, sets, args.rounds, args.warmup, dev)
    del sets
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    base = {m.stage: stats[m.key]["ms"] for m in active if m.baseline}
    rows = []
    for m in methods:
        nbytes = min_bytes(m.stage, s)
        floor_ms = nbytes / (hbm_gbps * 1e9) * 1e3
        st = stats.get(m.key)
        row = {"stage": m.stage, "method": m.name, "M": M, "n": s.n, "cp": s.cp, "counts": "/".join(map(str, counts)),
               "hidden": s.hidden, "dtype": args.dtype, "min_bytes": nbytes, "hbm_GBps": hbm_gbps,
               "floor_ms": floor_ms, "rounds": args.rounds, "warmup": args.warmup, "nbuf": nbuf,
               "check": failed.get(m.key) or skipped.get(m.key) or "ok"}
        if st is None:
            row.update(time_ms=float("nan"), min_ms=float("nan"), spread=float("nan"), GBps=float("nan"),
                       x_floor=float("nan"), x_torch=float("nan"))
        else:
            ms = st["ms"]
            row.update(time_ms=ms, min_ms=st["min_ms"], spread=st["spread"],
                       GBps=nbytes / (ms * 1e-3) / 1e9 if ms > 0 else float("nan"),
                       x_floor=ms / floor_ms if floor_ms > 0 else float("nan"),
                       x_torch=ms / base[m.stage] if base.get(m.stage) else float("nan"))
        rows.append(row)
    return rows


def format_table(tags: dict, rows: List[dict]) -> str:
    lines = []
    smoke = harness.smoke_note(tags)
    if smoke:
        lines.append(smoke)
    lines.append(f"{tags['gpu']} | torch {tags['torch']} | triton {tags['triton']} | flashinfer {tags['flashinfer']}"
                 f" | nsa_cp {tags['nsa_cp']} (git {tags['git_rev']}) | {tags['date']}")
    lines.append("one GPU, one process: the stages of the collectives, no link (the collectives between ranks need a "
                 "GPU per rank; ranks sharing one GPU: gather_scatter.py --shared-gpu N)")
    hdr = f"  {'stage':<31}{'method':<34}{'ms':>9}{'spread':>8}{'GB/s':>9}{'x floor':>9}{'x torch':>9}"
    for M in sorted({r["M"] for r in rows}):
        rs = [r for r in rows if r["M"] == M]
        r0 = rs[0]
        lines += ["", f"M={M}  counts [{r0['counts'].replace('/', ', ')}]  n={r0['n']}  H={r0['hidden']} {r0['dtype']}"
                  f"  ({r0['rounds']} rounds, {r0['nbuf']} buffer sets; floor: min bytes at the measured HBM copy "
                  f"rate {r0['hbm_GBps']:.0f} GB/s)", hdr]
        stage = None
        for r in rs:
            label = r["stage"] if r["stage"] != stage else ""
            stage = r["stage"]
            if r["check"] != "ok":
                what = r["check"] if r["check"].startswith("skipped") else f"CHECK FAILED: {r['check']}"
                lines.append(f"  {label:<31}{r['method']:<34}  {what}")
                continue
            lines.append(f"  {label:<31}{r['method']:<34}{r['time_ms']:>9.4f}{r['spread']:>7.0%} {r['GBps']:>9.4g}"
                         f"{r['x_floor']:>9.2f}{r['x_torch']:>9.2f}")
        lines.append(f"  {'fp32 accumulation':<31}(nsa_cp sums inside its P2P reduce-scatter kernel, pulling from its "
                     f"peers: gather_scatter.py --shared-gpu N)")
    return "\n".join(lines)


def parse_args(argv=None):
    p = harness.arg_parser(__doc__)
    p.add_argument("--M", type=int, nargs="+", help="max_rank_len sweep (GPU: 256 2048 8192 32768; CPU: 64)")
    p.add_argument("--cp", type=int, default=2, help="ranks of the layout (counts [M, 0.8M, ...] cycling)")
    p.add_argument("--hidden", type=int, default=7168, help="row length (FP8 rows need a multiple of 128)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--max-bufs", type=int, default=8, help="most rotating buffer sets per size")
    p.add_argument("--floor-mib", type=int, default=1024, help="MiB of the HBM copy that sets the floor")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kernels-before", metavar="FILE",
                   help="a norm_rows.py of an earlier commit (git show REV:nsa_cp/rows/kernels/norm_rows.py > FILE): its "
                        "row-kernel stages are timed beside today's and checked bitwise against them")
    p.add_argument("--csv")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0 or args.cp < 1:
        p.error("--rounds and --cp must be >= 1, --warmup >= 0")
    return args


def main(argv=None):
    args = parse_args(argv)
    harness.check_output_paths([("--csv", args.csv), ("--json", args.json)])
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # nsa_cp's Triton kernels on CPU tensors (smoke run)
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    args.M = args.M or ([256, 2048, 8192, 32768] if cuda else [64])
    floor_mib = args.floor_mib if cuda else min(args.floor_mib, 64)
    torch.set_grad_enabled(False)
    nsa_cp = harness.import_nsa_cp()
    tags = harness.env_tags(dev, "none", 1, nsa_cp, "one GPU, one process: stages" if cuda else None)

    def log(msg):
        print(msg, flush=True)

    hbm = hbm_bandwidth(dev, floor_mib, args.rounds)
    log(f"HBM copy ({floor_mib} MiB, read + write): {hbm:.0f} GB/s")
    before = load_row_kernels(args.kernels_before) if args.kernels_before else None
    rows = []
    for M in args.M:
        rows += run_size(M, args, dev, nsa_cp, hbm, log, before)
    print(format_table(tags, rows), flush=True)  # tables first, files after
    harness.write_rows(tags, rows, args.csv, args.json)
    bad = [r for r in rows if r["check"] != "ok" and not r["check"].startswith("skipped")]
    if bad:
        raise SystemExit(f"{len(bad)} method(s) failed their check (see CHECK FAILED above)")


if __name__ == "__main__":
    harness.run_main(main)
