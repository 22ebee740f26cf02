"""First-use checks: an engine's own moves run beside nsa_cp's on the first calls of each kind, compared by value.

A contract (``contracts``) sees the shape of an engine's code, not what its values mean: a reordered return of
the same arity, a scale of another dtype or a changed padding convention all pass it. So on the first
``NSA_CP_FIRST_USE_CHECKS`` calls of each kind of move in a process (a kind names the move, its layout and wire
format, e.g. ``"dispatch padded fp8_e4m3_g128"``), a plugin also runs the engine's own move on the same inputs
and compares the two results:

* :func:`exact`: data movement, bitwise (structure, shape, dtype, then the bytes); tuples element by element;
* :func:`within`: sums, ``|ours - theirs| <= bound`` elementwise, the bound stated by the caller.

:meth:`Checks.settle` makes the group's ranks agree (one all-reduce of a flag: a difference any rank saw
declines the kind on every rank, so every rank keeps taking the same moves and no collective is left
unmatched), counts the check and, on a difference, declines the kind for the process: one warning naming what
differed, recorded for ``status()["first_use"]``. The caller then returns the engine's own result for that
call. The checks run on CPU and GPU alike; each costs the engine's move, the comparison and one small
all-reduce (which syncs the host on a GPU), on the first ``N`` calls of a kind only.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from .. import envs
from ..geometry.layout import ShardLayout

logger = logging.getLogger("nsa_cp")

__all__ = ["Checks", "exact", "within", "structure", "real_rows"]


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor {list(value.shape)} {value.dtype}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return "None" if value is None else type(value).__name__


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, one row per row of ``t`` (``[rows, bytes]``; a 0-d or 1-d tensor: one row each)."""
    t = t.detach().contiguous()
    rows = t.shape[0] if t.dim() else 1
    return t.reshape(-1).view(torch.uint8).reshape(rows, -1)


def structure(name: str, ours: Any, theirs: Any) -> Optional[str]:
    """What differs in kind (type, length, shape, dtype) between two results, or None."""
    if isinstance(ours, torch.Tensor) and isinstance(theirs, torch.Tensor):
        if ours.shape != theirs.shape:
            return f"{name}: shape {list(ours.shape)} where the engine gives {list(theirs.shape)}"
        if ours.dtype != theirs.dtype:
            return f"{name}: dtype {ours.dtype} where the engine gives {theirs.dtype}"
        return None
    if type(ours) is not type(theirs) and not (isinstance(ours, (tuple, list)) and isinstance(theirs, (tuple, list))):
        return f"{name}: {_describe(ours)} where the engine gives {_describe(theirs)}"
    if isinstance(ours, (tuple, list)) and len(ours) != len(theirs):
        return f"{name}: {_describe(ours)} where the engine gives {_describe(theirs)}"
    return None


def exact(name: str, ours: Any, theirs: Any) -> Optional[str]:
    """None where ``ours`` and ``theirs`` are bitwise the same (tensors, None, or tuples / lists of them,
    element by element), else one line naming the first difference: which element, and its shape, dtype or
    first differing row."""
    problem = structure(name, ours, theirs)
    if problem is not None:
        return problem
    if isinstance(ours, (tuple, list)):
        for i, (a, b) in enumerate(zip(ours, theirs)):
            problem = exact(f"{name}[{i}]", a, b)
            if problem is not None:
                return problem
        return None
    if not isinstance(ours, torch.Tensor) or ours.numel() == 0:
        return None
    differs = (_bytes(ours) != _bytes(theirs)).any(dim=1)
    if bool(differs.any()):
        rows = differs.nonzero().flatten()
        return f"{name}: {rows.numel()} of {differs.numel()} rows differ, the first row {int(rows[0])}"
    return None


def within(name: str, ours: Any, theirs: Any, bound: torch.Tensor) -> Optional[str]:
    """None where ``|ours - theirs| <= bound`` everywhere (``bound`` broadcasts; NaN anywhere differs), else one
    line naming the first row out of bound and by how much. Shapes and dtypes must match exactly."""
    problem = structure(name, ours, theirs)
    if problem is not None or ours.numel() == 0:
        return problem
    diff = (ours.double() - theirs.double()).abs()
    bad = ~(diff <= bound.double())  # NaN compares False: out of bound
    if bool(bad.any()):
        row = int(bad.reshape(bad.shape[0], -1).any(dim=1).nonzero()[0])
        return (f"{name}: row {row} differs by up to {float(diff[row].max()):.3g}, beyond the bound "
                f"{float(bound.double().expand_as(diff)[row].max()):.3g}")
    return None


def real_rows(padded: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """The real rows of a rank-major ``[cp * M, ...]`` tensor in compact order ``[T, ...]`` (rank q's rows at
    ``layout.offsets[q]``): what a compact result must equal."""
    m = layout.max_rank_len
    return torch.cat([padded[q * m: q * m + n] for q, n in enumerate(layout.per_rank_actual_token)]) \
        if layout.cp_size else padded[:0]


class Checks:
    """The first-use checks of one engine plugin in one process (module docstring)."""

    def __init__(self, engine: str, own: str):
        self.engine, self.own = engine, own
        self.checked: Dict[str, int] = {}
        self.declined: Dict[str, str] = {}

    def due(self, kind: str) -> bool:
        """Whether this call of ``kind`` is checked (one of the first ``NSA_CP_FIRST_USE_CHECKS``, not declined)."""
        return kind not in self.declined and self.checked.get(kind, 0) < envs.NSA_CP_FIRST_USE_CHECKS

    def refused(self, kind: str) -> Optional[str]:
        """The reason the engine's own moves take ``kind`` for this process (a check found a difference), or None."""
        what = self.declined.get(kind)
        return None if what is None else f"a first-use check declined {kind} ({what})"

    def settle(self, kind: str, difference: Optional[str], group: Optional[dist.ProcessGroup]) -> bool:
        """Agree over ``group`` whether any rank saw a difference in this check of ``kind`` (collective: every
        rank that checked calls it); count it; on a difference decline ``kind`` for the process, warn once and
        return True (the caller returns the engine's own result)."""
        device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(dist.get_backend(group)) \
            else torch.device("cpu")
        flag = torch.tensor([0 if difference is None else 1], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        self.checked[kind] = self.checked.get(kind, 0) + 1
        if int(flag.item()) == 0:
            return False
        self.declined[kind] = difference or "another rank saw a difference"
        logger.warning("nsa_cp: first-use check: %s's own move and nsa_cp's differ for %s: %s; %s take such calls "
                       "in this process", self.engine, kind, self.declined[kind], self.own)
        return True

    def as_status(self) -> dict:
        """``status()["first_use"]``: the checks per kind (``NSA_CP_FIRST_USE_CHECKS``), the calls checked by
        kind, and the kinds declined with what differed."""
        return {"checks_per_kind": envs.NSA_CP_FIRST_USE_CHECKS, "checked": dict(self.checked),
                "declined": dict(self.declined)}

    def reset(self) -> None:
        self.checked.clear()
        self.declined.clear()
