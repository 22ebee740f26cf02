"""The overlapped boundary over torch.distributed point-to-point: the consumer runs on each rank's rows as
they land, and each finished chunk's partials travel back to their owner while the next chunk computes.

Schedule on rank ``r`` of ``P`` (``n_q``: rank q's real rows; every rank derives the same from the layout):

* step 0: the consumer on this rank's own rows, with no wait;
* step ``k = 1 .. P-1``: rank r's rows go to ``(r + k) % P`` and rank ``(r - k) % P``'s rows arrive
  (a ring shift per step, so each rank takes a different peer first). Every step's transfers are posted
  at the start; a consumer call waits for its own chunk's rows only, then its partials go back to their
  owner ``(r - k) % P`` while the next chunk computes (and partials of this rank's rows arrive from
  ``(r + k) % P``, which computed them at its step k);
* the end: this rank's partials from every rank summed in fp32 in rank order (0 .. P-1), as the P2P
  reduce-scatter sums them, rounded once to the output dtype.

Chunks: a step's slot (rank q's ``n_q`` rows) moves and computes as one chunk, or with ``chunk_rows`` as
``ceil(n_q / chunk_rows)`` chunks of at most ``chunk_rows`` rows each, in row order, each moved, computed
and sent back on its own (the first consumer call on a peer's rows waits for its first chunk only).

A rank with no rows sends nothing and gets no consumer call for its slot; nobody waits for it. Each
chunk's sends and receives are one ``batch_isend_irecv`` (NCCL: every pair of ranks posts its transfers
in the same order; gloo: separate messages told apart by tags).

Device semantics: on CUDA (NCCL) the transfers run on the process group's stream; a wait makes the current
stream wait for that chunk's rows, and the consumer runs on the current stream. On gloo the waits block
with a deadline: a peer that has not delivered within ``timeout_ms`` raises ``P2PTimeoutError`` naming it
(on NCCL the process group's own timeout governs); CUDA tensors on gloo are staged through host memory.
"""

from __future__ import annotations

import weakref
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

_STARTED: "weakref.WeakSet" = weakref.WeakSet()  # non-gloo groups a collective has started (_started)


@dataclass(frozen=True)
class Chunk:
    """The rows a consumer call gets: ``rows`` real rows of rank ``source`` from its row ``first`` on,
    which sit at ``padded_offset = source * M + first`` in the padded gather and ``compact_offset =
    offsets[source] + first`` in the compact one; ``step``: 0 for the local rows, k for the rows of
    ``(rank - k) % P``."""

    source: int
    rows: int
    padded_offset: int
    compact_offset: int
    step: int
    first: int = 0


def pieces(rows: int, chunk_rows: Optional[int]) -> List[Tuple[int, int]]:
    """``[(start, stop), ...]``: ``rows`` rows in chunks of at most ``chunk_rows`` (None: one chunk; no
    rows: none)."""
    if rows == 0:
        return []
    step = rows if not chunk_rows else chunk_rows
    return [(a, min(a + step, rows)) for a in range(0, rows, step)]


def schedule(layout: ShardLayout, rank: int, chunk_rows: Optional[int] = None) -> List[Chunk]:
    """``rank``'s consumer calls in order: its own rows (step 0), then ``(rank - k) % P``'s for
    k = 1 .. P-1, each slot as its chunks (:func:`pieces`); a rank with no rows has none."""
    size, m = layout.cp_size, layout.max_rank_len
    return [Chunk(q, b - a, q * m + a, layout.offsets[q] + a, k, a)
            for k, q in ((k, (rank - k) % size) for k in range(size))
            for a, b in pieces(layout.per_rank_actual_token[q], chunk_rows)]


def _tag(step: int, piece: int, stride: int, scatter: bool) -> int:
    """gloo's tag of one chunk's messages (a wire part adds 0 or 1): distinct per step, chunk and direction."""
    return ((step * stride + piece) * 2 + scatter) * 2


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


