"""Rank-side checks of nsa_cp's own NCCL communicator that run on gloo (tests/transports/test_nccl_native.py).

``EmulatedNative`` stands in for ``NativeNccl``: it takes the same arguments (byte / element counts and
offsets computed by ``Collectives``) and does the movement with torch.distributed on views, so the
arithmetic that turns rows into NCCL's counts and offsets is checked against torch's own path on CPU.
"""

from __future__ import annotations

import traceback
from typing import Dict, Optional

import torch
import torch.distributed as dist


class EmulatedNative:
    """NativeNccl's entries, done with gloo on the views its byte/element arguments name."""

    def __init__(self, group):
        self.group, self.calls = group, []

    def all_gather(self, out, shard):
        self.calls.append("all_gather")
        dist.all_gather_into_tensor(out, shard.clone(), group=self.group)

    def reduce_scatter(self, out, full):
        self.calls.append("reduce_scatter")
        dist.reduce_scatter_tensor(out, full, group=self.group)

    def all_gather_rows(self, out, shard, counts, offsets, row_bytes):
        # what NcclComm.all_gather_v does: one broadcast per rank with rows, rooted there
        self.calls.append("all_gather_rows")
        flat, rank = out.view(torch.uint8).view(-1), self.group.rank()
        for q, (c, o) in enumerate(zip(counts, offsets)):
            if c:
                if q == rank:
                    flat[o:o + c].copy_(shard.contiguous().view(torch.uint8).view(-1))
                view = flat[o:o + c]
                dist.broadcast(view, src=q, group=self.group)

    def reduce_scatter_rows(self, out, full, counts, offsets):
        # NcclComm.reduce_scatter_v: one reduce per rank with rows, rooted there
        self.calls.append("reduce_scatter_rows")
        flat, rank = full.view(-1), self.group.rank()
        for q, (c, o) in enumerate(zip(counts, offsets)):
            if c:
                part = flat[o:o + c].clone()
                dist.reduce(part, dst=q, group=self.group)
                if q == rank:
                    out.view(-1).copy_(part)


def run_checks(rank: int, world: int, payload: dict) -> Dict[str, Optional[str]]:
    import nsa_cp
    from nsa_cp.transport.dist.collectives import Collectives

    group = dist.group.WORLD
    results: Dict[str, Optional[str]] = {}

    def check(name, fn):
        try:
            results[name] = fn()
        except Exception:
            results[name] = traceback.format_exc()
        dist.barrier()

    def refused():
        reason = nsa_cp.nccl_unavailable_reason(group)
        if not reason:
            return "nccl_unavailable_reason: empty on a gloo group of CPU tensors"
        try:
            nsa_cp.init_nccl(group)
        except RuntimeError as err:
            if reason not in str(err):
                return f"init_nccl raised {err!r}, which does not carry the reason {reason!r}"
        else:
            return "init_nccl succeeded on a gloo group"
        if nsa_cp.transport.get_nccl(group) is not None:
            return "a refused init_nccl registered a communicator"
        return None

    def rows_arithmetic():
        for counts in ([3, 0, 5, 1, 2, 7, 0, 4][:world], [0] * world, [2] * world):
            layout = nsa_cp.ShardLayout(counts)
            rows = [layout.rows(q, compact=True) for q in range(world)]
            for dtype, shape in ((torch.bfloat16, (6,)), (torch.float32, (2, 3)), (torch.uint8, (5,))):
                emulated = EmulatedNative(group)
                native = Collectives(group, emulated)

                def rank_rows(q, n, salt):  # rank q's random rows, the same wherever they are made
                    gen = torch.Generator().manual_seed(1000 * salt + q)
                    return (torch.randn((n, *shape), generator=gen) * 4).to(dtype)

                got = torch.full((layout.total_len, *shape), 7, dtype=dtype)
                native.all_gather_rows(got, rank_rows(rank, counts[rank], 1), rows)
                want = torch.cat([rank_rows(q, counts[q], 1) for q in range(world)])
                if not torch.equal(got, want):
                    return f"all_gather_rows {counts} {dtype} {shape}: rows not where the layout puts them"
                if dtype == torch.uint8:
                    continue
                got = torch.full((counts[rank], *shape), float("nan"), dtype=dtype)
                native.reduce_scatter_rows(got, rank_rows(rank, layout.total_len, 2), rows)
                start, stop = rows[rank]
                exact = sum(rank_rows(q, layout.total_len, 2)[start:stop].double() for q in range(world))
                if not torch.allclose(got.double(), exact, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-2):
                    return f"reduce_scatter_rows {counts} {dtype} {shape}: not the sum of this rank's rows"
                want_calls = ["all_gather_rows", "reduce_scatter_rows"]
                if emulated.calls != want_calls:
                    return f"native entries called {emulated.calls}, expected {want_calls}"
        return None

    def padded_scatter_by_rows():
        # with a native communicator the padded reduce-scatter sums each rank's real rows straight into
        # the result (grouped reduces at offsets q * M): against the fp64 sum, NaN-poisoned output
        from nsa_cp.transport.dist import moves as algorithms
        from nsa_cp.planning.request import Request

        for counts in ([3, 0, 5, 1, 2, 7, 0, 4][:world], [0] * world, [2] * world, [4] + [0] * (world - 1)):
            layout = nsa_cp.ShardLayout(counts)
            emulated = EmulatedNative(group)
            req = Request.of("cp_reduce_scatter", torch.empty(0, 1), layout, group)
            run = algorithms.scatter_runner(Collectives(group, emulated), req, rank, "padded")
            full = [torch.randn((layout.padded_len, 6), generator=torch.Generator().manual_seed(50 + q))
                    for q in range(world)]
            out = torch.full((counts[rank], 6), float("nan"))
            got = run(full[rank], out, None, None)
            start = rank * layout.max_rank_len
            exact = sum(f[start:start + counts[rank]].double() for f in full)
            if got is not out or not torch.allclose(got.double(), exact, rtol=1e-5, atol=1e-5):
                return f"padded reduce-scatter by rows {counts}: not this rank's summed rows"
            if layout.total_len and not layout.is_even and emulated.calls != ["reduce_scatter_rows"]:
                return f"padded reduce-scatter {counts}: native entries called {emulated.calls}"
        return None

    def env_turns_it_off():
        import os

        saved = os.environ.get("NSA_CP_NCCL_CALL")
        try:
            for value, want in (("auto", True), ("direct", False), ("public", False)):
                os.environ["NSA_CP_NCCL_CALL"] = value
                if (Collectives(group, EmulatedNative(group)).native is not None) != want:
                    return f"NSA_CP_NCCL_CALL={value}: native {'not ' if want else ''}taken"
        finally:
            if saved is None:
                os.environ.pop("NSA_CP_NCCL_CALL", None)
            else:
                os.environ["NSA_CP_NCCL_CALL"] = saved
        return None

    def cpu_plans_never_native():
        layout = nsa_cp.ShardLayout([rank + 2 for rank in range(world)])
        from nsa_cp.planning.request import Request
        from nsa_cp.transport.dist.provider import DistTransport

        req = Request.of("cp_all_gather", torch.empty(layout.count(rank), 4), layout, group)
        coll, _ = DistTransport(group)._collectives(req, "padded")
        return None if coll.native is None else f"a CPU plan took {coll.native!r} ({layout})"

    check("refused", refused)
    check("rows_arithmetic", rows_arithmetic)
    check("padded_scatter", padded_scatter_by_rows)
    check("env", env_turns_it_off)
    check("cpu_plans", cpu_plans_never_native)
    return results
