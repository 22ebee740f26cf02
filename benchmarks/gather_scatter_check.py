"""gather_scatter.py's correctness check: every method once on NaN-poisoned outputs against the expected
outputs the benchmark declares (docs/performance.md, "Method"). A part of gather_scatter.py
(no other benchmark imports it).
"""

from __future__ import annotations

import os
import sys
from typing import Dict, Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402  spawn, seeds, poisoning, the timing protocol, env tags, writers
harness.part_of("gather_scatter.py", __name__)  # run as a script, it says which script to run
from gather_scatter_report import EVEN  # noqa: E402
from harness import Ctx  # noqa: E402


def check_methods(ctx: Ctx, methods: Sequence, bufs, ag_ref: Dict[str, torch.Tensor], rs_ref: torch.Tensor,
                  rtol: float, atol: float, log) -> Dict[str, str]:
    """Run every method once on poisoned outputs and compare: a gather with ``ag_ref[method.kind]``
    exactly, a reduce-scatter with ``rs_ref`` (the float32 sum) within ``rtol`` / ``atol``, and an nsa_*
    reduce-scatter with the even collective's output too. Returns {name: skip reason} of methods that
    raised NotImplementedError on some rank. Aborts (on every rank) on any mismatch."""
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

    _, skipped = harness.verdicts(ctx, [m.name for m in methods], status, notes)
    log(f"  check ok: {len(methods) - len(skipped)} methods match the expected outputs")
    return skipped


def _diff(what, out, ref, rtol=0.0, atol=0.0) -> str:
    if out.shape != ref.shape:
        return f"{what}: shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
    bad = ~torch.isclose(out.float(), ref.float(), rtol=rtol, atol=atol)  # NaN never close
    rows = bad.reshape(bad.shape[0], -1).any(dim=1).nonzero().flatten()
    err = (out.float() - ref.float()).abs().nan_to_num(float("inf")).max().item()
    return f"{what}: {rows.numel()} wrong rows (first {rows[:8].tolist()}), max |diff| {err:.3g}"
