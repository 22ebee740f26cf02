"""layer_tail.py's pieces that both its parts use (the tail and ``--part boundary``): the baseline norm,
the per-rank context and buffers, the MoE stand-ins, docs/design.md's FP8 wire in torch, the row type, the
communicators of the nsa rows and what a row needs, the check of a row's outputs against its float32
reference and the eager (host-inclusive) timing. A part of layer_tail.py (no other benchmark imports it).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402  spawn, seeds, the timing protocol, env tags, writers
harness.part_of("layer_tail.py", __name__)  # run as a script, it says which script to run

EPS = 1e-6
FP8 = "fp8_e4m3_g128"
FP8_MAX = 448.0
# relative L2 error of the next layer's normed rows and residual against the float32 reference: over
# the whole tensor, and of the worst row (so one wrong row among 32768 cannot hide). Correct runs give
# ~2e-3 overall in bf16 on the CPU path (one rounding of the residual and of the normed rows; a norm that
# rounds the sum before normalising gives ~3e-3), up to ~9e-3 with FP8 (an input one bf16 ulp off can
# round to the next FP8 value). A 5% error in one rank's partials gives 1.2e-2.
TOL = {"bf16": 6e-3, "fp8": 2e-2}
ROW_TOL = {"bf16": 2e-2, "fp8": 6e-2}


# ============================================================================ baseline norm
class BaseNorm:
    """The norm a user's layer runs: ``(x, residual, weight) -> (y, residual)`` with the add fused.

    flashinfer's ``fused_add_rmsnorm`` works in place (residual <- x + residual, x <- y); the
    ``nsa_cp.RMSNorm`` fallback returns new tensors. Callers use the returned pair either way."""

    def __init__(self, choice: str, nsa, device: torch.device, hidden: int, dtype):
        self.name, self.why = "nsa_cp.RMSNorm", ""
        self._fi = None
        if choice in ("auto", "flashinfer"):
            try:
                import flashinfer
                from flashinfer.norm import fused_add_rmsnorm

                if device.type != "cuda":
                    raise RuntimeError("flashinfer needs a CUDA device")
                t0 = time.perf_counter()
                x = torch.randn(4, hidden, device=device, dtype=dtype)
                r = torch.randn_like(x)
                w = torch.randn(hidden, device=device, dtype=dtype)
                fused_add_rmsnorm(x, r, w, EPS)  # the first call JIT-builds the kernel (~30 s)
                torch.cuda.synchronize(device)
                self._fi = fused_add_rmsnorm
                kernel = "CUDA JIT" if getattr(flashinfer.norm, "_USE_CUDA_NORM", True) else "CuTe DSL"
                self.name = f"flashinfer {flashinfer.__version__} fused_add_rmsnorm ({kernel} kernel)"
                self.why = f"first call {time.perf_counter() - t0:.1f} s"
            except Exception as e:  # noqa: BLE001 - any failure falls back, saying why
                if choice == "flashinfer":
                    raise
                self.why = f"flashinfer unavailable: {type(e).__name__}: {str(e)[:200]}"
        self._mods: Dict[int, torch.nn.Module] = {}
        self._nsa = nsa

    def __call__(self, x, residual, weight):
        if self._fi is not None:
            self._fi(x, residual, weight, EPS)
            return x, residual
        mod = self._mods.get(id(weight))
        if mod is None:
            mod = self._nsa.RMSNorm(weight.shape[0], eps=EPS, dtype=weight.dtype, device=weight.device)
            mod.weight.data = weight  # shares the tensor: no copy, no autograd history (run under no_grad)
            mod.requires_grad_(False)
            self._mods[id(weight)] = mod
        return mod(x, residual)

    def as_layer_norm(self, weight):
        """A plain function with the communicator's norm convention and no ``weight`` attribute, so an
        NSACPLayerCommunicator keeps norm-then-gather with it (the unfused rows)."""

        def norm(x, residual=None):
            if residual is None:
                return self(x, torch.zeros_like(x), weight)[0]
            return self(x, residual, weight)

        return norm


# ============================================================================ state
@dataclasses.dataclass
class TailCtx(harness.Ctx):
    norm: Optional[BaseNorm] = None
    w1: Optional[torch.Tensor] = None  # post-attention norm weight [H]
    w2: Optional[torch.Tensor] = None  # next layer's input norm weight [H]
    coef: float = 1.0  # this rank's stand-in constant
    comms: Dict[str, object] = dataclasses.field(default_factory=dict)  # communicators per row
    fused_backend_kw: bool = False  # the fused functions take backend=


@dataclasses.dataclass
class TailBufs:
    x: torch.Tensor  # [n_r, H] attention output (flashinfer normalises it in place)
    res: torch.Tensor  # [n_r, H] residual (updated in place or rebound)
    partials: Optional[torch.Tensor] = None  # [M*P, H] this rank's MoE partials, padded (boundary part)


def coef_of(rank: int) -> float:
    return (rank + 1) / 4.0  # exact in bf16; partials differ per rank, so a wrong source shows


def make_tail_bufs(c: TailCtx, rank: int, seed: int, partials: bool = False) -> TailBufs:
    n = c.layout.per_rank_actual_token[rank]
    x = harness.randn((n, c.hidden), harness.seed_of(seed, 11, rank), c.dtype, c.device)
    res = harness.randn((n, c.hidden), harness.seed_of(seed, 12, rank), c.dtype, c.device)
    part = harness.randn((c.layout.padded_len, c.hidden), harness.seed_of(seed, 13, rank), c.dtype, c.device) if partials else None
    return TailBufs(x, res, part)


def weights(hidden, dtype, device, seed) -> Tuple[torch.Tensor, torch.Tensor]:
    w1 = 1.0 + 0.1 * harness.randn((hidden,), harness.seed_of(seed, 21), torch.float32, device)
    w2 = 1.0 + 0.1 * harness.randn((hidden,), harness.seed_of(seed, 22), torch.float32, device)
    return w1.to(dtype), w2.to(dtype)


# ============================================================================ stand-ins
def standin_bf16(c: TailCtx, full: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    """The MoE: one kernel reading every gathered row and writing this rank's partials into ``buf``."""
    torch.mul(full, c.coef, out=buf)
    return buf


