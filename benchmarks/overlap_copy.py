"""overlap.py's emulated link: a copy paced to NVLink's rate on one GPU. A part of overlap.py (no other
benchmark imports it).

On one GPU a plain copy runs at HBM speed (3.2-3.9 TB/s on an H200), ten times a link's, and takes most
of the memory bandwidth the consumer needs (docs/design.md, "The overlapped boundary"). The copy here is a
Triton kernel launched on a small grid: each program copies BLOCK elements at a time and strides over the buffer
by the grid, so the grid and BLOCK (with its warps) set how many bytes are in flight and hence the rate.
``calibrate`` times a sweep of them on a buffer several times the L2 and keeps, among those within 5% of the
target alone, the one on the fewest programs. Those programs hold a few SMs, as an SM-driven push over
NVLink does.

Rows are copied as int16 words (any 2-byte dtype, bit for bit). On CPU tensors (smoke runs) the same
kernel runs under Triton's interpreter; without Triton it falls back to ``copy_`` and says the copy is not
paced.

The copy-engine mechanism (``PacedPieces``, ``calibrate_pieces``): a copy engine on one GPU runs at HBM
speed, so each copy is cut into pieces of ``piece_bytes`` (``copy_`` of contiguous same-dtype views:
cudaMemcpyAsync D2D), each after a 1-thread sleep kernel (``torch.cuda._sleep``) sized so that the average
rate is the link's. The smallest piece (of 1-16 MiB) is kept whose unslept rate clears the target and whose
two launches the host enqueues in at most half the piece's time at the target rate.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable, List, Optional, Tuple

import torch

import harness  # noqa: E402  (the benchmarks folder is the running script's: on the path)

harness.part_of("overlap.py", __name__)  # run as a script, it says which script to run

try:
    import triton
    import triton.language as tl
except ImportError:  # the smoke run still goes through the same calls, with copy_
    triton = None

# (int16 elements a program copies per step, warps): 2-64 KiB in flight per program, 16-128 bytes a thread
CONFIGS = ((1024, 4), (4096, 4), (8192, 8), (16384, 8), (32768, 16))
MAX_GRID = 64
NEAR = 0.05  # among configurations this near the target rate, the one on the fewest programs (SMs)
CALIBRATION_MIB = 256  # source and destination each: several times the H200's 50 MB L2

if triton is not None:

    @triton.jit
    def _paced_copy(src, dst, n, grid, BLOCK: tl.constexpr):
        # a few programs stride over the buffer: the grid, not the buffer's size, sets the bytes in flight
        pid = tl.program_id(0)
        for start in range(pid * BLOCK, n, grid * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < n
            tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


@dataclasses.dataclass
class PacedCopy:
    """``copy(src, dst)``: rows of src into dst (same shape, 2-byte elements) on the current stream."""

    grid: int
    block: int
    warps: int = 4
    rate_gbs: float = float("nan")  # measured alone at calibration (bytes copied / s)
    paced: bool = True

    def __call__(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        if src.numel() == 0:
            return
        if not self.paced or not src.is_cuda:  # a smoke run's CPU tensors: Triton 3.6's interpreter cannot
            dst.copy_(src)  # loop over a runtime bound, and a CPU copy paces nothing anyway
            return
        s, d = src.reshape(-1).view(torch.int16), dst.reshape(-1).view(torch.int16)
        _paced_copy[(self.grid,)](s, d, s.numel(), self.grid, BLOCK=self.block, num_warps=self.warps)

    def describe(self) -> str:
        if not self.paced:
            return "torch copy_ (NOT paced: Triton is not importable)"
        rate = f", {self.rate_gbs:.0f} GB/s alone" if self.rate_gbs == self.rate_gbs else ""
        return f"Triton copy kernel on {self.grid} programs of {self.warps} warps x {self.block} int16 per step{rate}"


def _timed(copy: Callable, src, dst, reps: int = 3) -> Tuple[float, float]:
    """``copy`` alone: (GB/s: bytes copied, one direction, as a link's rate is counted; host s to enqueue it),
    medians of reps."""
    copy(src, dst)  # compiles the BLOCK's kernel the first time
    ts, host = [], []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        copy(src, dst)
        host.append(time.perf_counter() - t0)
        stop.record()
        stop.synchronize()
        ts.append(start.elapsed_time(stop))
    return src.numel() * src.element_size() / (statistics.median(ts) * 1e-3) / 1e9, statistics.median(host)


def _rate_gbs(copy: Callable, src, dst, reps: int = 3) -> float:
    return _timed(copy, src, dst, reps)[0]


def _calibration_buffers(device: torch.device):
    n = CALIBRATION_MIB << 19
    src = torch.randint(-(1 << 15), 1 << 15, (n,), dtype=torch.int16, device=device)
    return src, torch.empty_like(src)


def _check_and_free(src, dst, what: str) -> None:
    if not torch.equal(src, dst):
        raise SystemExit(f"{what}: the calibration copy is not exact (CHECK FAILED)")
    del src, dst
    torch.cuda.empty_cache()


def calibrate(device: torch.device, target_gbs: float, log: Callable[[str], None]) -> Tuple[PacedCopy, List[tuple]]:
    """The (grid, BLOCK, warps) whose copy alone runs at ``target_gbs`` on the fewest programs (within 5%; else
    the nearest), and the sweep [(grid, block, warps, GB/s)]."""
    if triton is None:
        log("paced copy: Triton is not importable: torch copy_ instead, NOT paced to the link")
        return PacedCopy(0, 0, paced=False), []
    if device.type != "cuda":  # the interpreter's rate means nothing: a small fixed grid, same code path
        return PacedCopy(2, 1024), []
    src, dst = _calibration_buffers(device)
    sweep = []
    for block, warps in CONFIGS:
        for grid in range(1, MAX_GRID + 1):
            rate = _rate_gbs(PacedCopy(grid, block, warps), src, dst)
            sweep.append((grid, block, warps, rate))
            if rate > 1.5 * target_gbs:  # the rate grows with the grid: the rest overshoots
                break
    _check_and_free(src, dst, "paced copy")
    near = [c for c in sweep if abs(c[3] - target_gbs) <= NEAR * target_gbs]
    grid, block, warps, rate = (min(near, key=lambda c: (c[0], abs(c[3] - target_gbs))) if near
                                else min(sweep, key=lambda c: abs(c[3] - target_gbs)))
    off = abs(rate - target_gbs) / target_gbs
    log(f"paced copy: calibrated {len(sweep)} (grid, BLOCK, warps) on {CALIBRATION_MIB} MiB; kept {grid} programs of "
        f"{warps} warps x {block} int16: {rate:.0f} GB/s alone against a target of {target_gbs:.0f} GB/s "
        f"({off:.1%} off)"
        + ("" if off <= 0.10 else "  WARNING: more than 10% off the target"))
    return PacedCopy(grid, block, warps, rate), sweep


def carveout_setter() -> Optional[Callable[[Optional[int]], None]]:
    """torch's SM carveout for cuBLASLt matmuls (``torch._C._set_sm_carveout_experimental``), or None."""
    return getattr(torch._C, "_set_sm_carveout_experimental", None)


# ============================================================================ the copy-engine mechanism
PIECE_MIB = (1, 2, 4, 8, 16)  # candidate piece sizes, smallest (least bursty) first
HOST_SHARE = 0.5  # a piece's two launches must be enqueued in at most this share of its time at the target rate
TIGHT = 0.02  # the sleep is refined until the rate alone is this near the target
REFINE_STEPS = 8
SMOKE_PIECE_BYTES = 4096  # CPU tensors: a few pieces per smoke chunk, so the cutting runs


@dataclasses.dataclass
class PacedPieces:
    """``copy(src, dst)``: src into dst (contiguous, same shape and dtype) on the current stream as copy-engine
    copies of ``piece_bytes`` (``copy_`` of flat views: cudaMemcpyAsync D2D, no SMs), each after a 1-thread
    sleep kernel of ``sleep_cycles`` (a shorter last piece: in proportion) that holds the stream so that the
    average rate is the link's. On CPU tensors the same pieces, no sleep kernel."""

    piece_bytes: int
    sleep_cycles: int = 0
    cycles_per_us: float = float("nan")  # the sleep kernel's clock, measured at calibration
    rate_gbs: float = float("nan")  # measured alone at calibration (bytes copied / s)

    def __call__(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        s, d = src.reshape(-1), dst.reshape(-1)  # views: both are contiguous
        step = max(1, self.piece_bytes // s.element_size())
        for a in range(0, s.numel(), step):
            b = min(a + step, s.numel())
            if s.is_cuda:
                torch.cuda._sleep(self.sleep_cycles * (b - a) // step)
            d[a:b].copy_(s[a:b])

    @property
    def piece_mib(self) -> float:
        return self.piece_bytes / (1 << 20)

    def describe(self) -> str:
        us = self.sleep_cycles / self.cycles_per_us
        size = f"{self.piece_mib:g} MiB" if self.piece_bytes >= 1 << 20 else f"{self.piece_bytes >> 10} KiB"
        if self.rate_gbs != self.rate_gbs:  # CPU tensors: nothing paced
            return f"copy-engine pieces of {size} (CPU tensors: no sleep kernel, not paced)"
        return (f"copy-engine pieces of {size} at HBM speed, separated by a 1-thread sleep kernel "
                f"({self.sleep_cycles} cycles, {us:.1f} us), average {self.rate_gbs:.0f} GB/s measured alone")


def sleep_cycles_per_us(reps: int = 5) -> float:
    """``torch.cuda._sleep``'s cycles per microsecond of device time: the slope between two lengths (the
    launch's own time cancels), median of reps."""
    def us(cycles):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.cuda._sleep(cycles)
        b.record()
        b.synchronize()
        return a.elapsed_time(b) * 1e3

    lo, hi = 200_000, 2_200_000
    us(lo)
    return (hi - lo) / statistics.median(us(hi) - us(lo) for _ in range(reps))


def calibrate_pieces(device: torch.device, target_gbs: float, log: Callable[[str], None],
                     piece_mib: Optional[float] = None) -> PacedPieces:
    """The copy-engine copy paced to ``target_gbs``: the smallest piece of ``PIECE_MIB`` (or ``piece_mib``)
    whose copy with no sleep runs faster than the target and whose host enqueue keeps ahead, then the sleep
    refined on the measured rate until the copy alone is within 2% of the target."""
    if device.type != "cuda":  # no rate to pace on CPU tensors: the same pieces, no sleep kernel
        return PacedPieces(SMOKE_PIECE_BYTES)
    cpu = sleep_cycles_per_us()
    src, dst = _calibration_buffers(device)
    nbytes = src.numel() * src.element_size()
    ce = None
    for mib in [piece_mib] if piece_mib else PIECE_MIB:
        ce = PacedPieces(int(mib * (1 << 20)), 0, cpu)
        rate, host_s = _timed(ce, src, dst)
        pieces = -(-nbytes // ce.piece_bytes)
        piece_us = ce.piece_bytes / target_gbs / 1e3  # a piece's time at the target rate
        host_us = host_s * 1e6 / pieces
        if rate > target_gbs * (1 + NEAR) and host_us <= HOST_SHARE * piece_us:
            break
        log(f"copy-engine pieces: {mib:g} MiB too small: {rate:.0f} GB/s with no sleep, {host_us:.1f} us to enqueue "
            f"a piece of {piece_us:.1f} us at the target")
    for _ in range(REFINE_STEPS):  # the gap's sleep: the rest of a piece's time at the target rate
        if abs(rate - target_gbs) <= TIGHT * target_gbs:
            break
        short_us = ce.piece_bytes / target_gbs / 1e3 - ce.piece_bytes / rate / 1e3
        ce.sleep_cycles = max(0, round(ce.sleep_cycles + short_us * cpu))
        rate = _rate_gbs(ce, src, dst)
    ce.rate_gbs = rate
    _check_and_free(src, dst, "copy-engine pieces")
    off = abs(rate - target_gbs) / target_gbs
    log(f"copy-engine pieces: calibrated on {CALIBRATION_MIB} MiB: sleep kernel {cpu:.0f} cycles/us; "
        f"{ce.describe()} against a target of {target_gbs:.0f} GB/s ({off:.1%} off)"
        + ("" if off <= NEAR else f"  WARNING: more than {NEAR:.0%} off the target"))
    return ce


# ============================================================================ copy-engine pieces with ballast
BALLAST_MIB = 8  # the ballast's source and destination each: together well inside the L2 (50 MB on H100 / H200)


@dataclasses.dataclass
class BallastPieces:
    """``copy(src, dst)``: src into dst on the current stream as copy-engine pieces of ``piece_bytes``, each
    followed by ballast copies of ``ballast_bytes`` in all (cudaMemcpyAsync between two L2-resident scratch
    buffers of BALLAST_MIB) that hold the stream's copy engine for the rest of the piece's time at the link's
    rate. No kernel at all: nothing waits for an SM, as a copy-engine pull over NVLink does not; the ballast
    stays in the L2, so the HBM sees about the real piece's bytes. On CPU tensors the same pieces, no ballast."""

    piece_bytes: int
    ballast_bytes: int = 0
    scratch: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
    rate_gbs: float = float("nan")  # measured alone at calibration (bytes copied / s, the ballast not counted)

    def __call__(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        s, d = src.reshape(-1), dst.reshape(-1)
        step = max(1, self.piece_bytes // s.element_size())
        for a in range(0, s.numel(), step):
            b = min(a + step, s.numel())
            d[a:b].copy_(s[a:b])
            if self.scratch is not None and s.is_cuda:
                self._ballast(self.ballast_bytes * (b - a) // step)

    def _ballast(self, nbytes: int) -> None:
        bs, bd = self.scratch
        while nbytes > 0:
            k = min(nbytes, bs.numel())
            bd[:k].copy_(bs[:k])
            nbytes -= k

    @property
    def piece_mib(self) -> float:
        return self.piece_bytes / (1 << 20)

    def describe(self) -> str:
        if self.rate_gbs != self.rate_gbs:
            return f"copy-engine pieces of {self.piece_bytes >> 10} KiB (CPU tensors: no ballast, not paced)"
        return (f"copy-engine pieces of {self.piece_mib:g} MiB, each followed by {self.ballast_bytes / (1 << 20):.1f} MiB of "
                f"ballast copies inside the L2 ({BALLAST_MIB} MiB scratch), average {self.rate_gbs:.0f} GB/s measured "
                f"alone")


def calibrate_ballast(device: torch.device, target_gbs: float, log: Callable[[str], None],
                      piece_mib: Optional[float] = None) -> BallastPieces:
    """The copy-engine copy paced by ballast to ``target_gbs``: pieces of ``piece_mib`` (default 16 MiB: the
    fewest launches), the ballast refined on the measured rate until the copy alone is within 2% of the target."""
    piece = int((piece_mib or PIECE_MIB[-1]) * (1 << 20))
    if device.type != "cuda":
        return BallastPieces(SMOKE_PIECE_BYTES)
    n = BALLAST_MIB << 20
    ce = BallastPieces(piece, 0, (torch.randint(0, 256, (n,), dtype=torch.uint8, device=device),
                                  torch.empty(n, dtype=torch.uint8, device=device)))
    src, dst = _calibration_buffers(device)
    rate, host_s = _timed(ce, src, dst)
    if rate <= target_gbs:
        log(f"copy-engine ballast: the pieces alone run at {rate:.0f} GB/s, below the target: no ballast")
    # a piece's time is linear in its ballast, t(b) = t0 + b / rate_b: solve t(b) = piece / target (secant steps)
    b0, t0 = 0, piece / (rate * 1e9)
    b1 = piece
    for _ in range(REFINE_STEPS):
        if abs(rate - target_gbs) <= TIGHT * target_gbs or rate < target_gbs and ce.ballast_bytes == 0:
            break
        ce.ballast_bytes = b1
        rate, host_s = _timed(ce, src, dst)
        t1 = piece / (rate * 1e9)
        if t1 <= t0:
            b0, t0, b1 = b1, t1, b1 * 2
            continue
        b0, t0, b1 = b1, t1, max(0, round(b1 + (piece / (target_gbs * 1e9) - t1) * (b1 - b0) / (t1 - t0)))
    ce.rate_gbs = rate
    _check_and_free(src, dst, "copy-engine ballast pieces")
    pieces = -(-(CALIBRATION_MIB << 20) // piece)
    off = abs(rate - target_gbs) / target_gbs
    log(f"copy-engine ballast: calibrated on {CALIBRATION_MIB} MiB: {ce.describe()} against a target of "
        f"{target_gbs:.0f} GB/s ({off:.1%} off); host {host_s * 1e6 / pieces:.1f} us to enqueue a piece of "
        f"{piece / target_gbs / 1e3:.1f} us" + ("" if off <= NEAR else f"  WARNING: more than {NEAR:.0%} off the target"))
    return ce
