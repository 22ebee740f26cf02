"""overlap.py's emulated link: a copy paced to NVLink's rate on one GPU. A part of overlap.py (no other
benchmark imports it).

On one GPU a plain copy runs at HBM speed (3.2-3.9 TB/s on an H200), ten times a link's, and takes most
of the memory bandwidth the consumer needs (DESIGN.md, "The overlapped boundary"). The copy here is a Triton
kernel launched on a small grid: each program copies BLOCK elements at a time and strides over the buffer
by the grid, so the grid and BLOCK (with its warps) set how many bytes are in flight and hence the rate.
``calibrate`` times a sweep of them on a buffer several times the L2 and keeps, among those within 5% of the
target alone, the one on the fewest programs. Those programs hold a few SMs, as an SM-driven push over
NVLink does.

Rows are copied as int16 words (any 2-byte dtype, bit for bit). On CPU tensors (smoke runs) the same
kernel runs under Triton's interpreter; without Triton it falls back to ``copy_`` and says the copy is not
paced.
"""

from __future__ import annotations

import dataclasses
import statistics
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


def _rate_gbs(copy: PacedCopy, src, dst, reps: int = 3) -> float:
    """GB/s of ``copy`` alone (bytes copied, one direction, as a link's rate is counted): median of reps."""
    copy(src, dst)  # compiles the BLOCK's kernel the first time
    ts = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        copy(src, dst)
        stop.record()
        stop.synchronize()
        ts.append(start.elapsed_time(stop))
    return src.numel() * src.element_size() / (statistics.median(ts) * 1e-3) / 1e9


def calibrate(device: torch.device, target_gbs: float, log: Callable[[str], None]) -> Tuple[PacedCopy, List[tuple]]:
    """The (grid, BLOCK, warps) whose copy alone runs at ``target_gbs`` on the fewest programs (within 5%; else
    the nearest), and the sweep [(grid, block, warps, GB/s)]."""
    if triton is None:
        log("paced copy: Triton is not importable: torch copy_ instead, NOT paced to the link")
        return PacedCopy(0, 0, paced=False), []
    if device.type != "cuda":  # the interpreter's rate means nothing: a small fixed grid, same code path
        return PacedCopy(2, 1024), []
    n = CALIBRATION_MIB << 19
    src = torch.randint(-(1 << 15), 1 << 15, (n,), dtype=torch.int16, device=device)
    dst = torch.empty_like(src)
    sweep = []
    for block, warps in CONFIGS:
        for grid in range(1, MAX_GRID + 1):
            rate = _rate_gbs(PacedCopy(grid, block, warps), src, dst)
            sweep.append((grid, block, warps, rate))
            if rate > 1.5 * target_gbs:  # the rate grows with the grid: the rest overshoots
                break
    if not torch.equal(src, dst):
        raise SystemExit("paced copy: the calibration copy is not exact (CHECK FAILED)")
    near = [c for c in sweep if abs(c[3] - target_gbs) <= NEAR * target_gbs]
    grid, block, warps, rate = (min(near, key=lambda c: (c[0], abs(c[3] - target_gbs))) if near
                                else min(sweep, key=lambda c: abs(c[3] - target_gbs)))
    del src, dst
    torch.cuda.empty_cache()
    off = abs(rate - target_gbs) / target_gbs
    log(f"paced copy: calibrated {len(sweep)} (grid, BLOCK, warps) on {CALIBRATION_MIB} MiB; kept {grid} programs of "
        f"{warps} warps x {block} int16: {rate:.0f} GB/s alone against a target of {target_gbs:.0f} GB/s "
        f"({off:.1%} off)"
        + ("" if off <= 0.10 else "  WARNING: more than 10% off the target"))
    return PacedCopy(grid, block, warps, rate), sweep


def carveout_setter() -> Optional[Callable[[Optional[int]], None]]:
    """torch's SM carveout for cuBLASLt matmuls (``torch._C._set_sm_carveout_experimental``), or None."""
    return getattr(torch._C, "_set_sm_carveout_experimental", None)
