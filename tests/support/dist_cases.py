"""Checks of the collectives that run inside a process group (gloo on CPU, NCCL on GPUs).

The parent builds a list of case dicts (``make_cases``); every rank runs all of them (``run_cases``)
and reports ``{case_id: None | error}``. Every rank derives every rank's inputs from the case seed, so
expected results come from an independent oracle (tests/support/oracles.py: plain torch.cat / fp64 sums), not
from nsa_cp.rows.reference. Outputs handed in are poisoned with NaN first, so an unwritten row fails.
"""

from __future__ import annotations

import random
import traceback
from typing import Dict, List, Optional

import torch

from oracles import check_sum as _check_sum, expected_gather as _expected_gather, gen as _gen

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


# --------------------------------------------------------------------------- case lists
def _random_counts(rng: random.Random, world: int) -> List[int]:
    kind = rng.choice(["random", "with_zeros", "one_big", "near_even"])
    if kind == "random":
        return [rng.randint(0, 13) for _ in range(world)]
    if kind == "with_zeros":
        return [rng.choice([0, 0, rng.randint(1, 9)]) for _ in range(world)]
    if kind == "one_big":
        counts = [rng.randint(0, 2) for _ in range(world)]
        counts[rng.randrange(world)] = 17
        return counts
    base = rng.randint(3, 9)
    counts = [base] * world
    counts[rng.randrange(world)] = base - 1
    return counts


def make_cases(
    world: int, seed: int = 0, random_layouts: int = 10, big_layouts: int = 0, gpu: bool = False
) -> List[dict]:
    """Deterministic case list for one world size."""
    rng = random.Random(seed * 1000 + world)
    layouts = [
        ([0] * world, 1),  # all empty
        ([5] * world, 1),  # even
        ([6] * world, 4),  # even counts but align makes padding
        ([4] * world, 4),  # even and aligned
        ([7] + [0] * (world - 1), 1),  # only rank 0 holds tokens
        ([0] * (world - 1) + [3], 2),  # only the last rank
        ([i + 1 for i in range(world)], 1),
    ]
    layouts += [(_random_counts(rng, world), rng.choice([1, 1, 2, 8])) for _ in range(random_layouts)]
    cases = []
    for li, (counts, align) in enumerate(layouts):
        for op in ("gather", "scatter"):
            for compact in (False, True):
                dtype = rng.choice(["bf16", "fp32"])
                rest = rng.choice([(8,), (24,), (3, 5), (2, 4, 6)])
                use_out = rng.random() < 0.5
                algo = rng.choice(["auto", "padded", "coalesced"]) if compact else "auto"
                cases.append(
                    dict(
                        id=f"{op}-L{li}-{'compact' if compact else 'padded'}-{dtype}-{'x'.join(map(str, rest))}"
                        f"-{'out' if use_out else 'new'}-{algo}",
                        op=op, counts=counts, align=align, compact=compact, dtype=dtype,
                        rest=rest, use_out=use_out, algo=algo, seed=rng.randrange(1 << 30),
                    )
                )
    for i in range(big_layouts):  # production-like rows (H=7168) for the CUDA kernels' real block shapes
        counts = [rng.choice([0, rng.randint(1, 300)]) for _ in range(world)]
        for op in ("gather", "scatter"):
            for compact, algo in ((False, "auto"), (True, "padded"), (True, "coalesced")):
                cases.append(dict(id=f"big{i}-{op}-{'compact' if compact else 'padded'}-{algo}",
                                  op=op, counts=counts, align=rng.choice([1, 64]), compact=compact,
                                  dtype="bf16", rest=(7168,), use_out=rng.random() < 0.5, algo=algo,
                                  seed=rng.randrange(1 << 30)))
    # even layout must be bitwise the plain collective with nothing else launched
    for dtype in ("bf16", "fp32"):
        for op in ("gather", "scatter"):
            cases.append(dict(id=f"even-direct-{op}-{dtype}", op=f"even_direct_{op}", counts=[6] * world,
                              align=1, compact=False, dtype=dtype, rest=(16,), use_out=False, algo="auto",
                              seed=rng.randrange(1 << 30)))
    # the communicator: both modes, both layouts, layout=None
    for mode in ("full", "scattered"):
        for compact in (False, True):
            for counts in ([rng.randint(0, 6) for _ in range(world)], [4] * world):
                cases.append(dict(id=f"comm-{mode}-{'compact' if compact else 'padded'}-{'-'.join(map(str, counts))}",
                                  op="communicator", mode=mode, counts=counts, align=1, compact=compact,
                                  dtype="fp32", rest=(32,), use_out=False, algo="auto", seed=rng.randrange(1 << 30)))
    cases.append(dict(id="comm-no-layout", op="communicator", mode="full", counts=None, align=1, compact=False,
                      dtype="fp32", rest=(32,), use_out=False, algo="auto", seed=1))
    for dtype in ("bf16", "fp32"):  # CUDA graphs on GPUs, direct calls on gloo
        cases.append(dict(id=f"bucket-{dtype}", op="bucket", counts=None, align=1, compact=False, dtype=dtype,
                          rest=(64,), use_out=False, algo="auto", seed=rng.randrange(1 << 20)))
    if not gpu:  # on GPUs the transport exists; its own suite (tests/transports/test_p2p_gpu.py) covers it
        cases.append(dict(id="p2p-fallback", op="p2p_fallback", counts=[rng.randint(0, 4) for _ in range(world)],
                          align=1, compact=False, dtype="fp32", rest=(16,), use_out=False, algo="auto", seed=4))
    cases.append(dict(id="validate", op="validate", counts=[rng.randint(0, 5) for _ in range(world)], align=2,
                      compact=False, dtype="fp32", rest=(8,), use_out=True, algo="auto", seed=3))
    cases.append(dict(id="errors", op="errors", counts=[2] + [3] * (world - 1), align=1, compact=False,
                      dtype="fp32", rest=(8,), use_out=True, algo="auto", seed=2))
    return cases


