"""layer_tail.py ``--part boundary``: the two halves of the layer boundary on their own (padded layout),
each row with its float32 reference (the plain gather bitwise) and the row its ratio divides by; the
boundary's goals (``TARGETS_13``, device ms ratios per M). A part of layer_tail.py (no other benchmark
imports it).
"""

from __future__ import annotations

import os
import sys
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402  spawn, seeds, the timing protocol, env tags, writers
harness.part_of("layer_tail.py", __name__)  # run as a script, it says which script to run
from layer_tail_common import (EPS, FP8, Row, TailBufs, TailCtx, _comm, _needs_fused, _needs_p2p,  # noqa: E402
                               _needs_quant, _prepare_p2p, _rms, make_tail_bufs, quant_ref)

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

# the fused boundary's goals (boundary part): (label, numerator row, denominator row, limit, smallest M it applies at), device ms
TARGETS_13 = [
    ("fused norm+AG P2P / cp_all_gather P2P", "normag_fused_p2p", "ag_nsa_p2p", 1.1, 2048),
    ("fused norm+AG P2P / flashinfer-or-baseline norm + F.pad + AG", "normag_fused_p2p", "ag_sglang", 0.6, 0),
    ("fused RS+norm P2P / cp_reduce_scatter P2P", "rsnorm_fused_p2p", "rs_nsa_p2p", 1.1, 2048),
    ("FP8 gather P2P / bf16 gather P2P", "ag_fp8_p2p", "ag_nsa_p2p", 0.6, 8192),
    ("fused norm+FP8 AG P2P / norm + SGLang FP8 DP-gather recipe", "normag_fp8_fused_p2p", "ag_dpfp8_sglang", 0.5, 0),
]



def format_boundary_targets(by: Dict[tuple, dict], Ms: List[int]) -> List[str]:
    """The boundary's goals (TARGETS_13) as device-ms ratios per M, with verdicts; ``by``: (M, row) -> row."""
    lines = ["", "boundary goals (device ms ratios), per M " + " ".join(map(str, Ms)) + ":"]
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