def _rows(parts: Sequence[torch.Tensor], a: int, b: int) -> Tuple[torch.Tensor, ...]:
    """Rows ``a:b`` of every wire part (views: a contiguous tensor's row range is contiguous)."""
    return tuple(p[a:b] for p in parts)


def _bytes(parts: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, ...]:
    """float8 travels as its bytes (not every backend takes float8 tensors)."""
    return tuple(p.view(torch.uint8) if p.dtype == torch.float8_e4m3fn else p for p in parts)


@dataclass
class _Batch:
    """One ``(step, chunk)`` batch in flight: its works, and on gloo with CUDA tensors the host buffers the
    sends left (kept alive until done) and the ``(host, device)`` copies that land the receives."""

    works: list
    keep: tuple = ()
    landing: tuple = ()


def _exchange(group, send: Sequence[torch.Tensor], to: Optional[int], recv: Sequence[torch.Tensor],
              frm: Optional[int], tag: int, gloo: bool, timeout_ms: int) -> _Batch:
    """One batch: the sends (to global rank ``to``) and receives (from ``frm``). gloo moves host memory
    only, so there CUDA tensors are staged through it (a fallback and a test path: ranks sharing one GPU
    run over gloo; NCCL and the P2P transport move device memory)."""
    landing = ()
    if gloo and any(t.is_cuda for t in (*send, *recv)):
        send = tuple(t.cpu() for t in send)  # after the current stream's work (the consumer's output)
        landing = tuple((torch.empty(t.shape, dtype=t.dtype), t) for t in recv)
        recv = tuple(host for host, _ in landing)
    ops = [dist.P2POp(dist.isend, t, to, group, tag + i) for i, t in enumerate(send)] if to is not None else []
    ops += [dist.P2POp(dist.irecv, t, frm, group, tag + i) for i, t in enumerate(recv)] if frm is not None else []
    try:
        return _Batch(dist.batch_isend_irecv(ops) if ops else [], tuple(send), landing)
    except RuntimeError as e:
        raise _peer_failed(e, f"a transfer with rank {to if to is not None else frm}", gloo, timeout_ms)


def _peer_failed(e: RuntimeError, what: str, gloo: bool, timeout_ms: int) -> Exception:
    """gloo's error for a peer past the deadline or gone (its connection closed) -> P2PTimeoutError, as
    the P2P transport says it; any other backend's error as it is."""
    if not gloo:
        return e
    err = P2PTimeoutError(f"overlapped boundary: {what} did not complete within {timeout_ms} ms "
                          f"(NSA_CP_P2P_TIMEOUT_MS), or the peer is gone: {e}")
    err.__cause__ = e
    return err


def _wait(batches: Sequence[_Batch], timeout_ms: int, gloo: bool, what: str) -> None:
    for batch in batches:
        for work in batch.works:
            try:
                work.wait(timedelta(milliseconds=timeout_ms)) if gloo else work.wait()
            except RuntimeError as e:
                raise _peer_failed(e, what, gloo, timeout_ms)
        for host, device in batch.landing:
            device.copy_(host)


def _started(group, device: torch.device) -> None:
    """One all-reduce on a non-gloo group the first time it carries an overlapped boundary: NCCL creates a
    group's communicator lazily, and a first point-to-point batch that leaves out a rank (one with nothing
    to move at a step) is undefined behaviour. Every rank enters the call, so every rank runs it."""
    pg = group if group is not None else dist.group.WORLD
    if pg not in _STARTED:  # by object: a group destroyed and made again under its old name starts again
        dist.all_reduce(torch.zeros(1, device=device), group=group)
        _STARTED.add(pg)


