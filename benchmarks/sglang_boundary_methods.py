"""sglang_boundary.py's rows: the context and buffers (SGLang's shapes), the methods of each side (SGLang's
path and the plugin's), where the partials are staged, the check of every method against its float32
reference, the HBM bytes per call (the formulas of sglang_boundary.py's docstring), the copy rate the floor
divides by and the GPU operations per call (torch.profiler). A part of sglang_boundary.py (no other
benchmark imports it).
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402  seeds, poisoning, verdicts, the P2P hooks
harness.part_of("sglang_boundary.py", __name__)  # run as a script, it says which script to run

EPS = 1e-6
TOL = 1e-2  # relative L2 error of every checked output against its float32 reference (NaN never passes)
SIDES = ("gather", "scatter")


def physical_of(counts: Sequence[int], cp: int) -> int:
    """SGLang's physical rows per rank: every shard padded up front to one length, the longest real shard
    rounded up to a multiple of ``2 * cp`` (``cp/padding.pad_logical_token_to_physical``, zigzag)."""
    a = 2 * cp
    return -(-max(counts) // a) * a


# ============================================================================ context and buffers
@dataclasses.dataclass
class BoundaryCtx(harness.Ctx):
    physical: int = 0  # SGLang's local rows per rank (= layout.max_rank_len: ShardLayout(counts, align=physical))
    w: Optional[torch.Tensor] = None  # the read step's RMSNorm weight [H], of the rows' dtype
    norm: Optional[Callable] = None  # nsa_cp.rows.norm.fused_add_rmsnorm_into: SGLang's in-place add + RMSNorm
    extra: Dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # where the plugin's partials are


@dataclasses.dataclass
class Bufs:
    x: torch.Tensor  # [physical, H] the layer's output rows (SGLang's norm overwrites them with y, in place)
    res: torch.Tensor  # [physical, H] the residual (updated in place by both paths, padding rows included)
    partials: torch.Tensor  # [physical * cp, H] this rank's MoE partials, padded rank-major


def make_bufs(c: BoundaryCtx, rank: int, seed: int) -> Bufs:
    """``rank``'s inputs from ``seed`` (any rank can rebuild any rank's); padding rows random, as the
    layer computed them."""
    P, H = c.physical, c.hidden
    return Bufs(harness.randn((P, H), harness.seed_of(seed, 1, rank), c.dtype, c.device),
                harness.randn((P, H), harness.seed_of(seed, 2, rank), c.dtype, c.device),
                harness.randn((P * c.world, H), harness.seed_of(seed, 3, rank), c.dtype, c.device))


def set_bytes(c: BoundaryCtx) -> int:
    return (2 + c.world) * c.physical * c.hidden * c.dtype.itemsize


def real_rows(c: BoundaryCtx, padded: torch.Tensor) -> torch.Tensor:
    """The compact ``[T, H]`` rows of a padded ``[physical * cp, H]`` tensor."""
    P = c.physical
    return torch.cat([padded[q * P:q * P + n] for q, n in enumerate(c.counts)])


# ============================================================================ the methods
def sglang_gather(c: BoundaryCtx, b: Bufs):
    """SGLang 0.5.23 (``prepare._then_attn_cp_gather``): its read step, the residual add + RMSNorm, in place
    on all ``physical`` local rows, then ``all_gather_into_tensor`` of the equal shards into a fresh buffer."""
    c.norm(b.x, b.res, c.w, EPS, out=b.x)
    full = torch.empty((c.physical * c.world, c.hidden), dtype=c.dtype, device=c.device)
    harness.all_gather_single(full, b.x, group=c.group)
    return full, b.res


def plugin_gather(compact: bool):
    """``CpMovesAdapter.gather_rows``' fused path: the padding rows' residual add, then ONE
    ``fused_add_rmsnorm_all_gather`` of the real rows."""

    def fn(c: BoundaryCtx, b: Bufs):
        n, P = c.n, c.physical
        if n < P:  # SGLang's step writes its padding rows into the residual too; nothing gathers them
            b.res[n:P].add_(b.x[n:P])
        gathered, _ = c.nsa.fused_add_rmsnorm_all_gather(b.x[:n], b.res[:n], c.w, EPS, c.layout, group=c.group,
                                                         compact=compact, backend=c.p2p_backend)
        return gathered, b.res

    return fn


def sglang_scatter(c: BoundaryCtx, b: Bufs):
    """SGLang 0.5.23 (``ops.attn_cp_reduce_scatter_output``): ``reduce_scatter_tensor`` of the padded partials
    into a fresh ``[physical, H]``."""
    mine = torch.empty((c.physical, c.hidden), dtype=c.dtype, device=c.device)
    harness.reduce_scatter_single(mine, b.partials, group=c.group)
    return mine


def _key(compact: bool, source: str) -> str:
    return f"{source}/{int(compact)}"


def plugin_scatter(compact: bool, source: str):
    """``CpMovesAdapter.reduce_scatter``: a fresh ``[physical, H]``, its padding rows zeroed, the sum over
    ranks of the real rows into its first n rows; the partials where ``source`` says (``c.extra``)."""
    key = _key(compact, source)

    def fn(c: BoundaryCtx, b: Bufs):
        partials, n = c.extra[key], c.n
        out = partials.new_empty((c.physical, c.hidden))
        out[n:].zero_()
        c.nsa.cp_reduce_scatter(partials, c.layout, c.group, compact=compact, out=out[:n], backend=c.p2p_backend)
        return out

    return fn


def stage_buffer(compact: bool):
    """The MoE wrote its partials into the buffer the plugin hands it (``CpMovesAdapter.mlp_output_buffer``,
    i.e. ``cp_reduce_scatter_buffer``: the P2P transport's reduce buffer, no copy in), as
    layer_tail.py's boundary rows stage them: looked up once per configuration, written untimed."""
    key = _key(compact, "buffer")

    def stage(c: BoundaryCtx, b: Bufs) -> None:
        if key not in c.extra:
            c.extra[key] = c.nsa.cp_reduce_scatter_buffer(b.x, c.layout, c.group, compact=compact,
                                                          backend=c.p2p_backend)
        c.extra[key].copy_(real_rows(c, b.partials) if compact else b.partials)

    return stage


def stage_gathered(compact: bool):
    """SGLang's default in-place MoE: the partials are written into the tensor the plugin's gather returned
    (with P2P a view of the transport's gather buffer, which the reduce-scatter copies into its reduce
    buffer first). One plugin gather, then the partials over its rows (untimed)."""
    key = _key(compact, "gathered")

    def stage(c: BoundaryCtx, b: Bufs) -> None:
        gathered, _ = plugin_gather(compact)(c, b)
        gathered.copy_(real_rows(c, b.partials) if compact else b.partials)
        c.extra[key] = gathered

    return stage


def _sglang_needs(c: BoundaryCtx) -> Optional[str]:
    if c.shared_gpu:
        return ("ranks share one GPU over gloo, whose collective is not SGLang's NCCL: the plugin / sglang "
                "comparison needs a GPU per rank")
    return None


def _plugin_needs(c: BoundaryCtx) -> Optional[str]:
    return harness.p2p_needs(c) if c.device.type == "cuda" else None  # CPU: nsa_cp's gloo path (smoke)


def _plugin_prepare(c: BoundaryCtx) -> None:
    if c.device.type == "cuda":
        harness.p2p_prepare(c)  # what the plugin's scheduler hook creates (CpMovesAdapter.create_transport)


@dataclasses.dataclass(frozen=True)
class Method:
    side: str  # "gather" | "scatter"
    label: str  # "sglang" | "plugin" | "plugin_inplace" | "plugin_compact" | ...
    fn: Callable[[BoundaryCtx, Bufs], object]
    what: str
    compact: bool = False
    inplace: bool = False  # scatter: the partials are in the gather's output (copied in on P2P)
    needs: Optional[Callable[[BoundaryCtx], Optional[str]]] = None
    prepare: Optional[Callable[[BoundaryCtx], None]] = None
    stage: Optional[Callable[[BoundaryCtx, Bufs], None]] = None  # puts the partials in place (untimed)

    @property
    def name(self) -> str:
        return f"{self.side}/{self.label}"

    @property
    def plugin(self) -> bool:
        return self.label != "sglang"


def make_methods(compact: bool) -> List[Method]:
    """The rows: SGLang's path and the plugin's (padded), per side; ``compact`` adds the compact plugin rows."""
    rows = [Method("gather", "sglang", sglang_gather, "read step (add + RMSNorm, physical rows) + "
                   "all_gather_into_tensor", needs=_sglang_needs)]
    scatter = [Method("scatter", "sglang", sglang_scatter, "reduce_scatter_tensor into a fresh [physical, H]",
                      needs=_sglang_needs)]
    for cmp_ in (False, True) if compact else (False,):
        tag = "_compact" if cmp_ else ""
        rows.append(Method("gather", f"plugin{tag}", plugin_gather(cmp_), "padding rows' residual add + "
                           "fused_add_rmsnorm_all_gather" + (" (compact)" if cmp_ else ""), cmp_,
                           needs=_plugin_needs, prepare=_plugin_prepare))
        scatter.append(Method("scatter", f"plugin{tag}", plugin_scatter(cmp_, "buffer"), "cp_reduce_scatter(out=) "
                              "from the plugin's MoE output buffer" + (" (compact)" if cmp_ else ""), cmp_,
                              needs=_plugin_needs, prepare=_plugin_prepare, stage=stage_buffer(cmp_)))
        scatter.append(Method("scatter", f"plugin{tag}_inplace", plugin_scatter(cmp_, "gathered"), "cp_reduce_scatter"
                              "(out=) from the gather's output (SGLang's in-place MoE)", cmp_, True,
                              needs=_plugin_needs, prepare=_plugin_prepare, stage=stage_gathered(cmp_)))
    return rows + scatter


# ============================================================================ HBM bytes per call
def hbm_rows(m: Method, counts: Sequence[int], rank: int, physical: int) -> int:
    """Rows of H elements that ``rank``'s own calls read and write (sglang_boundary.py's docstring)."""
    n, P, cp, T = counts[rank], physical, len(counts), sum(counts)
    if m.side == "gather":
        if not m.plugin:
            return 4 * P + P + cp * P  # norm: read x, res, write res, y; all-gather: read P, write cp * P
        # padding add: read x, res, write res of P - n rows; fused: read x, res, write res of n rows, push cp * n;
        # padded: this rank's buffer's padding rows zeroed
        return 3 * (P - n) + 3 * n + cp * n + (0 if m.compact else cp * P - T)
    if not m.plugin:
        return cp * P + P  # read every partial row, write P
    copy_in = 2 * (T if m.compact else cp * P) if m.inplace else 0  # P2P: the gather's rows into the reduce buffer
    return (P - n) + cp * n + n + copy_in  # zero the padding rows; pull n rows from every rank, write n


def hbm_bytes(c: BoundaryCtx, m: Method) -> int:
    """Bytes per call for the floor: the busiest rank's (one GPU per rank) or every rank's together (ranks
    sharing one GPU share its memory)."""
    per_rank = [hbm_rows(m, c.counts, r, c.physical) for r in range(c.world)]
    return (sum(per_rank) if c.shared_gpu else max(per_rank)) * c.hidden * c.dtype.itemsize


def copy_gbps(c: BoundaryCtx, nbytes: int, rounds: int) -> float:
    """GB/s of a device-to-device copy moving ``nbytes`` (read plus written), median of rounds, as stages.py
    measures its floor; the fastest rank's (every rank the same value). Ranks sharing one GPU: rank 0
    measures while the others wait."""
    rate = 0.0
    if not c.shared_gpu or c.rank == 0:
        src = torch.ones(max(1, nbytes // 8), dtype=torch.float32, device=c.device)
        dst = torch.empty_like(src)
        for _ in range(3):
            dst.copy_(src)
        harness.sync(c)
        ts = []
        for _ in range(max(5, rounds)):
            if c.device.type == "cuda":
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                dst.copy_(src)
                stop.record()
                stop.synchronize()
                ts.append(start.elapsed_time(stop))
            else:
                t0 = time.perf_counter()
                dst.copy_(src)
                ts.append((time.perf_counter() - t0) * 1e3)
        rate = 2 * src.numel() * 4 / (statistics.median(ts) * 1e-3) / 1e9
        del src, dst
    harness.sync(c)
    dist.barrier(group=c.group)
    t = torch.tensor([rate], dtype=torch.float64, device=c.control)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=c.group)
    return float(t.item())


# ============================================================================ GPU operations per call
def gpu_ops(c: BoundaryCtx, methods: List[Method], b: Bufs, calls: int, log=None) -> Dict[str, Optional[float]]:
    """{name: GPU operations per call (kernels, memcpys and memsets: torch.profiler's CUDA events over
    ``calls`` calls), the most of any rank}; None on the CPU, with ``calls`` 0, or where the profiler fails.
    ``log``: prints rank 0's operation names."""
    if c.device.type != "cuda" or calls < 1:
        return {m.name: None for m in methods}
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    counts, out = [], {}
    for m in methods:
        harness.sync(c)
        dist.barrier(group=c.group)
        try:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(calls):
                    m.fn(c, b)
                harness.sync(c)
            names = [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]
            counts.append(len(names) / calls)
            if log is not None:
                seen = {k: names.count(k) / calls for k in dict.fromkeys(names)}
                log(f"  {m.name}: {len(names) / calls:g} GPU ops per call: "
                    + ", ".join(f"{k[:70]} x{v:g}" for k, v in seen.items()))
        except Exception as e:  # noqa: BLE001 - the count is optional: say why, go on
            print(f"[rank {c.rank}] {m.name}: no GPU operation count: {type(e).__name__}: {str(e)[:200]}",
                  file=sys.stderr, flush=True)
            counts.append(-1.0)
    t = torch.tensor(counts, dtype=torch.float64, device=c.control)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=c.group)
    for m, v in zip(methods, t.tolist()):
        out[m.name] = v if v >= 0 else None
    return out


# ============================================================================ correctness
def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    if out.shape != ref.shape:
        return float("inf")
    if out.numel() == 0:
        return 0.0
    err = float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))
    return err if math.isfinite(err) else float("inf")  # NaN -> inf


