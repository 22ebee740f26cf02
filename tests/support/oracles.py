"""The oracles the in-group checks share (dist_cases, the P2P cases): seeded inputs every rank can rebuild,
and independent expected results written with plain torch.cat and fp64 sums, never from nsa_cp.rows.reference.
"""

from __future__ import annotations

from typing import List, Optional

import torch

__all__ = ["gen", "expected_gather", "check_sum"]


def gen(seed: int, rank: int, rows: int, rest, dtype, device) -> torch.Tensor:
    """Rank ``rank``'s ``[rows, *rest]`` random input of ``seed`` (the same on every rank that asks)."""
    g = torch.Generator().manual_seed(seed * 131 + rank)
    return torch.randn((rows, *rest), generator=g, dtype=torch.float32).to(dtype).to(device)


def expected_gather(shards, layout, compact: bool) -> torch.Tensor:
    """Every rank's shard concatenated: compact, or padded with zero rows to ``layout.max_rank_len`` each."""
    if compact:
        return torch.cat(shards)
    m = layout.max_rank_len
    pieces = []
    for shard in shards:
        pieces.append(shard)
        pieces.append(torch.zeros((m - shard.shape[0], *shard.shape[1:]), dtype=shard.dtype))
    return torch.cat(pieces)


def check_sum(result: torch.Tensor, partials: List[torch.Tensor], dtype) -> Optional[str]:
    """None when ``result`` is the sum of ``partials`` within ``len(partials)`` ulps of ``dtype`` of the
    fp64 sum of magnitudes, else why not (NaN/inf counts as unwritten rows)."""
    exact = torch.stack([p.double() for p in partials]).sum(0)
    magnitude = torch.stack([p.double().abs() for p in partials]).sum(0)
    eps = torch.finfo(dtype).eps
    bound = len(partials) * eps * magnitude + 1e-30
    got = result.double().cpu()
    if not torch.isfinite(got).all():
        return "reduce-scatter output holds NaN/inf (unwritten rows?)"
    err = (got - exact).abs()
    if (err > bound).any():
        return f"reduce-scatter error {err.max().item():.3g} exceeds bound {bound.max().item():.3g}"
    return None
