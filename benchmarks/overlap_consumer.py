"""overlap.py's consumer: a DeepSeek-V3-shaped MoE stand-in that one emulated rank runs per chunk of gathered
rows. A part of overlap.py; overlapped_boundary.py runs the same stand-in on every rank.

DeepSeek-V3's config.json: hidden_size 7168, moe_intermediate_size 2048, n_routed_experts 256,
num_experts_per_tok 8, n_shared_experts 1. Per chunk ``x [rows, H]`` -> partials ``out [rows, H]`` (bf16):

* the shared expert, whole: gate_up ``[rows, 7168] x [7168, 2*2048]``, SiLU(gate) * up, down
  ``[rows, 2048] x [2048, 7168]`` written into ``out``;
* the routed experts this rank holds, EP-split over the cp ranks (256 / cp experts), with balanced routing:
  each local expert gets ``ceil(rows * 8 / 256)`` of the chunk's rows (a fixed random choice per chunk
  size), so the rank does ``rows * 8 / cp`` expert passes. The grouped GEMM is two ``torch.bmm`` over the
  experts (gate_up, then down after SiLU * up), between the permutation (``index_select``) and the
  weighted combine into ``out`` (``index_add_``). Every call reads all the rank's expert weights, as a
  grouped GEMM does.

FLOPs per chunk: (rows + experts * rows_per_expert) * 6 * H * I. The routing is fixed, not learned: the
stand-in has a MoE's shapes, FLOPs and bytes, not its values.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, Tuple

import torch
import torch.nn.functional as F

import harness  # noqa: E402  (the benchmarks folder is the running script's: on the path)

harness.part_of("overlap.py", __name__)  # run as a script, it says which script to run


@dataclasses.dataclass(frozen=True)
class MoeShape:
    hidden: int = 7168
    inter: int = 2048
    routed: int = 256
    topk: int = 8


DEEPSEEK_V3 = MoeShape()
SMOKE = MoeShape(hidden=256, inter=64, routed=16, topk=4)  # CPU smoke runs: the same calls, tiny


class Consumer:
    """The MoE stand-in of one rank of ``cp``: its weights (random, scaled to keep activations O(1))."""

    def __init__(self, shape: MoeShape, cp: int, device: torch.device, dtype=torch.bfloat16, seed: int = 0):
        if shape.routed % cp:
            raise SystemExit(f"{shape.routed} routed experts do not split over cp = {cp} ranks")
        self.shape, self.cp, self.device, self.dtype = shape, cp, device, dtype
        self.experts = shape.routed // cp
        H, I = shape.hidden, shape.inter
        g = torch.Generator(device=device).manual_seed(seed)

        def weight(*size, fan_in):
            w = torch.randn(size, generator=g, device=device, dtype=dtype)
            return w.mul_(1.0 / math.sqrt(fan_in))

        self.w_gate_up = weight(H, 2 * I, fan_in=H)
        self.w_down = weight(I, H, fan_in=I)
        self.w1 = weight(self.experts, H, 2 * I, fan_in=H)
        self.w2 = weight(self.experts, I, H, fan_in=I)
        self._routes: Dict[int, Tuple[torch.Tensor, torch.Tensor, int]] = {}

    @property
    def weight_bytes(self) -> int:
        return sum(w.numel() * w.element_size() for w in (self.w_gate_up, self.w_down, self.w1, self.w2))

    def rows_per_expert(self, rows: int) -> int:
        return math.ceil(rows * self.shape.topk / self.shape.routed)

    def flops(self, rows: int) -> float:
        expert_rows = self.experts * self.rows_per_expert(rows) if rows else 0
        return (rows + expert_rows) * 6.0 * self.shape.hidden * self.shape.inter

    def route(self, rows: int) -> Tuple[torch.Tensor, torch.Tensor, int]:
        """(row index of every expert slot, its combine weight, rows per expert) for a chunk of ``rows``."""
        if rows not in self._routes:
            rpe = self.rows_per_expert(rows)
            slots = self.experts * rpe
            g = torch.Generator().manual_seed(rows)
            perms = [torch.randperm(rows, generator=g) for _ in range(math.ceil(slots / rows))]
            idx = torch.cat(perms)[:slots].to(self.device)
            wts = torch.rand(slots, 1, generator=g).to(self.device, self.dtype)
            self._routes[rows] = (idx, wts, rpe)
        return self._routes[rows]

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """``out [rows, H]`` = the shared expert of ``x [rows, H]`` + its routed experts' weighted sum."""
        rows = x.shape[0]
        if rows == 0:
            return
        I = self.shape.inter
        gu = torch.mm(x, self.w_gate_up)
        torch.mm(F.silu(gu[:, :I]) * gu[:, I:], self.w_down, out=out)
        idx, wts, rpe = self.route(rows)
        xp = x.index_select(0, idx).view(self.experts, rpe, -1)
        g = torch.bmm(xp, self.w1)
        y = torch.bmm(F.silu(g[..., :I]) * g[..., I:], self.w2).view(self.experts * rpe, -1)
        out.index_add_(0, idx, y.mul_(wts))