def standin_fp8(c: TailCtx, q: torch.Tensor, scale: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    """The FP8 MoE: partials = dequant(q, scale) * 1 (cast, then the group scales; two kernels).
    The same on every rank (torch has no one-kernel fp8 x fp32 product to fold a constant into)."""
    rows, groups = q.shape[0], q.shape[1] // 128
    view = buf.view(rows, groups, 128)
    view.copy_(q.view(rows, groups, 128))
    view.mul_(scale.view(rows, groups, 1))
    return buf


def quant_ref(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """docs/design.md's FP8 wire in torch (the reference of the checks): per row, groups of 128."""
    rows, h = x.shape
    g = x.float().view(rows, h // 128, 128)
    scale = g.abs().amax(dim=-1, keepdim=True).clamp_min(1e-10) / FP8_MAX
    q = (g / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(rows, h), scale.view(rows, h // 128)


def _split_quant(gathered):
    if isinstance(gathered, (tuple, list)) and len(gathered) == 2:
        return gathered
    raise TypeError(f"expected (q, scale) from the FP8 gather, got {type(gathered).__name__}")


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    fn: Callable[[TailCtx, TailBufs], tuple]  # -> outputs: tensors, or (q, scale) pairs of an FP8 gather
    what: str
    wire: str = "bf16"  # "bf16" | "fp8": its baseline (tail part) and tolerance
    needs: Optional[Callable[[TailCtx], Optional[str]]] = None
    prepare: Optional[Callable[[TailCtx], None]] = None
    # boundary part: the float32 reference of the outputs, whether they must match bitwise, where the
    # partials go before a call (the P2P reduce buffer), and the row the ratio column divides by
    ref: Optional[Callable[[TailCtx, int], tuple]] = None
    exact: bool = False
    stage: Optional[Callable[[TailCtx, TailBufs], None]] = None
    baseline: Optional[str] = None


def _comm(c: TailCtx, backend: str, compact: bool):
    key = f"{backend}/{int(compact)}"
    comm = c.comms.get(key)
    if comm is None:
        cls = c.nsa.NSACPLayerCommunicator
        # unfused on purpose: fuse=False where the communicator has the switch, and norms without a
        # ``weight`` attribute, which it could not fuse anyway
        kw = {"fuse": False} if "fuse" in inspect.signature(cls.__init__).parameters else {}
        comm = cls(c.group, c.norm.as_layer_norm(c.w2), c.norm.as_layer_norm(c.w1), compact=compact, backend=backend,
                   **kw)
        c.comms[key] = comm
    return comm


def _needs_p2p(c: TailCtx) -> Optional[str]:
    return harness.p2p_needs(c)


def _needs_fused(backend: str, quant: Optional[str] = None):
    def needs(c: TailCtx) -> Optional[str]:
        for name in ("fused_add_rmsnorm_all_gather", "reduce_scatter_fused_add_rmsnorm") + (
            ("quant_fp8_g128",) if quant else ()
        ):
            if not hasattr(c.nsa, name):
                return f"this nsa_cp has no {name}"
        if backend == "p2p":
            return _needs_p2p(c)
        if not c.fused_backend_kw and c.backend == "nccl":
            return ("the fused functions take no backend= argument, so the NCCL path cannot be forced while "
                    "a P2P transport is registered")
        return None

    return needs


def _needs_quant(c: TailCtx) -> Optional[str]:
    return None if hasattr(c.nsa, "quant_fp8_g128") else "this nsa_cp has no quant_fp8_g128"


def _prepare_p2p(c: TailCtx):
    harness.p2p_prepare(c)


# ============================================================================ correctness
def _rms(s: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return s * torch.rsqrt(s.pow(2).mean(dim=-1, keepdim=True) + EPS) * w.float()


def _as_values(out) -> torch.Tensor:
    """A tensor, or an FP8 gather's (q, scale) dequantized to float32 (q * its group's scale)."""
    if isinstance(out, (tuple, list)):
        q, scale = out
        n, h = q.shape
        return (q.float().view(n, h // 128, 128) * scale.float().view(n, h // 128, 1)).view(n, h)
    return out


def _rel(out: torch.Tensor, ref: torch.Tensor) -> Tuple[float, float]:
    """(relative L2 error of the tensor, of its worst row); inf for NaN or a wrong shape."""
    if out.shape != ref.shape:
        return float("inf"), float("inf")
    if out.numel() == 0:
        return 0.0, 0.0
    diff = out.float() - ref
    whole = (diff.norm() / ref.norm().clamp_min(1e-30)).item()
    rows = (diff.norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)).max().item()
    return tuple(e if math.isfinite(e) else float("inf") for e in (whole, rows))


def check_rows(c: TailCtx, rows: List[Row], seed: int, log, reference: Callable) -> Dict[str, str]:
    """One tail per row on fresh inputs, against ``row.ref`` or else ``reference(c, seed, row.wire)`` (the
    tail's); aborts the run on any mismatch; returns {row: skip reason}
    for rows that raised NotImplementedError on some rank."""
    status = torch.zeros(len(rows), dtype=torch.int64, device=c.device)
    errors = torch.zeros(len(rows), dtype=torch.float64, device=c.device)
    notes: Dict[str, str] = {}
    for i, row in enumerate(rows):
        s = harness.seed_of(seed, 31, i)
        b = make_tail_bufs(c, c.rank, s, partials=row.ref is not None)
        try:
            if row.stage is not None:
                row.stage(c, b)
            outs = tuple(row.fn(c, b))
        except NotImplementedError as e:
            status[i], notes[row.name] = harness.SKIP, f"NotImplementedError: {e}"
            continue
        except (ValueError, TypeError, RuntimeError) as e:
            # an API this checkout shapes differently (or a bug): the row is left out, loudly, and the rest
            # of the run goes on. Such errors come from argument checks, before any rank communicates.
            status[i], notes[row.name] = harness.SKIP, f"ERROR {type(e).__name__}: {str(e).strip()[:300]}"
            print(f"[rank {c.rank}] {row.name}: {notes[row.name]}", file=sys.stderr, flush=True)
            harness.sync(c)
            dist.barrier(group=c.group)
            continue
        harness.sync(c)
        refs = reference(c, s, row.wire) if row.ref is None else row.ref(c, s)
        if len(outs) != len(refs):
            status[i], notes[row.name] = harness.BAD, f"{len(outs)} outputs, expected {len(refs)}"
        elif row.exact:
            same = [o.shape == r.shape and torch.equal(o, r.to(o.dtype)) for o, r in zip(outs, refs)]
            if not all(same):
                status[i], notes[row.name] = harness.BAD, f"outputs differ from the exact expected rows: {same}"
        else:
            errs = [_rel(_as_values(o), r) for o, r in zip(outs, refs)]
            whole, worst = max(e[0] for e in errs), max(e[1] for e in errs)
            errors[i] = min(whole, 1e30)
            if not (whole <= TOL[row.wire] and worst <= ROW_TOL[row.wire]):
                status[i], notes[row.name] = harness.BAD, (
                    "relative L2 error (whole, worst row) per output: "
                    + "; ".join(f"{a:.3g}, {b_:.3g}" for a, b_ in errs)
                    + f" (tolerance {TOL[row.wire]}, {ROW_TOL[row.wire]})")
        dist.barrier(group=c.group)
    dist.all_reduce(errors, op=dist.ReduceOp.MAX, group=c.group)
    flags, skipped = harness.verdicts(c, [r.name for r in rows], status, notes)
    worst = ", ".join(f"{r.name} {e:.1e}" for r, f, e in zip(rows, flags, errors.tolist()) if f == harness.OK)
    log(f"  check ok: {len(rows) - len(skipped)} rows match the float32 reference (relative L2 error, max over "
        f"ranks: {worst})")
    return skipped


# ============================================================================ timing
def time_eager(c: TailCtx, rows: List[Row], bufsets, rounds: int, layers: int) -> Dict[str, float]:
    """Host-inclusive ms per layer: ``layers`` tails back to back between two device syncs."""
    align = harness.aligner(c)
    samples: Dict[str, List[float]] = {r.name: [] for r in rows}
    nb = len(bufsets)
    for rnd in range(rounds):
        dist.barrier(group=c.group)
        for k in range(len(rows)):
            row = rows[(rnd + k) % len(rows)]
            if align is not None:
                align()
            harness.sync(c)
            t0 = time.perf_counter()
            for layer in range(layers):
                row.fn(c, bufsets[(rnd + layer) % nb])
            harness.sync(c)
            samples[row.name].append((time.perf_counter() - t0) * 1e3 / layers)
    local = torch.tensor([statistics.median(samples[r.name]) for r in rows], dtype=torch.float64, device=c.device)
    dist.all_reduce(local, op=dist.ReduceOp.MAX, group=c.group)
    return {r.name: v for r, v in zip(rows, local.tolist())}
