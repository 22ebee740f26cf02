"""gather_scatter.py's report: the table per configuration, the host-time summary against the project's
targets, the rows of NCCL on symmetric buffers, and the merge of the main and symmetric-memory runs
into one result. A part of gather_scatter.py (no other benchmark imports it).
"""

from __future__ import annotations

import os
import sys
from typing import Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402  spawn, seeds, poisoning, the timing protocol, env tags, writers
harness.part_of("gather_scatter.py", __name__)  # run as a script, it says which script to run

EVEN = {"ag": "even_ag", "rs": "even_rs"}  # each direction's reference: the even collective
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
                if smoke:  # a CPU run's collectives are gloo's, not NCCL's
                    label = label.replace("NCCL", "gloo")
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