def _rms(s: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS) * w.float()


def check_gather(c: BoundaryCtx, m: Method, seed: int, got) -> Optional[str]:
    """Every rank's real rows normed (float32 reference), the plugin's padding rows zero, and this rank's
    residual ``x + residual`` on all physical rows (SGLang's step updates its padding rows too)."""
    gathered, res = got
    P, errors = c.physical, []
    rows = c.layout.total_len if m.compact else c.layout.padded_len
    if gathered.shape != (rows, c.hidden):
        return f"gathered: shape {list(gathered.shape)}, expected {[rows, c.hidden]}"
    for q, n in enumerate(c.counts):
        b = make_bufs(c, q, seed)
        s = b.x.float() + b.res.float()
        start = c.layout.offsets[q] if m.compact else q * P
        errors.append((f"rank {q} rows", _rel(gathered[start:start + n], _rms(s[:n], c.w))))
        if m.plugin and not m.compact and not torch.equal(gathered[start + n:(q + 1) * P].float(),
                                                          torch.zeros_like(s[n:])):
            return f"rank {q}'s padding rows are not zero"
        if q == c.rank:
            errors.append(("residual", _rel(res, s.to(c.dtype).float())))
    bad = [f"{what} {e:.2e}" for what, e in errors if not e <= TOL]
    return f"relative L2 error > {TOL}: {', '.join(bad)}" if bad else None


