"""Distributed benchmark: nsa_cp's uneven all-gather / reduce-scatter against torch/NCCL baselines.

Usage::

    python benchmarks/gather_scatter.py                          # every visible GPU, default sweep
                                                                 # (one GPU: the stages, benchmarks/stages.py)
    python benchmarks/gather_scatter.py --shared-gpu 4           # 4 ranks sharing cuda:0 (P2P rows; total work)
    python benchmarks/gather_scatter.py --M 8192 --imbalance 0.2 --rounds 50 --csv out.csv
    python benchmarks/gather_scatter.py --counts 4096,4096,7936,8192 --hidden 7168
    python benchmarks/gather_scatter.py --seq-lens '700*64' --seq-lens '32768,4096*6' --page-size 64
    python benchmarks/gather_scatter.py --cpu-ranks 2 --M 64 --rounds 3   # CPU/gloo smoke run
    python benchmarks/gather_scatter.py --agreement --M 2048 8192          # the agreement check's cost (NCCL)

Per configuration (a list of per-rank counts): every method checked once on NaN-poisoned outputs against
the expected outputs each rank builds from seeded inputs (gathers exactly, reduce-scatters against the
float32 sum), then timed interleaved over rounds (``harness.time_methods``); bandwidth in the nccl-tests
convention (``metrics``). The methods (``METHODS``, one line each; ``--methods`` selects by name or glob),
the protocol, the metrics and the outputs: docs/performance.md, "Method".

This file declares what is measured: the buffers and seeded inputs, the methods, their expected outputs
and the bandwidth rule (``metrics``). Its parts, imported by it alone: ``gather_scatter_check.py`` (the
check on poisoned outputs), ``gather_scatter_symm.py`` (the rows of NCCL on symmetric buffers),
``gather_scatter_report.py`` (tables, host-time summary, merged result), ``gather_scatter_cli.py``
(arguments, modes, configurations). What every benchmark shares: ``harness.py``.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402  spawn, seeds, poisoning, the timing protocol, env tags, writers
from harness import Ctx  # noqa: E402

# this benchmark's parts (no other benchmark imports them): check, report, command line, symmetric-memory rows
from gather_scatter_check import check_methods  # noqa: E402
from gather_scatter_cli import choose_mode, make_configs, stage_argv  # noqa: E402
from gather_scatter_cli import parse_args as _parse_args  # noqa: E402
from gather_scatter_report import (EVEN, SHARED_GPU_NOTE, format_host_summary, format_table,  # noqa: E402
                                   merge_results)
from gather_scatter_symm import symm_ag, symm_bind, symm_needs, symm_rs, symm_setup  # noqa: E402

# Reduce-scatter tolerance: rtol = RS_TOL, atol = RS_TOL * P (about 8 eps; NCCL may round each of the
# P-1 partial sums, whose magnitude grows like sqrt(P)). A wrong row misses by O(sqrt(P)).
RS_TOL = {torch.bfloat16: 3e-2, torch.float16: 4e-3, torch.float32: 1e-5}


# ============================================================================ buffers
@dataclasses.dataclass
class Bufs:
    """One rotating set of inputs and outputs. ``x`` is a view of the first n_r rows of ``x_full``."""

    x_full: torch.Tensor  # [M, H]    input of even_ag
    x: torch.Tensor  # [n_r, H]  local shard
    y_pad: torch.Tensor  # [M*P, H]  reduce-scatter input, padded layout (padding rows random)
    y_cmp: torch.Tensor  # [T, H]    reduce-scatter input, compact layout (same real rows)
    out_pad: torch.Tensor  # [M*P, H]  gather output, padded
    out_cmp: torch.Tensor  # [T, H]    gather output, compact
    rs_full: torch.Tensor  # [M, H]    output of even_rs
    rs_out: torch.Tensor  # [n_r, H]  view of rs_full's first n_r rows
    idx: int = 0  # which rotating set this is
    # buffers a method's ``bind`` hook attaches (e.g. symmetric-memory copies of the inputs); those
    # listed in ``extra_outputs`` are poisoned before the correctness check like the outputs above
    extra: Dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    extra_outputs: List[torch.Tensor] = dataclasses.field(default_factory=list)

    def outputs(self) -> List[torch.Tensor]:
        return [self.out_pad, self.out_cmp, self.rs_full, *self.extra_outputs]


def _inputs_of(rank, layout, hidden, dtype, device, seed) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_full [M,H], y_cmp [T,H], y_pad [M*P,H]) of ``rank``: any rank can rebuild any rank's inputs."""
    M, T, P = layout.max_rank_len, layout.total_len, layout.cp_size
    x_full = harness.randn((M, hidden), harness.seed_of(seed, 1, rank), dtype, device)
    y_cmp = harness.randn((T, hidden), harness.seed_of(seed, 2, rank), dtype, device)
    y_pad = harness.randn((M * P, hidden), harness.seed_of(seed, 3, rank), dtype, device)
    for q, (off, n) in enumerate(zip(layout.offsets, layout.per_rank_actual_token)):
        y_pad[q * M : q * M + n] = y_cmp[off : off + n]
    return x_full, y_cmp, y_pad