# --------------------------------------------------------------------------- helpers
def _poison(shape, dtype, device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _poison_allocator(device) -> None:
    """Fill freed CUDA cache blocks with NaN so a new_empty output that is not fully written shows NaN."""
    if device.type == "cuda":
        junk = torch.full((64 << 20,), float("nan"), dtype=torch.float32, device=device)
        del junk


# --------------------------------------------------------------------------- one case
def _run_gather(case, rank, world, group, device, nsa_cp) -> Optional[str]:
    dtype = DTYPES[case["dtype"]]
    layout = nsa_cp.ShardLayout(case["counts"], align=case["align"])
    shards = [_gen(case["seed"], q, n, case["rest"], dtype, "cpu") for q, n in enumerate(case["counts"])]
    expected = _expected_gather(shards, layout, case["compact"])
    x = shards[rank].to(device)
    out = _poison(expected.shape, dtype, device) if case["use_out"] else None
    _poison_allocator(device)
    got = nsa_cp.cp_all_gather(x, layout, group, compact=case["compact"], out=out, algo=case["algo"])
    if out is not None and got.data_ptr() != out.data_ptr():
        return "result is not the given out tensor"
    if tuple(got.shape) != tuple(expected.shape) or got.dtype != dtype:
        return f"shape/dtype {tuple(got.shape)} {got.dtype}, expected {tuple(expected.shape)} {dtype}"
    if not torch.equal(got.cpu(), expected):
        bad = (got.cpu() != expected).reshape(expected.shape[0], -1).any(1).nonzero().flatten().tolist()
        return f"gathered rows differ from the oracle at rows {bad[:10]}"
    return None


def _run_scatter(case, rank, world, group, device, nsa_cp) -> Optional[str]:
    dtype = DTYPES[case["dtype"]]
    layout = nsa_cp.ShardLayout(case["counts"], align=case["align"])
    rows = layout.total_len if case["compact"] else layout.padded_len
    partials = [_gen(case["seed"], q, rows, case["rest"], dtype, "cpu") for q in range(world)]
    start, stop = layout.rows(rank, compact=case["compact"])
    n = layout.per_rank_actual_token[rank]
    y = partials[rank].to(device)
    y_before = y.clone()
    out = _poison((n, *case["rest"]), dtype, device) if case["use_out"] else None
    _poison_allocator(device)
    got = nsa_cp.cp_reduce_scatter(y, layout, group, compact=case["compact"], out=out, algo=case["algo"])
    if out is not None and got.data_ptr() != out.data_ptr():
        return "result is not the given out tensor"
    if tuple(got.shape) != (n, *case["rest"]) or got.dtype != dtype:
        return f"shape/dtype {tuple(got.shape)} {got.dtype}, expected {(n, *case['rest'])} {dtype}"
    if not torch.equal(y.cpu(), y_before.cpu()):
        return "the input y was modified"
    return _check_sum(got, [p[start:stop] for p in partials], dtype)


def _run_even_direct(case, rank, world, group, device, nsa_cp) -> Optional[str]:
    """An even layout makes exactly one equal-shard collective on the caller's tensor, no kernel, and the
    result is bitwise torch.distributed's own collective's."""
    import torch.distributed as dist
    from nsa_cp.transport.dist import moves as algorithms
    from nsa_cp.transport.dist.collectives import Collectives

    dtype = DTYPES[case["dtype"]]
    layout = nsa_cp.ShardLayout(case["counts"])
    n = layout.per_rank_actual_token[rank]
    calls = []
    originals = {}

    def spy(name):
        original = getattr(Collectives, name)
        originals[name] = original

        def wrapper(*args, **kwargs):
            # the agreement's fingerprint words (int32, beside the rows: nsa_cp/transport/dist/agreement.py)
            calls.append("fingerprint" if args[1].dtype == torch.int32 else name)
            return original(*args, **kwargs)

        setattr(Collectives, name, wrapper)

    def forbidden(*args, **kwargs):
        raise AssertionError("even layout launched a pack/compact kernel")

    saved = {name: getattr(algorithms, name) for name in ("_fill_cuda", "_fill_reference", "_padded_to_compact",
                                                          "_compact_to_padded")}
    for name in ("all_gather_equal", "reduce_scatter_equal", "all_gather_rows", "reduce_scatter_rows"):
        spy(name)
    for name in saved:
        setattr(algorithms, name, forbidden)
    try:
        if case["op"] == "even_direct_gather":
            x = _gen(case["seed"], rank, n, case["rest"], dtype, device)
            got = nsa_cp.cp_all_gather(x, layout, group)
            direct = _poison(got.shape, dtype, device)
            dist.all_gather_into_tensor(direct, x, group=group)
            expected_calls = ["all_gather_equal"]
        else:
            y = _gen(case["seed"], rank, layout.padded_len, case["rest"], dtype, device)
            got = nsa_cp.cp_reduce_scatter(y, layout, group)
            direct = _poison(got.shape, dtype, device)
            dist.reduce_scatter_tensor(direct, y, group=group)
            expected_calls = ["reduce_scatter_equal"]
    finally:
        for name, original in originals.items():
            setattr(Collectives, name, original)
        for name, original in saved.items():
            setattr(algorithms, name, original)
    if [c for c in calls if c != "fingerprint"] != expected_calls or calls.count("fingerprint") > 1:
        return f"even layout made calls {calls}, expected exactly {expected_calls} (and the fingerprint's, at most one)"
    if not torch.equal(got.view(torch.uint8) if got.dtype != torch.uint8 else got, direct.view(torch.uint8)):
        return "even layout result is not bitwise the direct collective's"
    return None


def _run_communicator(case, rank, world, group, device, nsa_cp) -> Optional[str]:
    hidden = case["rest"][0]
    dtype = DTYPES[case["dtype"]]
    norm1 = nsa_cp.RMSNorm(hidden, eps=1e-5).to(device)
    norm2 = nsa_cp.RMSNorm(hidden, eps=1e-5).to(device)
    g = torch.Generator().manual_seed(case["seed"])
    with torch.no_grad():
        norm1.weight.copy_(torch.rand(hidden, generator=g) + 0.5)
        norm2.weight.copy_(torch.rand(hidden, generator=g) + 0.5)
    comm = nsa_cp.NSACPLayerCommunicator(group, norm1, norm2, mlp_mode=case["mode"], compact=case["compact"])
    counts = case["counts"] if case["counts"] is not None else [3] * world
    layout = nsa_cp.ShardLayout(counts) if case["counts"] is not None else None
    h = [_gen(case["seed"], q, n, (hidden,), dtype, "cpu") for q, n in enumerate(counts)]
    attn = [_gen(case["seed"] + 7, q, n, (hidden,), dtype, "cpu") for q, n in enumerate(counts)]

    def rms(x, w, eps=1e-5):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    with torch.no_grad():
        # the residual is updated in place (the norm convention): hand in copies of the inputs
        hs, res = comm.prepare_attn(h[rank].clone().to(device), None, layout)
        if not torch.equal(res.cpu(), h[rank]):
            return "prepare_attn with residual=None must return the input as residual"
        if not torch.allclose(hs.cpu(), rms(h[rank], norm1.weight.cpu()), rtol=1e-5, atol=1e-5):
            return "prepare_attn norm mismatch"
        hs, res = comm.prepare_mlp(attn[rank].to(device), res, layout)
        summed = [a + b for a, b in zip(attn, h)]
        normed = [rms(s, norm2.weight.cpu()) for s in summed]
        if not torch.allclose(res.cpu(), summed[rank]):
            return "prepare_mlp residual must be x + residual, local"
        if case["mode"] == "full" and layout is not None:
            expected = _expected_gather(normed, layout, case["compact"])
        else:
            expected = normed[rank]
        if tuple(hs.shape) != tuple(expected.shape) or not torch.allclose(hs.cpu(), expected, rtol=1e-5, atol=1e-5):
            return f"prepare_mlp hidden {tuple(hs.shape)} does not match expected {tuple(expected.shape)}"
        # a stand-in MoE: each rank scales by its own factor; the reduce-scatter sums the partials
        partial = hs * (rank + 1)
        out, res2 = comm.postprocess_layer(partial, res, layout)
        if res2.data_ptr() != res.data_ptr():
            return "postprocess_layer must pass the residual through"
        scale = sum(range(1, world + 1)) if (case["mode"] == "full" and layout is not None) else rank + 1
        if tuple(out.shape) != tuple(normed[rank].shape):
            return f"postprocess_layer shape {tuple(out.shape)}, expected {tuple(normed[rank].shape)}"
        if not torch.allclose(out.cpu(), normed[rank] * scale, rtol=1e-5, atol=1e-4):
            return "postprocess_layer sum mismatch"
    return None


def _expect_value_error(fn, words, out: Optional[torch.Tensor] = None) -> Optional[str]:
    snapshot = out.clone() if out is not None else None
    try:
        fn()
    except ValueError as err:
        text = str(err)
        missing = [w for w in words if w not in text]
        if missing:
            return f"ValueError {text!r} does not mention {missing}"
        if out is not None and not torch.equal(out.view(torch.uint8), snapshot.view(torch.uint8)):
            return f"out was written although the call raised ({text})"
        return None
    except Exception as err:  # anything but ValueError is a defect
        return f"expected ValueError mentioning {words}, got {type(err).__name__}: {err}"
    return f"expected ValueError mentioning {words}, nothing raised"


def _run_errors(case, rank, world, group, device, nsa_cp) -> Optional[str]:
    layout = nsa_cp.ShardLayout(case["counts"], align=4)  # padded_len != total_len at every world size
    n = layout.per_rank_actual_token[rank]
    x = _gen(3, rank, n, (8,), torch.float32, device)
    good_out = _poison((layout.padded_len, 8), torch.float32, device)
    y = _gen(4, rank, layout.padded_len, (8,), torch.float32, device)
    rs_out = _poison((n, 8), torch.float32, device)
    checks = [
        (lambda: nsa_cp.cp_all_gather(x[:0] if n else _gen(3, 0, 1, (8,), torch.float32, device), layout, group, out=good_out),
         ["x", "expected", "got"], good_out),
        (lambda: nsa_cp.cp_all_gather(x, layout, group, out=_poison((layout.padded_len + 1, 8), torch.float32, device)),
         ["out", f"[{layout.padded_len}, 8]", f"[{layout.padded_len + 1}, 8]"], None),
        (lambda: nsa_cp.cp_all_gather(x, layout, group, out=good_out.to(torch.float64)), ["out", "dtype"], None),
        (lambda: nsa_cp.cp_all_gather(x, layout, group, compact=True, out=good_out),
         ["out", f"[{layout.total_len}, 8]"], good_out),
        (lambda: nsa_cp.cp_all_gather(x, nsa_cp.ShardLayout(case["counts"] + [1]), group, out=good_out),
         ["layout", "cp_size", str(world + 1)], good_out),
        (lambda: nsa_cp.cp_all_gather(x.reshape(-1), layout, group), ["x", "2 or more"], None),
        (lambda: nsa_cp.cp_all_gather(x, [1, 2], group), ["layout", "ShardLayout"], None),
        (lambda: nsa_cp.cp_all_gather(x, layout, group, compact=True, algo="fast"), ["algo"], None),
        (lambda: nsa_cp.cp_reduce_scatter(y[1:], layout, group, out=rs_out),
         ["y", f"[{layout.padded_len}, 8]", f"[{layout.padded_len - 1}, 8]"], rs_out),
        (lambda: nsa_cp.cp_reduce_scatter(y, layout, group, out=_poison((n + 1, 8), torch.float32, device)),
         ["out", f"[{n}, 8]", f"[{n + 1}, 8]"], None),
        (lambda: nsa_cp.cp_reduce_scatter(y, layout, group, compact=True, out=rs_out),
         ["y", f"[{layout.total_len}, 8]"], rs_out),
        (lambda: nsa_cp.cp_reduce_scatter(y, layout, group, out=rs_out.to(torch.bfloat16)), ["out", "dtype"], None),
        # CUDA tensors: P2P needs init_p2p first; CPU tensors: no init_p2p can help, the message says why
        (lambda: nsa_cp.cp_all_gather(x, layout, group, out=good_out, backend="p2p"),
         ["backend", "init_p2p" if device.type == "cuda" else "cannot serve cpu tensors"], good_out),
        (lambda: nsa_cp.cp_reduce_scatter(y, layout, group, out=rs_out, backend="mpi"), ["backend", "mpi"], rs_out),
    ]
    if device.type == "cuda":
        checks.append((lambda: nsa_cp.cp_all_gather(x, layout, group, out=good_out.cpu()), ["out", "device"], None))
    for i, (fn, words, out) in enumerate(checks):
        problem = _expect_value_error(fn, words, out)
        if problem:
            return f"error check {i}: {problem}"
    return None


def _run_validate(case, rank, world, group, device, nsa_cp) -> Optional[str]:
    """validate=True: disagreement or one rank's bad input makes EVERY rank raise, nobody hangs."""
    from nsa_cp.planning.validation import LayoutMismatchError

    base = nsa_cp.ShardLayout(case["counts"], align=2)
    other = nsa_cp.ShardLayout(case["counts"][:-1] + [case["counts"][-1] + 1], align=2)

    def gather_call(layout, rows, out_rows):
        x = _gen(5, rank, rows, (8,), torch.float32, device)
        out = _poison((out_rows, 8), torch.float32, device)
        return (lambda: nsa_cp.cp_all_gather(x, layout, group, out=out, validate=True)), out

    scenarios = []
    # 1. the last rank holds another layout: everyone raises LayoutMismatchError
    if world > 1:
        mine = other if rank == world - 1 else base
        fn, out = gather_call(mine, mine.per_rank_actual_token[rank], mine.padded_len)
        scenarios.append(("layouts differ", fn, out, LayoutMismatchError, ["rank", "ShardLayout"]))
    # 2. rank 0 passes one row too many: rank 0 raises its ValueError, the others LayoutMismatchError
    fn, out = gather_call(base, base.per_rank_actual_token[rank] + (1 if rank == 0 else 0), base.padded_len)
    want = ValueError if rank == 0 else LayoutMismatchError
    scenarios.append(("bad rows on rank 0", fn, out, want, ["x"] if rank == 0 else ["[0]"]))
    # 3. the same layout, but rank 0 reduce-scatters while the others gather: a different call
    if world > 1:
        if rank == 0:
            y = _gen(6, rank, base.padded_len, (8,), torch.float32, device)
            out = _poison((base.per_rank_actual_token[rank], 8), torch.float32, device)
            fn = lambda: nsa_cp.cp_reduce_scatter(y, base, group, out=out, validate=True)  # noqa: E731
        else:
            fn, out = gather_call(base, base.per_rank_actual_token[rank], base.padded_len)
        scenarios.append(("gather vs reduce-scatter", fn, out, LayoutMismatchError, ["disagree"]))
    for name, fn, out, expected, words in scenarios:
        snapshot = out.clone()
        try:
            fn()
        except Exception as err:  # every rank must raise exactly the expected kind
            if type(err) is not expected:
                return f"{name}: expected {expected.__name__}, got {type(err).__name__}: {err}"
            if any(w not in str(err) for w in words):
                return f"{name}: {type(err).__name__} {err!r} does not mention {words}"
        else:
            return f"{name}: nothing raised"
        if not torch.equal(out.view(torch.uint8), snapshot.view(torch.uint8)):
            return f"{name}: out was written although the call raised"
    # 4. agreement: validation passes and the result is right
    shards = [_gen(7, q, n, (8,), torch.float32, "cpu") for q, n in enumerate(base.per_rank_actual_token)]
    got = nsa_cp.cp_all_gather(shards[rank].to(device), base, group, validate=True)
    if not torch.equal(got.cpu(), _expected_gather(shards, base, False)):
        return "validated gather returned wrong data"
    return None


def _run_bucket(case, rank, world, group, device, nsa_cp) -> Optional[str]:
    """A bucket (max_rank_len fixed) with per-rank counts changed in device tensors between calls.

    On CUDA the two calls are captured once in a CUDA graph and replayed an odd number of times; on
    CPU (gloo) they are called directly with the same tensors, which checks the same semantics."""
    capture = device.type == "cuda"
    m, hidden, dtype = 24, 64, DTYPES[case["dtype"]]
    bucket = nsa_cp.ShardLayout([m] * world)
    counts_dev = torch.full((world,), m, dtype=torch.int32, device=device)
    offsets_dev = torch.arange(world, dtype=torch.int32, device=device) * m
    dc = (counts_dev, offsets_dev)
    x = torch.zeros((m, hidden), dtype=dtype, device=device)
    y = torch.zeros((bucket.padded_len, hidden), dtype=dtype, device=device)

    def calls():
        return (nsa_cp.cp_all_gather(x, bucket, group, device_counts=dc, backend="nccl"),
                nsa_cp.cp_reduce_scatter(y, bucket, group, device_counts=dc, backend="nccl"))

    if capture:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):  # warm up outside capture (kernel compilation, NCCL setup)
            for _ in range(2):
                calls()
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            gathered, reduced = calls()
    rng = random.Random(case["seed"])
    for replay in range(5):
        counts = [rng.randint(0, m) for _ in range(world)]
        shards = [_gen(case["seed"] + replay, q, n, (hidden,), dtype, "cpu") for q, n in enumerate(counts)]
        partials = [_gen(case["seed"] + 50 + replay, q, bucket.padded_len, (hidden,), dtype, "cpu") for q in range(world)]
        counts_dev.copy_(torch.tensor(counts, dtype=torch.int32))
        x.fill_(float("nan"))  # rows past this replay's count must not leak into the result
        x[: counts[rank]].copy_(shards[rank].to(device))
        y.copy_(partials[rank].to(device))
        if capture:
            gathered.fill_(float("nan"))
            reduced.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize(device)
        else:
            gathered, reduced = calls()
        want = torch.cat([torch.cat([s, torch.zeros((m - s.shape[0], hidden), dtype=dtype)]) for s in shards])
        if not torch.equal(gathered.cpu(), want):
            return f"replay {replay} counts {counts}: gathered rows differ"
        n = counts[rank]
        problem = _check_sum(reduced[:n].cpu(), [p[rank * m: rank * m + n] for p in partials], dtype)
        if problem:
            return f"replay {replay} counts {counts}: {problem}"
    return None


