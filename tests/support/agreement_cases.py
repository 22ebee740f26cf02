"""Workers of tests/collectives/test_agreement_gloo.py and test_agreement_gpu.py: ranks that disagree on a call
of the torch.distributed path, without ``validate=``, raise LayoutMismatchError on every rank (host-visible:
in that call, naming the argument), or with the device check get a NaN result and the next call raises.

A case is ``(id, field, call)``: ``call(rank, world, device, out)`` makes one public call whose arguments
depend on the rank (the last rank disagrees); ``field`` is the argument the message must name. After every
case the ranks make one agreeing call, which must equal the same call with the check off, bit for bit.
"""

from __future__ import annotations

import os
import traceback

import torch

H = 256  # two FP8 groups of 128


def _x(n, device, dtype=torch.float32, h=H, seed=0):
    g = torch.Generator().manual_seed(seed + n)
    return torch.randn(n, h, generator=g).to(dtype).to(device)


def _nan(shape, dtype, device):
    """A result buffer filled with NaN (0xFF bytes for FP8) before the call: nothing stale passes."""
    if dtype == torch.float8_e4m3fn:
        return torch.full(shape, 0xFF, dtype=torch.uint8, device=device).view(dtype)
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _counts(world, last):
    """Counts of ``world`` ranks whose max is 6, the last rank holding ``last`` (one rank: ``[last]``)."""
    return [6] + [4] * (world - 2) + [last] if world > 1 else [last]


def cases(world):
    """``(id, field, call)`` for ``world`` ranks; ``mine(rank, a, b)`` picks ``b`` on the last rank."""
    import nsa_cp

    def mine(rank, a, b):
        return b if rank == world - 1 else a

    def gather(layout_a, layout_b, **kw):
        def call(rank, device):
            layout = nsa_cp.ShardLayout(mine(rank, layout_a, layout_b))
            return nsa_cp.cp_all_gather(_x(layout.count(rank), device), layout, **kw)
        return call

    def scatter(layout_a, layout_b, compact_a=False, compact_b=False):
        def call(rank, device):
            layout = nsa_cp.ShardLayout(mine(rank, layout_a, layout_b))
            compact = mine(rank, compact_a, compact_b)
            return nsa_cp.cp_reduce_scatter(_x(layout.global_len(compact), device), layout, compact=compact)
        return call

    base, same_max, other_max = _counts(world, 5), _counts(world, 3), _counts(world, 8)
    zero = [0] * world

    def quant(rank, device):
        layout = nsa_cp.ShardLayout(base)
        q = mine(rank, "fp8_e4m3_g128", "fp8_e4m3_g128_ue8m0")
        return nsa_cp.cp_all_gather(_x(layout.count(rank), device), layout, quant=q)

    def compact(rank, device):
        layout = nsa_cp.ShardLayout(base)
        return nsa_cp.cp_all_gather(_x(layout.count(rank), device), layout, compact=mine(rank, False, True))

    def row(rank, device):
        layout = nsa_cp.ShardLayout(base)
        return nsa_cp.cp_all_gather(_x(layout.count(rank), device, h=mine(rank, H, 2 * H)), layout)

    def dtype(rank, device):
        layout = nsa_cp.ShardLayout(base)
        return nsa_cp.cp_all_gather(_x(layout.count(rank), device, mine(rank, torch.float32, torch.bfloat16)), layout)

    def positions(rank, device):
        layout = nsa_cp.ShardLayout(base)
        pos = torch.arange(layout.total_len, device=device).flip(0) if rank == world - 1 else None
        return nsa_cp.cp_all_gather(_x(layout.count(rank), device), layout, compact=True, positions=pos)

    def kind(rank, device):  # a gather on some ranks, a reduce-scatter on the last
        layout = nsa_cp.ShardLayout(base)
        if rank == world - 1:
            return nsa_cp.cp_reduce_scatter(_x(layout.padded_len, device), layout)
        return nsa_cp.cp_all_gather(_x(layout.count(rank), device), layout)

    def norm(rank, device):
        layout = nsa_cp.ShardLayout(base)
        n = layout.count(rank)
        return nsa_cp.fused_add_rmsnorm_all_gather(
            _x(n, device), _x(n, device, seed=1), torch.ones(H, device=device), 1e-6, layout,
            quant=mine(rank, "fp8_e4m3_g128", None))

    return [
        ("counts-same-max", "layout", gather(base, same_max)),
        ("max-rank-len", "layout", gather(base, other_max)),
        ("zero-token-rank", "layout", gather(base, base[:-1] + [0])),
        ("no-tokens-anywhere-on-one-rank", "layout", gather(base, zero)),
        ("quant", "quant", quant),
        ("compact", "compact", compact),
        ("row-shape", "x", row),
        ("dtype", "x", dtype),
        ("positions", "positions", positions),
        ("gather-vs-reduce-scatter", "call", kind),
        ("norm-quant", "quant", norm),
        ("reduce-scatter-counts", "layout", scatter(base, same_max)),
        ("reduce-scatter-max", "layout", scatter(base, other_max)),
        ("reduce-scatter-compact", "compact", scatter(base, base, False, True)),
    ]


