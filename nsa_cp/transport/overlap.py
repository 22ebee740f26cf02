"""The overlapped boundary over torch.distributed point-to-point: the consumer runs on each rank's rows as
they land, and each finished slot's partials travel back to their owner while the next slot computes.

Schedule on rank ``r`` of ``P`` (``n_q``: rank q's real rows; every rank derives the same from the layout):

* step 0: the consumer on this rank's own rows, with no wait;
* step ``k = 1 .. P-1``: rank r's rows go to ``(r + k) % P`` and rank ``(r - k) % P``'s rows arrive
  (a ring shift per step, so each rank takes a different peer first). Every step's transfer is posted
  at the start; step k's consumer waits for step k's rows only, then its partials go back to their owner
  ``(r - k) % P`` while step ``k + 1`` computes (and partials of this rank's rows arrive from ``(r + k) % P``);
* the end: this rank's partials from every rank summed in fp32 in rank order (0 .. P-1), as the P2P
  reduce-scatter sums them, rounded once to the output dtype.

A rank with no rows sends nothing and gets no consumer call for its slot; nobody waits for it. Each
step's sends and receives are one ``batch_isend_irecv`` (NCCL: one group, matched on every rank in the
same step order; gloo: separate messages told apart by tags).

Device semantics: on CUDA the transfers run on the process group's stream; a wait makes the current
stream wait for that step's rows, and the consumer runs on the current stream. On CPU (gloo) the waits
block with a deadline: a peer that has not delivered within ``timeout_ms`` raises ``P2PTimeoutError``
naming it (on NCCL the process group's own timeout governs).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..geometry.layout import ShardLayout
from ..geometry.wire import format_of
from ..rows.quant import quantize
from .p2p.errors import P2PTimeoutError

__all__ = ["Chunk", "schedule", "run"]

_GATHER_TAG, _SCATTER_TAG = 1 << 20, 2 << 20


@dataclass(frozen=True)
class Chunk:
    """The rows a consumer call gets: rank ``source``'s ``rows`` real rows, which sit at
    ``padded_offset = source * M`` in the padded gather and ``compact_offset = offsets[source]`` in the
    compact one; ``step``: 0 for the local rows, k for the rows of ``(rank - k) % P``."""

    source: int
    rows: int
    padded_offset: int
    compact_offset: int
    step: int


def schedule(layout: ShardLayout, rank: int) -> List[Chunk]:
    """``rank``'s steps in order: its own rows (step 0), then ``(rank - k) % P``'s for k = 1 .. P-1, a rank
    with no rows included (``rows == 0``: no consumer call, but the step still returns partials)."""
    size = layout.cp_size
    return [Chunk(q, layout.per_rank_actual_token[q], q * layout.max_rank_len, layout.offsets[q], k)
            for k, q in ((k, (rank - k) % size) for k in range(size))]


def _wire(x: torch.Tensor, n: int, quant: Optional[str]) -> Tuple[torch.Tensor, ...]:
    """What moves for ``x[:n]``: the rows, or with ``quant`` the float8_e4m3fn rows and the fp32 scales."""
    if quant is None:
        return (x[:n].contiguous(),)
    return quantize(x[:n], quant) if n else _empty(x, 0, quant)


def _empty(x: torch.Tensor, rows: int, quant: Optional[str]) -> Tuple[torch.Tensor, ...]:
    """Receive buffers for ``rows`` rows of what moves for rows like ``x``'s."""
    if quant is None:
        return (torch.empty((rows, *x.shape[1:]), dtype=x.dtype, device=x.device),)
    groups = x.shape[1] // format_of(quant).group
    return (torch.empty((rows, x.shape[1]), dtype=torch.float8_e4m3fn, device=x.device),
            torch.empty((rows, groups), dtype=torch.float32, device=x.device))


def _bytes(parts: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, ...]:
    """float8 travels as its bytes (not every backend takes float8 tensors)."""
    return tuple(p.view(torch.uint8) if p.dtype == torch.float8_e4m3fn else p for p in parts)