def make_bufs(ctx: Ctx, hidden, dtype, seed, idx: int = 0) -> Bufs:
    x_full, y_cmp, y_pad = _inputs_of(ctx.rank, ctx.layout, hidden, dtype, ctx.device, seed)
    L = ctx.layout
    rs_full = torch.empty((ctx.M, hidden), dtype=dtype, device=ctx.device)
    return Bufs(
        x_full=x_full,
        x=x_full[: ctx.n],
        y_pad=y_pad,
        y_cmp=y_cmp,
        out_pad=torch.empty((L.padded_len, hidden), dtype=dtype, device=ctx.device),
        out_cmp=torch.empty((L.total_len, hidden), dtype=dtype, device=ctx.device),
        rs_full=rs_full,
        rs_out=rs_full[: ctx.n],
        idx=idx,
    )


def bytes_per_set(layout, hidden, dtype) -> int:
    row = hidden * torch.tensor([], dtype=dtype).element_size()
    M, T, PM = layout.max_rank_len, layout.total_len, layout.padded_len
    return row * (M + PM + T + PM + T + M)


# ============================================================================ methods
# Each method: fn(ctx, bufs) -> its output tensor. ``kind`` says which global layout it produces or
# consumes ("even" | "padded" | "compact"): it picks the expected output and the rows counted in algbw.
@dataclasses.dataclass(frozen=True)
class Method:
    name: str
    direction: str  # "ag" | "rs"
    kind: str  # "even" | "padded" | "compact" | "ordered" (compact rows in batch order)
    fn: Callable[[Ctx, Bufs], torch.Tensor]
    needs: Optional[Callable[[Ctx], Optional[str]]] = None  # -> reason to skip, or None
    prepare: Optional[Callable[[Ctx], None]] = None  # once per configuration, before the check
    stage: Optional[Callable[[Ctx, Bufs], None]] = None  # before the check's call only (not timed)
    # waits on the host for the GPU (validation's verdict): timed in rounds of its own, since a host
    # sync inside a round would drain the run-ahead of every method after it
    syncs_host: bool = False
    # once per configuration, after the rotating buffer sets exist (untimed): attach per-set buffers
    bind: Optional[Callable[[Ctx, List["Bufs"]], None]] = None
    # which processes run it: "main", or "symm" (separate processes whose symmetric-memory backend is
    # NCCL: torch fixes that backend per process at the first allocation, and the P2P transport of
    # the main processes allocates with the CUDA backend)
    process: str = "main"

    @property
    def is_nsa(self) -> bool:
        return self.name.startswith("nsa_")


def even_ag(c: Ctx, b: Bufs):
    harness.all_gather_single(b.out_pad, b.x_full, group=c.group)
    return b.out_pad


def fpad_ag(c: Ctx, b: Bufs):
    harness.all_gather_single(b.out_pad, F.pad(b.x, (0, 0, 0, c.M - c.n)), group=c.group)
    return b.out_pad


def fpad_ag_compact(c: Ctx, b: Bufs):
    full = fpad_ag(c, b)
    return torch.cat([full[r * c.M : r * c.M + n] for r, n in enumerate(c.counts)])


_ORDER: Dict[tuple, Tuple[torch.Tensor, torch.Tensor]] = {}


