"""torch.compile checks that run inside a process group (gloo on CPU, NCCL on GPUs); see test_compile.py.

Every rank runs every case (``run_compile_cases``) and reports ``{case_id: None | error}`` ("SKIP: why"
for a case this machine cannot run). The main case compiles ``_model`` (cp_all_gather, some torch ops,
cp_reduce_scatter) with ``fullgraph=True`` and a counting backend and compares it with the same function
run eagerly: the gather bitwise, the sum with allclose. Inputs are seeded per rank. World size 2.
"""

from __future__ import annotations

import traceback
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

import nsa_cp
from dist_harness import rank_device

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
HIDDEN = 16

LAYOUTS = {  # world 2: uneven, aligned (padding on both ranks), a zero-token rank, even
    "uneven": ([5, 3], 1),
    "uneven-align4": ([5, 3], 4),
    "zero-rank": ([4, 0], 1),
    "even": ([4, 4], 1),
}


def make_cases(backends, p2p: bool = False) -> List[dict]:
    cases = []
    for backend in backends:
        for name, (counts, align) in LAYOUTS.items():
            for compact in (False, True):
                cases.append(dict(id=f"{backend}-{name}-{'compact' if compact else 'padded'}", op="model",
                                  backend=backend, counts=counts, align=align, compact=compact))
        if backend != "eager":
            cases.append(dict(id=f"{backend}-dynamic-uneven-padded", op="model", backend=backend, counts=[5, 3],
                              align=1, compact=False, dynamic=True))
            cases.append(dict(id=f"{backend}-unused-gather-runs", op="unused", backend=backend, counts=[0, 3],
                              align=1, compact=False))
            cases.append(dict(id=f"{backend}-new-layouts", op="layouts", backend=backend, counts=[5, 3], align=1,
                              compact=True, more_counts=[[6, 2], [3, 7], [4, 4], [9, 2]]))
        cases.append(dict(id=f"{backend}-device-counts-bucket", op="bucket", backend=backend, counts=[6, 6],
                          align=1, compact=False, replays=[[6, 2], [0, 5], [3, 6]]))
        if p2p:
            for compact in (False, True):
                cases.append(dict(id=f"{backend}-p2p-uneven-{'compact' if compact else 'padded'}", op="p2p",
                                  backend=backend, counts=[5, 3], align=1, compact=compact))
    cases.append(dict(id="explain-no-graph-break", op="explain", counts=[5, 3], align=1, compact=True))
    cases.append(dict(id="out-refused-fullgraph", op="out_fullgraph", counts=[5, 3], align=1, compact=False))
    cases.append(dict(id="eager-bypasses-ops", op="bypass", counts=[5, 3], align=1, compact=False))
    cases.append(dict(id="opcheck", op="opcheck", counts=[5, 0], align=2, compact=False))
    return cases


# --------------------------------------------------------------------------- helpers
def _model(x, layout, group, compact: bool, scale: float):
    full = nsa_cp.cp_all_gather(x, layout, group, compact=compact)
    partial = torch.tanh(full) * scale + full  # stand-in for the MoE: this rank's partials of every token
    mine = nsa_cp.cp_reduce_scatter(partial, layout, group, compact=compact)
    return full, mine * 2


def _inputs(case, rank, device, dtype):
    layout = nsa_cp.ShardLayout(case["counts"], align=case["align"])
    g = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn(layout.count(rank), HIDDEN, generator=g).to(dtype).to(device)
    return layout, x


def _mismatch(got, want, dtype) -> Optional[str]:
    """None when the compiled ``(full, mine)`` matches the eager one: gather exact, sum allclose."""
    (full, mine), (ref_full, ref_mine) = got, want
    if full.shape != ref_full.shape or not torch.equal(full, ref_full):
        return f"compiled gather {tuple(full.shape)} differs from eager {tuple(ref_full.shape)}"
    if mine.shape != ref_mine.shape or mine.dtype != ref_mine.dtype:
        return f"compiled reduce-scatter {tuple(mine.shape)} {mine.dtype}, eager {tuple(ref_mine.shape)} {ref_mine.dtype}"
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5  # Inductor fuses the pointwise ops (one rounding)
    if not torch.allclose(mine.float(), ref_mine.float(), rtol=tol, atol=tol):
        return f"compiled reduce-scatter differs from eager by {(mine.float() - ref_mine.float()).abs().max().item():.3g}"
    return None


