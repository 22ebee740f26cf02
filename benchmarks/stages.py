"""One-GPU benchmark: the stages of nsa_cp's collectives on one GPU, against torch, flashinfer (where
installed) and the HBM floor.

Usage::

    python benchmarks/stages.py                          # the GPU: M in 256 2048 8192 32768, cp 2
    python benchmarks/stages.py --M 8192 --cp 8 --csv stages.csv --json stages.json
    python benchmarks/stages.py --M 16 --hidden 256 --rounds 2    # no GPU: a CPU smoke run

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

import argparse
import dataclasses
import os
import random
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from harness import DTYPES  # noqa: E402
EPS = 1e-6
FP8_MAX = 448.0
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
def torch_add_rmsnorm(x, res, w):
    """SGLang's ``forward_native``: fp32 sum, residual <- sum rounded, y = s * rsqrt(mean(s^2) + eps) * w."""
    s = x.float() + res.float()
    res.copy_(s)
    y = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS) * w.float()
    return y.to(x.dtype)


def torch_quant(x):
    """SGLang's ``per_token_group_quant_fp8`` written in torch: groups of 128, amax / 448 per group."""
    rows, h = x.shape
    g = x.float().view(rows, h // 128, 128)
    scale = g.abs().amax(-1, keepdim=True).clamp(min=1e-10) / FP8_MAX
    q = (g / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(rows, h), scale.view(rows, h // 128)


def ref_norm(x, res, w):
    """(y, residual) in fp32 arithmetic, from fresh copies (the inputs are untouched)."""
    s = x.double() + res.double()
    s = s.float().double()
    return (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS) * w.double()), s.to(x.dtype)


# ============================================================================ methods
@dataclasses.dataclass
class Method:
    stage: str
    name: str  # unique within its stage
    fn: Callable[[dict], object]  # one call on a buffer set
    check: Callable[[dict], Optional[str]]  # the check's call and verdict on a fresh set: None if right
    baseline: bool = False  # the stage's torch baseline ("x torch")

    @property
    def key(self) -> str:
        return f"{self.stage} / {self.name}"


def _poison(*ts):
    for t in ts:
        if t.dtype == torch.float8_e4m3fn:
            t.view(torch.uint8).fill_(0x7F)  # NaN in e4m3fn
        else:
            t.fill_(float("nan"))


def _rel(out, ref) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp(min=1e-30))


def _equal(what, out, ref) -> Optional[str]:
    if out.shape != ref.shape:
        return f"{what}: shape {list(out.shape)}, expected {list(ref.shape)}"
    return None if torch.equal(out, ref) else f"{what}: differs from the expected rows"


def _exact_check(key: str, ref: Callable[[dict], torch.Tensor]):
    """``chk(fn)``: the check of a method writing buffer ``key``: poisoned first, then equal to ``ref``."""

    def chk(fn):
        def check(b):
            _poison(b[key])
            got = fn(b)
            return _equal(key, b[key] if got is None else got, ref(b))
        return check

    return chk


def _close(what, out, ref, tol) -> Optional[str]:
    if out.shape != ref.shape:
        return f"{what}: shape {list(out.shape)}, expected {list(ref.shape)}"
    err = _rel(out, ref)
    return None if err <= tol else f"{what}: relative error {err:.2e} > {tol:.0e}"


def methods_for(s: Shape, nsa, log) -> List[Method]:
    """Every stage's methods; those this machine cannot run are left out, saying why (``log``)."""
    from nsa_cp import layout as nsa_layout

    dev, M, n, P = s.device, s.M, s.n, s.cp
    tol_norm = 2 * 2.0 ** -7 if s.dtype == torch.bfloat16 else 1e-3
    count = torch.tensor([n], dtype=torch.int32, device=dev)
    w = (1.0 + 0.1 * torch.randn(s.hidden, generator=torch.Generator().manual_seed(5))).to(s.dtype).to(dev)
    layout = nsa_layout.ShardLayout(s.counts)
    index = torch.cat([torch.arange(c) + r * M for r, c in enumerate(s.counts)]).to(dev)
    out: List[Method] = []

    def optional(stage, name, make):
        try:
            fn = make()
        except Exception as e:  # noqa: BLE001 - an API this checkout or machine lacks: say why, go on
            log(f"  {stage}: {name} skipped: {type(e).__name__}: {str(e)[:160]}")
            return None
        return fn

    # ---- pack / pad
    def ref_pad(b):
        return F.pad(b["x"], (0, 0, 0, M - n))

    def pack_nsa(impl=None):
        def make():
            from nsa_cp.kernels.pack import pack_into_slot

            return lambda b: pack_into_slot(b["x"], b["slot"], count, impl=impl)
        return make

    def copy_zero(b):
        b["slot"][:n].copy_(b["x"])
        b["slot"][n:].zero_()
        return b["slot"]

    chk_slot = _exact_check("slot", ref_pad)

    out.append(Method("pack / pad", "torch F.pad", ref_pad, chk_slot(ref_pad), baseline=True))
    out.append(Method("pack / pad", "torch copy_ + zero_", copy_zero, chk_slot(copy_zero)))
    try:  # which row kernel nsa_cp takes for these tensors (the label of its rows)
        from nsa_cp.kernels._rows import native_module

        native = native_module(torch.empty(1, 1, dtype=s.dtype, device=dev), None) is not None
    except Exception:  # noqa: BLE001 - the row says Triton then
        native = False
    fn = optional("pack / pad", "nsa_cp pack", pack_nsa())
    if fn:
        out.append(Method("pack / pad", f"nsa_cp pack ({'native' if native else 'Triton'})",
                          fn, chk_slot(fn)))
    if native:  # the Triton twin the native kernel replaces
        fn = optional("pack / pad", "nsa_cp pack (Triton)", pack_nsa("triton"))
        if fn:
            out.append(Method("pack / pad", "nsa_cp pack (Triton)", fn, chk_slot(fn)))

    # ---- add + RMSNorm (local rows)
    def chk_norm(fn, where="y"):
        def check(b):
            y_ref, res_ref = ref_norm(b["x"], b["res"], w)
            x0 = b["x"].clone()
            got = fn(b)
            y = got[0] if isinstance(got, tuple) else got
            return (_close("y", y, y_ref, tol_norm) or _close("residual", b["res"], res_ref, 2.0 ** -7)
                    or (None if where == "inplace" or torch.equal(b["x"], x0) else "x was modified"))
        return check

    def torch_norm(b):
        return torch_add_rmsnorm(b["x"], b["res"], w)

    out.append(Method("add + RMSNorm", "torch formula", torch_norm, chk_norm(torch_norm), baseline=True))

    def nsa_norm(impl):
        def make():
            mod = nsa.RMSNorm(s.hidden, eps=EPS, dtype=s.dtype, device=dev, impl=impl)
            mod.weight.data.copy_(w)
            mod.requires_grad_(False)
            return lambda b: mod(b["x"], b["res"])
        return make

    for impl, label in (("triton", "nsa_cp.RMSNorm (Triton)"),):
        if dev.type == "cuda":
            fn = optional("add + RMSNorm", label, nsa_norm(impl))
            if fn:
                out.append(Method("add + RMSNorm", label, fn, chk_norm(fn)))
    fi = _flashinfer(dev, s.dtype, log)
    if fi is not None:
        def fi_norm(b):  # in place: x <- y, residual <- x + residual
            fi.fused_add_rmsnorm(b["x"], b["res"], w, EPS)
            return b["x"]
        out.append(Method("add + RMSNorm", "flashinfer fused_add_rmsnorm", fi_norm, chk_norm(fi_norm, "inplace")))

    # ---- add + RMSNorm into the padded slot
    def torch_norm_pad(b):
        return F.pad(torch_add_rmsnorm(b["x"], b["res"], w), (0, 0, 0, M - n))

    def chk_norm_slot(fn):
        def check(b):
            y_ref, res_ref = ref_norm(b["x"], b["res"], w)
            _poison(b["slot"])
            got = fn(b)
            got = b["slot"] if got is None else got
            return (_close("slot", got, F.pad(y_ref, (0, 0, 0, M - n)), tol_norm)
                    or _close("residual", b["res"], res_ref, 2.0 ** -7)
                    or _equal("slot padding", got[n:], torch.zeros_like(got[n:])))
        return check

    out.append(Method("add + RMSNorm into slot", "torch formula + F.pad", torch_norm_pad, chk_norm_slot(torch_norm_pad),
                      baseline=True))

    def nsa_norm_slot():
        from nsa_cp.kernels.norm import fused_add_rmsnorm_into

        return lambda b: fused_add_rmsnorm_into(b["x"], b["res"], w, EPS, b["slot"], count)

    fn = optional("add + RMSNorm into slot", "nsa_cp fused kernel", nsa_norm_slot)
    if fn:
        out.append(Method("add + RMSNorm into slot", "nsa_cp fused kernel (Triton)", fn, chk_norm_slot(fn)))
    if fi is not None:
        pack = optional("add + RMSNorm into slot", "flashinfer + nsa_cp pack", pack_nsa())
        if pack:
            def fi_pack(b):
                fi.fused_add_rmsnorm(b["x"], b["res"], w, EPS)
                pack(b)
                return b["slot"]
            out.append(Method("add + RMSNorm into slot", "flashinfer + nsa_cp pack", fi_pack, chk_norm_slot(fi_pack)))

    # ---- FP8 quantization (local rows), and fused add + RMSNorm + FP8 into the slot
    def chk_quant(fn):
        def check(b):
            q_ref, s_ref = torch_quant(b["x"])
            got = fn(b)
            q, sc = got
            deq = q.float().view(n, -1, 128) * sc.view(n, -1, 1)
            deq_ref = q_ref.float().view(n, -1, 128) * s_ref.view(n, -1, 1)
            return _close("scale", sc, s_ref, 1e-6) or _close("dequantized q", deq, deq_ref, 2e-2)
        return check

    out.append(Method("FP8 quantization", "torch formula", lambda b: torch_quant(b["x"]),
                      chk_quant(lambda b: torch_quant(b["x"])), baseline=True))
    if s.hidden % 128 == 0:
        fn = optional("FP8 quantization", "nsa_cp.quant_fp8_g128", lambda: (lambda b: nsa.quant_fp8_g128(b["x"])))
        if fn:
            out.append(Method("FP8 quantization", "nsa_cp.quant_fp8_g128", fn, chk_quant(fn)))

    def torch_norm_fp8(b):
        q, sc = torch_quant(torch_add_rmsnorm(b["x"], b["res"], w))
        return F.pad(q.view(torch.uint8), (0, 0, 0, M - n)).view(torch.float8_e4m3fn), F.pad(sc, (0, 0, 0, M - n))

    def chk_norm_fp8(fn):
        def check(b):
            y_ref, res_ref = ref_norm(b["x"], b["res"], w)
            _poison(b["q"], b["scale"])
            got = fn(b)
            q, sc = (b["q"], b["scale"]) if got is None else got
            deq = (q[:n].float().view(n, -1, 128) * sc[:n].view(n, -1, 1)).view(n, -1)
            return (_close("dequantized slot", deq, y_ref, 4e-2) or _close("residual", b["res"], res_ref, 2.0 ** -7)
                    or _equal("padding q", q[n:].view(torch.uint8), torch.zeros_like(q[n:].view(torch.uint8))))
        return check

    out.append(Method("add + RMSNorm + FP8 into slot", "torch formula + quant + F.pad", torch_norm_fp8,
                      chk_norm_fp8(torch_norm_fp8), baseline=True))

    def nsa_norm_fp8():
        from nsa_cp.kernels.norm import fused_add_rmsnorm_into

        return lambda b: fused_add_rmsnorm_into(b["x"], b["res"], w, EPS, b["q"], count, quant="fp8_e4m3_g128",
                                                dst_scale=b["scale"])

    if s.hidden % 128 == 0:
        fn = optional("add + RMSNorm + FP8 into slot", "nsa_cp fused kernel", nsa_norm_fp8)
        if fn:
            out.append(Method("add + RMSNorm + FP8 into slot", "nsa_cp fused kernel (Triton)", fn, chk_norm_fp8(fn)))

    # ---- compaction
    def ref_compact(b):
        return torch.cat([b["padded"][r * M:r * M + c] for r, c in enumerate(s.counts)])

    def index_sel(b):
        return torch.index_select(b["padded"], 0, index, out=b["compact"])

    chk_compact = _exact_check("compact", ref_compact)

    out.append(Method("compaction", "torch.cat of slices", ref_compact, chk_compact(ref_compact), baseline=True))
    out.append(Method("compaction", "torch index_select(out=)", index_sel, chk_compact(index_sel)))

    def nsa_compact(impl=None):
        def make():
            from nsa_cp.kernels.compact import padded_to_compact

            return lambda b: padded_to_compact(b["padded"], layout, b["compact"], impl=impl)
        return make

    fn = optional("compaction", "nsa_cp compact", nsa_compact())
    if fn:
        out.append(Method("compaction", f"nsa_cp compact ({'native' if native else 'Triton'})",
                          fn, chk_compact(fn)))
    if native:
        fn = optional("compaction", "nsa_cp compact (Triton)", nsa_compact("triton"))
        if fn:
            out.append(Method("compaction", "nsa_cp compact (Triton)", fn, chk_compact(fn)))

    # ---- fp32 accumulation (the reduce-scatter's sum)
    def sum_dim(b):
        return b["out"].copy_(b["partials"].sum(0, dtype=torch.float32))

    def sum_loop(b):
        acc = b["partials"][0].float()
        for q in range(1, P):
            acc += b["partials"][q]
        return b["out"].copy_(acc)

    def chk_sum(fn):
        def check(b):
            _poison(b["out"])
            got = fn(b)
            return _close("sum", got, b["partials"].double().sum(0), 1e-2)
        return check

    out.append(Method("fp32 accumulation", "torch sum(dtype=float32)", sum_dim, chk_sum(sum_dim), baseline=True))
    out.append(Method("fp32 accumulation", "torch loop of fp32 adds", sum_loop, chk_sum(sum_loop)))
    return out


def _flashinfer(dev, dtype, log):
    """flashinfer.norm where it imports and works on this device and dtype, else None (saying why)."""
    if dev.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return None
    try:
        import flashinfer.norm as fi

        x = torch.randn(4, 256, device=dev, dtype=dtype)
        fi.fused_add_rmsnorm(x, torch.randn_like(x), torch.ones(256, device=dev, dtype=dtype), EPS)
        torch.cuda.synchronize(dev)
        return fi
    except Exception as e:  # noqa: BLE001 - optional
        log(f"  flashinfer rows skipped: {type(e).__name__}: {str(e)[:160]}")
        return None


def min_bytes(stage: str, s: Shape) -> int:
    """The fewest bytes a stage must move: each input read once, each output written once."""
    M, n, H, P, e = s.M, s.n, s.hidden, s.cp, s.elem
    return {
        "pack / pad": (n + M) * H * e,
        "add + RMSNorm": 4 * n * H * e,  # read x, residual; write residual, y
        "add + RMSNorm into slot": (3 * n + M) * H * e,
        "FP8 quantization": n * H * e + n * H + n * H // 128 * 4,
        "add + RMSNorm + FP8 into slot": 3 * n * H * e + M * H + M * H // 128 * 4,
        "compaction": 2 * s.T * H * e,
        "fp32 accumulation": (P + 1) * n * H * e,
    }[stage]


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
def run_size(M: int, args, dev, nsa, hbm_gbps: float, log) -> List[dict]:
    counts = [(M, round(0.8 * M))[r % 2] for r in range(args.cp)]
    s = Shape(M=M, n=round(0.8 * M), cp=args.cp, counts=counts, hidden=args.hidden, dtype=DTYPES[args.dtype],
              device=dev)
    log(f"M={M}: counts {counts}, this rank's n={s.n}, H={s.hidden} {args.dtype}")
    methods = methods_for(s, nsa, log)
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
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--M", type=int, nargs="+", help="max_rank_len sweep (GPU: 256 2048 8192 32768; CPU: 64)")
    p.add_argument("--cp", type=int, default=2, help="ranks of the layout (counts [M, 0.8M, ...] cycling)")
    p.add_argument("--hidden", type=int, default=7168, help="row length (FP8 rows need a multiple of 128)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--max-bufs", type=int, default=8, help="most rotating buffer sets per size")
    p.add_argument("--floor-mib", type=int, default=1024, help="MiB of the HBM copy that sets the floor")
    p.add_argument("--seed", type=int, default=0)
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
    rows = []
    for M in args.M:
        rows += run_size(M, args, dev, nsa_cp, hbm, log)
    print(format_table(tags, rows), flush=True)  # tables first, files after
    harness.write_rows(tags, rows, args.csv, args.json)
    bad = [r for r in rows if r["check"] != "ok" and not r["check"].startswith("skipped")]
    if bad:
        raise SystemExit(f"{len(bad)} method(s) failed their check (see CHECK FAILED above)")


if __name__ == "__main__":
    harness.run_main(main)
