"""cost_model.py's arithmetic: the boundary's time (gather + consumer + reduce-scatter) serialized, and the
overlapped schedule of docs/design.md's "The overlapped boundary" simulated chunk by chunk on every rank. A part
of cost_model.py (no other benchmark imports it); tests/bench/test_overlap_bench.py tests it directly.

Times are in seconds, sizes in rows of ``Moe.hidden`` elements. ``Inputs`` holds the measured stage costs
(cost_model.py's table says where each comes from); ``Moe`` the consumer's shape.

Serialized (what the 2x H200 tables measured): the P2P gather, then the consumer over all T rows in one
call, then the P2P reduce-scatter. A P2P collective takes ``call`` + the busiest port's bytes / ``link``:
port rows = max over ranks of max(rows in, rows out), the same count for the gather and the reduce-scatter.

Overlapped, on every rank r (counts n, T = sum(n)):

* gather stream: the peers' slots arrive in rotation (r+1, r+2, ...: each rank pulls a different peer
  first), a slot of n rows cut into floor(n / min_rows) equal pieces. All ranks share the links fairly, so
  rank r's stream ends when the serialized gather would (its rows in over the port time), each piece
  after the first paying a signal (``step``);
* consumer: the local rows first with no wait, then chunks of arrived pieces, merged until a chunk holds
  ``min_rows`` (near the balance rows the grouped GEMM turns weight-bound: each call reads every local
  expert's weights); a call costs ``launches * launch`` + max(FLOPs / ``tflops``, bytes / ``hbm``);
* reduce-scatter: a finished chunk's partials of peers' rows are pushed to their owners while the next
  chunk computes (one egress queue per rank, free once the gather is served); the partials of a rank's
  LAST chunk have nothing to hide under and are pulled by their owners in one final fused kernel that
  also sums the staged partials in rank order (exact, as the serialized kernel): ``call`` + max(link
  bytes / ``link``, HBM bytes / ``hbm``);
* while a rank's link moves rows (its gather, its pushes) its consumer runs at (1 - ``slowdown``) of its
  speed (the HBM and SMs the copy takes). Incoming pushes are not counted separately (a rank sends about
  what it receives) and two pushes into one rank do not contend (the rotation spreads them).

With one chunk (``one_chunk=True``: everything arrives, one consumer call, one fused reduce-scatter)
the schedule is the serialized one, to the rounding.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Sequence, Tuple

import harness  # noqa: E402  (the benchmarks folder is the running script's: on the path)

harness.part_of("cost_model.py", __name__)  # run as a script, it says which script to run


@dataclasses.dataclass(frozen=True)
class Inputs:
    link_gbs: float = 356.0  # one direction of one GPU's NVLink, GB/s
    call_us: float = 9.2  # a P2P call with no rows (kernel launch, geometry round trip)
    step_us: float = 4.0  # one signal between GPUs (a further piece of a stream)
    launch_us: float = 4.4  # an empty kernel between two events
    hbm_gbs: float = 4137.0  # device-to-device copy, bytes read + written
    tflops: float = 600.0  # the consumer's achieved bf16 rate
    slowdown: float = 0.20  # consumer speed lost while a copy runs (fraction)
    launches: int = 6  # kernels per consumer call (route/permute, 2 GEMMs, activation, combine, shared)


@dataclasses.dataclass(frozen=True)
class Moe:
    """DeepSeek-V3's MoE layer (config.json: hidden 7168, moe_intermediate_size 2048, 256 routed experts,
    top-8, 1 shared expert), bf16. ``shared_split``: the shared expert is TP-split over the cp ranks like
    the routed experts are EP-split, so each rank does 1/cp of the layer; False: every rank runs it whole."""

    hidden: int = 7168
    inter: int = 2048
    routed: int = 256
    topk: int = 8
    shared: int = 1
    elem: int = 2
    shared_split: bool = True

    @property
    def row_bytes(self) -> int:
        return self.hidden * self.elem

    def passes(self, cp: int) -> float:
        """Expert passes per gathered row on one rank (gate_up + down of one expert over one row)."""
        return self.topk / cp + (self.shared / cp if self.shared_split else self.shared)

    def flops_per_row(self, cp: int) -> float:
        return self.passes(cp) * 3 * 2 * self.hidden * self.inter  # gate, up, down: 2 FLOPs a MAC

    def weight_bytes(self, cp: int) -> float:
        experts = self.routed / cp + (self.shared / cp if self.shared_split else self.shared)
        return experts * 3 * self.hidden * self.inter * self.elem

    def act_bytes_per_row(self, cp: int) -> float:
        """x read, partial written, and per pass gate_up out/in (2I each) and the activation out/in (I each)."""
        return 2 * self.row_bytes + self.passes(cp) * 6 * self.inter * self.elem

    def balance_rows(self, cp: int, inp: Inputs) -> int:
        """Rows at which a consumer call's FLOPs take as long as reading its weights (below: weight-bound)."""
        weights_s = self.weight_bytes(cp) / (inp.hbm_gbs * 1e9)
        per_row_s = self.flops_per_row(cp) / (inp.tflops * 1e12) - self.act_bytes_per_row(cp) / (inp.hbm_gbs * 1e9)
        return max(1, math.ceil(weights_s / per_row_s)) if per_row_s > 0 else 1 << 30


