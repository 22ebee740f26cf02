"""Layer-tail benchmark: one decoder layer's MoE tail, eager, SGLang-style against nsa_cp's tails.

Usage::

    python benchmarks/layer_tail.py                              # every visible GPU, M in 256 2048 8192 32768
    python benchmarks/layer_tail.py --M 2048 --rounds 20 --csv tail.csv --json tail.json
    python benchmarks/layer_tail.py --cpu-ranks 2 --M 16 --hidden 256 --rounds 2   # CPU/gloo smoke run

One tail, on every rank, from the attention output ``x [n_r, H]`` and the residual ``[n_r, H]``:

    add + RMSNorm (post-attention) -> gather every rank's rows -> MoE stand-in (one kernel: the gathered
    rows times a per-rank constant, written into the buffer the reduce-scatter reads) ->
    reduce-scatter back to [n_r, H] -> add + RMSNorm (the next layer's input norm)

``--part boundary`` times the two halves of that boundary on their own instead (padded layout), with
the boundary's goals printed last as ratios per M: ``ag_sglang`` (baseline norm + F.pad + all-gather),
``ag_nsa_p2p`` (``cp_all_gather`` alone, P2P), ``normag_fused_{p2p,nccl}`` (``fused_add_rmsnorm_all_gather``),
``ag_fp8_p2p`` (``cp_all_gather(quant="fp8_e4m3_g128")`` alone), ``ag_dpfp8_sglang`` (baseline norm +
SGLang's FP8 DP-gather recipe: quantize the local rows, gather payload and scales, dequantize),
``normag_fp8_fused_p2p``; ``rs_sglang`` (``reduce_scatter_tensor`` + slice + baseline norm),
``rs_nsa_p2p`` (``cp_reduce_scatter`` alone from the P2P reduce buffer), ``rsnorm_fused_{p2p,nccl}``
(``reduce_scatter_fused_add_rmsnorm``). Each is checked once against its float32 reference (the plain
gather bitwise). The tail part prints the layer-tail goals last.

Rows of the tail part (``--methods`` selects by name or glob; ``sglang`` and ``sglang_fp8`` are always kept):

* ``sglang``          what SGLang 0.5.23 does at this boundary, written as a user would: the baseline
                      norm in place, ``F.pad`` to ``[M, H]`` + ``all_gather_into_tensor`` into a fresh
                      ``[M*P, H]``, the stand-in into a fresh buffer, ``reduce_scatter_tensor`` into a fresh
                      ``[M, H]`` + the slice ``[:n_r]``, the baseline norm.
* ``nsa_{p2p,nccl}_{padded,compact}``  ``NSACPLayerCommunicator`` (backend "p2p" / "nccl"), unfused:
                      its norms are plain functions around the baseline norm (no ``weight`` attribute,
                      so it keeps norm-then-gather): ``prepare_mlp`` -> stand-in into
                      ``mlp_output_buffer`` -> ``postprocess_layer`` -> next layer's ``prepare_attn``.
* ``fused_{p2p,nccl}_{padded,compact}``  ``nsa_cp.fused_add_rmsnorm_all_gather`` -> stand-in into the
                      communicator's ``mlp_output_buffer`` -> ``nsa_cp.reduce_scatter_fused_add_rmsnorm``
                      (the next layer's norm fused into the reduce-scatter).
* ``comm_fused_{p2p,nccl}_padded``  what a decoder loop on nsa_cp gets by default: communicators whose norms
                      are ``nsa_cp.RMSNorm`` (so ``prepare_mlp`` fuses norm + gather), chained with
                      ``set_next`` (``postprocess_layer`` fuses the reduce-scatter with the next layer's norm
                      and the next ``prepare_attn`` takes the pair as it is).
* ``sglang_fp8``      the FP8 MoE input as SGLang makes it: baseline norm, ``F.pad`` + all-gather of bf16,
                      then every rank quantizes every gathered row (``per_token_group_quant_fp8`` before
                      the FP8 MoE; ``nsa_cp.quant_fp8_g128`` stands in for SGLang's quantizer here, same
                      convention), the FP8 stand-in, reduce-scatter + slice, baseline norm.
* ``fused_fp8_{p2p,nccl}_{padded,compact}``  ``fused_add_rmsnorm_all_gather(quant="fp8_e4m3_g128")``: each
                      rank quantizes its own rows and the wire carries FP8 + scales; then as the fused rows.
                      Ratios of these rows are to ``sglang_fp8``.

The FP8 stand-in is two kernels (cast the FP8 rows to bf16, multiply by the group scales), the same in
every FP8 row. Baseline norm: flashinfer's ``fused_add_rmsnorm`` (in place) where importable and working,
else ``nsa_cp.RMSNorm``; the output says which (``--norm`` forces one). Rows whose API this checkout lacks
(the fused functions, a ``backend=`` argument to force NCCL under a registered P2P transport, the P2P
transport itself) are skipped, saying why.

Protocol: benchmarks/harness.py's, as for gather_scatter.py (docs/performance.md, "Method"):
one process per GPU, NCCL; gloo ranks on the CPU as a smoke test. Per configuration (counts
``[M, round(0.8 M)]`` by default):

1. Correctness, once per row: inputs drawn from seeds every rank knows (a different seed per row, so a
   row cannot pass on another row's leftovers), one tail, and the next layer's normed rows and the
   residual compared with a float32 reference built locally from every rank's inputs (relative L2 error
   <= 1e-2, FP8 rows 2e-2; NaN never passes). Any failure on any rank aborts the run.
2. ``device ms``: harness.time_methods: warm-up, then rounds; each round one barrier, a GPU sleep
   long enough for the host to enqueue the whole round (host enqueuing ahead), every row once in an order
   rotated per round, each between CUDA events after an untimed aligner; median over rounds, MAX over ranks.
3. ``host us/layer``: in the same calls, the host time a tail took to return (to enqueue its work).
4. ``eager ms``: host-inclusive, back to back: per round one barrier, then per row: aligner + device sync,
   ``--layers`` tails with no sync between them, device sync; (wall time) / layers. Median over rounds,
   MAX over ranks. Below about M = 1024 this is the host time; above, the device time.

This file declares the tail's rows and their expected output (``reference``); its parts, imported by
it alone: ``layer_tail_boundary.py`` (the ``--part boundary`` rows, their references and goals) and
``layer_tail_common.py`` (baseline norm, context, buffers, stand-ins, the row type, the check, eager timing).

``x sglang``: the row's time over its baseline's (``sglang``, or ``sglang_fp8`` for FP8 rows) in the same
run. ``--csv`` / ``--json``: one row per (configuration, row), tagged as every benchmark tags its rows
(``harness.env_tags``), plus the baseline norm.
"""