def _agreeing(rank, world, device):
    """One agreeing call of each kind, with NaN-filled outputs: results as tuples of tensors."""
    import nsa_cp

    layout = nsa_cp.ShardLayout(_counts(world, 5))
    x = _x(layout.count(rank), device, seed=7)
    out = _nan((layout.padded_len, H), torch.float32, device)
    got = [nsa_cp.cp_all_gather(x, layout, out=out)]
    got += list(nsa_cp.cp_all_gather(x, layout, quant="fp8_e4m3_g128", compact=True))
    got.append(nsa_cp.cp_reduce_scatter(_x(layout.padded_len, device, seed=9), layout,
                                        out=_nan((layout.count(rank), H), torch.float32, device)))
    return got


def _bits(t):
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def run_host(rank, world, payload):
    """Every case raises LayoutMismatchError naming its field on every rank, in that call; an agreeing call
    after each equals the call with the check off, bit for bit."""
    import nsa_cp

    device = torch.device(payload.get("device", "cpu"))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ["NSA_CP_AGREEMENT"] = "off"
    reference = _agreeing(rank, world, device)
    os.environ["NSA_CP_AGREEMENT"] = payload.get("mode", "auto")
    results = {}
    for case_id, field, call in cases(world):
        try:
            call(rank, device)
            results[case_id] = f"rank {rank}: no error"
        except nsa_cp.LayoutMismatchError as err:
            text = str(err)
            results[case_id] = None if f"disagree on {field}" in text else f"rank {rank}: not naming {field}: {text}"
        except Exception:  # noqa: BLE001
            results[case_id] = f"rank {rank}: not a LayoutMismatchError:\n{traceback.format_exc()}"
        got = _agreeing(rank, world, device)
        if not all(torch.equal(_bits(a), _bits(b)) for a, b in zip(got, reference)):
            results[case_id] = (results[case_id] or "") + f"\nrank {rank}: the agreeing call after it differs"
    return results


def run_device(rank, world, payload):
    """The device check forced on a gloo group (Triton's interpreter on CPU, or the GPU): each case's result is
    NaN on every rank (FP8: its scales), the next call raises naming the field, the call after it is clean."""
    import nsa_cp
    from nsa_cp.transport.dist import agreement

    device = torch.device(payload.get("device", "cpu"))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    agreement.FORCE_DEVICE_CHECK = True
    reference = _agreeing(rank, world, device)
    results = {}
    for case_id, field, call in cases(world):
        if case_id not in (DEVICE_CASES_CUDA if device.type == "cuda" else DEVICE_CASES):
            continue
        problems = []
        try:
            got = call(rank, device)
            poisoned = got[1] if isinstance(got, tuple) else got
            if device.type == "cuda":
                torch.cuda.synchronize()
            if poisoned.numel() and not torch.isnan(poisoned.float()).all():
                problems.append("the result is not all NaN")
        except nsa_cp.LayoutMismatchError as err:
            problems.append(f"raised in the call itself: {err}")
        except Exception:  # noqa: BLE001  (sizes that differ: gloo's own error is no hang, and no silent result)
            problems.append(f"not a LayoutMismatchError:\n{traceback.format_exc()}")
        try:
            _agreeing(rank, world, device)
            problems.append("the next call did not raise")
        except nsa_cp.LayoutMismatchError as err:
            if f"disagree on {field}" not in str(err) and field not in str(err):
                problems.append(f"the next call's error does not name {field}: {err}")
        got = _agreeing(rank, world, device)
        if not all(torch.equal(_bits(a), _bits(b)) for a, b in zip(got, reference)):
            problems.append("the agreeing call after the error differs from before")
        results[case_id] = "\n".join(f"rank {rank}: {p}" for p in problems) or None
    return results


# the device check needs every rank to run the same collectives of the same sizes (NCCL: docs/design.md)
DEVICE_CASES = ("counts-same-max", "quant", "compact", "positions", "reduce-scatter-counts", "reduce-scatter-compact")
# on CUDA a compact reduce-scatter takes the coalesced movement (uneven-list reduces) where the padded one
# takes one equal-shard reduce-scatter: other collectives, which gloo aborts a rank on (and NCCL hangs on)
DEVICE_CASES_CUDA = tuple(c for c in DEVICE_CASES if c != "reduce-scatter-compact")


