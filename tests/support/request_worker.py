"""Rank side of tests/collectives/test_request.py: the call record on a gloo world."""

from typing import Dict, Optional

import torch

import nsa_cp
from nsa_cp.planning import plan
from nsa_cp.planning.request import Request
from boundary_cases import _expect_value_error as _raises


def run_request_checks(rank: int, world: int, payload: dict) -> Dict[str, Optional[str]]:
    counts = [5 + q for q in range(world)]
    layout = nsa_cp.ShardLayout(counts)
    x = torch.randn(counts[rank], 256, generator=torch.Generator().manual_seed(3 + rank))
    out: Dict[str, Optional[str]] = {}
    # a quantization nsa_cp does not know is refused, never taken for the FP8 wire
    out["bad-quant"] = _raises(lambda: nsa_cp.cp_all_gather(x, layout, quant="int8"), ["quant", "int8"]) or _raises(
        lambda: nsa_cp.fused_add_rmsnorm_all_gather(x, None, torch.ones(256), 1e-6, layout, quant="fp8"), ["quant", "fp8"])
    # the record never raises; the call names the tensor
    req = Request.of("cp_all_gather", [1, 2], layout, None)
    out["not-a-tensor"] = (None if req.row_shape is None else "Request.of read a shape off a list") or _raises(
        lambda: nsa_cp.cp_all_gather([1, 2], layout), ["x: expected a torch.Tensor", "list"])
    # the request is the cache key: an equal call finds the same plan, a different choice another
    a = plan.lookup(Request.of("cp_all_gather", x, nsa_cp.ShardLayout(counts), None))
    b = plan.lookup(Request.of("cp_all_gather", x, nsa_cp.ShardLayout(list(counts)), None))
    c = plan.lookup(Request.of("cp_all_gather", x, layout, None, compact=True))
    out["cache-key"] = None if (a is b and a is not c) else f"plans: equal {a is b}, compact differs {a is not c}"
    return out
