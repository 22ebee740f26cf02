"""gather_scatter.py's rows of NCCL on symmetric buffers (``symm_ag``, ``symm_rs``): what SGLang's
``--enable-symm-mem`` gives its CP gather, timed beside the even collective in processes of their own.

A part of gather_scatter.py (its methods table lists these rows; no other benchmark imports it). ``b`` is
one of gather_scatter.py's rotating buffer sets (``Bufs``: ``x_full``, ``y_pad``, ``idx``, ``extra``,
``extra_outputs``).
"""

from __future__ import annotations

import os
import sys
from typing import Dict, Optional

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402  spawn, seeds, poisoning, the timing protocol, env tags, writers
harness.part_of("gather_scatter.py", __name__)  # run as a script, it says which script to run
from harness import Ctx  # noqa: E402


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


def symm_needs(c: Ctx) -> Optional[str]:
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


def symm_bind(c: Ctx, bufsets: list) -> None:
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


def symm_ag(c: Ctx, b):
    if _SYMM["error"]:
        raise NotImplementedError(_SYMM["error"])
    harness.all_gather_single(b.extra["symm_ag_out"], b.extra["symm_ag_in"], group=c.group)
    return b.extra["symm_ag_out"]


def symm_rs(c: Ctx, b):
    if _SYMM["error"]:
        raise NotImplementedError(_SYMM["error"])
    harness.reduce_scatter_single(b.extra["symm_rs_out"], b.extra["symm_rs_in"], group=c.group)
    return b.extra["symm_rs_out"][: c.n]
