"""overlap.py's buffers and methods: one emulated rank's chunks, the copies (paced, on a side stream) and the
consumer (on the current stream), serialized and overlapped, in both directions; their correctness check.
A part of overlap.py (no other benchmark imports it).

The methods are the same for each mechanism (``Mechanism``): only the copy callable and the carveout
differ (the SM-driven Triton copy with the consumer's GEMMs carved; copy-engine pieces with none).

The emulated rank r holds ``counts[r]`` rows (r = 1: a 0.8M rank, the one that receives the most). Its
gathered buffer is compact ``[T, H]``, rank q's rows at ``offsets[q]``; each peer's rows come from an
allocation of their own (``peer_src[q]``: a stand-in for that peer's memory). Gather order: the local chunk
first (no copy, no wait), then the peers in rotation r+1, r+2, ... (one chunk per peer slot). Reduce-scatter
order: the peers' chunks first, the local chunk last; each peer chunk's partials go to ``received[q]`` (that
peer's memory), the local chunk's stay.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Dict, List, Optional, Set

import torch

import harness  # noqa: E402  (the benchmarks folder is the running script's: on the path)

harness.part_of("overlap.py", __name__)  # run as a script, it says which script to run

CARVE_MARGIN = 1.0  # default: a gather chunk gets the carveout if it starts before the copy alone would end


@dataclasses.dataclass
class Chunk:
    owner: int  # the emulated rank whose rows these are
    off: int  # first row in the compact gathered buffer
    rows: int


class Streams:
    """The consumer's stream (current) and the copies' side stream (high priority); no-ops on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.side = torch.cuda.Stream(device, priority=-1) if self.cuda else None

    def on_side(self):
        return torch.cuda.stream(self.side) if self.cuda else contextlib.nullcontext()

    def fork(self) -> None:  # the side stream starts after what the current one has enqueued
        if self.cuda:
            self.side.wait_stream(torch.cuda.current_stream())

    def join(self) -> None:
        if self.cuda:
            torch.cuda.current_stream().wait_stream(self.side)

    def record(self):  # an event on the current stream (None on the CPU)
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record()
        return ev

    def wait(self, ev) -> None:  # the current stream waits for ``ev``
        if ev is not None:
            torch.cuda.current_stream().wait_event(ev)


class Carveout:
    """cuBLASLt matmuls launched under ``on(True)`` target all SMs but ``sms`` (the copy's grid): a persistent
    GEMM then runs beside the copy instead of in two waves behind it. ``sms`` 0 or no setter: nothing."""

    def __init__(self, setter: Optional[Callable], sms: int):
        self.setter, self.sms = setter, sms if setter else 0

    @contextlib.contextmanager
    def on(self, active: bool):
        if not (active and self.sms):
            yield
            return
        self.setter(self.sms)
        try:
            yield
        finally:
            self.setter(None)


@dataclasses.dataclass
class Mechanism:
    """How the emulated link moves rows: ``copy(src, dst)`` on the current stream, the consumer's carveout
    beside it, and the mechanism's own CSV columns."""

    name: str  # "sm" (an SM-driven copy), "ce" or "ceb" (copy-engine pieces: sleep- or ballast-paced)
    copy: Callable
    carve: Carveout
    takes_sms: bool  # the copy runs on SMs: the carved consumer alone is timed too
    columns: Dict[str, object] = dataclasses.field(default_factory=dict)


CONSUMER_ONLY = ("ag consumer", "ag consumer 1 call", "rs consumer")  # no copy: the same for every mechanism


