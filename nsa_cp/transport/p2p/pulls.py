"""The P2P transport's overlapped boundary: copy-engine pulls of each rank's rows, copy-engine pushes of the
partials, no SM moving a byte (docs/design.md, "The overlapped boundary").

One call on rank ``r`` of ``P`` (``M = max_rank_len``; slot q = rows ``[q*M, q*M + n_q)``):

1. stage (current stream): this rank's real rows (bf16, or the FP8 wire's bytes and scales, quantized here
   exactly as the serialized gather's kernel does) into slot r of its own gather buffer 0, which every peer
   has mapped;
2. pull stream: the entry barrier (one 32-thread block; it carries the call fingerprint: layout, wire
   format, ``chunk_rows``, output row shape and dtype, ``shared``), then for ``k = 1 .. P-1`` and each chunk
   of rank ``(r - k) % P``'s slot, ``cudaMemcpyAsync`` from that rank's buffer into the same rows of ours and
   one event per chunk. ``rows(chunk)`` makes the current stream wait for that chunk's event only;
3. ``put(chunk, partial)``: this rank's own partials into slot r of its reduce buffer (current stream); a
   peer's, after an event on the current stream, by ``cudaMemcpyAsync`` on the push stream into slot r of
   that peer's reduce buffer (the owner's slot q holds rank q's partials of the owner's rows);
4. ``finish``: the push stream waits for the consumer and the pulls, then the done barrier (the second
   32-thread block); the current stream waits for it, sums the owner's slots in fp32 in rank order (one
   Triton pass, rounded once, ``shared`` added before the rounding: bitwise the serialized P2P
   reduce-scatter for a row-independent consumer), and one kernel overwrites the result with NaN if the
   error record is set (a peer that timed out, or ranks whose fingerprints differ): never silently wrong.

A rank whose consumer raised mid-call marks its transport broken (``abort``) and never enters the done
barrier, so every peer's done barrier times out (P2PTimeoutError at its next call, its result NaN).
"""

from __future__ import annotations

import math
import zlib
from typing import Optional

import torch

from ...geometry.chunks import pieces, schedule
from ...geometry.wire import FORMATS
from ...rows.slot_sum import slot_sum
from ...support import Support
from .errors import FP_FORMAT_SHIFT, FP_OVERLAP, P2PError

__all__ = ["PullRoute", "PullPipeline", "MECHANISM", "fingerprint", "supports"]

MECHANISM = "P2P copy-engine pulls and pushes (an event per chunk; two 32-thread barrier blocks per call)"


def fingerprint(req) -> tuple:
    """``(hash, desc)`` of an OverlapRequest as the entry barrier carries it (csrc/common.cuh's
    CallFingerprint): a CRC of everything the ranks must agree on, and the flags with the total rows."""
    call = req.call
    text = f"{req.describe()}|M={call.layout.max_rank_len}".encode()
    code = FORMATS[call.quant].code if call.quant is not None else 0
    desc = FP_OVERLAP | (code & 7) << FP_FORMAT_SHIFT | min(call.layout.total_len, 0xFFFFFF) << 8
    return zlib.crc32(text) & 0xFFFFFFFF, desc


class PullRoute:
    """What every call of one OverlapRequest on one transport shares, built once (``P2PRoutes.overlap``):
    the buffer views (this rank's gather buffer 0 and every peer's, as mapped here; the reduce buffers),
    the chunk schedule, every pull's rows, and the device count of this rank's rows (the FP8 stage's)."""

    __slots__ = ("t", "req", "fp", "m", "n", "local", "peers", "reduce", "peer_reduce", "chunks", "pulls", "count")

    def __init__(self, transport, req):
        t, call = transport, req.call
        layout = call.layout
        size, r, m = layout.cp_size, t.rank, layout.max_rank_len
        counts = layout.per_rank_actual_token
        self.t, self.req, self.fp, self.m, self.n = t, req, fingerprint(req), m, counts[r]
        b = t._buffers
        if call.quant is not None:
            fmt = FORMATS[call.quant]
            self.local = b.quant_views(fmt, 0, size * m)
            self.peers = [b.quant_views(fmt, 0, size * m, peer=q) for q in range(size)]
            self.count = torch.tensor([self.n], dtype=torch.int32, device=t.device)
        else:
            self.local = (b.gathers[0][:size * m],)
            self.peers = [(g[:size * m],) for g in b.peer_gather]
            self.count = None
        self.reduce, self.peer_reduce = b.reduce, b.peer_reduce
        self.chunks = schedule(layout, r, req.chunk_rows)
        # (step, first row, rows [lo, hi) of the source's slot): in the order the consumer takes them
        self.pulls = [(k, a, (r - k) % size * m + a, (r - k) % size * m + b_) for k in range(1, size)
                      for a, b_ in pieces(counts[(r - k) % size], req.chunk_rows)]

    def start(self, x: torch.Tensor, streams) -> "PullPipeline":
        return PullPipeline(self, x, streams)