def counts_for(cp: int, M: int) -> List[int]:
    """The tables' uneven layout: [M, 0.8M, M, 0.8M, ...]."""
    return [M if r % 2 == 0 else round(0.8 * M) for r in range(cp)]


def port_rows(counts: Sequence[int]) -> int:
    """Rows the busiest port moves in a gather (or a reduce-scatter): max over ranks of rows in and out."""
    T, cp = sum(counts), len(counts)
    return max(max(T - n, (cp - 1) * n) for n in counts)


def collective_s(counts: Sequence[int], inp: Inputs, moe: Moe) -> float:
    """A serialized P2P gather or reduce-scatter (the calibrated model)."""
    return inp.call_us * 1e-6 + port_rows(counts) * moe.row_bytes / (inp.link_gbs * 1e9)


def consumer_s(rows: int, cp: int, moe: Moe, inp: Inputs) -> float:
    """One consumer call over ``rows`` gathered rows on one rank: launches + its roofline."""
    if rows <= 0:
        return 0.0
    flops = rows * moe.flops_per_row(cp) / (inp.tflops * 1e12)
    hbm = (moe.weight_bytes(cp) + rows * moe.act_bytes_per_row(cp)) / (inp.hbm_gbs * 1e9)
    return inp.launches * inp.launch_us * 1e-6 + max(flops, hbm)


@dataclasses.dataclass
class Boundary:
    gather: float  # serialized collective (overlapped: the gather stream's end)
    consumer: float  # one consumer call over all T rows (the serialized consumer)
    rs: float  # serialized collective (overlapped: the slowest final kernel)
    total: float
    chunks: int = 1  # consumer calls on the busiest rank

    @property
    def comm(self) -> float:
        return self.gather + self.rs


def serialized(counts: Sequence[int], moe: Moe, inp: Inputs) -> Boundary:
    cp, g = len(counts), collective_s(counts, inp, moe)
    c = consumer_s(sum(counts), cp, moe, inp)
    return Boundary(g, c, g, g + c + g)


def _advance(t0: float, work: float, windows: List[Tuple[float, float]], slow: float) -> float:
    """When ``work`` seconds of consumer time started at ``t0`` end, running at (1 - slow) inside windows."""
    t, left = t0, work
    merged: List[List[float]] = []
    for a, b in sorted(windows):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    for a, b in merged:
        if b <= t:
            continue
        if a > t:
            if left <= a - t:
                return t + left
            left, t = left - (a - t), a
        cap = (b - t) * (1.0 - slow)
        if left <= cap:
            return t + left / (1.0 - slow)
        left, t = left - cap, b
    return t + left