def _exchange(group, send: Sequence[torch.Tensor], to: Optional[int], recv: Sequence[torch.Tensor],
              frm: Optional[int], tag: int, cpu: bool, timeout_ms: int) -> list:
    """One step's sends (to global rank ``to``) and receives (from ``frm``) as one batch; its works."""
    ops = [dist.P2POp(dist.isend, t, to, group, tag + i) for i, t in enumerate(send)] if to is not None else []
    ops += [dist.P2POp(dist.irecv, t, frm, group, tag + i) for i, t in enumerate(recv)] if frm is not None else []
    try:
        return dist.batch_isend_irecv(ops) if ops else []
    except RuntimeError as e:
        raise _peer_failed(e, f"a transfer with rank {to if to is not None else frm}", cpu, timeout_ms)


def _peer_failed(e: RuntimeError, what: str, cpu: bool, timeout_ms: int) -> Exception:
    """gloo's error for a peer past the deadline or gone (its connection closed) -> P2PTimeoutError, as
    the P2P transport says it; any other backend's error as it is."""
    if not cpu:
        return e
    err = P2PTimeoutError(f"overlapped boundary: {what} did not complete within {timeout_ms} ms "
                          f"(NSA_CP_P2P_TIMEOUT_MS), or the peer is gone: {e}")
    err.__cause__ = e
    return err


def _wait(works: list, timeout_ms: int, cpu: bool, what: str) -> None:
    for work in works:
        try:
            work.wait(timedelta(milliseconds=timeout_ms)) if cpu else work.wait()
        except RuntimeError as e:
            raise _peer_failed(e, what, cpu, timeout_ms)


def run(x: torch.Tensor, layout: ShardLayout, rank: int, group, consumer: Callable, check: Callable, *,
        quant: Optional[str], out_row_shape: Tuple[int, ...], out_dtype: torch.dtype, timeout_ms: int) -> torch.Tensor:
    """The schedule of the module docstring on checked arguments; returns ``[n_rank, *out_row_shape]``.
    ``consumer(rows, chunk)`` gets ``[k, H]`` (or ``(q, scale)`` with ``quant``) and a :class:`Chunk`;
    ``check(y, chunk)`` raises on a consumer output of the wrong shape, dtype or device."""
    size, counts = layout.cp_size, layout.per_rank_actual_token
    n, cpu = counts[rank], x.device.type == "cpu"
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(size))
    mine = _wire(x, n, quant)

    # every step's rows posted at once (the links run ahead of the consumer); rank r's rows go to every
    # peer whatever its count (every rank computes on every row), a peer's arrive where it has any
    arrived, gathers = {}, {}
    for k in range(1, size):
        dst, src = (rank + k) % size, (rank - k) % size
        arrived[src] = _empty(x, counts[src], quant) if counts[src] else ()
        gathers[k] = _exchange(group, _bytes(mine) if n else (), ranks[dst] if n else None, _bytes(arrived[src]),
                               ranks[src] if counts[src] else None, _GATHER_TAG + 8 * k, cpu, timeout_ms)

    partials: List[Optional[torch.Tensor]] = [None] * size  # of this rank's rows, by the rank that computed them
    scatters = []
    for chunk in schedule(layout, rank):
        k, src = chunk.step, chunk.source
        if k:
            _wait(gathers[k], timeout_ms, cpu, f"rank {ranks[src]}'s rows (step {k})")
        y = None
        if chunk.rows:
            rows = mine if k == 0 else arrived.pop(src)
            y = consumer(rows if quant else rows[0], chunk)
            check(y, chunk)
        if k == 0:
            partials[rank] = y
            continue
        # step k's partials go back to their owner while step k + 1 computes; this rank's own arrive from
        # (rank + k), which computed them at its step k
        owner = (rank + k) % size
        if n:
            partials[owner] = torch.empty((n, *out_row_shape), dtype=out_dtype, device=x.device)
        scatters += _exchange(group, (y.contiguous(),) if y is not None else (), ranks[src] if y is not None else None,
                              (partials[owner],) if n else (), ranks[owner] if n else None, _SCATTER_TAG + 8 * k,
                              cpu, timeout_ms)
    _wait(scatters, timeout_ms, cpu, "the partials of this rank's rows")
    acc = torch.zeros((n, *out_row_shape), dtype=torch.float32, device=x.device)
    for q in range(size) if n else ():  # rank order in fp32, as the P2P reduce-scatter sums
        acc += partials[q].float()
    return acc.to(out_dtype)