class Setup:
    """One shape: counts [M, 0.8M, ...] over cp, the emulated rank's chunks and buffers."""

    def __init__(self, cp: int, M: int, hidden: int, device: torch.device, seed: int):
        self.cp, self.M, self.device = cp, M, device
        self.counts = [M if q % 2 == 0 else round(0.8 * M) for q in range(cp)]
        self.r = 1 if cp > 1 else 0
        self.T = sum(self.counts)
        offsets = [sum(self.counts[:q]) for q in range(cp)]
        peers = [(self.r + k) % cp for k in range(1, cp)]
        self.ag = [Chunk(self.r, offsets[self.r], self.counts[self.r])] + [Chunk(q, offsets[q], self.counts[q])
                                                                          for q in peers]
        self.rs = self.ag[1:] + self.ag[:1]
        g = torch.Generator(device=device).manual_seed(seed)

        def randn(rows):
            return torch.randn(rows, hidden, generator=g, device=device, dtype=torch.bfloat16)

        self.gathered = randn(self.T)
        self.local = self.rows(self.gathered, self.ag[0]).clone()
        self.peer_src = {c.owner: randn(c.rows) for c in self.ag[1:]}  # the peers' memory, one allocation each
        for c in self.ag[1:]:  # as gathered once, so every method's consumer reads the same rows
            self.rows(self.gathered, c).copy_(self.peer_src[c.owner])
        self.partials = torch.empty_like(self.gathered)
        self.received = {c.owner: torch.empty_like(self.peer_src[c.owner]) for c in self.ag[1:]}

    @staticmethod
    def rows(t: torch.Tensor, c: Chunk) -> torch.Tensor:
        return t[c.off:c.off + c.rows]

    @property
    def copy_bytes(self) -> int:
        return sum(c.rows for c in self.ag[1:]) * self.gathered.shape[1] * self.gathered.element_size()

    def label(self) -> str:
        return (f"cp={self.cp} M={self.M}: counts {self.counts}, emulated rank {self.r} ({self.counts[self.r]} rows), "
                f"T={self.T}, {len(self.ag) - 1} peer chunks, {self.copy_bytes / 1e6:.0f} MB over the emulated link")


def make_methods(S: Setup, consumer, mech: Mechanism, st: Streams, carve_ag: Set[int]) -> Dict[str, Callable]:
    """name -> fn(): each enqueues one run and leaves the side stream joined into the current one."""
    rows, copy, carve = S.rows, mech.copy, mech.carve
    carve_rs = set(range(1, len(S.rs)))  # chunk j runs beside the push of chunk j - 1

    def copy_in(events: Optional[List] = None):
        st.fork()
        with st.on_side():
            for c in S.ag[1:]:
                copy(S.peer_src[c.owner], rows(S.gathered, c))
                if events is not None:
                    events.append(st.record())

    def consume(chunks, carved=frozenset()):
        for i, c in enumerate(chunks):
            with carve.on(i in carved):
                consumer(rows(S.gathered, c), rows(S.partials, c))

    def push(c):
        copy(rows(S.partials, c), S.received[c.owner])

    def ag_copy():
        copy_in()
        st.join()

    def ag_serial():
        copy_in()
        st.join()
        consume(S.ag)

    def ag_overlap():
        events = [None]  # the local chunk waits for nothing
        copy_in(events)
        for i, c in enumerate(S.ag):
            st.wait(events[i])
            with carve.on(i in carve_ag):
                consumer(rows(S.gathered, c), rows(S.partials, c))
        st.join()

    def ag_beside_copy():  # the same copies and consumer with no waits: the consumer's slowdown alone
        copy_in()
        consume(S.ag, carve_ag)
        st.join()

    def rs_copy():
        st.fork()
        with st.on_side():
            for c in S.rs[:-1]:
                push(c)
        st.join()

    def rs_serial():
        consume(S.rs)
        rs_copy()

    def rs_overlap():
        for j, c in enumerate(S.rs):
            with carve.on(j in carve_rs):
                consumer(rows(S.gathered, c), rows(S.partials, c))
            if c.owner != S.r:
                ev = st.record()
                with st.on_side():
                    st.wait(ev)  # the side stream waits for this chunk's partials
                    push(c)
        st.join()

    methods = {
        "ag copy": ag_copy, "ag consumer": lambda: consume(S.ag),
        "ag consumer 1 call": lambda: consumer(S.gathered, S.partials), "ag serial": ag_serial,
        "ag overlap": ag_overlap, "ag consumer+copy": ag_beside_copy,
        "rs copy": rs_copy, "rs consumer": lambda: consume(S.rs), "rs serial": rs_serial, "rs overlap": rs_overlap,
        # the carveout alone (the same chunks carved, no copy): what it costs the consumer apart from the copy
        "ag consumer carved": lambda: consume(S.ag, carve_ag), "rs consumer carved": lambda: consume(S.rs, carve_rs),
    }
    if not mech.takes_sms:  # no carveout beside a copy that takes no SMs: the carved runs are the plain ones
        del methods["ag consumer carved"], methods["rs consumer carved"]
    return methods


