"""The overlapped boundary over torch.distributed point-to-point (the groups P2P does not serve: several
nodes, gloo): a :class:`DistPipeline` moves each rank's rows to the ranks that compute on them and each
finished chunk's partials back to their owner, while the API runs the consumer (nsa_cp/api/boundary.py).

Schedule on rank ``r`` of ``P`` (nsa_cp/geometry/chunks.py; ``n_q``: rank q's real rows):

* step 0: the consumer on this rank's own rows, with no wait;
* step ``k = 1 .. P-1``: rank r's rows go to ``(r + k) % P`` and rank ``(r - k) % P``'s rows arrive. Every
  step's transfers are posted at the start; ``rows(chunk)`` waits for that chunk's rows only, and
  ``put(chunk, partial)`` sends the partials back to their owner ``(r - k) % P`` while the next chunk
  computes (and partials of this rank's rows arrive from ``(r + k) % P``, which computed them at its step k);
* ``finish``: this rank's partials from every rank summed in fp32 in rank order (0 .. P-1), as the P2P
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

import math
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ...geometry.chunks import Chunk, pieces, schedule
from ...geometry.layout import ShardLayout
from ...geometry.wire import format_of
from ...rows.quant import quantize
from ...rows.slot_sum import slot_sum
from ..p2p.errors import P2PTimeoutError
from .agreement import agree_now

__all__ = ["DistPipeline", "MECHANISM"]

MECHANISM = "torch.distributed point-to-point (batch_isend_irecv per chunk)"
_STARTED: "weakref.WeakSet" = weakref.WeakSet()  # non-gloo groups a collective has started (_started)


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
                          f"(NSA_CP_P2P_TIMEOUT_MS), or the peer is gone (or it is in another call: "
                          f"NSA_CP_VALIDATE=1 names an argument the ranks disagree on): {e}")
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


class DistPipeline:
    """One overlapped boundary over torch.distributed point-to-point, started: every chunk's rows posted.

    ``chunks``: this rank's consumer calls in order (:func:`nsa_cp.geometry.chunks.schedule`); ``rows(chunk)``
    the chunk's rows once they landed (``[k, H]``, or ``(q, scale)`` with ``quant``); ``put(chunk, partial)``
    its checked ``[k, *out_row_shape]`` partial in ``out_dtype``; ``finish(shared)`` the sum ``[n_rank,
    *out_row_shape]``; ``abort()`` after the consumer raised (nothing to undo: the peers time out).

    Transfers are batches ``(step k, chunk j)``, a rank's send and receive of the same ``(k, j)`` in one
    batch, posted in the same ``(k, j)`` order on every rank: the gathers' first, then the partials'. A
    batch's transfers thus wait for nothing but each other, so no ring of sends can stall (an NCCL send
    blocks its stream until the peer's receive is posted)."""

    def __init__(self, x: torch.Tensor, layout: ShardLayout, rank: int, group, *, quant: Optional[str],
                 out_row_shape: Tuple[int, ...], out_dtype: torch.dtype, timeout_ms: int,
                 chunk_rows: Optional[int] = None, fields: Optional[dict] = None):
        size, counts = layout.cp_size, layout.per_rank_actual_token
        self.layout, self.rank, self.group, self.quant, self.chunk_rows = layout, rank, group, quant, chunk_rows
        self.out_row_shape, self.out_dtype, self.timeout_ms, self.device = out_row_shape, out_dtype, timeout_ms, x.device
        self.n, self.gloo = counts[rank], dist.get_backend(group) == "gloo"
        self.ranks = dist.get_process_group_ranks(group) if group is not None else list(range(size))
        if not self.gloo:
            _started(group, x.device)
        elif fields is not None:  # host-visible: ranks that disagree (chunk_rows, ...) raise now, never time out
            agree_now(group, "cp_overlapped_boundary", fields, rank, size)
        self.most = max(len(pieces(c, chunk_rows)) for c in counts)
        self.mine, self.own = _wire(x, self.n, quant), pieces(self.n, chunk_rows)
        sent = tuple(t.cpu() for t in self.mine) if self.gloo else self.mine  # gloo sends host memory: stage once
        # every chunk's rows posted at once (the links run ahead of the consumer); rank r's rows go to every
        # peer whatever its count (every rank computes on every row), a peer's arrive where it has any
        self.arrived, self.gathers = {}, {}
        for k in range(1, size):
            dst, src = (rank + k) % size, (rank - k) % size
            self.arrived[src], theirs = _empty(x, counts[src], quant), pieces(counts[src], chunk_rows)
            for j in range(self.most):
                send = _bytes(_rows(sent, *self.own[j])) if j < len(self.own) else ()
                recv = _bytes(_rows(self.arrived[src], *theirs[j])) if j < len(theirs) else ()
                self.gathers[k, j] = _exchange(group, send, self.ranks[dst] if send else None, recv,
                                               self.ranks[src] if recv else None, _tag(k, j, self.most, False),
                                               self.gloo, timeout_ms)
        self.chunks = schedule(layout, rank, chunk_rows)
        # slots[q]: this rank's rows as rank q computed them (its own put in place, the peers' received in
        # place), the layout the final sum reads
        self.slots = torch.empty((size, self.n, *out_row_shape), dtype=out_dtype, device=x.device)
        self.scatters, self.posted = [], (1, 0)  # posted: the next (step, chunk) batch of partials to post

    def _index(self, chunk: Chunk) -> int:
        return chunk.first // self.chunk_rows if self.chunk_rows else 0

    def rows(self, chunk: Chunk):
        """The chunk's rows (views), after waiting for them: ``[k, H]`` or ``(q, scale)``."""
        k, a = chunk.step, chunk.first
        if k:
            self._wait([self.gathers[k, self._index(chunk)]],
                       f"rank {self.ranks[chunk.source]}'s rows {a}..{a + chunk.rows} (step {k})")
        rows = _rows(self.mine if k == 0 else self.arrived[chunk.source], a, a + chunk.rows)
        return rows if self.quant else rows[0]

    def put(self, chunk: Chunk, y: torch.Tensor) -> None:
        """Chunk's partials: this rank's kept, a peer's sent back to it while the next chunk computes."""
        k, j = chunk.step, self._index(chunk)
        if k == 0:
            self.slots[self.rank, chunk.first:chunk.first + chunk.rows] = y
            return
        self._post_until((k, j))
        self._post(k, j, y)
        self.posted = (k, j + 1) if j + 1 < self.most else (k + 1, 0)
        if chunk.first + chunk.rows == self.layout.per_rank_actual_token[chunk.source]:
            self._post_until((k + 1, 0))  # the slot's last chunk: the step's other batches go now, as its peers'

    def _post(self, k: int, j: int, y: Optional[torch.Tensor]) -> None:
        size = self.layout.cp_size
        src, owner = (self.rank - k) % size, (self.rank + k) % size
        recv = (self.slots[owner, self.own[j][0]:self.own[j][1]],) if j < len(self.own) else ()
        self.scatters.append(_exchange(self.group, (y.contiguous(),) if y is not None else (),
                                       self.ranks[src] if y is not None else None, recv,
                                       self.ranks[owner] if recv else None, _tag(k, j, self.most, True), self.gloo,
                                       self.timeout_ms))

    def _post_until(self, until: Tuple[int, int]) -> None:
        """Post, in order, the batches before ``until`` that carry no partials of this rank (its slot there
        was shorter or empty): they still receive this rank's partials from their owner."""
        k, j = self.posted
        while (k, j) < until:
            self._post(k, j, None)
            k, j = (k, j + 1) if j + 1 < self.most else (k + 1, 0)
            if j == 0:
                self.arrived.pop((self.rank - k + 1) % self.layout.cp_size, None)  # that slot is computed: free it
        self.posted = (k, j)

    def finish(self, shared: Optional[torch.Tensor]) -> torch.Tensor:
        """``[n_rank, *out_row_shape]``: every rank's partials of this rank's rows in fp32 in rank order, plus
        ``shared``, rounded once."""
        size, n = self.layout.cp_size, self.n
        self._post_until((size, 0))
        self._wait(self.scatters, "the partials of this rank's rows")
        width = math.prod(self.out_row_shape)
        add = shared.reshape(n, width) if shared is not None else None
        return slot_sum(self.slots.view(size, n, width), n, add, self.out_dtype).view(n, *self.out_row_shape)

    def abort(self) -> None:
        """The consumer raised: nothing is undone (the peers stop at their timeout)."""

    def _wait(self, batches, what: str) -> None:
        _wait(batches, self.timeout_ms, self.gloo, what)