def _op_counts(graph: torch.fx.GraphModule) -> Dict[str, int]:
    counts: Dict[str, int] = {}
    for node in graph.graph.nodes:
        if node.op == "call_function" and "nsa_cp" in str(node.target):
            name = str(node.target).replace(".default", "")  # Dynamo records the packet, AOT the overload
            counts[name] = counts.get(name, 0) + 1
    return counts


def _compile_and_compare(case, rank, group, device, dtype, layout, x) -> Optional[str]:
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    scale = 0.5 + rank
    # clone: on the P2P backend the eager gather is a view of the transport's buffer
    want = tuple(t.clone() for t in _model(x, layout, group, case["compact"], scale))
    counter = CompileCounterWithBackend(case["backend"])
    compiled = torch.compile(_model, backend=counter, fullgraph=True, dynamic=case.get("dynamic"))
    for _ in range(2):  # the second call reuses the graph
        got = compiled(x, layout, group, case["compact"], scale)
    if counter.frame_count != 1:
        return f"expected 1 graph, got {counter.frame_count}"
    ops = _op_counts(counter.graphs[0])
    if ops != {"nsa_cp.cp_all_gather": 1, "nsa_cp.cp_reduce_scatter": 1}:
        return f"expected one nsa_cp::cp_all_gather and one nsa_cp::cp_reduce_scatter node, got {ops}"
    return _mismatch(got, want, dtype)


# --------------------------------------------------------------------------- cases
def _run_model(case, rank, world, group, device, dtype) -> Optional[str]:
    layout, x = _inputs(case, rank, device, dtype)
    return _compile_and_compare(case, rank, group, device, dtype, layout, x)


def _run_p2p(case, rank, world, group, device, dtype) -> Optional[str]:
    """The P2P backend (auto picks it for uneven layouts): the compiled gather must own its memory."""
    from nsa_cp.rows import _native
    from nsa_cp.transport import p2p

    reason = _native.unavailable_reason() if not _native.available() else p2p.p2p_unavailable_reason(group, device)
    if reason:
        return f"SKIP: P2P unavailable: {reason}"
    transport = nsa_cp.init_p2p(group, max_tokens_per_rank=16, hidden_size=HIDDEN, dtype=dtype)
    try:
        layout, x = _inputs(case, rank, device, dtype)
        problem = _compile_and_compare(case, rank, group, device, dtype, layout, x)
        if problem:
            return problem
        full, _ = torch.compile(_model, backend=case["backend"], fullgraph=True)(x, layout, group, case["compact"], 1.0)
        if full.untyped_storage().data_ptr() in [g.untyped_storage().data_ptr() for g in transport._gathers]:
            return "the compiled gather returned a transport's gather buffer (must be a copy)"
        before = full.clone()
        nsa_cp.cp_all_gather(torch.zeros_like(x), layout, group, compact=case["compact"])  # overwrites the buffer
        torch.cuda.synchronize(device)
        if not torch.equal(full, before):
            return "the compiled gather's result changed after the next gather"
        return None
    finally:
        nsa_cp.transport.destroy_p2p(group)


def _unused_gather(x, y, layout, group):
    nsa_cp.cp_all_gather(x, layout, group)  # result dropped: the collective must still run on every rank
    return nsa_cp.cp_reduce_scatter(y, layout, group)