from __future__ import annotations

import inspect
import os
import sys
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402  spawn, seeds, the timing protocol, env tags, writers

# this benchmark's parts (no other benchmark imports them)
from layer_tail_boundary import BOUNDARY_ROWS, format_boundary_targets  # noqa: E402
from layer_tail_common import (EPS, FP8, BaseNorm, Row, TailBufs, TailCtx, _comm, _needs_fused,  # noqa: E402
                               _needs_p2p, _needs_quant, _prepare_p2p, _rms, check_rows, coef_of, make_tail_bufs,
                               quant_ref, standin_bf16, standin_fp8, time_eager, weights, _split_quant)

def sglang(c: TailCtx, b: TailBufs):
    M, n = c.M, c.n
    h, b.res = c.norm(b.x, b.res, c.w1)
    full = torch.empty((M * c.world, c.hidden), dtype=c.dtype, device=c.device)
    harness.all_gather_single(full, F.pad(h, (0, 0, 0, M - n)), group=c.group)
    partials = standin_bf16(c, full, torch.empty_like(full))
    mine = torch.empty((M, c.hidden), dtype=c.dtype, device=c.device)
    harness.reduce_scatter_single(mine, partials, group=c.group)
    return c.norm(mine[:n], b.res, c.w2)


def sglang_fp8(c: TailCtx, b: TailBufs):
    M, n = c.M, c.n
    h, b.res = c.norm(b.x, b.res, c.w1)
    full = torch.empty((M * c.world, c.hidden), dtype=c.dtype, device=c.device)
    harness.all_gather_single(full, F.pad(h, (0, 0, 0, M - n)), group=c.group)
    q, scale = c.nsa.quant_fp8_g128(full)  # stands in for SGLang's per_token_group_quant_fp8
    partials = standin_fp8(c, q, scale, torch.empty_like(full))
    mine = torch.empty((M, c.hidden), dtype=c.dtype, device=c.device)
    harness.reduce_scatter_single(mine, partials, group=c.group)
    return c.norm(mine[:n], b.res, c.w2)


