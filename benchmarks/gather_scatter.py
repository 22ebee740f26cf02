"""Distributed benchmark: nsa_cp's uneven all-gather / reduce-scatter against torch/NCCL baselines.

Usage::

    python benchmarks/gather_scatter.py                          # every visible GPU, default sweep
                                                                 # (one GPU: the stages, benchmarks/stages.py)
    python benchmarks/gather_scatter.py --shared-gpu 4           # 4 ranks sharing cuda:0 (P2P rows; total work)
    python benchmarks/gather_scatter.py --M 8192 --imbalance 0.2 --rounds 50 --csv out.csv
    python benchmarks/gather_scatter.py --counts 4096,4096,7936,8192 --hidden 7168
    python benchmarks/gather_scatter.py --seq-lens '700*64' --seq-lens '32768,4096*6' --page-size 64
    python benchmarks/gather_scatter.py --cpu-ranks 2 --M 64 --rounds 3   # CPU/gloo smoke run

Per configuration (a list of per-rank counts): every method checked once on NaN-poisoned outputs against
the expected outputs each rank builds from seeded inputs (gathers exactly, reduce-scatters against the
float32 sum), then timed interleaved over rounds (``harness.time_methods``); bandwidth in the nccl-tests
convention (``metrics``). The methods (``METHODS``, one line each; ``--methods`` selects by name or glob),
the protocol, the metrics and the outputs: docs/performance.md, "Benchmark protocol".
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402  spawn, seeds, poisoning, the timing protocol, env tags, writers
from harness import Ctx  # noqa: E402

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
    return None if c.nsa.get_nccl(c.group) is not None else "no native NCCL communicator (--native-nccl off or refused)"


def p2p_ag(compact: bool, engine: str):
    """The P2P transport's gather with a forced engine; returns the view of its gather buffer (its runner
    built once per transport, layout and row shape, as the plan caches it)."""
    runners = {}

    def fn(c: Ctx, b: Bufs):
        transport, key = c.nsa.get_p2p(c.group), (c.layout, tuple(b.x.shape[1:]))
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


# ---- NCCL on symmetric buffers (what SGLang's --enable-symm-mem gives its CP gather): torch's
# symmetric memory with the NCCL backend, i.e. ncclMemAlloc + an NCCL window registered on the group's
# communicator at rendezvous, then the plain collectives on those buffers (NCCL picks its symmetric
# kernels for them). Runs in processes of its own (Method.process = "symm"), on even layouts.
_SYMM: Dict[str, object] = {"error": None, "cache": {}}


def symm_setup() -> None:
    """In a "symm" process, before any symmetric allocation: select the NCCL backend, or record why not."""
    try:
        from torch.distributed import _symmetric_memory as symm_mem
    except ImportError as e:
        _SYMM["error"] = f"torch {torch.__version__} has no torch.distributed._symmetric_memory ({e})"
        return
    missing = [n for n in ("set_backend", "empty", "rendezvous") if not hasattr(symm_mem, n)]
    if missing:
        _SYMM["error"] = f"torch {torch.__version__}: _symmetric_memory lacks {', '.join(missing)}"
        return
    try:
        symm_mem.set_backend("NCCL")
    except Exception as e:  # noqa: BLE001 - any refusal is a reason to skip, printed
        _SYMM["error"] = f"torch {torch.__version__}: set_backend('NCCL') failed: {type(e).__name__}: {e}"


def _symm_needs(c: Ctx) -> Optional[str]:
    if c.backend != "nccl":
        return f"{c.backend}: symmetric memory needs NCCL on CUDA GPUs"
    if not c.layout.is_even:
        return "symmetric-buffer rows run on even layouts only (the plain collectives)"
    return _SYMM["error"]


def _symm_empty(shape, c: Ctx) -> torch.Tensor:
    from torch.distributed import _symmetric_memory as symm_mem

    t = symm_mem.empty(*shape, dtype=c.dtype, device=c.device)
    symm_mem.rendezvous(t, c.group if c.group is not None else dist.group.WORLD)
    return t


def symm_bind(c: Ctx, bufsets: List[Bufs]) -> None:
    """Symmetric copies of each set's inputs and outputs (allocated once per (M, set), kept: windows
    stay registered for the whole run). A failure here skips the rows, with the reason."""
    M, P, H = c.M, c.world, c.hidden
    for b in bufsets:
        key = (M, H, b.idx)
        if key not in _SYMM["cache"]:
            try:
                _SYMM["cache"][key] = {
                    "ag_in": _symm_empty((M, H), c),
                    "ag_out": _symm_empty((M * P, H), c),
                    "rs_in": _symm_empty((M * P, H), c),
                    "rs_out": _symm_empty((M, H), c),
                }
            except Exception as e:  # noqa: BLE001
                _SYMM["error"] = f"symmetric allocation/rendezvous failed: {type(e).__name__}: {e}"
                return
        bufs = _SYMM["cache"][key]
        bufs["ag_in"].copy_(b.x_full)
        bufs["rs_in"].copy_(b.y_pad)
        b.extra.update({f"symm_{k}": v for k, v in bufs.items()})
        b.extra_outputs += [bufs["ag_out"], bufs["rs_out"]]


def symm_ag(c: Ctx, b: Bufs):
    if _SYMM["error"]:
        raise NotImplementedError(_SYMM["error"])
    harness.all_gather_single(b.extra["symm_ag_out"], b.extra["symm_ag_in"], group=c.group)
    return b.extra["symm_ag_out"]


def symm_rs(c: Ctx, b: Bufs):
    if _SYMM["error"]:
        raise NotImplementedError(_SYMM["error"])
    harness.reduce_scatter_single(b.extra["symm_rs_out"], b.extra["symm_rs_in"], group=c.group)
    return b.extra["symm_rs_out"][: c.n]


SHARED_GPU_SKIP = "ranks share one GPU over gloo: only the P2P rows run (no NCCL; gloo would time host copies)"


def _nccl_only(what):
    return lambda c: None if c.backend == "nccl" else f"{c.backend} does not support {what}"


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
    Method("nsa_ag_padded", "ag", "padded", nsa_ag(False, backend="nccl")),
    Method("nsa_ag_compact", "ag", "compact", nsa_ag(True, backend="nccl")),
    Method("nsa_ag_compact_padded", "ag", "compact", nsa_ag(True, algo="padded", backend="nccl")),
    Method("nsa_ag_compact_coalesced", "ag", "compact", nsa_ag(True, algo="coalesced", backend="nccl")),
    Method("nsa_ag_padded_torch", "ag", "padded", nsa_torch_nccl(nsa_ag(False, backend="nccl")), _native_nccl_needs),
    Method("nsa_ag_compact_torch", "ag", "compact", nsa_torch_nccl(nsa_ag(True, backend="nccl")), _native_nccl_needs),
    Method("nsa_ag_padded_validated", "ag", "padded", nsa_ag(False, backend="nccl", validate=True), syncs_host=True),
    Method("nsa_ag_padded_auto", "ag", "padded", p2p_auto_ag(False), harness.p2p_needs, harness.p2p_prepare),
    Method("nsa_ag_compact_auto", "ag", "compact", p2p_auto_ag(True), harness.p2p_needs, harness.p2p_prepare),
    Method("nsa_ag_ordered", "ag", "ordered", nsa_ag_ordered(p2p=False)),
    Method("nsa_ag_ordered_auto", "ag", "ordered", nsa_ag_ordered(p2p=True), harness.p2p_needs, harness.p2p_prepare),
    Method("p2p_ag_padded_sm", "ag", "padded", p2p_ag(False, "sm"), harness.p2p_needs, harness.p2p_prepare),
    Method("p2p_ag_padded_ce", "ag", "padded", p2p_ag(False, "ce"), harness.p2p_needs, harness.p2p_prepare),
    Method("p2p_ag_compact_sm", "ag", "compact", p2p_ag(True, "sm"), harness.p2p_needs, harness.p2p_prepare),
    Method("p2p_ag_compact_ce", "ag", "compact", p2p_ag(True, "ce"), harness.p2p_needs, harness.p2p_prepare),
    Method("symm_ag", "ag", "even", symm_ag, _symm_needs, bind=symm_bind, process="symm"),
    # ---- reduce-scatter
    Method("even_rs", "rs", "even", even_rs),
    Method("list_rs", "rs", "compact", list_rs),
    Method("nsa_rs_padded", "rs", "padded", nsa_rs(False, backend="nccl")),
    Method("nsa_rs_compact", "rs", "compact", nsa_rs(True, backend="nccl")),
    Method("nsa_rs_compact_padded", "rs", "compact", nsa_rs(True, algo="padded", backend="nccl")),
    Method("nsa_rs_compact_coalesced", "rs", "compact", nsa_rs(True, algo="coalesced", backend="nccl")),
    Method("nsa_rs_padded_torch", "rs", "padded", nsa_torch_nccl(nsa_rs(False, backend="nccl")), _native_nccl_needs),
    Method("nsa_rs_compact_torch", "rs", "compact", nsa_torch_nccl(nsa_rs(True, backend="nccl")), _native_nccl_needs),
    Method("nsa_rs_padded_validated", "rs", "padded", nsa_rs(False, backend="nccl", validate=True), syncs_host=True),
    Method("nsa_rs_padded_auto", "rs", "padded", p2p_rs(False), harness.p2p_needs, harness.p2p_prepare,
           p2p_stage(False), bind=p2p_bind(False)),
    Method("nsa_rs_compact_auto", "rs", "compact", p2p_rs(True), harness.p2p_needs, harness.p2p_prepare,
           p2p_stage(True), bind=p2p_bind(True)),
    Method("symm_rs", "rs", "even", symm_rs, _symm_needs, bind=symm_bind, process="symm"),
]
EVEN = {"ag": "even_ag", "rs": "even_rs"}


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





def check_methods(ctx: Ctx, methods: Sequence[Method], bufs: Bufs, hidden, dtype, seed, log):
    """Run every method once on poisoned outputs and compare. Returns {name: skip reason} of methods
    that raised NotImplementedError on some rank. Aborts (on every rank) on any mismatch."""
    ag_ref, rs_ref = _expected_outputs(ctx, hidden, dtype, seed)
    rtol, atol = RS_TOL[dtype], RS_TOL[dtype] * ctx.world
    status = torch.zeros(len(methods), dtype=torch.int64, device=ctx.control)
    notes: Dict[str, str] = {}
    even_rs_out = None
    pristine = [t.clone() for t in (bufs.x_full, bufs.y_cmp, bufs.y_pad)]
    for i, m in enumerate(methods):
        harness.poison(ctx, bufs.outputs())
        if m.stage is not None:
            m.stage(ctx, bufs)
        try:
            out = m.fn(ctx, bufs)
        except NotImplementedError as e:
            status[i], notes[m.name] = harness.SKIP, f"NotImplementedError: {e}"
            continue
        harness.sync(ctx)
        if m.direction == "ag":
            ref = ag_ref[m.kind]
            ok = out.shape == ref.shape and torch.equal(out, ref)
            if not ok:
                notes[m.name] = _diff(f"gather output ({m.kind} layout)", out, ref)
        else:
            ok = out.shape == rs_ref.shape and torch.allclose(out.float(), rs_ref.float(), rtol=rtol, atol=atol)
            if ok and m.is_nsa and even_rs_out is not None:
                ok = torch.allclose(out.float(), even_rs_out.float(), rtol=rtol, atol=atol)
                if not ok:
                    notes[m.name] = _diff("reduce-scatter output vs even_rs", out, even_rs_out, rtol, atol)
            elif not ok:
                notes[m.name] = _diff("reduce-scatter output vs fp32 sum", out, rs_ref, rtol, atol)
            if m.name == EVEN["rs"] and ok:
                even_rs_out = out.clone()
        # the inputs must be untouched
        if not all(torch.equal(a, b) for a, b in zip((bufs.x_full, bufs.y_cmp, bufs.y_pad), pristine)):
            ok = False
            notes[m.name] = notes.get(m.name, "") + " [modified its INPUT]"
            for a, b in zip((bufs.x_full, bufs.y_cmp, bufs.y_pad), pristine):
                a.copy_(b)
        if not ok:
            status[i] = harness.BAD

    flags = status.clone()
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=ctx.group)
    flags = flags.tolist()
    bad = [m.name for m, s in zip(methods, flags) if s == harness.BAD]
    if bad:
        mine = [f"  {k}: {v}" for k, v in notes.items() if k in bad]
        msg = f"CORRECTNESS FAILURE, counts {list(ctx.counts)}: {bad}" + (
            f"\n[rank {ctx.rank}]\n" + "\n".join(mine) if mine else f" (no mismatch on rank {ctx.rank})"
        )
        print(msg, file=sys.stderr, flush=True)
        raise RuntimeError(msg)
    skipped = {m.name: notes.get(m.name, "NotImplementedError on another rank") for m, s in zip(methods, flags)
               if s == harness.SKIP}
    log(f"  check ok: {len(methods) - len(skipped)} methods match the expected outputs")
    return skipped


def _diff(what, out, ref, rtol=0.0, atol=0.0) -> str:
    if out.shape != ref.shape:
        return f"{what}: shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
    bad = ~torch.isclose(out.float(), ref.float(), rtol=rtol, atol=atol)  # NaN never close
    rows = bad.reshape(bad.shape[0], -1).any(dim=1).nonzero().flatten()
    err = (out.float() - ref.float()).abs().nan_to_num(float("inf")).max().item()
    return f"{what}: {rows.numel()} wrong rows (first {rows[:8].tolist()}), max |diff| {err:.3g}"


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
            from nsa_cp.split import in_seq_split  # the split rule of the package itself

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


# ============================================================================ worker
def run_config(ctx: Ctx, methods, args, cfg_idx, log) -> Tuple[List[dict], Dict[str, str]]:
    dtype, hidden, L = harness.DTYPES[args.dtype], args.hidden, ctx.layout
    pad = (L.padded_len - L.total_len) / L.padded_len if L.padded_len else 0.0
    log(f"[{cfg_idx + 1}] counts {list(ctx.counts)}  M={ctx.M}  total={L.total_len}  padding {pad:.1%}")
    active, skipped = [], {}
    for m in methods:
        reason = m.needs(ctx) if m.needs else None
        if reason is None and ctx.shared_gpu and m.needs is not harness.p2p_needs:
            reason = SHARED_GPU_SKIP
        if reason:
            skipped[m.name] = reason
        else:
            active.append(m)
    for prepare in dict.fromkeys(m.prepare for m in active if m.prepare):  # each hook once, in order
        prepare(ctx)
    nbuf = harness.rotating_sets(ctx.device, bytes_per_set(L, hidden, dtype), args.max_bufs)
    bufsets = [make_bufs(ctx, hidden, dtype, harness.seed_of(args.seed, cfg_idx, b), b) for b in range(nbuf)]
    for bind in dict.fromkeys(m.bind for m in active if m.bind):  # each hook once, in order
        bind(ctx, bufsets)
    skipped.update(check_methods(ctx, active, bufsets[0], hidden, dtype, harness.seed_of(args.seed, cfg_idx, 0), log))
    active = [m for m in active if m.name not in skipped]
    stats = {}
    for group in ([m for m in active if not m.syncs_host], [m for m in active if m.syncs_host]):
        if group:
            # a syncing method cannot run ahead: no head-start sleep, which it would only wait out
            ahead = not args.cold and not group[0].syncs_host
            stats.update(harness.time_methods(ctx, group, bufsets, args.rounds, args.warmup, ahead=ahead))
    del bufsets
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
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


# ============================================================================ report
def format_table(result, cpu: bool) -> str:
    tags = result["tags"]
    lines = []
    if cpu:
        lines.append(f"*** {harness.SMOKE} ***")
    if tags:
        lines.append(harness.header_line(tags))
        if "sharing one GPU" in tags.get("mode", ""):
            lines.append(f"*** {SHARED_GPU_NOTE} ***")
    hdr = f"{'method':<26}{'ms':>9}{'spread':>8}{'host ms':>9}{'algbw':>9}{'busbw':>9}{'link':>9}{'x even':>8}"
    symm_header = False
    for cfg, rs in harness.by_config(result):
        if cfg >= SYMM_CONFIG_BASE and not symm_header:
            symm_header = True
            lines.append("")
            lines.append("--- NCCL on symmetric buffers (torch symmetric memory, NCCL backend: what SGLang's "
                         "--enable-symm-mem uses), timed in processes of their own; 'x even' against the even "
                         "collective timed there (even_*@symm)")
        if not rs:
            lines.append("")
            lines += harness.skipped_lines(result, cfg, 26)
            continue
        r0 = rs[0]
        lines.append("")
        lines.append(
            f"counts [{r0['counts'].replace('/', ', ')}]  M={r0['max_rank_len']}  total={r0['total_len']}"
            f"  padding {r0['padding_frac']:.1%}  H={r0['hidden']} {r0['dtype']}  ({r0['rounds']} rounds,"
            f" {r0['nbuf']} buffer sets)   GB/s: algbw/busbw on counted rows, link on real rows"
        )
        lines.append(hdr)
        for r in rs:
            lines.append(
                f"{r['method']:<26}{r['time_ms']:>9.3f}{r['spread']:>7.0%} {r['host_ms']:>9.3f}{r['algbw_GBps']:>9.4g}"
                f"{r['busbw_GBps']:>9.4g}{r['link_GBps']:>9.4g}"
                + (f"{r['x_even']:>8.2f}" if r["x_even"] == r["x_even"] else f"{'-':>8}")  # no even row beside it
            )
        lines += harness.skipped_lines(result, cfg, 26)
    return "\n".join(lines)


SHARED_GPU_NOTE = ("ranks SHARE ONE GPU (gloo for control, P2P over CUDA IPC for data): the link is the GPU's own "
                   "memory, not NVLink, and the GPU time-slices the ranks' kernels, so each time is the total work "
                   "of every rank, not the latency of a real cp run")


# host-time goals per call, against the plain collective of the same direction
HOST_ROWS = {
    "ag": [("even_ag", "plain all_gather_into_tensor", None), ("fpad_ag", "F.pad + all-gather", None),
           ("nsa_ag_padded", "nsa NCCL padded", 1.0), ("nsa_ag_compact", "nsa NCCL compact", 1.0),
           ("nsa_ag_padded_torch", "nsa NCCL padded, torch's comm", None),
           ("nsa_ag_compact_torch", "nsa NCCL compact, torch's comm", None),
           ("nsa_ag_padded_auto", "nsa P2P padded (auto)", 0.35), ("nsa_ag_compact_auto", "nsa P2P compact (auto)", 0.35)],
    "rs": [("even_rs", "plain reduce_scatter_tensor", None), ("nsa_rs_padded", "nsa NCCL padded", 1.0),
           ("nsa_rs_compact", "nsa NCCL compact", 1.0), ("nsa_rs_padded_torch", "nsa NCCL padded, torch's comm", None),
           ("nsa_rs_compact_torch", "nsa NCCL compact, torch's comm", None), ("nsa_rs_padded_auto", "nsa P2P padded (auto)", 0.35),
           ("nsa_rs_compact_auto", "nsa P2P compact (auto)", 0.35)],
}


def format_host_summary(result) -> str:
    """Host microseconds per call (median over rounds, max over ranks) of the calls the project sets
    targets for, with the ratio to the plain collective of the same direction and the verdict."""
    by_cfg: Dict[int, Dict[str, dict]] = {}
    for r in result["rows"]:
        if r["config"] < SYMM_CONFIG_BASE:
            by_cfg.setdefault(r["config"], {})[r["method"]] = r
    smoke = harness.smoke_note(result.get("tags"))
    if smoke:
        lines = ["", "host us per call (median over rounds, max over ranks), the CPU path's, not a GPU launch's",
                 smoke]
    else:
        lines = ["", "host us per call (median over rounds, max over ranks; targets: P2P <= 0.35x, NCCL path <= 1.0x "
                 "of the plain collective's host time)"]
    for cfg, rows in sorted(by_cfg.items()):
        r0 = next(iter(rows.values()))
        if r0["padding_frac"] == 0:  # even layouts take the plain collective: the targets are for uneven calls
            continue
        lines.append(f"counts [{r0['counts'].replace('/', ', ')}]  M={r0['max_rank_len']}")
        for direction, specs in HOST_ROWS.items():
            base = rows.get(specs[0][0])
            for name, label, target in specs:
                r = rows.get(name)
                if r is None:
                    continue
                us = r["host_ms"] * 1e3
                ratio = r["host_ms"] / base["host_ms"] if base and base["host_ms"] > 0 else float("nan")
                verdict = "" if target is None or smoke or base is None else (
                    f"  target <= {target:.2f}x: {'ok' if ratio <= target else 'MISS'}")
                lines.append(f"  {direction}  {label:<30}{us:9.1f} us  {ratio:6.2f}x{verdict}")
    lines += format_symm_summary(result)
    return "\n".join(lines)


def format_symm_summary(result) -> List[str]:
    """Device ms of the plain collectives on symmetric buffers against the even collective timed beside
    them (even_*@symm) and the one of the main run at the same M (even layout)."""
    main_even = {(r["max_rank_len"], r["method"]): r for r in result["rows"]  # even_* time [M, H] per rank
                 if r["config"] < SYMM_CONFIG_BASE and r["method"] in EVEN.values()}
    symm = {(r["max_rank_len"], r["method"]): r for r in result["rows"] if r["config"] >= SYMM_CONFIG_BASE}
    lines = []
    for M in sorted({m for m, _ in symm}):
        for d in ("ag", "rs"):
            s, beside = symm.get((M, f"symm_{d}")), symm.get((M, f"even_{d}@symm"))
            if s is None:
                continue
            main = main_even.get((M, f"even_{d}"))
            if not lines:
                lines += ["", "NCCL on symmetric buffers, device ms (even layout [M]*P): symm / even beside it "
                          "(same processes) / even of the main run"]
            lines.append(f"  M={M:<6} {d}  symm {s['time_ms']:.4f}  even {beside['time_ms'] if beside else float('nan'):.4f}"
                         f" ({s['x_even']:.2f}x)  main-run even {main['time_ms'] if main else float('nan'):.4f}"
                         f"  host us: symm {s['host_ms'] * 1e3:.1f}")
    for cfg, sk in sorted(result["skipped"].items(), key=lambda kv: int(kv[0])):
        if int(cfg) >= SYMM_CONFIG_BASE:
            for name, why in sk.items():
                lines.append(f"  {name} skipped: {why}")
            break
    return lines


# ============================================================================ main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
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
    p.add_argument("--csv", help="write one row per (configuration, method)")
    p.add_argument("--json", help="same rows as JSON")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0:
        p.error("--rounds must be >= 1 and --warmup >= 0")
    return args


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


def main(argv=None):
    args = parse_args(argv)
    harness.check_output_paths([("--csv", args.csv), ("--json", args.json)])  # before anything is measured
    harness.keep_multicast_off()
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


SYMM_CONFIG_BASE = 1000  # the symmetric-memory run's configurations are numbered from here


def merge_results(main: Optional[dict], symm: Optional[dict]) -> dict:
    """One result: the main run's rows, then the symmetric-memory run's (config ids from
    SYMM_CONFIG_BASE, their even references renamed ``even_ag@symm`` / ``even_rs@symm`` so that no
    name repeats within the CSV's (M, method) pairs)."""
    out = {"tags": None, "rows": [], "skipped": {}}
    if main is not None:
        out.update(tags=main["tags"], rows=list(main["rows"]), skipped=dict(main["skipped"]))
    if symm is not None:
        out["tags"] = out["tags"] or symm["tags"]
        for r in symm["rows"]:
            r = dict(r, config=r["config"] + SYMM_CONFIG_BASE)
            if r["method"] in EVEN.values():
                r["method"] += "@symm"
            out["rows"].append(r)
        for i, sk in symm["skipped"].items():
            out["skipped"][str(int(i) + SYMM_CONFIG_BASE)] = sk
        out["symm_configs"] = symm.get("configs", [])
    return out


if __name__ == "__main__":
    harness.run_main(main)
