"""stages.py's stages: each stage's methods (torch's baseline first), the check of each against its
expected output, and its byte floor (``min_bytes``: each input read once, each output written once).
One function per stage; ``methods_for`` lists them in the table's order. A part of stages.py (no other
benchmark imports it). ``s``: stages.py's ``Shape`` (M, n, cp, counts, hidden, dtype, device, T, elem).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional

import torch
import torch.nn.functional as F

import harness  # noqa: E402  (the benchmarks folder is the running script's: on the path)

harness.part_of("stages.py", __name__)  # run as a script, it says which script to run

EPS = 1e-6
FP8_MAX = 448.0


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


# ============================================================================ methods and checks
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


# ============================================================================ what every stage's methods see
@dataclasses.dataclass
class Env:
    """One size's shape, nsa_cp, the norm weight, this rank's count, the layout and its compaction index,
    which row kernel nsa_cp takes (native or Triton), flashinfer's norm (or None) and the log."""

    s: object
    nsa: object
    log: Callable[[str], None]
    w: torch.Tensor
    count: torch.Tensor
    layout: object
    index: torch.Tensor
    native: bool
    fi: object

    @property
    def tol_norm(self) -> float:
        return 2 * 2.0 ** -7 if self.s.dtype == torch.bfloat16 else 1e-3

    def optional(self, stage, name, make):
        """``make()``, or None with a line saying why (an API this checkout or machine lacks)."""
        try:
            return make()
        except Exception as e:  # noqa: BLE001 - say why, go on
            self.log(f"  {stage}: {name} skipped: {type(e).__name__}: {str(e)[:160]}")
            return None


def make_env(s, nsa, log) -> Env:
    from nsa_cp.geometry import layout as nsa_layout

    dev, M = s.device, s.M
    w = (1.0 + 0.1 * torch.randn(s.hidden, generator=torch.Generator().manual_seed(5))).to(s.dtype).to(dev)
    index = torch.cat([torch.arange(c) + r * M for r, c in enumerate(s.counts)]).to(dev)
    try:  # which row kernel nsa_cp takes for these tensors (the label of its rows)
        from nsa_cp.rows.kernels._rows import native_module

        native = native_module(torch.empty(1, 1, dtype=s.dtype, device=dev), None) is not None
    except Exception:  # noqa: BLE001 - the row says Triton then
        native = False
    return Env(s, nsa, log, w, torch.tensor([s.n], dtype=torch.int32, device=dev), nsa_layout.ShardLayout(s.counts),
               index, native, _flashinfer(dev, s.dtype, log))


def pack_nsa(e: Env, impl=None):
    """nsa_cp's pack of ``x`` into its slot (padding rows zeroed), as a ``make`` for ``Env.optional``."""

    def make():
        from nsa_cp.rows.kernels.pack import pack_into_slot

        return lambda b: pack_into_slot(b["x"], b["slot"], e.count, impl=impl)

    return make


# ============================================================================ the stages
def pack_pad(e: Env) -> List[Method]:
    """pack / pad: x [n, H] into its [M, H] slot, padding rows zeroed."""
    M, n = e.s.M, e.s.n
    out: List[Method] = []

    def ref_pad(b):
        return F.pad(b["x"], (0, 0, 0, M - n))

    def copy_zero(b):
        b["slot"][:n].copy_(b["x"])
        b["slot"][n:].zero_()
        return b["slot"]

    chk_slot = _exact_check("slot", ref_pad)

    out.append(Method("pack / pad", "torch F.pad", ref_pad, chk_slot(ref_pad), baseline=True))
    out.append(Method("pack / pad", "torch copy_ + zero_", copy_zero, chk_slot(copy_zero)))
    fn = e.optional("pack / pad", "nsa_cp pack", pack_nsa(e))
    if fn:
        out.append(Method("pack / pad", f"nsa_cp pack ({'native' if e.native else 'Triton'})",
                          fn, chk_slot(fn)))
    if e.native:  # the Triton twin the native kernel replaces
        fn = e.optional("pack / pad", "nsa_cp pack (Triton)", pack_nsa(e, "triton"))
        if fn:
            out.append(Method("pack / pad", "nsa_cp pack (Triton)", fn, chk_slot(fn)))
    return out