def _run_p2p_fallback(case, rank, world, group, device, nsa_cp) -> Optional[str]:
    """The communicator asked for a P2P transport on a gloo group with CPU tensors. Where P2P is
    unavailable (no GPU or no nsa_cp._C: CI) nothing is registered, backend "auto" falls back on every
    rank and backend "p2p" raises RuntimeError with the reason. Where it is available (a GPU machine:
    the ranks then share cuda:0 through CUDA IPC) the transport is registered and the CPU tensors still
    take the gloo path. Either way the gathered rows are exact."""
    from nsa_cp.transport import p2p

    reason = p2p.p2p_unavailable_reason(group)  # collective: the same verdict on every rank
    norm = nsa_cp.RMSNorm(16)
    try:
        comm = nsa_cp.NSACPLayerCommunicator(group, norm, norm, p2p_max_tokens_per_rank=8, hidden_size=16,
                                             dtype=torch.float32)
        registered = nsa_cp.transport.get_p2p(group) is not None
        if registered != (reason is None):
            return f"P2P unavailable reason {reason!r}, yet a transport registered: {registered}"
        layout = nsa_cp.ShardLayout(case["counts"])
        shards = [_gen(9, q, n, (16,), torch.float32, "cpu") for q, n in enumerate(case["counts"])]
        with torch.no_grad():
            full, _ = comm.prepare_mlp(shards[rank].to(device), torch.zeros_like(shards[rank]).to(device), layout)
            want = _expected_gather([norm(s) for s in shards], layout, False)
        if not torch.equal(full.cpu(), want):
            return f"fallback gather differs from the oracle ({layout})"
        if reason is None:
            return None
        try:
            nsa_cp.NSACPLayerCommunicator(group, norm, norm, backend="p2p", p2p_max_tokens_per_rank=8,
                                          hidden_size=16, dtype=torch.float32)
        except RuntimeError as err:
            if "unavailable" not in str(err):
                return f"backend='p2p' raised without saying why: {err}"
            return None
        return "backend='p2p' without a usable transport did not raise"
    finally:
        nsa_cp.transport.destroy_p2p(group)  # later cases expect no transport