def check_scatter(c: BoundaryCtx, m: Method, seed: int, out) -> Optional[str]:
    """This rank's real rows: the sum over ranks of its slot's partials (float32 reference); the plugin's
    rows past them zero."""
    n, a = c.n, c.rank * c.physical
    if out.shape != (c.physical, c.hidden):
        return f"out: shape {list(out.shape)}, expected {[c.physical, c.hidden]}"
    acc = torch.zeros((n, c.hidden), dtype=torch.float32, device=c.device)
    for q in range(c.world):
        acc += make_bufs(c, q, seed).partials[a:a + n].float()
    err = _rel(out[:n], acc)
    if not err <= TOL:
        return f"relative L2 error {err:.2e} > {TOL}"
    if m.plugin and not torch.equal(out[n:], torch.zeros_like(out[n:])):
        return "the rows past the real count are not zero"
    return None


def check_methods(c: BoundaryCtx, methods: List[Method], seed: int, log) -> Dict[str, str]:
    """Each method once on fresh seeded inputs (the P2P gather buffers poisoned with NaN first) against its
    float32 reference; any mismatch on any rank aborts the run (harness.verdicts). Returns {name: why} of
    the methods that raised an error of an API this checkout shapes differently (skipped, loudly)."""
    status = torch.zeros(len(methods), dtype=torch.int64, device=c.control)
    notes: Dict[str, str] = {}
    for i, m in enumerate(methods):
        s = harness.seed_of(seed, 31, i)
        b = make_bufs(c, c.rank, s)
        harness.poison(c, [])
        try:
            if m.stage is not None:
                m.stage(c, b)
            got = m.fn(c, b)
            harness.sync(c)
        except (NotImplementedError, ValueError, TypeError, RuntimeError) as e:
            status[i], notes[m.name] = harness.SKIP, f"{type(e).__name__}: {str(e).strip()[:300]}"
            print(f"[rank {c.rank}] {m.name}: {notes[m.name]}", file=sys.stderr, flush=True)
            harness.sync(c)
            dist.barrier(group=c.group)
            continue
        why = (check_gather if m.side == "gather" else check_scatter)(c, m, s, got)
        if why:
            status[i], notes[m.name] = harness.BAD, why
        dist.barrier(group=c.group)
    _, skipped = harness.verdicts(c, [m.name for m in methods], status, notes)
    log(f"  check ok: {len(methods) - len(skipped)} of {len(methods)} methods match their float32 references")
    return skipped