def _stream(r: int, counts: Sequence[int], min_rows: int) -> List[Tuple[int, int]]:
    """Rank r's gather stream: (owner, rows) pieces in arrival order (rotation, slots cut into pieces)."""
    cp, out = len(counts), []
    for k in range(1, cp):
        q = (r + k) % cp
        n = counts[q]
        parts = max(1, n // min_rows) if n else 0
        out += [(q, n // parts + (1 if i < n % parts else 0)) for i in range(parts)]
    return out


def overlapped(counts: Sequence[int], moe: Moe, inp: Inputs, min_rows: int = 0, one_chunk: bool = False) -> Boundary:
    """The chunked schedule on every rank (see the module docstring). ``min_rows`` 0: twice the balance
    rows (a chunk's weights then cost at most half its FLOP time)."""
    cp, rb, link = len(counts), moe.row_bytes, inp.link_gbs * 1e9
    ser = serialized(counts, moe, inp)
    if cp == 1:
        return ser
    min_rows = min_rows or 2 * moe.balance_rows(cp, inp)
    port_s = port_rows(counts) * rb / link
    step, call = inp.step_us * 1e-6, inp.call_us * 1e-6
    plans: Dict[int, Tuple[float, List[Tuple[float, List[Tuple[int, int]]]]]] = {}  # r -> (stream end, chunks)
    gather_end = 0.0
    for r, n in enumerate(counts):
        pieces = _stream(r, counts, min_rows)
        rows_in = sum(p for _, p in pieces)
        chunks, cur, got, t_ready = [(0.0, [(r, n)])], [], 0, 0.0
        for i, (q, p) in enumerate(pieces):
            got += p
            # fair share of the links: rank r's last piece lands when the serialized gather ends
            t_ready = call + i * step + port_s * got / rows_in
            cur.append((q, p))
            if sum(x for _, x in cur) >= min_rows or i == len(pieces) - 1:
                chunks.append((t_ready, cur))
                cur = []
        if one_chunk:  # the serialized boundary: one gather kernel, one consumer call
            t_ready = call + port_s
            chunks = [(t_ready, [(r, n)] + pieces)]
        plans[r] = (t_ready, chunks)
        gather_end = max(gather_end, t_ready)
    # each rank's consumer, its pushes (partials of finished chunks) and the partials left for the end
    done, pushed_into, last_pieces, busiest = {}, {r: 0.0 for r in range(cp)}, {}, 1
    for r, (stream_end, chunks) in plans.items():
        windows = [(0.0, stream_end)]  # its link is busy until its gather stream ends
        egress, t = stream_end, 0.0
        for j, (ready, pieces) in enumerate(chunks):
            rows = sum(p for _, p in pieces)
            t = _advance(max(t, ready), consumer_s(rows, cp, moe, inp), windows, inp.slowdown)
            if j == len(chunks) - 1:
                last_pieces[r] = [(q, p) for q, p in pieces if q != r]
                break
            for q, p in pieces:
                if q != r:
                    start = max(t, egress)
                    egress = start + step + p * rb / link
                    windows.append((start, egress))
                    pushed_into[q] = max(pushed_into[q], egress)
        done[r] = t
        busiest = max(busiest, len(chunks))
    end, rs_end = 0.0, 0.0
    for r, n in enumerate(counts):
        pulled_in = sum(p for q in range(cp) for o, p in last_pieces[q] if o == r)
        pulled_out = sum(p for _, p in last_pieces[r])
        producers = [done[q] for q in range(cp) if any(o == r for o, _ in last_pieces[q])]
        start = max([done[r], pushed_into[r]] + producers)
        staged = (cp - 1) * n - pulled_in  # pushed earlier, read from this rank's HBM
        hbm = (staged + 2 * n) * rb / (inp.hbm_gbs * 1e9)
        final = call + max(max(pulled_in, pulled_out) * rb / link, hbm)
        rs_end = max(rs_end, final)
        end = max(end, start + final)
    return Boundary(gather_end, ser.consumer, rs_end, end, busiest)


def exposed(ovl: Boundary) -> float:
    """What the communication costs beyond the serialized consumer: overlapped time - one consumer call."""
    return ovl.total - ovl.consumer
