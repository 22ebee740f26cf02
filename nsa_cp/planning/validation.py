"""Rank agreement: make a collective whose ranks disagree fail on every rank instead of corrupting data.

With validation on (``validate=True`` on a call or the communicator, or NSA_CP_VALIDATE=1), every call
first runs its local input checks, then ONE small all-reduce (MAX) of

    [fingerprint, -fingerprint, bad_0, bad_1, ..., bad_{P-1}]

where the fingerprint is a 62-bit hash of (per_rank_actual_token, align, call kind, dtype, row shape,
compact, algorithm, transport) and ``bad_r`` is 1
when rank r's own checks failed. From the result every rank knows the min and max fingerprint (they
differ iff some rank holds another layout) and which ranks rejected their input, so all ranks raise
together: the rank with bad input raises its own ValueError, the others a LayoutMismatchError naming
those ranks; with disagreeing layouts every rank raises LayoutMismatchError naming its own layout.
Nobody enters the data collective, so nothing hangs and nothing is written. Off by default: it costs
one small all-reduce per call (see docs/performance.md for the measured cost).
"""

from __future__ import annotations

import hashlib
from typing import Optional

import torch
import torch.distributed as dist

from . import checks
from ..errors import LayoutMismatchError
from ..geometry.layout import ShardLayout
from ..transport import groups

__all__ = ["LayoutMismatchError", "layout_fingerprint", "agree", "agree_on_plan", "agree_on_fields"]


def layout_fingerprint(layout, call: str, signature: str = "") -> int:
    """62-bit fingerprint of a layout, the call kind and the call's signature (dtype, row shape,
    compact, algorithm, transport); 0 is reserved for 'no valid layout'."""
    return _hash62(f"{call}|{tuple(layout.per_rank_actual_token)}|{layout.align}|{signature}")


def _hash62(text: str) -> int:
    """A 62-bit hash of ``text`` (its negation fits int64 too); 0 is reserved for 'no valid input'."""
    return (int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 2) or 1


def agree(
    call: str,
    layout,
    group: Optional[dist.ProcessGroup],
    rank: int,
    size: int,
    device: torch.device,
    local_error: Optional[ValueError],
    signature: str = "",
) -> None:
    """Collective: raise on every rank if any rank's checks failed or the layouts differ.

    Args:
        call: the public call's name ("cp_all_gather" / "cp_reduce_scatter"), part of the fingerprint
            so that a gather on one rank and a reduce-scatter on another are caught too.
        layout: this rank's ShardLayout, or None when it was not even a layout (then local_error is set).
        device: where the all-reduce runs (the call's tensor device: CUDA for NCCL, CPU for gloo).
        local_error: this rank's ValueError from its own input checks, or None.
        signature: what else the ranks must agree on (dtype, row shape, compact, algorithm, transport).
    """
    fingerprint = layout_fingerprint(layout, call, signature) if local_error is None else 0
    values = [fingerprint, -fingerprint] + [0] * size
    values[2 + rank] = 1 if local_error is not None else 0
    # built on the host and copied once rather than four device writes: less host time for this piece
    flags = torch.tensor(values, dtype=torch.int64).to(device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    highest, lowest, *bad = flags.tolist()
    lowest = -lowest
    bad_ranks = [r for r, flag in enumerate(bad) if flag]
    if local_error is not None:
        raise local_error
    if bad_ranks:
        raise LayoutMismatchError(
            f"{call}: rank(s) {bad_ranks} rejected their input (see their ValueError); this rank {rank} "
            f"holds {layout!r} and did not communicate"
        )
    if highest != lowest:
        raise LayoutMismatchError(
            f"{call}: the ranks disagree on the layout or the call (fingerprints range "
            f"{lowest:#x}..{highest:#x}); this rank {rank} holds {layout!r} with {signature} (fingerprint "
            f"{fingerprint:#x}). Every rank of the group must pass the same ShardLayout, dtype, row shape, "
            f"compact flag, algo and backend"
        )


def agree_on_plan(req, plan, error: Optional[ValueError], positions) -> None:
    """Collective: after this rank's plan checks (``plan``, or the ValueError ``error`` they raised), one small
    all-reduce whatever they said, so a rank with bad input or another layout makes every rank raise instead
    of leaving the others in a collective. Positions are also checked to be a permutation here."""
    rank, size = groups.group_rank_and_size(req.group)
    if error is None and positions is not None:
        try:
            checks.check_permutation(positions, req.layout.total_len)
        except ValueError as err:
            plan, error = None, err
    layout = req.layout if isinstance(req.layout, ShardLayout) else None
    device = req.device or _comm_device(req.group)
    agree(req.op, layout, req.group, rank, size, device, error, plan.signature if plan is not None else "")


def _comm_device(group) -> torch.device:
    """Where the agreement's all-reduce runs when the call's tensor is not one: the group's device."""
    nccl = dist.get_backend(group) == "nccl"
    return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")


def agree_on_fields(call: str, fields: dict, group: Optional[dist.ProcessGroup], rank: int, size: int,
                    device: torch.device, local_error: Optional[ValueError]) -> None:
    """Collective, as :func:`agree`, naming what differs: ONE small all-reduce (MAX) of ``[h_1, -h_1, ...,
    h_F, -h_F, bad_0, ..., bad_{P-1}]``, one 62-bit hash per field of ``fields`` (argument name -> its value
    as text, the same names in the same order on every rank). Every rank raises: the rank with bad input its
    own ValueError, the others LayoutMismatchError naming those ranks; where the ranks' values of some
    fields differ, LayoutMismatchError on every rank naming those arguments and this rank's values."""
    names = list(fields)
    hashes = [0 if local_error is not None else _hash62(f"{call}|{name}|{fields[name]}") for name in names]
    values = [v for h in hashes for v in (h, -h)] + [0] * size
    values[2 * len(names) + rank] = 1 if local_error is not None else 0
    flags = torch.tensor(values, dtype=torch.int64).to(device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    got = flags.tolist()
    bad_ranks = [r for r, flag in enumerate(got[2 * len(names):]) if flag]
    if local_error is not None:
        raise local_error
    if bad_ranks:
        raise LayoutMismatchError(f"{call}: rank(s) {bad_ranks} rejected their input (see their ValueError); this "
                                  f"rank {rank} did not communicate")
    differ = [name for i, name in enumerate(names) if got[2 * i] != -got[2 * i + 1]]
    if differ:
        mine = ", ".join(f"{name}={fields[name]}" for name in differ)
        raise LayoutMismatchError(f"{call}: the ranks disagree on {', '.join(differ)}; this rank {rank} passed {mine}. "
                                  f"Every rank of the group must pass the same {', '.join(differ)}; nothing moved")