def gloo_cuda_probe(device) -> str:
    """'' when this gloo group moves CUDA tensors in the path's collectives, else why not (the test skips)."""
    import torch.distributed as dist

    try:
        x = torch.ones(4, device=device)
        out = torch.empty(4 * dist.get_world_size(), device=device)
        dist.all_gather_into_tensor(out, x)
        dist.reduce_scatter_tensor(x, out)
    except RuntimeError as err:
        return f"gloo here does not move CUDA tensors in an equal-shard collective: {err}"
    return ""


def run_shared_gpu(rank, world, payload):
    """Ranks sharing cuda:0 over gloo: the host-visible check (``kind`` "host") or the device check forced
    (``kind`` "device": the kernel on the GPU, the pinned record copy), as on CPU."""
    from dist_harness import rank_device

    device = rank_device(rank)
    torch.cuda.set_device(device)
    why = gloo_cuda_probe(device)
    if why:
        return {"__skip__": why}
    fn = run_host if payload["kind"] == "host" else run_device
    return fn(rank, world, {**payload, "device": str(device)})


def run_one_rank(rank, world, payload):
    """NCCL with one rank (one GPU): the check's every part on the device, where no rank can disagree. The
    same calls with NSA_CP_AGREEMENT off / auto / separate are bitwise equal and finite; a mismatch recorded by
    an earlier call (set here by hand, as the kernel sets it) poisons the next result with NaN (FP8: its
    scales), the call after raises naming the field, and the one after that is clean again; the kernel wrote
    the record to its pinned host copy through the copy's device mapping."""
    import nsa_cp
    from nsa_cp.rows.kernels.agree import SET_BIT
    from nsa_cp.transport.dist import agreement

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    results = {}
    got = {}
    for mode in ("off", "auto", "separate"):
        os.environ["NSA_CP_AGREEMENT"] = mode
        got[mode] = [t.clone() for t in _agreeing(rank, world, device)]
    bad = [m for m in ("auto", "separate") if not all(torch.equal(_bits(a), _bits(b)) for a, b in zip(got["off"], got[m]))]
    results["modes-bitwise"] = f"{bad} differ from off" if bad else None
    finite = all(bool(torch.isfinite(t.float()).all()) for t in got["auto"])
    results["modes-finite"] = None if finite else "a result of an agreeing call is not finite"
    for mode in ("auto", "separate"):
        os.environ["NSA_CP_AGREEMENT"] = mode
        layout = nsa_cp.ShardLayout([5], align=8)
        x = _x(5, device)
        nsa_cp.cp_all_gather(x, layout, quant="fp8_e4m3_g128")  # the plan and its record exist
        record = agreement._RECORDS[(torch.distributed.group.WORLD, device)]
        record.device.fill_(SET_BIT | 1 << 1)  # bit 1: "layout" (Request.fields' second name)
        q, scale = nsa_cp.cp_all_gather(x, layout, quant="fp8_e4m3_g128")
        torch.cuda.synchronize()
        problems = [] if torch.isnan(scale).all() else ["the scales were not poisoned"]
        try:
            nsa_cp.cp_all_gather(x, layout)
            problems.append("the next call did not raise")
        except nsa_cp.LayoutMismatchError as err:
            if "layout" not in str(err):
                problems.append(f"the error does not name layout: {err}")
        clean = nsa_cp.cp_all_gather(x, layout)
        if not torch.equal(clean[:5], x):
            problems.append("the call after the error is not the plain gather")
        results[f"poison-then-raise-{mode}"] = "; ".join(problems) or None
        # the kernel wrote the record to its pinned host copy itself (no copy after each check)
        results[f"record-mapped-{mode}"] = None if record.mapped else "the record's host copy was not reachable"
    return results


def run_overlap_chunk_rows(rank, world, payload):
    """cp_overlapped_boundary over gloo, without validate=: ranks passing different ``chunk_rows`` raise
    LayoutMismatchError naming it on every rank (before any transfer, never a timeout); the call after it,
    agreeing, gives the sum."""
    import nsa_cp

    layout = nsa_cp.ShardLayout(_counts(world, 5))
    x = torch.ones(layout.count(rank), 16)
    results = {}
    try:
        nsa_cp.cp_overlapped_boundary(x, layout, lambda rows, chunk: rows, chunk_rows=2 if rank == world - 1 else 3,
                                      timeout_ms=60000)
        results["chunk-rows"] = f"rank {rank}: no error"
    except nsa_cp.LayoutMismatchError as err:
        results["chunk-rows"] = None if "disagree on chunk_rows" in str(err) else f"rank {rank}: {err}"
    except Exception:  # noqa: BLE001
        results["chunk-rows"] = f"rank {rank}: not a LayoutMismatchError:\n{traceback.format_exc()}"
    got = nsa_cp.cp_overlapped_boundary(x, layout, lambda rows, chunk: rows, chunk_rows=2)
    results["after"] = None if torch.equal(got, torch.full_like(x, world)) else f"rank {rank}: wrong sum {got}"
    return results