def add_rmsnorm(e: Env) -> List[Method]:
    """add + RMSNorm of the n local rows (residual updated)."""
    s, nsa, dev, w, fi, tol_norm = e.s, e.nsa, e.s.device, e.w, e.fi, e.tol_norm
    out: List[Method] = []

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
            fn = e.optional("add + RMSNorm", label, nsa_norm(impl))
            if fn:
                out.append(Method("add + RMSNorm", label, fn, chk_norm(fn)))
    if fi is not None:
        def fi_norm(b):  # in place: x <- y, residual <- x + residual
            fi.fused_add_rmsnorm(b["x"], b["res"], w, EPS)
            return b["x"]
        out.append(Method("add + RMSNorm", "flashinfer fused_add_rmsnorm", fi_norm, chk_norm(fi_norm, "inplace")))
    return out


def add_rmsnorm_into_slot(e: Env) -> List[Method]:
    """add + RMSNorm written straight into the padded slot."""
    M, n, w, fi, count, tol_norm = e.s.M, e.s.n, e.w, e.fi, e.count, e.tol_norm
    out: List[Method] = []

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
        from nsa_cp.rows.kernels.norm_rows import fused_add_rmsnorm_into

        return lambda b: fused_add_rmsnorm_into(b["x"], b["res"], w, EPS, b["slot"], count)

    fn = e.optional("add + RMSNorm into slot", "nsa_cp fused kernel", nsa_norm_slot)
    if fn:
        out.append(Method("add + RMSNorm into slot", "nsa_cp fused kernel (Triton)", fn, chk_norm_slot(fn)))
    if fi is not None:
        pack = e.optional("add + RMSNorm into slot", "flashinfer + nsa_cp pack", pack_nsa(e))
        if pack:
            def fi_pack(b):
                fi.fused_add_rmsnorm(b["x"], b["res"], w, EPS)
                pack(b)
                return b["slot"]
            out.append(Method("add + RMSNorm into slot", "flashinfer + nsa_cp pack", fi_pack, chk_norm_slot(fi_pack)))
    return out


def fp8(e: Env) -> List[Method]:
    """FP8 quantization of the local rows, and the fused add + RMSNorm + FP8 into the slot."""
    s, nsa, M, n, w, count = e.s, e.nsa, e.s.M, e.s.n, e.w, e.count
    out: List[Method] = []

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
        fn = e.optional("FP8 quantization", "nsa_cp.quant_fp8_g128", lambda: (lambda b: nsa.quant_fp8_g128(b["x"])))
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
        from nsa_cp.rows.kernels.norm_rows import fused_add_rmsnorm_into

        return lambda b: fused_add_rmsnorm_into(b["x"], b["res"], w, EPS, b["q"], count, quant="fp8_e4m3_g128",
                                                dst_scale=b["scale"])

    if s.hidden % 128 == 0:
        fn = e.optional("add + RMSNorm + FP8 into slot", "nsa_cp fused kernel", nsa_norm_fp8)
        if fn:
            out.append(Method("add + RMSNorm + FP8 into slot", "nsa_cp fused kernel (Triton)", fn, chk_norm_fp8(fn)))
    return out


def compaction(e: Env) -> List[Method]:
    """compaction: [cp*M, H] padded rows to [T, H] compact."""
    s, M, layout, index = e.s, e.s.M, e.layout, e.index
    out: List[Method] = []

    def ref_compact(b):
        return torch.cat([b["padded"][r * M:r * M + c] for r, c in enumerate(s.counts)])

    def index_sel(b):
        return torch.index_select(b["padded"], 0, index, out=b["compact"])

    chk_compact = _exact_check("compact", ref_compact)

    out.append(Method("compaction", "torch.cat of slices", ref_compact, chk_compact(ref_compact), baseline=True))
    out.append(Method("compaction", "torch index_select(out=)", index_sel, chk_compact(index_sel)))

    def nsa_compact(impl=None):
        def make():
            from nsa_cp.rows.kernels.compact import padded_to_compact

            return lambda b: padded_to_compact(b["padded"], layout, b["compact"], impl=impl)
        return make

    fn = e.optional("compaction", "nsa_cp compact", nsa_compact())
    if fn:
        out.append(Method("compaction", f"nsa_cp compact ({'native' if e.native else 'Triton'})",
                          fn, chk_compact(fn)))
    if e.native:
        fn = e.optional("compaction", "nsa_cp compact (Triton)", nsa_compact("triton"))
        if fn:
            out.append(Method("compaction", "nsa_cp compact (Triton)", fn, chk_compact(fn)))
    return out