def nsa_unfused(backend: str, compact: bool):
    def fn(c: TailCtx, b: TailBufs):
        comm = _comm(c, backend, compact)
        full, b.res = comm.prepare_mlp(b.x, b.res, c.layout)
        partials = standin_bf16(c, full, comm.mlp_output_buffer(c.layout, b.x))
        out, b.res = comm.postprocess_layer(partials, b.res, c.layout)
        return comm.prepare_attn(out, b.res, c.layout)

    return fn


def nsa_fused(backend: str, compact: bool, quant: Optional[str] = None):
    def fn(c: TailCtx, b: TailBufs):
        comm = _comm(c, backend, compact)
        kw = {"backend": backend} if c.fused_backend_kw else {}
        gathered, b.res = c.nsa.fused_add_rmsnorm_all_gather(
            b.x, b.res, c.w1, EPS, c.layout, c.group, compact=compact, quant=quant, **kw
        )
        buf = comm.mlp_output_buffer(c.layout, b.x)
        if quant is None:
            partials = standin_bf16(c, gathered, buf)
        else:
            partials = standin_fp8(c, *_split_quant(gathered), buf)
        return c.nsa.reduce_scatter_fused_add_rmsnorm(partials, b.res, c.w2, EPS, c.layout, c.group,
                                                      compact=compact, **kw)

    return fn


def _rmsnorm(c: TailCtx, weight: torch.Tensor):
    mod = c.nsa.RMSNorm(c.hidden, eps=EPS, dtype=c.dtype, device=c.device)
    mod.weight.data = weight
    mod.requires_grad_(False)
    return mod


def _comm_pair(c: TailCtx, backend: str, compact: bool):
    """(this layer's, the next layer's) communicators with nsa_cp.RMSNorm norms, chained (set_next): what
    a decoder loop on nsa_cp gets by default (fused norm+gather; reduce-scatter fused with the next norm)."""
    key = f"chained/{backend}/{int(compact)}"
    pair = c.comms.get(key)
    if pair is None:
        cls = c.nsa.NSACPLayerCommunicator
        this = cls(c.group, _rmsnorm(c, c.w2), _rmsnorm(c, c.w1), compact=compact, backend=backend)
        nxt = cls(c.group, _rmsnorm(c, c.w2), _rmsnorm(c, c.w1), compact=compact, backend=backend)
        this.set_next(nxt)
        pair = c.comms[key] = (this, nxt)
    return pair


def nsa_chained(backend: str, compact: bool):
    def fn(c: TailCtx, b: TailBufs):
        comm, nxt = _comm_pair(c, backend, compact)
        full, b.res = comm.prepare_mlp(b.x, b.res, c.layout)
        partials = standin_bf16(c, full, comm.mlp_output_buffer(c.layout, b.x))
        out, b.res = comm.postprocess_layer(partials, b.res, c.layout)
        return nxt.prepare_attn(out, b.res, c.layout)

    return fn


def _needs_chained(backend: str):
    def needs(c: TailCtx) -> Optional[str]:
        if not hasattr(c.nsa.NSACPLayerCommunicator, "set_next"):
            return "this nsa_cp's NSACPLayerCommunicator has no set_next (no fused chain)"
        return _needs_p2p(c) if backend == "p2p" else None

    return needs