_RUNNERS = {
    "gather": _run_gather,
    "scatter": _run_scatter,
    "even_direct_gather": _run_even_direct,
    "even_direct_scatter": _run_even_direct,
    "communicator": _run_communicator,
    "errors": _run_errors,
    "validate": _run_validate,
    "bucket": _run_bucket,
    "p2p_fallback": _run_p2p_fallback,
}


def run_cases(rank: int, world: int, payload: dict) -> Dict[str, Optional[str]]:
    """Entry point in every rank: run each case, record None or the failure text."""
    import torch.distributed as dist

    import nsa_cp

    device = torch.device("cuda", rank) if payload["device"] == "cuda" else torch.device("cpu")
    group = dist.group.WORLD
    results: Dict[str, Optional[str]] = {}
    if payload.get("native_nccl"):  # the same cases through nsa_cp's own NCCL communicator
        nsa_cp.init_nccl(group, device)
        results["native_plans"] = _native_plans(rank, world, group, device, nsa_cp)
    for case in payload["cases"]:
        try:
            results[case["id"]] = _RUNNERS[case["op"]](case, rank, world, group, device, nsa_cp)
        except Exception:
            results[case["id"]] = traceback.format_exc()
        # a failing rank must not leave the others waiting in a collective: agree before the next case
        dist.barrier()
    if payload.get("native_nccl"):
        nsa_cp.transport.destroy_nccl(group)
    return results