def _order(c: Ctx) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(positions, gather_index)`` of this configuration, the same on every rank: positions, a fixed
    permutation of the T batch rows (compact row i goes to batch row positions[i], as
    ``torch.cat(nsa_cp.in_seq_positions(...))`` would give); gather_index, the padded row each batch row
    comes from (what SGLang's ``index_select`` after a padded gather uses)."""
    key = (c.counts, c.M, str(c.device))
    if key not in _ORDER:
        T = c.layout.total_len
        g = torch.Generator().manual_seed(harness.seed_of(T, c.M, 7))
        positions = torch.randperm(T, generator=g)
        padded_row = torch.cat([torch.arange(n) + r * c.M for r, n in enumerate(c.counts)])
        gather_index = torch.empty(T, dtype=torch.int64)
        gather_index[positions] = padded_row
        _ORDER[key] = (positions.to(c.device), gather_index.to(c.device))
    return _ORDER[key]


def fpad_ag_index_select(c: Ctx, b: Bufs):
    """What a user writes for batch order: F.pad + all-gather, then index_select of the real rows."""
    return fpad_ag(c, b).index_select(0, _order(c)[1])


def nsa_ag_ordered(p2p: bool):
    """cp_all_gather(positions=...): every rank's rows straight to their batch rows (backend "nccl", or
    the P2P rows' ``Ctx.p2p_backend``)."""

    def fn(c: Ctx, b: Bufs):
        backend = c.p2p_backend if p2p else "nccl"
        return c.nsa.cp_all_gather(b.x, c.layout, c.group, positions=_order(c)[0], backend=backend)

    return fn


def list_ag(c: Ctx, b: Bufs):
    dist.all_gather(list(b.out_cmp.split(c.counts)), b.x, group=c.group)
    return b.out_cmp


def even_rs(c: Ctx, b: Bufs):
    harness.reduce_scatter_single(b.rs_full, b.y_pad, group=c.group)
    return b.rs_out


def list_rs(c: Ctx, b: Bufs):
    dist.reduce_scatter(b.rs_out, list(b.y_cmp.split(c.counts)), group=c.group)
    return b.rs_out


def nsa_ag(compact: bool, **kw):
    """A method calling ``nsa_cp.cp_all_gather(compact=..., **kw)`` into the preallocated output."""

    def fn(c: Ctx, b: Bufs):
        out = b.out_cmp if compact else b.out_pad
        return c.nsa.cp_all_gather(b.x, c.layout, c.group, compact=compact, out=out, **kw)

    return fn


def nsa_rs(compact: bool, **kw):
    """A method calling ``nsa_cp.cp_reduce_scatter(compact=..., **kw)`` into the preallocated output."""

    def fn(c: Ctx, b: Bufs):
        y = b.y_cmp if compact else b.y_pad
        return c.nsa.cp_reduce_scatter(y, c.layout, c.group, compact=compact, out=b.rs_out, **kw)

    return fn


def nsa_torch_nccl(fn):
    """``fn`` with ``NSA_CP_NCCL_CALL=direct``: the NCCL path through torch's process group even where
    ``init_nccl`` made nsa_cp's own communicator (the before/after of that communicator, in one run)."""
    return harness.with_env(fn, "NSA_CP_NCCL_CALL", "direct")


def _native_nccl_needs(c: Ctx) -> Optional[str]:
    if c.backend != "nccl":
        return "nsa_cp's own NCCL communicator needs NCCL on CUDA GPUs"
    return None if c.nsa.transport.get_nccl(c.group) is not None else "no native NCCL communicator (--native-nccl off or refused)"


def p2p_ag(compact: bool, engine: str):
    """The P2P transport's gather with a forced engine; returns the view of its gather buffer (its runner
    built once per transport, layout and row shape, as the plan caches it)."""
    runners = {}

    def fn(c: Ctx, b: Bufs):
        transport, key = c.nsa.transport.get_p2p(c.group), (c.layout, tuple(b.x.shape[1:]))
        built = runners.get(key)
        if built is None or built[0] is not transport:
            runners.clear()  # a new transport: the old runners point into freed buffers
            built = runners[key] = (transport, transport.gather_runner(c.layout, compact, key[1], engine=engine))
        return built[1](b.x)

    return fn


def p2p_auto_ag(compact: bool):
    """cp_all_gather with backend='auto' after init_p2p: what a user gets (P2P for uneven layouts)."""

    def fn(c: Ctx, b: Bufs):
        return c.nsa.cp_all_gather(b.x, c.layout, c.group, compact=compact, backend=c.p2p_backend)

    return fn


def p2p_rs(compact: bool):
    """cp_reduce_scatter, auto backend, on the buffer the communicator hands the MoE
    (``NSACPLayerCommunicator.mlp_output_buffer``, i.e. ``cp_reduce_scatter_buffer``; with P2P the
    transport's reduce buffer, so no copy before the pull). The buffer is looked up once per
    configuration (``p2p_bind``), as a layer loop would per batch, so the call's host time is the
    reduce-scatter's alone."""
    key = f"mlp_out_{int(compact)}"

    def fn(c: Ctx, b: Bufs):
        return c.nsa.cp_reduce_scatter(b.extra[key], c.layout, c.group, compact=compact, out=b.rs_out,
                                       backend=c.p2p_backend)

    return fn


def p2p_bind(compact: bool):
    key = f"mlp_out_{int(compact)}"

    def bind(c: Ctx, bufsets: List[Bufs]):
        # what the communicator's mlp_output_buffer returns in full mode, asked of the public function it calls
        buf = c.nsa.cp_reduce_scatter_buffer(bufsets[0].x, c.layout, c.group, compact=compact, backend=c.p2p_backend)
        for b in bufsets:
            b.extra[key] = buf

    return bind


def p2p_stage(compact: bool):
    key = f"mlp_out_{int(compact)}"

    def stage(c: Ctx, b: Bufs):
        b.extra[key].copy_(b.y_cmp if compact else b.y_pad)

    return stage


SHARED_GPU_SKIP = "ranks share one GPU over gloo: only the P2P rows run (no NCCL; gloo would time host copies)"


def _nccl_only(what):
    return lambda c: None if c.backend == "nccl" else f"{c.backend} does not support {what}"


def nsa_nccl_rows(d: str, call) -> List[Method]:
    """nsa_cp's NCCL-path rows of direction ``d`` (``call``: nsa_ag or nsa_rs): padded and compact, compact
    with each algorithm forced, through torch's communicator (``_torch``), and with validation on."""
    return [
        Method(f"nsa_{d}_padded", d, "padded", call(False, backend="nccl")),
        Method(f"nsa_{d}_compact", d, "compact", call(True, backend="nccl")),
        Method(f"nsa_{d}_compact_padded", d, "compact", call(True, algo="padded", backend="nccl")),
        Method(f"nsa_{d}_compact_coalesced", d, "compact", call(True, algo="coalesced", backend="nccl")),
        Method(f"nsa_{d}_padded_torch", d, "padded", nsa_torch_nccl(call(False, backend="nccl")), _native_nccl_needs),
        Method(f"nsa_{d}_compact_torch", d, "compact", nsa_torch_nccl(call(True, backend="nccl")), _native_nccl_needs),
        Method(f"nsa_{d}_padded_validated", d, "padded", call(False, backend="nccl", validate=True), syncs_host=True),
    ]


# One line per method. A transport variant is one more line, e.g.
#   Method("nsa_ag_compact_p2p", "ag", "compact", nsa_ag(True, backend="p2p"), needs=..., prepare=...)
# with ``needs`` returning why it cannot run here (or None) and ``prepare`` doing per-configuration setup.
METHODS: List[Method] = [
    # ---- all-gather
    Method("even_ag", "ag", "even", even_ag),
    Method("fpad_ag", "ag", "padded", fpad_ag),
    Method("fpad_ag_compact", "ag", "compact", fpad_ag_compact),
    Method("list_ag", "ag", "compact", list_ag, _nccl_only("uneven all_gather lists")),
    Method("fpad_ag_index_select", "ag", "ordered", fpad_ag_index_select),
    *nsa_nccl_rows("ag", nsa_ag),
    Method("nsa_ag_padded_auto", "ag", "padded", p2p_auto_ag(False), harness.p2p_needs, harness.p2p_prepare),
    Method("nsa_ag_compact_auto", "ag", "compact", p2p_auto_ag(True), harness.p2p_needs, harness.p2p_prepare),
    Method("nsa_ag_ordered", "ag", "ordered", nsa_ag_ordered(p2p=False)),
    Method("nsa_ag_ordered_auto", "ag", "ordered", nsa_ag_ordered(p2p=True), harness.p2p_needs, harness.p2p_prepare),
    Method("p2p_ag_padded_sm", "ag", "padded", p2p_ag(False, "sm"), harness.p2p_needs, harness.p2p_prepare),
    Method("p2p_ag_padded_ce", "ag", "padded", p2p_ag(False, "ce"), harness.p2p_needs, harness.p2p_prepare),
    Method("p2p_ag_compact_sm", "ag", "compact", p2p_ag(True, "sm"), harness.p2p_needs, harness.p2p_prepare),
    Method("p2p_ag_compact_ce", "ag", "compact", p2p_ag(True, "ce"), harness.p2p_needs, harness.p2p_prepare),
    Method("symm_ag", "ag", "even", symm_ag, symm_needs, bind=symm_bind, process="symm"),
    # ---- reduce-scatter
    Method("even_rs", "rs", "even", even_rs),
    Method("list_rs", "rs", "compact", list_rs),
    *nsa_nccl_rows("rs", nsa_rs),
    Method("nsa_rs_padded_auto", "rs", "padded", p2p_rs(False), harness.p2p_needs, harness.p2p_prepare,
           p2p_stage(False), bind=p2p_bind(False)),
    Method("nsa_rs_compact_auto", "rs", "compact", p2p_rs(True), harness.p2p_needs, harness.p2p_prepare,
           p2p_stage(True), bind=p2p_bind(True)),
    Method("symm_rs", "rs", "even", symm_rs, symm_needs, bind=symm_bind, process="symm"),
]


def select_methods(patterns: Optional[str], process: Optional[str] = None) -> List[Method]:
    """Methods matching any comma-separated name/glob; the even reference of each direction is kept.
    With ``process``, only that process kind's methods (plus the even references, which every kind
    times so that its ``x even`` compares within its own processes); empty when it has none."""
    if patterns:
        chosen = harness.match_names(patterns, [m.name for m in METHODS])
    else:
        chosen = {m.name for m in METHODS}
    if process is not None:
        chosen = {m.name for m in METHODS if m.name in chosen and m.process == process}
    for m in METHODS:
        if m.name in chosen:
            chosen.add(EVEN[m.direction])
    if process is not None and not any(m.process == process for m in METHODS if m.name in chosen):
        return []
    return [m for m in METHODS if m.name in chosen]


# ============================================================================ correctness
def _expected_outputs(ctx: Ctx, hidden, dtype, seed):
    """Expected outputs built locally from every rank's (re-drawn) inputs: no collective involved."""
    L, M, P = ctx.layout, ctx.M, ctx.world
    xs = [_inputs_of(q, L, hidden, dtype, ctx.device, seed)[0] for q in range(P)]
    ag = {
        "even": torch.cat(xs),
        "padded": torch.cat([F.pad(x[:n], (0, 0, 0, M - n)) for x, n in zip(xs, ctx.counts)]),
        "compact": torch.cat([x[:n] for x, n in zip(xs, ctx.counts)]),
    }
    ag["ordered"] = torch.empty_like(ag["compact"])
    ag["ordered"][_order(ctx)[0]] = ag["compact"]
    a, b = L.offsets[ctx.rank], L.offsets[ctx.rank] + ctx.n
    acc = torch.zeros((b - a, hidden), dtype=torch.float32, device=ctx.device)
    for q in range(P):  # one rank's inputs at a time: bounded memory at large P*M
        acc += _inputs_of(q, L, hidden, dtype, ctx.device, seed)[1][a:b].float()
    return ag, acc.to(dtype)





# ============================================================================ metrics and rows
def metrics(method: Method, layout, hidden, dtype, ms) -> Dict[str, float]:
    P, counts = layout.cp_size, layout.per_rank_actual_token
    row = hidden * torch.tensor([], dtype=dtype).element_size()
    rows = layout.total_len if method.kind in ("compact", "ordered") else layout.padded_len
    if method.direction == "ag":
        link_rows = (P - 1) * max(counts)
    else:
        link_rows = layout.total_len - min(counts)
    s = ms * 1e-3
    algbw = rows * row / s / 1e9 if s > 0 else float("nan")
    return {
        "bytes": rows * row,
        "algbw_GBps": algbw,
        "busbw_GBps": algbw * (P - 1) / P,
        "link_GBps": link_rows * row / s / 1e9 if s > 0 else float("nan"),
    }


# ============================================================================ worker
def _shared_gpu_refuses(ctx: Ctx, m: Method) -> Optional[str]:
    return SHARED_GPU_SKIP if ctx.shared_gpu and m.needs is not harness.p2p_needs else None


def run_config(ctx: Ctx, methods, args, cfg_idx, log) -> Tuple[List[dict], Dict[str, str]]:
    dtype, hidden, L = harness.DTYPES[args.dtype], args.hidden, ctx.layout
    pad = (L.padded_len - L.total_len) / L.padded_len if L.padded_len else 0.0
    log(f"[{cfg_idx + 1}] counts {list(ctx.counts)}  M={ctx.M}  total={L.total_len}  padding {pad:.1%}")
    active, skipped = harness.runnable(ctx, methods, _shared_gpu_refuses)
    nbuf = harness.rotating_sets(ctx.device, bytes_per_set(L, hidden, dtype), args.max_bufs)
    bufsets = [make_bufs(ctx, hidden, dtype, harness.seed_of(args.seed, cfg_idx, b), b) for b in range(nbuf)]
    for bind in dict.fromkeys(m.bind for m in active if m.bind):  # each hook once, in order
        bind(ctx, bufsets)
    ag_ref, rs_ref = _expected_outputs(ctx, hidden, dtype, harness.seed_of(args.seed, cfg_idx, 0))
    skipped.update(check_methods(ctx, active, bufsets[0], ag_ref, rs_ref, RS_TOL[dtype], RS_TOL[dtype] * ctx.world, log))
    active = [m for m in active if m.name not in skipped]
    stats = {}
    for group in ([m for m in active if not m.syncs_host], [m for m in active if m.syncs_host]):
        if group:
            # a syncing method cannot run ahead: no head-start sleep, which it would only wait out
            ahead = not args.cold and not group[0].syncs_host
            stats.update(harness.time_methods(ctx, group, bufsets, args.rounds, args.warmup, ahead=ahead))
    del bufsets
    harness.release_memory(ctx.device)
    rows = []
    for m in active:
        st = stats[m.name]
        even = stats.get(EVEN[m.direction])
        rows.append(
            {
                "config": cfg_idx,
                "counts": "/".join(map(str, ctx.counts)),
                "max_rank_len": ctx.M,
                "total_len": L.total_len,
                "padded_len": L.padded_len,
                "padding_frac": pad,
                "hidden": hidden,
                "dtype": args.dtype,
                "align": args.align,
                "direction": m.direction,
                "method": m.name,
                "layout_rows": "compact" if m.kind in ("compact", "ordered") else "padded",
                "time_ms": st["ms"],
                "min_ms": st["min_ms"],
                "spread": st["spread"],
                "host_ms": st["host_ms"],
                **metrics(m, L, hidden, dtype, st["ms"]),
                "x_even": st["ms"] / even["ms"] if even else float("nan"),
                "rounds": args.rounds,
                "warmup": args.warmup,
                "timing": ("cold" if args.cold else "ahead") + "+aligned",
                "nbuf": nbuf,
            }
        )
    return rows, skipped


def worker(rank, world, mode, port, args, configs, result_path, process="main"):
    device = harness.init_rank(rank, world, mode, port)
    use_cuda = mode == "nccl"
    if process == "symm":
        symm_setup()  # before anything allocates symmetric memory in this process
    nsa = harness.import_nsa_cp()
    methods = select_methods(args.methods, process)
    if use_cuda and process == "main" and args.native_nccl == "auto" and hasattr(nsa, "init_nccl"):
        harness.init_native_nccl(nsa, rank, device)  # the NCCL path's uneven calls take it (nsa_*_torch: without it)
    log = harness.rank_log(rank)
    harness.run_rank(
        rank, device, nsa, configs, args,
        lambda layout: Ctx(nsa, layout, None, rank, world, device, dist.get_backend(), args.hidden,
                           harness.DTYPES[args.dtype]),
        lambda ctx, i: run_config(ctx, methods, args, i, log),
        {"tags": None, "rows": [], "skipped": {}}, result_path, row_tags={"process": process})


# ============================================================================ main
def parse_args(argv=None):
    return _parse_args(argv, __doc__)


def main(argv=None):
    args = parse_args(argv)
    harness.check_output_paths([("--csv", args.csv), ("--json", args.json)])  # before anything is measured
    harness.keep_multicast_off()
    if args.agreement:  # the agreement check's cost: its own mode (gather_scatter_agreement.py)
        import gather_scatter_agreement

        gather_scatter_agreement.run(args)
        return
    mode, world = choose_mode(args)
    if mode == "stages":
        print("one CUDA GPU: no link to time between ranks here (ranks sharing this GPU would move rows through "
              "its own memory, not NVLink), so this run times the stages of the collectives on this GPU against "
              "torch (and flashinfer where installed) and the HBM floor. The collective rows with ranks sharing "
              "the GPU: --shared-gpu N (total work, not latency).", flush=True)
        # benchmarks/stages.py in a process of its own (no benchmark imports another); its exit status is ours
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stages.py")
        code = subprocess.run([sys.executable, script, *stage_argv(args)]).returncode
        if code:
            raise SystemExit(code)
        return
    if mode == "nccl":
        args.M = args.M or [256, 2048, 8192, 32768]
    elif mode == "shared-gpu":
        args.M = args.M or [256, 2048]  # every rank's buffers live on the one GPU
        print(f"*** {SHARED_GPU_NOTE} ***", flush=True)
    else:
        args.M = args.M or [64, 256]
        print(f"*** {harness.SMOKE} ***", flush=True)
    if world < 2:
        raise SystemExit(f"need at least 2 ranks, have {world} (use --cpu-ranks N for a CPU run)")
    configs = make_configs(args, world)
    if mode == "shared-gpu":
        even = [c for c in configs if len(set(c)) == 1]
        configs = [c for c in configs if len(set(c)) > 1]
        if even:  # the contract keeps the plain collective for even layouts: NCCL, which cannot run here
            print(f"ranks sharing one GPU: even layouts {[list(c) for c in even]} dropped (they take the plain "
                  f"NCCL collective, which needs a GPU per rank)", flush=True)
        if not configs:
            raise SystemExit("ranks sharing one GPU: no uneven layout left to time (use --imbalance > 0 or --counts)")
    result = _spawn(world, mode, args, configs, "main") if select_methods(args.methods, "main") else None
    symm = None
    if select_methods(args.methods, "symm") and args.symm != "off":
        # the even layout of every M swept (the symmetric rows are plain collectives on even shards)
        even = list(dict.fromkeys(tuple([max(c)] * world) for c in configs))
        if mode == "nccl":
            print(f"NCCL on symmetric buffers: separate processes, even layouts M = {[c[0] for c in even]}", flush=True)
            try:
                symm = _spawn(world, mode, args, even, "symm", timeout_s=args.symm_timeout)
            except Exception as e:  # noqa: BLE001 - the main run's rows stand; say why these are missing
                why = f"the symmetric-buffer run failed: {type(e).__name__}: {str(e).strip()[-300:]}"
                print(why, flush=True)
                symm = {"tags": None, "rows": [], "configs": [list(c) for c in even],
                        "skipped": {str(i): {"symm_ag": why, "symm_rs": why} for i in range(len(even))}}
        else:
            why = "symmetric memory needs NCCL with a GPU per rank (this is a run on gloo)"
            symm = {"tags": None, "rows": [], "skipped": {str(i): {"symm_ag": why, "symm_rs": why} for i in range(len(even))},
                    "configs": [list(c) for c in even]}
    result = merge_results(result, symm)
    # tables first, files after: a file that cannot be written loses no printed result
    print(format_table(result, cpu=mode == "cpu"), flush=True)
    print(format_host_summary(result), flush=True)
    harness.write_rows(result["tags"], result["rows"], args.csv, args.json, skipped=result["skipped"])


def _spawn(world, mode, args, configs, process, timeout_s: Optional[float] = None) -> dict:
    """Run ``worker`` on ``world`` processes (harness.spawn: the first failing rank ends the run with its
    traceback); with ``timeout_s``, stop them past it. Returns rank 0's result."""
    result = harness.run_ranks(worker, world, mode, args, configs, process, prefix="gather_scatter_",
                               timeout_s=timeout_s, what=f"gather_scatter.py ({process} run)")
    result["configs"] = [list(c) for c in configs]
    return result


if __name__ == "__main__":
    harness.run_main(main)