ROWS: List[Row] = [
    Row("sglang", sglang, "SGLang-style: norm, F.pad + AG, stand-in, RS + slice, norm"),
    Row("nsa_p2p_padded", nsa_unfused("p2p", False), "communicator P2P padded, norm-then-gather", "bf16",
        _needs_p2p, _prepare_p2p),
    Row("nsa_p2p_compact", nsa_unfused("p2p", True), "communicator P2P compact, norm-then-gather", "bf16",
        _needs_p2p, _prepare_p2p),
    Row("nsa_nccl_padded", nsa_unfused("nccl", False), "communicator NCCL padded, norm-then-gather"),
    Row("nsa_nccl_compact", nsa_unfused("nccl", True), "communicator NCCL compact, norm-then-gather"),
    Row("fused_p2p_padded", nsa_fused("p2p", False), "fused norm+AG / RS+norm, P2P padded", "bf16",
        _needs_fused("p2p"), _prepare_p2p),
    Row("fused_p2p_compact", nsa_fused("p2p", True), "fused norm+AG / RS+norm, P2P compact", "bf16",
        _needs_fused("p2p"), _prepare_p2p),
    Row("fused_nccl_padded", nsa_fused("nccl", False), "fused norm+AG / RS+norm, NCCL padded", "bf16",
        _needs_fused("nccl")),
    Row("fused_nccl_compact", nsa_fused("nccl", True), "fused norm+AG / RS+norm, NCCL compact", "bf16",
        _needs_fused("nccl")),
    Row("comm_fused_p2p_padded", nsa_chained("p2p", False), "communicator, nsa_cp.RMSNorm norms, chained "
        "(fused by default), P2P padded", "bf16", _needs_chained("p2p"), _prepare_p2p),
    Row("comm_fused_nccl_padded", nsa_chained("nccl", False), "communicator, nsa_cp.RMSNorm norms, chained "
        "(fused by default), NCCL padded", "bf16", _needs_chained("nccl")),
    Row("sglang_fp8", sglang_fp8, "SGLang-style + quant of the gathered rows (nsa_cp.quant_fp8_g128 as "
        "per_token_group_quant_fp8)", "fp8", _needs_quant),
    Row("fused_fp8_p2p_padded", nsa_fused("p2p", False, FP8), "fused norm+FP8 AG / RS+norm, P2P padded", "fp8",
        _needs_fused("p2p", FP8), _prepare_p2p),
    Row("fused_fp8_p2p_compact", nsa_fused("p2p", True, FP8), "fused norm+FP8 AG / RS+norm, P2P compact", "fp8",
        _needs_fused("p2p", FP8), _prepare_p2p),
    Row("fused_fp8_nccl_padded", nsa_fused("nccl", False, FP8), "fused norm+FP8 AG / RS+norm, NCCL padded", "fp8",
        _needs_fused("nccl", FP8)),
]
BASELINE = {"bf16": "sglang", "fp8": "sglang_fp8"}


PART_ROWS = {"tail": ROWS, "boundary": BOUNDARY_ROWS}
PART_KEEP = {"tail": set(BASELINE.values()), "boundary": {"ag_sglang", "rs_sglang"}}


def baseline_of(row: Row) -> str:
    if row.baseline:
        return row.baseline
    return BASELINE[row.wire] if row.ref is None else row.name


def select_rows(patterns: Optional[str], part: str = "tail") -> List[Row]:
    rows = PART_ROWS[part]
    if not patterns:
        return list(rows)
    chosen = harness.match_names(patterns, [r.name for r in rows]) | PART_KEEP[part]
    return [r for r in rows if r.name in chosen]


