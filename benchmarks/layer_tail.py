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

Protocol: benchmarks/harness.py's, as for gather_scatter.py (docs/performance.md, "Benchmark protocol"):
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

``x sglang``: the row's time over its baseline's (``sglang``, or ``sglang_fp8`` for FP8 rows) in the same
run. ``--csv`` / ``--json``: one row per (configuration, row), tagged as every benchmark tags its rows
(``harness.env_tags``), plus the baseline norm.
"""

from __future__ import annotations

import argparse
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
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402  spawn, seeds, the timing protocol, env tags, writers

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
    """DESIGN.md's FP8 convention in torch (the reference of the checks): per row, groups of 128."""
    rows, h = x.shape
    g = x.float().view(rows, h // 128, 128)
    scale = g.abs().amax(dim=-1, keepdim=True).clamp_min(1e-10) / FP8_MAX
    q = (g / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(rows, h), scale.view(rows, h // 128)


def _split_quant(gathered):
    if isinstance(gathered, (tuple, list)) and len(gathered) == 2:
        return gathered
    raise TypeError(f"expected (q, scale) from the FP8 gather, got {type(gathered).__name__}")


# ============================================================================ rows
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


# ============================================================================ boundary part
# The two halves of the layer boundary on their own (``--part boundary``), padded layout: what the fused boundary's
# goals compare. Gather side: from x, residual -> every rank's normed rows. Reduce side: from this
# rank's partials (staged once into the buffer the reduce-scatter reads) -> the next layer's normed rows.
def _gather_ref_rows(c: TailCtx, seed: int, norm: bool) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(padded [M*P, H] rows of every rank: normed (bf16) or x itself, this rank's new residual)."""
    M, counts = c.M, c.layout.per_rank_actual_token
    rows, res1 = [], None
    for q in range(c.world):
        b = make_tail_bufs(c, q, seed)
        s = b.x.float() + b.res.float()
        rows.append(F.pad(_rms(s, c.w1).to(c.dtype) if norm else b.x, (0, 0, 0, M - counts[q])))
        if q == c.rank:
            res1 = s
    return torch.cat(rows), res1


def _dequant_ref(rows: torch.Tensor) -> torch.Tensor:
    q8, scale = quant_ref(rows)
    n, h = rows.shape
    return (q8.float().view(n, h // 128, 128) * scale.view(n, h // 128, 1)).view(n, h)


def ref_gather(norm: bool, fp8: bool):
    def ref(c: TailCtx, seed: int):
        rows, res1 = _gather_ref_rows(c, seed, norm)
        rows = _dequant_ref(rows) if fp8 else rows.float()
        return (rows, res1) if norm else (rows,)

    return ref


def ref_reduce(norm: bool):
    def ref(c: TailCtx, seed: int):
        a, n = c.rank * c.M, c.n
        acc = torch.zeros((n, c.hidden), dtype=torch.float32, device=c.device)
        for q in range(c.world):
            acc += make_tail_bufs(c, q, seed, partials=True).partials[a:a + n].float()
        if not norm:
            return (acc,)
        s2 = acc.to(c.dtype).float() + make_tail_bufs(c, c.rank, seed).res.float()
        return _rms(s2, c.w2), s2

    return ref


def b_ag_sglang(c: TailCtx, b: TailBufs):
    h, b.res = c.norm(b.x, b.res, c.w1)
    full = torch.empty((c.M * c.world, c.hidden), dtype=c.dtype, device=c.device)
    harness.all_gather_single(full, F.pad(h, (0, 0, 0, c.M - c.n)), group=c.group)
    return full, b.res


def b_ag_dpfp8_sglang(c: TailCtx, b: TailBufs):
    """SGLang's FP8 DP-gather recipe after the norm: quantize the local rows, gather the payload and the
    scales (two collectives; padded here, gatherv there), dequantize the gathered rows."""
    M, n, H = c.M, c.n, c.hidden
    h, b.res = c.norm(b.x, b.res, c.w1)
    q, scale = c.nsa.quant_fp8_g128(h)
    q_full = torch.empty((M * c.world, H), dtype=torch.uint8, device=c.device)
    harness.all_gather_single(q_full, F.pad(q.view(torch.uint8), (0, 0, 0, M - n)), group=c.group)
    s_full = torch.empty((M * c.world, H // 128), dtype=torch.float32, device=c.device)
    harness.all_gather_single(s_full, F.pad(scale, (0, 0, 0, M - n)), group=c.group)
    return c.nsa.dequant_fp8_g128(q_full.view(torch.float8_e4m3fn), s_full, c.dtype), b.res


def _bk(c: TailCtx, backend: str) -> dict:
    return {"backend": backend}


def b_ag_nsa(backend: str, quant: Optional[str] = None):
    def fn(c: TailCtx, b: TailBufs):
        kw = {"quant": quant} if quant else {}
        return (c.nsa.cp_all_gather(b.x, c.layout, c.group, backend=backend, **kw),)

    return fn


def b_normag_fused(backend: str, quant: Optional[str] = None):
    def fn(c: TailCtx, b: TailBufs):
        kw = {"backend": backend} if c.fused_backend_kw else {}
        return c.nsa.fused_add_rmsnorm_all_gather(b.x, b.res, c.w1, EPS, c.layout, c.group, quant=quant, **kw)

    return fn


def _rs_source(c: TailCtx, b: TailBufs, backend: str) -> torch.Tensor:
    if backend == "p2p":  # the transport's reduce buffer, where the MoE would have written (staged)
        return _comm(c, "p2p", False).mlp_output_buffer(c.layout, b.x)
    return b.partials


def stage_p2p_partials(c: TailCtx, b: TailBufs) -> None:
    _comm(c, "p2p", False).mlp_output_buffer(c.layout, b.x).copy_(b.partials)


def b_rs_sglang(c: TailCtx, b: TailBufs):
    mine = torch.empty((c.M, c.hidden), dtype=c.dtype, device=c.device)
    harness.reduce_scatter_single(mine, b.partials, group=c.group)
    return c.norm(mine[: c.n], b.res, c.w2)


def b_rs_nsa(backend: str):
    def fn(c: TailCtx, b: TailBufs):
        return (c.nsa.cp_reduce_scatter(_rs_source(c, b, backend), c.layout, c.group, backend=backend),)

    return fn


def b_rsnorm_fused(backend: str):
    def fn(c: TailCtx, b: TailBufs):
        kw = {"backend": backend} if c.fused_backend_kw else {}
        return c.nsa.reduce_scatter_fused_add_rmsnorm(_rs_source(c, b, backend), b.res, c.w2, EPS, c.layout, c.group,
                                                      **kw)

    return fn


def _needs_p2p_quant(c: TailCtx) -> Optional[str]:
    return _needs_quant(c) or _needs_p2p(c)


def _needs_dequant(c: TailCtx) -> Optional[str]:
    missing = [n for n in ("quant_fp8_g128", "dequant_fp8_g128") if not hasattr(c.nsa, n)]
    return f"this nsa_cp has no {', '.join(missing)}" if missing else None


BOUNDARY_ROWS: List[Row] = [
    Row("ag_sglang", b_ag_sglang, "baseline norm + F.pad + all_gather_into_tensor", ref=ref_gather(True, False)),
    Row("ag_nsa_p2p", b_ag_nsa("p2p"), "cp_all_gather alone (no norm), P2P", needs=_needs_p2p, prepare=_prepare_p2p,
        ref=ref_gather(False, False), exact=True),
    Row("normag_fused_p2p", b_normag_fused("p2p"), "fused_add_rmsnorm_all_gather, P2P", needs=_needs_fused("p2p"),
        prepare=_prepare_p2p, ref=ref_gather(True, False), baseline="ag_sglang"),
    Row("normag_fused_nccl", b_normag_fused("nccl"), "fused_add_rmsnorm_all_gather, NCCL", needs=_needs_fused("nccl"),
        ref=ref_gather(True, False), baseline="ag_sglang"),
    Row("ag_fp8_p2p", b_ag_nsa("p2p", FP8), "cp_all_gather(quant=fp8) alone (no norm), P2P", "fp8",
        needs=_needs_p2p_quant, prepare=_prepare_p2p, ref=ref_gather(False, True), baseline="ag_nsa_p2p"),
    Row("ag_dpfp8_sglang", b_ag_dpfp8_sglang, "baseline norm + SGLang's FP8 DP-gather recipe (quant, 2 gathers, "
        "dequant)", "fp8", needs=_needs_dequant, ref=ref_gather(True, True)),
    Row("normag_fp8_fused_p2p", b_normag_fused("p2p", FP8), "fused_add_rmsnorm_all_gather(quant=fp8), P2P", "fp8",
        needs=_needs_fused("p2p", FP8), prepare=_prepare_p2p, ref=ref_gather(True, True), baseline="ag_dpfp8_sglang"),
    Row("rs_sglang", b_rs_sglang, "reduce_scatter_tensor + slice + baseline norm", ref=ref_reduce(True)),
    Row("rs_nsa_p2p", b_rs_nsa("p2p"), "cp_reduce_scatter alone (no norm), P2P, from the reduce buffer",
        needs=_needs_p2p, prepare=_prepare_p2p, ref=ref_reduce(False), stage=stage_p2p_partials, baseline="rs_sglang"),
    Row("rsnorm_fused_p2p", b_rsnorm_fused("p2p"), "reduce_scatter_fused_add_rmsnorm, P2P, from the reduce buffer",
        needs=_needs_fused("p2p"), prepare=_prepare_p2p, ref=ref_reduce(True), stage=stage_p2p_partials,
        baseline="rs_sglang"),
    Row("rsnorm_fused_nccl", b_rsnorm_fused("nccl"), "reduce_scatter_fused_add_rmsnorm, NCCL", needs=_needs_fused("nccl"),
        ref=ref_reduce(True), baseline="rs_sglang"),
]
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


# ============================================================================ correctness
def _rms(s: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return s * torch.rsqrt(s.pow(2).mean(dim=-1, keepdim=True) + EPS) * w.float()


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


def check_rows(c: TailCtx, rows: List[Row], seed: int, log) -> Dict[str, str]:
    """One tail per row on fresh inputs; aborts the run on any mismatch; returns {row: skip reason}
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
    flags = status.clone()
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=c.group)
    dist.all_reduce(errors, op=dist.ReduceOp.MAX, group=c.group)
    flags = flags.tolist()
    bad = [r.name for r, f in zip(rows, flags) if f == harness.BAD]
    if bad:
        msg = f"CORRECTNESS FAILURE, counts {list(c.counts)}: {bad} [rank {c.rank}] " + "; ".join(
            f"{k}: {v}" for k, v in notes.items() if k in bad)
        print(msg, file=sys.stderr, flush=True)
        raise RuntimeError(msg)
    skipped = {r.name: notes.get(r.name, "NotImplementedError on another rank") for r, f in zip(rows, flags)
               if f == harness.SKIP}
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


def run_config(c: TailCtx, rows: List[Row], args, cfg_idx: int, log) -> Tuple[List[dict], Dict[str, str]]:
    L = c.layout
    log(f"[{cfg_idx + 1}] counts {list(c.counts)}  M={c.M}  total={L.total_len}")
    active, skipped = [], {}
    for r in rows:
        reason = r.needs(c) if r.needs else None
        if reason:
            skipped[r.name] = reason
        else:
            active.append(r)
    for prepare in dict.fromkeys(r.prepare for r in active if r.prepare):
        prepare(c)
    c.comms.clear()  # communicators bind to the transport of this configuration
    skipped.update(check_rows(c, active, harness.seed_of(args.seed, cfg_idx), log))
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
    c.comms.clear()
    if c.device.type == "cuda":
        torch.cuda.empty_cache()
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
    for cfg, rs in harness.by_config(result):
        lines.append("")
        if rs:
            r0 = rs[0]
            over = ("over sglang, FP8 rows over sglang_fp8" if r0.get("part", "tail") == "tail"
                    else "over the row named in 'base'")
            lines.append(f"counts [{r0['counts'].replace('/', ', ')}]  M={r0['max_rank_len']}  H={r0['hidden']} "
                         f"{r0['dtype']}  ({r0['rounds']} rounds, eager: {r0['layers']} calls back to back; x base: "
                         f"{over})")
            lines.append(hdr + ("   base" if r0.get("part") == "boundary" else ""))
        for r in rs:
            base = f"   {r['baseline']}" if r.get("part") == "boundary" and r["baseline"] != r["row"] else ""
            lines.append(f"{r['row']:<24}{r['device_ms']:>10.3f}{r['x_base_device']:>8.2f}{r['eager_ms']:>10.3f}"
                         f"{r['x_base_eager']:>8.2f}{r['host_us_per_layer']:>15.1f}{r['x_base_host']:>8.2f}{base}")
        lines += harness.skipped_lines(result, cfg, 24)
    smoke = harness.smoke_note(tags)
    lines += [smoke] if smoke else format_targets(rows)
    return "\n".join(lines)


# the fused boundary's goals (boundary part): (label, numerator row, denominator row, limit, smallest M it applies at), device ms
TARGETS_13 = [
    ("fused norm+AG P2P / cp_all_gather P2P", "normag_fused_p2p", "ag_nsa_p2p", 1.1, 2048),
    ("fused norm+AG P2P / flashinfer-or-baseline norm + F.pad + AG", "normag_fused_p2p", "ag_sglang", 0.6, 0),
    ("fused RS+norm P2P / cp_reduce_scatter P2P", "rsnorm_fused_p2p", "rs_nsa_p2p", 1.1, 2048),
    ("FP8 gather P2P / bf16 gather P2P", "ag_fp8_p2p", "ag_nsa_p2p", 0.6, 8192),
    ("fused norm+FP8 AG P2P / norm + SGLang FP8 DP-gather recipe", "normag_fp8_fused_p2p", "ag_dpfp8_sglang", 0.5, 0),
]


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
        lines += ["", "boundary goals (device ms ratios), per M " + " ".join(map(str, Ms)) + ":"]
        for label, num, den, limit, min_m in TARGETS_13:
            cells, verdict = [], "ok"
            for M in Ms:
                a, b = by.get((M, num)), by.get((M, den))
                if a is None or b is None or b["device_ms"] <= 0:
                    cells.append("  -  ")
                    verdict = "incomplete" if verdict == "ok" else verdict
                    continue
                ratio = a["device_ms"] / b["device_ms"]
                applies = M >= min_m
                cells.append(f"{ratio:5.2f}" + ("" if applies else "*"))
                if applies and ratio > limit:
                    verdict = "MISS"
            where = "every M" if min_m == 0 else f"M >= {min_m}"
            lines.append(f"  {label:<62} <= {limit:.2f} at {where:<9} {' '.join(cells)}  {verdict}")
        lines.append("  (* outside the M range the target applies to)")
    return lines


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
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
        configs = [tuple((M, int(round(M * (1 - args.imbalance))))[r % 2] for r in range(world)) for M in args.M]
    result = harness.run_ranks(worker, world, "nccl" if use_cuda else "cpu", args, configs, prefix="layer_tail_",
                               what="layer_tail.py")
    print(format_table(result, cpu=not use_cuda), flush=True)  # tables first, files after
    harness.write_rows(result["tags"], result["rows"], args.csv, args.json, skipped=result["skipped"],
                       norm=result.get("norm"))


if __name__ == "__main__":
    harness.run_main(main)
