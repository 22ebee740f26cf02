"""What the P2P checks share (tests/p2p_*_cases.py): layouts of every kind, the poisoning, one gather or
reduce-scatter through a runner built for the call, the fault checks' small transport, and comparisons."""

from __future__ import annotations

import random
from typing import Optional

import torch
import torch.distributed as dist

import nsa_cp
from nsa_cp.rows import reference
from nsa_cp.transport import p2p

from oracles import expected_gather, gen


def random_layout(rng: random.Random, world: int, max_tokens: int) -> "nsa_cp.ShardLayout":
    kind = rng.choice(["random", "zeros", "even", "empty", "full"])
    if kind == "random":
        counts = [rng.randint(0, max_tokens) for _ in range(world)]
    elif kind == "zeros":
        counts = [rng.choice([0, rng.randint(1, max_tokens)]) for _ in range(world)]
    elif kind == "even":
        counts = [rng.randint(1, max_tokens)] * world
    elif kind == "empty":
        counts = [0] * world
    else:
        counts = [max_tokens] + [rng.randint(0, max_tokens) for _ in range(world - 1)]
    return nsa_cp.ShardLayout(counts)


def poison(*tensors) -> None:
    """Fill with NaN, so that every row of the next result must be written by that call. Then every
    rank syncs and meets on the host: with double buffering a peer may write into our gather buffer
    without waiting for our entry signal (nothing of ours reads it any more), so a fill still queued on
    our stream could land on its rows. Real callers never write into the gather buffers."""
    for t in tensors:
        t.fill_(float("nan"))
    torch.cuda.synchronize()
    dist.barrier()


def run_gather(transport, x, layout, compact, engine="auto", device_counts=None):
    """One gather through a runner built for this call (what the plan layer caches)."""
    return transport.gather_runner(layout, compact, tuple(x.shape[1:]), engine=engine)(x, device_counts)


def run_scatter(transport, y, layout, compact, out=None, device_counts=None):
    return transport.reduce_scatter_runner(layout, compact, tuple(y.shape[1:]))(y, out, device_counts)


def layout_cases(world: int, max_tokens: int, seed: int):
    """One layout of every kind (zero-token ranks, even, empty, at capacity), then random ones."""
    rng = random.Random(seed)
    out = [nsa_cp.ShardLayout([rng.randint(0, max_tokens) for _ in range(world)]),
           nsa_cp.ShardLayout([0] + [rng.randint(1, max_tokens) for _ in range(world - 1)]),
           nsa_cp.ShardLayout([rng.randint(1, max_tokens)] * world),
           nsa_cp.ShardLayout([0] * world),
           nsa_cp.ShardLayout([max_tokens] + [rng.randint(0, max_tokens) for _ in range(world - 1)])]
    return out + [random_layout(rng, world, max_tokens) for _ in range(2)]


def norm_inputs(seed, layout, hidden, dtype, weight_dtype, with_residual):
    """Every rank's x and residual (derived from seeds on every rank), the weight, and the reference:
    (y rows per rank, residual after the call per rank)."""
    xs = [gen(seed, q, n, (hidden,), dtype, "cpu") for q, n in enumerate(layout.per_rank_actual_token)]
    rs = [gen(seed + 1, q, n, (hidden,), dtype, "cpu") if with_residual else None
          for q, n in enumerate(layout.per_rank_actual_token)]
    weight = (1.0 + 0.25 * gen(seed + 2, 0, 1, (hidden,), torch.float32, "cpu")[0]).to(weight_dtype)
    ys, r_after = [], []
    for x, r in zip(xs, rs):
        r_ref = None if r is None else r.clone()
        y, _ = reference.fused_add_rmsnorm(x, r_ref, weight, EPS)
        ys.append(y)
        r_after.append(r_ref)
    return xs, rs, weight, ys, r_after


EPS = 1e-6


def close_to(got: torch.Tensor, want: torch.Tensor, dtype) -> Optional[str]:
    """y of the fused stage against the reference: one rounding of the same fp32 value, up to the order
    of the sum of squares (a relative error of about one ulp of the dtype)."""
    rtol = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10, torch.float32: 1e-5}[dtype]
    got, want = got.double(), want.double()
    if not torch.isfinite(got).all():
        return "non-finite values (unwritten rows?)"
    err = ((got - want).abs() - rtol * want.abs()).max().item() if got.numel() else 0.0
    return None if err <= 1e-6 else f"max error beyond rtol {rtol}: {err:.3g}"


def random_positions(seed: int, total: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(total, generator=g).to(torch.int64).to(device)


# ---- faults at any world size (tests/transports/test_p2p_faults.py): every surviving rank gets the documented error
# within the timeout, nothing wrong is written, the broken transport refuses further calls, a new one works
def fault_transport(device, timeout_ms, double_buffer_tokens=None, group=None, check_layout=True):
    return p2p.P2PTransport(group, 32, 256, torch.bfloat16, device, timeout_ms=timeout_ms,
                            double_buffer_tokens=double_buffer_tokens, check_layout=check_layout)


def fault_layout(world):
    return nsa_cp.ShardLayout([8 + (q % 3) for q in range(world)])


def raises(fn, cls, words=()) -> Optional[str]:
    """None when fn() raises cls whose text holds every word; else what happened."""
    try:
        fn()
    except cls as err:
        missing = [w for w in words if w not in str(err)]
        return f"{cls.__name__} without {missing}: {err}" if missing else None
    except Exception as err:  # noqa: BLE001 - reported as the wrong error
        return f"expected {cls.__name__}, got {type(err).__name__}: {err}"
    return f"expected {cls.__name__}, nothing raised"


def good_gather(transport, rank, world, device, seed) -> Optional[str]:
    """One exact gather (both layouts) on a healthy transport."""
    layout = fault_layout(world)
    for compact in (False, True):
        shards = [gen(seed, q, n, (256,), torch.bfloat16, "cpu") for q, n in enumerate(layout.per_rank_actual_token)]
        poison(*transport._gathers)
        got = run_gather(transport, shards[rank].to(device), layout, compact, "sm").clone()
        torch.cuda.synchronize()
        transport.check_error()
        if not torch.equal(got.cpu(), expected_gather(shards, layout, compact)):
            return f"gather (compact={compact}) on a new transport differs"
    return None