def _run_unused(case, rank, world, group, device, dtype) -> Optional[str]:
    """Dead-code elimination must keep a gather whose result is unused and a zero-row reduce-scatter."""
    from nsa_cp.planning import plan

    torch._dynamo.reset()
    layout, x = _inputs(case, rank, device, dtype)
    y = torch.ones(layout.padded_len, HIDDEN, dtype=dtype, device=device)
    calls = []
    original = plan.call

    def spy(req, *args, **kwargs):
        calls.append({"cp_all_gather": "all_gather", "cp_reduce_scatter": "reduce_scatter"}.get(req.op, req.op))
        return original(req, *args, **kwargs)

    try:  # the ops' real implementations look plan.call up on the module at every call
        plan.call = spy
        mine = torch.compile(_unused_gather, backend=case["backend"], fullgraph=True)(x, y, layout, group)
    finally:
        plan.call = original
    if calls != ["all_gather", "reduce_scatter"]:
        return f"the compiled function ran {calls}, expected one gather then one reduce-scatter"
    if not torch.equal(mine, torch.full_like(mine, world)):
        return "reduce-scatter of ones is not the world size"
    return None


def _run_layouts(case, rank, world, group, device, dtype) -> Optional[str]:
    """New layouts on one compiled function: right results, at most one recompile (automatic dynamic)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend(case["backend"])
    compiled = torch.compile(_model, backend=counter, fullgraph=True)
    for counts in [case["counts"], *case["more_counts"]]:
        layout, x = _inputs(dict(case, counts=counts), rank, device, dtype)
        problem = _mismatch(compiled(x, layout, group, case["compact"], 1.5),
                            _model(x, layout, group, case["compact"], 1.5), dtype)
        if problem:
            return f"layout {counts}: {problem}"
    if counter.frame_count > 2:
        return f"{counter.frame_count} graphs for {1 + len(case['more_counts'])} layouts, expected <= 2"
    return None


def _bucket(x, y, layout, group, dc):
    return (nsa_cp.cp_all_gather(x, layout, group, device_counts=dc),
            nsa_cp.cp_reduce_scatter(y, layout, group, device_counts=dc))


def _run_bucket(case, rank, world, group, device, dtype) -> Optional[str]:
    """device_counts (CUDA-graph buckets) pass through the ops: counts changed in the tensor between calls."""
    torch._dynamo.reset()
    bucket = nsa_cp.ShardLayout(case["counts"])
    m = bucket.max_rank_len
    counts_dev = torch.zeros(world, dtype=torch.int32, device=device)
    dc = (counts_dev, torch.arange(world, dtype=torch.int32, device=device) * m)
    compiled = torch.compile(_bucket, backend=case["backend"], fullgraph=True)
    g = torch.Generator().manual_seed(99 + rank)
    for counts in case["replays"]:
        counts_dev.copy_(torch.tensor(counts, dtype=torch.int32))
        x = torch.randn(m, HIDDEN, generator=g).to(dtype).to(device)
        y = torch.randn(bucket.padded_len, HIDDEN, generator=g).to(dtype).to(device)
        got, want = compiled(x, y, bucket, group, dc), _bucket(x, y, bucket, group, dc)
        n = counts[rank]
        if not torch.equal(got[0], want[0]):
            return f"counts {counts}: compiled gather differs from eager"
        if not torch.allclose(got[1][:n].float(), want[1][:n].float(), rtol=1e-2, atol=1e-2):
            return f"counts {counts}: compiled reduce-scatter differs from eager"
    return None


def _run_explain(case, rank, world, group, device, dtype) -> Optional[str]:
    torch._dynamo.reset()
    layout, x = _inputs(case, rank, device, dtype)
    explanation = torch._dynamo.explain(_model)(x, layout, group, case["compact"], 1.0)
    if explanation.graph_count != 1 or explanation.graph_break_count != 0:
        return (f"expected 1 graph and 0 breaks, got {explanation.graph_count} graphs, "
                f"{explanation.graph_break_count} breaks: {explanation.break_reasons}")
    return None


def _run_out_fullgraph(case, rank, world, group, device, dtype) -> Optional[str]:
    def gather_into(x, layout, group, out):
        return nsa_cp.cp_all_gather(x, layout, group, out=out)

    torch._dynamo.reset()
    layout, x = _inputs(case, rank, device, dtype)
    out = torch.empty(layout.padded_len, HIDDEN, dtype=dtype, device=device)
    try:
        torch.compile(gather_into, backend="eager", fullgraph=True)(x, layout, group, out)
    except Exception as err:  # Dynamo reports the ValueError raised while tracing (nothing ran)
        text = f"{err} {err.__cause__!r} {err.__context__!r}"
        if "out: not supported inside torch.compile" not in text:
            return f"error does not name out: {type(err).__name__}: {text[:500]}"
        return None
    return "out= inside a fullgraph compile: nothing raised"


def _run_bypass(case, rank, world, group, device, dtype) -> Optional[str]:
    """Eager calls never reach nsa_cp.api.ops (no dispatcher)."""
    from nsa_cp.api import ops

    def forbidden(*args, **kwargs):
        raise AssertionError("an eager call went through nsa_cp.api.ops")

    saved = ops.call
    ops.call = forbidden
    try:
        layout, x = _inputs(case, rank, device, dtype)
        _model(x, layout, group, case["compact"], 1.0)
    finally:
        ops.call = saved
    return None


def _run_opcheck(case, rank, world, group, device, dtype) -> Optional[str]:
    """torch.library.opcheck runs the real op (collectives) several times, the same on every rank."""
    layout, x = _inputs(case, rank, device, dtype)
    counts, align = list(layout.per_rank_actual_token), layout.align
    g = torch.Generator().manual_seed(7)
    y = torch.randn(layout.padded_len, HIDDEN, generator=g).to(dtype).to(device)
    weight = (torch.rand(HIDDEN, generator=g) + 0.5).to(dtype).to(device)
    ops = torch.ops.nsa_cp
    for op, t, norm in ((ops.cp_all_gather.default, x, False), (ops.cp_reduce_scatter.default, y, False),
                        (ops.fused_add_rmsnorm_all_gather.default, x, True),
                        (ops.reduce_scatter_fused_add_rmsnorm.default, y, True)):
        for compact in (False, True):
            t_in = t[: layout.total_len] if (compact and t is y) else t
            tail = (counts, align, group.group_name, rank, compact, "auto", "auto", None, None, None, None)
            if norm:  # residual of this rank's rows, mutated in place (declared in the schema)
                residual = torch.randn(layout.count(rank), HIDDEN, generator=g).to(dtype).to(device)
                args = (t_in, residual, weight, 1e-6, *tail)
            else:
                args = (t_in, *tail)
            results = torch.library.opcheck(op, args, raise_exception=False)
            failed = {k: v for k, v in results.items() if v != "SUCCESS"}
            if failed:
                return f"opcheck {op} compact={compact}: {failed}"
    return None


_RUNNERS = {
    "model": _run_model,
    "p2p": _run_p2p,
    "unused": _run_unused,
    "layouts": _run_layouts,
    "bucket": _run_bucket,
    "explain": _run_explain,
    "out_fullgraph": _run_out_fullgraph,
    "bypass": _run_bypass,
    "opcheck": _run_opcheck,
}


def run_compile_cases(rank: int, world: int, payload: dict) -> Dict[str, Optional[str]]:
    """Entry point in every rank."""
    import nsa_cp.api.ops  # noqa: F401  registers torch.ops.nsa_cp.* for the direct calls

    device = rank_device(rank) if payload["device"] == "cuda" else torch.device("cpu")
    dtype = DTYPES[payload["dtype"]]
    group = dist.group.WORLD
    results: Dict[str, Optional[str]] = {}
    for case in payload["cases"]:
        try:
            results[case["id"]] = _RUNNERS[case["op"]](case, rank, world, group, device, dtype)
        except Exception:
            results[case["id"]] = traceback.format_exc()
        dist.barrier()  # a failing rank must not leave the other in a collective of the next case
    return results