def accumulation(e: Env) -> List[Method]:
    """fp32 accumulation: the reduce-scatter's sum of cp partials [n, H], rounded once."""
    P = e.s.cp
    out: List[Method] = []

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


STAGES = (pack_pad, add_rmsnorm, add_rmsnorm_into_slot, fp8, compaction, accumulation)


def load_row_kernels(path: str):
    """A ``norm_rows.py`` of another commit (``git show REV:nsa_cp/rows/kernels/norm_rows.py > FILE``), loaded as a
    module of ``nsa_cp.rows.kernels`` beside today's (its relative imports resolve there)."""
    import importlib.util

    import nsa_cp.rows.kernels  # noqa: F401  the parent package of the loaded module

    spec = importlib.util.spec_from_file_location("nsa_cp.rows.kernels._norm_rows_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def before_methods(e: Env, before) -> List[Method]:
    """The row-kernel stages with ``before``'s kernels (``load_row_kernels``), each checked bitwise against
    today's kernel on copies of the same inputs: an earlier kernel timed beside today's, in one run."""
    from nsa_cp.rows.kernels import norm_rows as now

    w, count = e.w, e.count
    calls = [  # (stage, method, call on a kernel module and a set, the outputs it writes; FP8: H % 128 == 0)
        ("add + RMSNorm into slot", "nsa_cp fused kernel (before)",
         lambda k, b: k.fused_add_rmsnorm_into(b["x"], b["res"], w, EPS, b["slot"], count), ("res", "slot"), False),
        ("FP8 quantization", "nsa_cp.quant_fp8_g128 (before)", lambda k, b: k.quant_fp8_g128(b["x"]), (), True),
        ("add + RMSNorm + FP8 into slot", "nsa_cp fused kernel (before)", lambda k, b: k.fused_add_rmsnorm_into(
            b["x"], b["res"], w, EPS, b["q"], count, quant="fp8_e4m3_g128", dst_scale=b["scale"]),
         ("res", "q", "scale"), True),
    ]
    bits = lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t  # noqa: E731 NaN-safe

    def same_as_now(call, keys):
        def check(b):
            mine = {k: b[k].clone() for k in ("x", "res", "slot", "q", "scale")}
            _poison(b["slot"], b["q"], b["scale"], mine["slot"], mine["q"], mine["scale"])
            got_before, got_now = call(before, b), call(now, mine)
            pairs = [(k, b[k], mine[k]) for k in keys] + [
                (f"returned[{i}]", x, y) for i, (x, y) in enumerate(zip(got_before or (), got_now or ()))]
            for what, x, y in pairs:
                if not torch.equal(bits(x), bits(y)):
                    return f"{what}: not bitwise today's kernel's"
            return None
        return check

    out = []
    for stage, name, call, keys, fp8 in calls:
        if fp8 and e.s.hidden % 128:
            continue
        out.append(Method(stage, name, (lambda c: lambda b: c(before, b))(call), same_as_now(call, keys)))
    return out


def methods_for(s, nsa, log, before=None) -> List[Method]:
    """Every stage's methods; those this machine cannot run are left out, saying why (``log``). ``before``:
    a row-kernel module (``load_row_kernels``) whose stages follow today's, each in its stage."""
    e = make_env(s, nsa, log)
    methods = [m for stage in STAGES for m in stage(e)]
    for m in before_methods(e, before) if before is not None else ():
        last = max(i for i, x in enumerate(methods) if x.stage == m.stage)
        methods.insert(last + 1, m)
    return methods


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


def min_bytes(stage: str, s) -> int:
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