def run(x: torch.Tensor, layout: ShardLayout, rank: int, group, consumer: Callable, finish: Callable, *,
        quant: Optional[str], out_row_shape: Tuple[int, ...], out_dtype: torch.dtype, timeout_ms: int,
        chunk_rows: Optional[int] = None, shared: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The schedule of the module docstring on checked arguments; returns ``[n_rank, *out_row_shape]``.
    ``consumer(rows, chunk)`` gets ``[k, H]`` (or ``(q, scale)`` with ``quant``) and a :class:`Chunk`;
    ``finish(y, chunk)`` makes its output the ``[k, *out_row_shape]`` partial that travels, or raises on one
    of the wrong shape, dtype or device. ``shared [n_rank, *out_row_shape]`` joins the final fp32 sum.

    Transfers are batches ``(step k, chunk j)``, a rank's send and receive of the same ``(k, j)`` in one
    batch, posted in the same ``(k, j)`` order on every rank: the gathers' first, then the partials'. A
    batch's transfers thus wait for nothing but each other, so no ring of sends can stall (an NCCL send
    blocks its stream until the peer's receive is posted)."""
    size, counts = layout.cp_size, layout.per_rank_actual_token
    n, gloo = counts[rank], dist.get_backend(group) == "gloo"
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(size))
    if not gloo:
        _started(group, x.device)
    most = max(len(pieces(c, chunk_rows)) for c in counts)
    mine, own = _wire(x, n, quant), pieces(n, chunk_rows)
    sent = tuple(t.cpu() for t in mine) if gloo else mine  # gloo sends host memory: stage this rank's rows once

    # every chunk's rows posted at once (the links run ahead of the consumer); rank r's rows go to every
    # peer whatever its count (every rank computes on every row), a peer's arrive where it has any
    arrived, gathers = {}, {}
    for k in range(1, size):
        dst, src = (rank + k) % size, (rank - k) % size
        arrived[src], theirs = _empty(x, counts[src], quant), pieces(counts[src], chunk_rows)
        for j in range(most):
            send = _bytes(_rows(sent, *own[j])) if j < len(own) else ()
            recv = _bytes(_rows(arrived[src], *theirs[j])) if j < len(theirs) else ()
            gathers[k, j] = _exchange(group, send, ranks[dst] if send else None, recv, ranks[src] if recv else None,
                                      _tag(k, j, most, False), gloo, timeout_ms)

    # partials[q]: this rank's rows as rank q computed them
    partials: List[Optional[torch.Tensor]] = [None] * size
    partials[rank] = torch.empty((n, *out_row_shape), dtype=out_dtype, device=x.device) if len(own) > 1 else None
    scatters, calls = [], schedule(layout, rank, chunk_rows)
    for k in range(size):
        src, owner = (rank - k) % size, (rank + k) % size  # owner: computed this rank's rows at its step k
        if k and n:
            partials[owner] = torch.empty((n, *out_row_shape), dtype=out_dtype, device=x.device)
        theirs = [c for c in calls if c.step == k]
        for j in range(len(theirs) if k == 0 else most):
            y = None
            if j < len(theirs):
                chunk = theirs[j]
                a, b = chunk.first, chunk.first + chunk.rows
                if k:
                    _wait([gathers[k, j]], timeout_ms, gloo, f"rank {ranks[src]}'s rows {a}..{b} (step {k})")
                rows = _rows(mine if k == 0 else arrived[src], a, b)
                y = finish(consumer(rows if quant else rows[0], chunk), chunk)
                if k == 0:  # this rank's own partials: kept as they are (one chunk), or put in place
                    if len(own) == 1:
                        partials[rank] = y
                    else:
                        partials[rank][a:b] = y
                    continue
            # this chunk's partials go back to their owner while the next chunk computes
            recv = (partials[owner][own[j][0]:own[j][1]],) if j < len(own) else ()
            scatters.append(_exchange(group, (y.contiguous(),) if y is not None else (), ranks[src] if y is not None
                                      else None, recv, ranks[owner] if recv else None, _tag(k, j, most, True), gloo,
                                      timeout_ms))
        if k:
            del arrived[src]  # its rows all computed: free them before the next slot's
    _wait(scatters, timeout_ms, gloo, "the partials of this rank's rows")
    acc = torch.zeros((n, *out_row_shape), dtype=torch.float32, device=x.device)
    for q in range(size) if n else ():  # rank order in fp32, as the P2P reduce-scatter sums
        acc += partials[q].float()
    if shared is not None:
        acc += shared.float()
    return acc.to(out_dtype)