def reference(c: TailCtx, seed: int, wire: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """(next layer's normed rows, residual) of this rank, in float32, from every rank's inputs."""
    M, P, H = c.M, c.world, c.hidden
    counts = c.layout.per_rank_actual_token
    hs, res1 = [], None
    for q in range(P):
        b = make_tail_bufs(c, q, seed)
        s = b.x.float() + b.res.float()
        hs.append(F.pad(_rms(s, c.w1).to(c.dtype), (0, 0, 0, M - counts[q])))
        if q == c.rank:
            res1 = s.to(c.dtype)
    full = torch.cat(hs)  # padded; the stand-in is per row, so the layout does not change the result
    mine = slice(c.rank * M, c.rank * M + c.n)
    acc = torch.zeros((c.n, H), dtype=torch.float32, device=c.device)
    if wire == "fp8":
        q8, scale = quant_ref(full[mine])
        part = (q8.float().view(c.n, H // 128, 128) * scale.view(c.n, H // 128, 1)).view(c.n, H).to(c.dtype)
        acc += part.float() * P
    else:
        for q in range(P):
            acc += (full[mine].float() * coef_of(q)).to(c.dtype).float()
    s2 = acc.to(c.dtype).float() + res1.float()
    return _rms(s2, c.w2), s2


def run_config(c: TailCtx, rows: List[Row], args, cfg_idx: int, log) -> Tuple[List[dict], Dict[str, str]]:
    L = c.layout
    log(f"[{cfg_idx + 1}] counts {list(c.counts)}  M={c.M}  total={L.total_len}")
    active, skipped = harness.runnable(c, rows)
    c.comms.clear()  # communicators bind to the transport of this configuration
    skipped.update(check_rows(c, active, harness.seed_of(args.seed, cfg_idx), log, reference))
    active = [r for r in active if r.name not in skipped]
    row_bytes = c.hidden * torch.tensor([], dtype=c.dtype).element_size()
    nbuf = harness.rotating_sets(c.device, 2 * c.n * row_bytes, 8)
    boundary = args.part == "boundary"
    bufsets = [make_tail_bufs(c, c.rank, harness.seed_of(args.seed, cfg_idx, 100 + k), boundary) for k in range(nbuf)]
    for stage in dict.fromkeys(r.stage for r in active if r.stage):  # partials into the reduce buffer, once
        stage(c, bufsets[0])
    dev = harness.time_methods(c, active, bufsets, args.rounds, args.warmup, ahead=not args.cold)
    eager = time_eager(c, active, bufsets, args.rounds, args.layers)
    del bufsets
    harness.release_memory(c.device, c.comms)
    out = []
    for r in active:
        base = baseline_of(r)
        d, e = dev[r.name], eager[r.name]
        bd, be = dev.get(base), eager.get(base)
        out.append({
            "part": args.part, "config": cfg_idx, "counts": "/".join(map(str, c.counts)), "max_rank_len": c.M,
            "total_len": L.total_len, "padded_len": L.padded_len, "hidden": c.hidden, "dtype": args.dtype,
            "row": r.name, "what": r.what, "wire": r.wire, "baseline": base,
            "device_ms": d["ms"], "device_spread": d["spread"], "host_us_per_layer": d["host_ms"] * 1e3,
            "eager_ms": e,
            "x_base_device": d["ms"] / bd["ms"] if bd else float("nan"),
            "x_base_eager": e / be if be else float("nan"),
            "x_base_host": d["host_ms"] / bd["host_ms"] if bd and bd["host_ms"] > 0 else float("nan"),
            "rounds": args.rounds, "layers": args.layers, "warmup": args.warmup, "nbuf": nbuf,
            "timing": ("cold" if args.cold else "ahead") + "+aligned",
            "norm": c.norm.name, "fused_backend_kw": c.fused_backend_kw,
        })
    return out, skipped


def worker(rank, world, mode, port, args, configs, result_path):
    device = harness.init_rank(rank, world, mode, port)
    use_cuda = mode == "nccl"
    torch.set_grad_enabled(False)  # the collectives are not differentiable; norms' weights are plain tensors
    # a tail takes the host several times one collective's call: sleep longer per call before a round
    # (harness.time_round reads this; ~2e6 cycles per ms at H200 clocks)
    harness.AHEAD_CYCLES_PER_METHOD = int(args.ahead_ms * 2_000_000)
    nsa = harness.import_nsa_cp()
    dtype = harness.DTYPES[args.dtype]
    rows = select_rows(args.methods, args.part)
    if use_cuda and args.native_nccl == "auto" and hasattr(nsa, "init_nccl"):
        harness.init_native_nccl(nsa, rank, device)  # the nsa_nccl_* tails' uneven calls take it
    log = harness.rank_log(rank)
    norm = BaseNorm(args.norm, nsa, device, args.hidden, dtype)
    log(f"baseline norm: {norm.name}" + (f" ({norm.why})" if norm.why else ""))
    fn = getattr(nsa, "fused_add_rmsnorm_all_gather", None)
    try:
        backend_kw = fn is not None and "backend" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        backend_kw = False
    w1, w2 = weights(args.hidden, dtype, device, args.seed)
    harness.run_rank(
        rank, device, nsa, configs, args,
        lambda layout: TailCtx(nsa, layout, None, rank, world, device, dist.get_backend(), args.hidden, dtype,
                               norm=norm, w1=w1, w2=w2, coef=coef_of(rank), fused_backend_kw=backend_kw),
        lambda c, i: run_config(c, rows, args, i, log),
        {"tags": None, "rows": [], "skipped": {}, "norm": f"{norm.name} {norm.why}".strip()}, result_path)


# ============================================================================ report
def format_table(result, cpu: bool) -> str:
    tags, rows = result["tags"], result["rows"]
    lines = []
    if cpu:
        lines.append(f"*** {harness.SMOKE} ***")
    lines.append(harness.header_line(tags))
    lines.append(f"baseline norm: {result.get('norm', '?')}; MoE stand-in: one kernel (bf16), two (FP8)")
    hdr = (f"{'row':<24}{'device ms':>10}{'x base':>8}{'eager ms':>10}{'x base':>8}{'host us/layer':>15}"
           f"{'x base':>8}")

    def head(r0):
        over = ("over sglang, FP8 rows over sglang_fp8" if r0.get("part", "tail") == "tail"
                else "over the row named in 'base'")
        return [f"counts [{r0['counts'].replace('/', ', ')}]  M={r0['max_rank_len']}  H={r0['hidden']} "
                f"{r0['dtype']}  ({r0['rounds']} rounds, eager: {r0['layers']} calls back to back; x base: {over})",
                hdr + ("   base" if r0.get("part") == "boundary" else "")]

    def line(r):
        base = f"   {r['baseline']}" if r.get("part") == "boundary" and r["baseline"] != r["row"] else ""
        return (f"{r['row']:<24}{r['device_ms']:>10.3f}{r['x_base_device']:>8.2f}{r['eager_ms']:>10.3f}"
                f"{r['x_base_eager']:>8.2f}{r['host_us_per_layer']:>15.1f}{r['x_base_host']:>8.2f}{base}")

    lines += harness.config_sections(result, head, line, 24)
    smoke = harness.smoke_note(tags)
    lines += [smoke] if smoke else format_targets(rows)
    return "\n".join(lines)


def format_targets(rows: List[dict]) -> List[str]:
    """The project's goals as ratios per M, with verdicts: for the tail part (host per layer
    <= 0.5x sglang at every M, eager <= 0.6x at M = 256), for the boundary part (device ms)."""
    by = {(r["max_rank_len"], r["row"]): r for r in rows}
    Ms = sorted({r["max_rank_len"] for r in rows})
    parts = {r.get("part", "tail") for r in rows}
    lines = []
    if "tail" in parts:
        lines += ["", "layer-tail goals (host us per layer <= 0.50x sglang at every M; eager ms <= 0.60x sglang at "
                  "M = 256), per M " + " ".join(map(str, Ms)) + ":"]
        names = list(dict.fromkeys(r["row"] for r in rows if r["wire"] == "bf16" and r["row"] != "sglang"))
        for name in names:
            cells, ok = [], True
            for M in Ms:
                r = by.get((M, name))
                if r is None:
                    cells.append("  -  ")
                    continue
                ok &= r["x_base_host"] <= 0.5
                cells.append(f"{r['x_base_host']:5.2f}")
            e = by.get((256, name))
            eager = "" if e is None else f" | eager @256 {e['x_base_eager']:.2f} {'ok' if e['x_base_eager'] <= 0.6 else 'MISS'}"
            lines.append(f"  {name:<22} host x {' '.join(cells)} {'ok' if ok else 'MISS'}{eager}")
    if "boundary" in parts:
        lines += format_boundary_targets(by, Ms)
    return lines


def parse_args(argv=None):
    p = harness.arg_parser(__doc__)
    p.add_argument("--M", type=int, nargs="+", help="max_rank_len sweep (GPU: 256 2048 8192 32768; CPU: 16 64)")
    p.add_argument("--imbalance", type=float, default=0.2, help="counts [M, round(M*(1-s)), M, ...]")
    p.add_argument("--counts", action="append", metavar="a,b,...", help="explicit per-rank counts (repeatable)")
    p.add_argument("--hidden", type=int, default=7168, help="a multiple of 128 (the FP8 groups)")
    p.add_argument("--dtype", choices=["bf16"], default="bf16")
    p.add_argument("--align", type=int, default=1)
    p.add_argument("--native-nccl", choices=("auto", "off"), default="auto",
                   help="auto: nsa_cp.init_nccl first, so the NCCL tails use nsa_cp's own NCCL communicator")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--layers", type=int, default=8, help="tails back to back per eager sample")
    p.add_argument("--cold", action="store_true", help="no GPU sleep before a device-time round")
    p.add_argument("--ahead-ms", type=float, default=3.0,
                   help="GPU sleep per call before a device-time round, so the host enqueues the round ahead")
    p.add_argument("--norm", choices=("auto", "flashinfer", "nsa"), default="auto")
    p.add_argument("--part", choices=("tail", "boundary"), default="tail",
                   help="tail: whole MoE tails; boundary: the two halves (norm+gather, reduce-scatter+norm) on their "
                        "own, with the boundary's goals")
    p.add_argument("--methods", help="comma-separated row names or globs (the baselines are always kept)")
    p.add_argument("--gpus", type=int)
    p.add_argument("--cpu-ranks", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--csv")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.hidden % 128:
        p.error(f"--hidden {args.hidden}: expected a multiple of 128 (FP8 groups)")
    if args.rounds < 1 or args.warmup < 0 or args.layers < 1:
        p.error("--rounds and --layers must be >= 1, --warmup >= 0")
    return args


def main(argv=None):
    args = parse_args(argv)
    harness.check_output_paths([("--csv", args.csv), ("--json", args.json)])  # before anything is measured
    harness.keep_multicast_off()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    use_cuda = gpus > 0 and args.cpu_ranks is None
    if use_cuda:
        world = args.gpus or gpus
        args.M = args.M or [256, 2048, 8192, 32768]
        if world < 2:
            raise SystemExit(f"layer_tail.py times a tail between ranks on GPUs of their own: found {gpus} GPU(s). "
                             f"On one GPU, gather_scatter.py times the stages; --cpu-ranks 2 runs this as a CPU "
                             f"smoke run")
    else:
        world = args.cpu_ranks or 2
        args.M = args.M or [16, 64]
        print(f"*** {harness.SMOKE} ***", flush=True)
    if world < 2:
        raise SystemExit(f"need at least 2 ranks, have {world} (use --cpu-ranks N for a CPU run)")
    if args.counts:
        configs = [tuple(int(v) for v in spec.split(",")) for spec in args.counts]
        for cfg in configs:
            if len(cfg) != world:
                raise SystemExit(f"--counts {cfg}: {len(cfg)} counts for {world} ranks")
    else:
        configs = harness.imbalanced_counts(args.M, world, args.imbalance)
    result = harness.run_ranks(worker, world, "nccl" if use_cuda else "cpu", args, configs, prefix="layer_tail_",
                               what="layer_tail.py")
    print(format_table(result, cpu=not use_cuda), flush=True)  # tables first, files after
    harness.write_rows(result["tags"], result["rows"], args.csv, args.json, skipped=result["skipped"],
                       norm=result.get("norm"))


if __name__ == "__main__":
    harness.run_main(main)