def _sync(S: Setup) -> None:
    if S.device.type == "cuda":
        torch.cuda.synchronize(S.device)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30)) if torch.isfinite(a).all() else float("inf")


def check(S: Setup, m: Dict[str, Callable], tol: float = 2e-2) -> List[str]:
    """Each method that moves rows, once on NaN-poisoned destinations: the rows it moves must arrive
    bit for bit, every partial must be written, and the consumer's partials must match the serialized
    run's within ``tol`` (relative; the combine's atomic adds may sum in any order). Returns failures."""
    fails, ref = [], None
    for name in ("rs serial", "rs overlap"):  # first: the gathered buffer still holds its initial rows
        for t in [S.partials, *S.received.values()]:
            t.fill_(float("nan"))
        m[name]()
        _sync(S)
        for c in S.rs[:-1]:
            if not torch.equal(S.received[c.owner], S.rows(S.partials, c)):
                fails.append(f"{name}: the partials of rank {c.owner}'s rows differ from what was pushed")
        if ref is None:
            ref = S.partials.clone()
        err = _rel(S.partials, ref)
        if err > tol:
            fails.append(f"{name}: partials off the serialized run's by {err:.1e} (NaN: a chunk was not written)")
    for name in ("ag copy", "ag serial", "ag overlap"):
        for c in S.ag[1:]:
            S.rows(S.gathered, c).fill_(float("nan"))
        S.partials.fill_(float("nan"))
        m[name]()
        _sync(S)
        for c in S.ag[1:]:
            if not torch.equal(S.rows(S.gathered, c), S.peer_src[c.owner]):
                fails.append(f"{name}: rank {c.owner}'s rows differ from its (emulated) memory")
        if not torch.equal(S.rows(S.gathered, S.ag[0]), S.local):
            fails.append(f"{name}: the local rows changed")
        if name != "ag copy":
            # a consumer that ran before its chunk landed read NaN: its partials show it
            err = _rel(S.partials, ref)
            if err > tol:
                fails.append(f"{name}: partials off the reference by {err:.1e} (NaN: read before the copy landed)")
    return fails


def carve_plan(S: Setup, m: Dict[str, Callable], consumer, carve: Carveout, margin: float = CARVE_MARGIN) -> Set[int]:
    """The gather chunks that start while the copies run (consumer alone against copy alone, timed once;
    a chunk starting before ``margin`` x the copy's time counts): they get the carveout; the later ones
    take every SM."""
    if S.device.type != "cuda" or not carve.sms:
        return set()
    evs = [torch.cuda.Event(enable_timing=True) for _ in range(len(S.ag) + 1)]
    torch.cuda._sleep(20_000_000)  # the host enqueues ahead: device times only
    evs[0].record()
    for i, c in enumerate(S.ag):
        consumer(S.rows(S.gathered, c), S.rows(S.partials, c))
        evs[i + 1].record()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    m["ag copy"]()
    b.record()
    torch.cuda.synchronize(S.device)
    copy_ms = a.elapsed_time(b)
    return {0} | {i for i in range(len(S.ag)) if evs[0].elapsed_time(evs[i]) < margin * copy_ms}