class PullPipeline:
    """One overlapped boundary on a ``P2PTransport``, started (the module docstring's steps 1-2 enqueued).
    The API's side (nsa_cp/planning/overlap.py): ``chunks``, ``rows(chunk)``, ``put(chunk, partial)``,
    ``finish(shared)``, ``abort()``, ``device``."""

    def __init__(self, route: PullRoute, x: torch.Tensor, streams):
        t, call = route.t, route.req.call
        self.t, self.route, self.device, self.rank, self.m, self.n = t, route, t.device, t.rank, route.m, route.n
        self.row_shape, self.hidden = tuple(call.row_shape), t.hidden_size
        self.out_row_shape, self.out_dtype, self.quant = route.req.out_row_shape, route.req.out_dtype, call.quant
        self.chunks, self.local, self.reduce, self.peer_reduce = route.chunks, route.local, route.reduce, route.peer_reduce
        self.cur = torch.cuda.current_stream(t.device)
        self.pull, self.push = streams
        r, m, n = self.rank, self.m, self.n
        if n:  # step 1: this rank's rows into its slot, where its peers pull them from
            if call.quant is not None:  # quantized straight into the slot (the serialized gather's kernel)
                from ...rows.kernels.norm_rows import quant_into  # Triton, imported where it runs

                quant_into(x, route.local[0][r * m:(r + 1) * m], route.local[1][r * m:(r + 1) * m], route.count,
                           call.quant)
            else:
                route.local[0][r * m:r * m + n].copy_(x.reshape(n, self.hidden))
        ready = torch.cuda.Event()
        ready.record(self.cur)
        self.pull.wait_event(ready)
        t._guard(t._state.pull_begin)(self.pull.cuda_stream, *route.fp)
        self.events = {}
        with torch.cuda.stream(self.pull):  # step 2: every chunk's pull, in the order the consumer takes them
            for k, a, lo, hi in route.pulls:
                for dst, part in zip(self.local, route.peers[(r - k) % len(route.peers)]):
                    dst[lo:hi].copy_(part[lo:hi])
                self.events[k, a] = event = torch.cuda.Event()
                event.record(self.pull)
        self.keep = []  # partials in flight on the push stream (their memory must outlive the copies)
        self.done = False

    def rows(self, chunk):
        """The chunk's rows in this rank's gather buffer (views), the current stream waiting for their pull."""
        if chunk.step:
            self.cur.wait_event(self.events[chunk.step, chunk.first])
        lo = chunk.source * self.m + chunk.first
        views = tuple(v[lo:lo + chunk.rows] for v in self.local)
        return views if self.quant is not None else views[0].view(chunk.rows, *self.row_shape)

    def put(self, chunk, y: torch.Tensor) -> None:
        """The chunk's partials ``[rows, *out_row_shape]`` into slot ``rank`` of the owner's reduce buffer."""
        rows = y.contiguous().view(chunk.rows, self.hidden)
        lo = self.rank * self.m + chunk.first
        if chunk.step == 0:
            self.reduce[lo:lo + chunk.rows].copy_(rows)
            return
        computed = torch.cuda.Event()
        computed.record(self.cur)
        self.push.wait_event(computed)
        with torch.cuda.stream(self.push):
            self.peer_reduce[chunk.source][lo:lo + chunk.rows].copy_(rows)
        self.keep.append(rows)

    def finish(self, shared: Optional[torch.Tensor]) -> torch.Tensor:
        """``[n_rank, *out_row_shape]``: the owner's slots summed in fp32 in rank order, plus ``shared``,
        rounded once; NaN where the call failed on the device (its error raised at the next call)."""
        t, size, n = self.t, len(self.peer_reduce), self.n
        consumed = torch.cuda.Event()
        consumed.record(self.cur)
        self.push.wait_event(consumed)
        self.push.wait_stream(self.pull)
        t._state.copy_engine_end(self.push.cuda_stream)
        self.cur.wait_stream(self.push)
        for rows in self.keep:
            rows.record_stream(self.push)
        self.keep, self.done = [], True
        slots = self.reduce[:size * self.m].view(size, self.m, self.hidden)
        out = slot_sum(slots, n, shared.reshape(n, self.hidden) if shared is not None else None, self.out_dtype)
        t._state.poison_on_error(out.data_ptr(), out.numel() * out.element_size(), self.cur.cuda_stream)
        return out.view(n, *self.out_row_shape)

    def abort(self) -> None:
        """The consumer raised mid-call: this rank never enters the done barrier (its peers time out there),
        so its transport is unusable from now on."""
        if not self.done:
            self.done = True
            self.t._broken = (P2PError, f"nsa_cp P2P transport: an overlapped boundary on rank {self.rank} stopped "
                                        f"mid-call (its consumer raised); its peers time out. Re-create the transport "
                                        f"(nsa_cp.destroy_p2p, then nsa_cp.init_p2p) on every rank")


def supports(transport, req) -> Support:
    """Whether ``transport`` (a P2PTransport) can run ``req`` as copy-engine pulls; a no says why."""
    call = req.call
    if call.device is None or call.device.type != "cuda":
        return Support.no(f"the P2P pulls need CUDA tensors, got {call.device}")
    verdict = transport.support(call.layout, tuple(call.row_shape), call.dtype, call.device, quant=call.quant)
    if not verdict:
        return verdict
    width = math.prod(req.out_row_shape)
    if width != transport.hidden_size or req.out_dtype != transport.dtype:
        return Support.no(f"the consumer's output rows ({list(req.out_row_shape)} {req.out_dtype}) travel through the "
                          f"P2P reduce buffer, which holds rows of {transport.hidden_size} {transport.dtype}")
    return Support.yes()