def _native_plans(rank, world, group, device, nsa_cp) -> Optional[str]:
    """After init_nccl: every uneven movement's plan holds the native communicator, the even one never."""
    from nsa_cp.planning import plan
    from nsa_cp.planning.request import Request

    even = nsa_cp.ShardLayout([4] * world)
    uneven = nsa_cp.ShardLayout([5 + q for q in range(world)]) if world > 1 else None
    x = torch.randn(4, 8, device=device)
    got = {"even gather": plan.lookup(Request.of("cp_all_gather", x, even, group, backend="nccl")).backend}
    want = {"even gather": "nccl"}
    if uneven is not None:
        x = torch.randn(uneven.count(rank), 8, device=device)
        for compact in (False, True):
            for algo in ("padded", "coalesced"):
                name = f"uneven gather compact={compact} algo={algo}"
                got[name] = plan.lookup(Request.of("cp_all_gather", x, uneven, group, compact, algo, "nccl")).backend
                want[name] = "nccl+native"
                y = torch.randn(uneven.global_len(compact), 8, device=device)
                name = f"uneven scatter compact={compact} algo={algo}"
                got[name] = plan.lookup(Request.of("cp_reduce_scatter", y, uneven, group, compact, algo, "nccl")).backend
                want[name] = "nccl+native"
    wrong = {k: (got[k], want[k]) for k in want if got[k] != want[k]}
    return f"plan backends (got, want): {wrong}" if wrong else None
