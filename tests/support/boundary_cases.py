"""Checks of the layer boundary inside a process group: the fused add + RMSNorm gather (with the FP8 wire),
the reduce-scatter + add + RMSNorm, the ordered gather / reduce-scatter, the FP8 gather, a 3-layer decoder
loop through chained communicators against the unfused loop, tensors with autograd history, and bad input.

Like dist_cases: the parent builds case dicts, every rank runs all of them and reports
``{case_id: None | error}``; every rank derives every rank's inputs from the case seed, and the expected
results come from an oracle written here in plain torch (not nsa_cp.rows.reference). Outputs are poisoned
with NaN. On CPU (gloo) the library runs the same arithmetic as the oracle, so results must be exact;
on CUDA the kernels may round a norm or an FP8 division differently: within one unit in the last place.
"""

from __future__ import annotations

import random
from typing import Dict, List, Optional

import torch

from dist_harness import run_each

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
EPS = 1e-6
FP8_MAX = 448.0


# --------------------------------------------------------------------------- oracle
def _gen(seed: int, rank: int, rows: int, hidden: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 131 + rank)
    return (torch.randn((rows, hidden), generator=g) * (1 + rank)).to(dtype)


def _weight(seed: int, hidden: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 99)
    return (torch.rand(hidden, generator=g) + 0.5).to(dtype)


def _norm(x, residual, weight, dtype):
    """(y, new residual) by the convention: fp32 sum, residual rounded, y rounded once."""
    s = x.float() if residual is None else x.float() + residual.float()
    # the mean of squares as the convention computes it: the sum in fp64 rounded once to fp32 (the same
    # total in any summation order), then one fp32 division by H
    mean_sq = s.double().square().sum(-1, keepdim=True).float() / s.shape[-1]
    y = s * torch.rsqrt(mean_sq + EPS) * weight.float()
    return y.to(dtype), (x if residual is None else s.to(dtype))


UE8M0 = "fp8_e4m3_g128_ue8m0"


def _quant(y, quant="fp8_e4m3_g128"):
    """SGLang's per_token_group_quant_fp8, or with UE8M0 vLLM's (its scale 2^ceil(log2(max(s, 1e-10))), taken
    here in fp64, where ceil(log2) of an fp32 is exact)."""
    rows, hidden = y.shape
    g = y.float().reshape(rows, hidden // 128, 128)
    scale = g.abs().amax(-1, keepdim=True).clamp_min(1e-10) / FP8_MAX
    if quant == UE8M0:
        scale = torch.exp2(torch.ceil(torch.log2(scale.double().clamp_min(1e-10)))).float()
    q = (g / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(rows, hidden), scale.reshape(rows, hidden // 128)


def _pad_scale(quant) -> float:
    return float(_quant(torch.zeros(1, 128), quant)[1][0, 0])


def _dequant_close(q, scale, want_q, want_s, what: str) -> Optional[str]:
    """Power-of-two scales where y may differ by an ulp (CUDA): a scale may be the next power, so compare
    the dequantized values, within one fp8 step of the larger scale."""
    q, scale = q.detach().cpu().float(), scale.detach().cpu()
    ratio = scale / want_s
    if not ((ratio == 1) | (ratio == 2) | (ratio == 0.5)).all():
        return f"{what}: power-of-two scales more than one power from the oracle's"
    rows, hidden = q.shape
    got = (q.view(rows, hidden // 128, 128) * scale[..., None]).view(rows, hidden)
    want = (want_q.float().view(rows, hidden // 128, 128) * want_s[..., None]).view(rows, hidden)
    step = 2.0 ** -7 * torch.maximum(scale, want_s).repeat_interleave(128, dim=1)
    bad = (got - want).abs() > 0.125 * want.abs() + step
    return f"{what}: {int(bad.sum())} dequantized values more than one fp8 step off" if bool(bad.any()) else None


def _arrange(shards, layout, how: str, positions=None, pad=0.0):
    """Rank shards -> the padded / compact / batch-order layout (independent of nsa_cp)."""
    if how == "compact":
        return torch.cat(shards)
    if how == "ordered":
        compact = torch.cat(shards)
        out = torch.empty_like(compact)
        out[positions] = compact
        return out
    m = layout.max_rank_len
    pieces = []
    for s in shards:
        pieces.append(s)
        pieces.append(torch.full((m - s.shape[0], *s.shape[1:]), pad, dtype=s.dtype))
    return torch.cat(pieces)


def _ulp_close(got: torch.Tensor, want: torch.Tensor, exact: bool, what: str) -> Optional[str]:
    got = got.detach().cpu()
    if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
        return f"{what}: shape/dtype {tuple(got.shape)} {got.dtype}, expected {tuple(want.shape)} {want.dtype}"
    if got.dtype == torch.float8_e4m3fn:
        g, w = got.float(), want.float()
        if exact:
            return None if torch.equal(got.view(torch.uint8), want.view(torch.uint8)) else f"{what}: fp8 bytes differ"
        # one e4m3 step: 2^(floor(log2|w|) - 3), at least the smallest subnormal
        step = torch.exp2(torch.floor(torch.log2(w.abs().clamp_min(2.0 ** -6))) - 3)
        bad = (g - w).abs() > step + 1e-12
        return f"{what}: {int(bad.sum())} fp8 values more than one step off" if bool(bad.any()) else None
    if exact:
        return None if torch.equal(got, want) else f"{what}: differs (max abs {float((got.float() - want.float()).abs().max()):.3g})"
    rel = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10, torch.float32: 2.0 ** -20}[want.dtype]
    bad = (got.float() - want.float()).abs() > rel * want.float().abs() + 1e-30
    if bool(torch.isnan(got.float()).any()):
        return f"{what}: NaN rows (unwritten)"
    return f"{what}: {int(bad.sum())} values more than one ulp off" if bool(bad.any()) else None


# --------------------------------------------------------------------------- cases
def _layouts(world: int, rng: random.Random):
    return [
        [0] * world,
        [5] * world,
        [3] + [0] * (world - 1),
        [0] * (world - 1) + [4],
        [i + 2 for i in range(world)],
        [rng.choice([0, rng.randint(1, 9)]) for _ in range(world)],
        [rng.randint(1, 12) for _ in range(world)],
    ]


def make_cases(world: int, seed: int = 0, gpu: bool = False, backend: str = "auto", hidden: Optional[int] = None,
               dtype: Optional[str] = None) -> List[dict]:
    """Deterministic case list for one world size; ``hidden`` / ``dtype`` pin every case's row (a P2P
    transport serves one hidden size and dtype)."""
    rng = random.Random(seed * 7919 + world)
    cases = []
    for li, counts in enumerate(_layouts(world, rng)):
        for how in ("padded", "compact", "ordered"):
            # the wire formats take turns by layout (every layout kind meets each)
            for quant in (None, UE8M0 if li % 2 else "fp8_e4m3_g128"):
                dtype = rng.choice(["bf16", "fp32"] if not gpu else ["bf16", "fp16"])
                cases.append(dict(id=f"normgather-L{li}-{how}-{quant or 'bf'}-{dtype}", op="norm_gather", counts=counts,
                                  how=how, quant=quant, dtype=dtype, hidden=256 if quant else rng.choice([64, 200]),
                                  residual=rng.random() < 0.8, use_out=rng.random() < 0.4, backend=backend,
                                  seed=rng.randrange(1 << 30)))
            dtype = rng.choice(["bf16", "fp32"] if not gpu else ["bf16", "fp16"])
            cases.append(dict(id=f"scatternorm-L{li}-{how}-{dtype}", op="scatter_norm", counts=counts, how=how,
                              dtype=dtype, hidden=rng.choice([64, 128]), residual=rng.random() < 0.8,
                              backend=backend, seed=rng.randrange(1 << 30)))
            cases.append(dict(id=f"quantgather-L{li}-{how}", op="quant_gather", counts=counts, how=how,
                              quant=UE8M0 if li % 2 else "fp8_e4m3_g128", dtype="bf16", hidden=384, use_out=rng.random() < 0.5, backend=backend,
                              seed=rng.randrange(1 << 30)))
    for i in range(4):  # the ordered gather / reduce-scatter on a real in-seq split
        seq_lens = [rng.randint(1, 40) for _ in range(rng.randint(1, 4))]
        cases.append(dict(id=f"ordered-split{i}", op="ordered", seq_lens=seq_lens, page_size=rng.choice([1, 4]),
                          dtype=rng.choice(["bf16", "fp32"]), hidden=32, backend=backend, seed=rng.randrange(1 << 30)))
    for compact in (False, True):
        for quant in (None, "fp8_e4m3_g128"):
            cases.append(dict(id=f"chain-{'compact' if compact else 'padded'}-{quant or 'bf'}", op="chain",
                              counts=[rng.randint(0, 9) for _ in range(world)], compact=compact, quant=quant,
                              dtype="fp32" if not gpu else "bf16", hidden=128, backend=backend,
                              seed=rng.randrange(1 << 30)))
    cases.append(dict(id="autograd", op="autograd", counts=[rng.randint(1, 6) for _ in range(world)], dtype="fp32",
                      hidden=32, backend=backend, seed=5))
    cases.append(dict(id="errors", op="errors", counts=[2] + [3] * (world - 1), dtype="bf16", hidden=200,
                      backend=backend, seed=6))
    for case in cases:
        if hidden is not None and case["op"] != "errors":
            case["hidden"] = hidden
        if dtype is not None:
            case["dtype"] = dtype
    return cases


def _setup(case, rank, world, device):
    import nsa_cp

    dtype = DTYPES[case["dtype"]]
    layout = nsa_cp.ShardLayout(case["counts"])
    positions = None
    if case.get("how") == "ordered":  # any permutation the ranks agree on
        g = torch.Generator().manual_seed(case["seed"])
        positions = torch.randperm(layout.total_len, generator=g)
    return nsa_cp, dtype, layout, positions


def _run_norm_gather(case, rank, world, group, device) -> Optional[str]:
    nsa_cp, dtype, layout, positions = _setup(case, rank, world, device)
    hidden, quant, exact = case["hidden"], case["quant"], device.type == "cpu"
    xs = [_gen(case["seed"], q, n, hidden, dtype) for q, n in enumerate(layout.per_rank_actual_token)]
    rs = [_gen(case["seed"] + 1, q, n, hidden, dtype) for q, n in enumerate(layout.per_rank_actual_token)]
    w = _weight(case["seed"], hidden, dtype)
    want = [_norm(x, r if case["residual"] else None, w, dtype) for x, r in zip(xs, rs)]
    x, residual = xs[rank].clone().to(device), rs[rank].clone().to(device) if case["residual"] else None
    rows = layout.total_len if case["how"] != "padded" else layout.padded_len
    out = None
    if case["use_out"]:
        out = (torch.full((rows, hidden), float("nan"), device=device).to(torch.float8_e4m3fn),
               torch.full((rows, hidden // 128), float("nan"), device=device)) if quant else \
            torch.full((rows, hidden), float("nan"), dtype=dtype, device=device)
    x_before = x.clone()
    gathered, res = nsa_cp.fused_add_rmsnorm_all_gather(
        x, residual, w.to(device), EPS, layout, group, compact=case["how"] == "compact", quant=quant, out=out,
        backend=case["backend"], positions=None if positions is None else positions.to(device))
    if not torch.equal(x.cpu(), x_before.cpu()):
        return "x was modified"
    if (res is not x) if residual is None else (res is not residual):
        return "the returned residual is not the caller's tensor"
    if residual is not None:
        problem = _ulp_close(residual, want[rank][1], True, "residual")
        if problem:
            return problem
    ys = [y for y, _ in want]
    if quant is None:
        return _ulp_close(gathered, _arrange(ys, layout, case["how"], positions), exact, "gathered")
    qs = [_quant(y, quant) for y in ys]
    q, scale = gathered
    want_q = _arrange([a for a, _ in qs], layout, case["how"], positions)
    want_s = _arrange([b for _, b in qs], layout, case["how"], positions, pad=_pad_scale(quant))
    if quant == UE8M0 and not exact:
        return _dequant_close(q, scale, want_q, want_s, "q * scale")
    problem = _ulp_close(q, want_q, exact, "q")
    return problem or _ulp_close(scale, want_s, exact, "scale")


def _run_quant_gather(case, rank, world, group, device) -> Optional[str]:
    nsa_cp, dtype, layout, positions = _setup(case, rank, world, device)
    hidden, exact = case["hidden"], device.type == "cpu"
    xs = [_gen(case["seed"], q, n, hidden, dtype) for q, n in enumerate(layout.per_rank_actual_token)]
    rows = layout.padded_len if case["how"] == "padded" else layout.total_len
    out = (torch.full((rows, hidden), float("nan"), device=device).to(torch.float8_e4m3fn),
           torch.full((rows, hidden // 128), float("nan"), device=device)) if case["use_out"] else None
    q, scale = nsa_cp.cp_all_gather(xs[rank].to(device), layout, group, compact=case["how"] == "compact", out=out,
                                    quant=case["quant"], backend=case["backend"],
                                    positions=None if positions is None else positions.to(device))
    if out is not None and (q is not out[0] or scale is not out[1]):
        return "out= given but other tensors returned"
    qs = [_quant(x, case["quant"]) for x in xs]
    # quantizing before the gather equals quantizing the gathered rows: the library's own quantizer too
    full = _arrange(xs, layout, case["how"], positions)
    q_lib, s_lib = nsa_cp.quantize(full.to(device), case["quant"])
    problem = _ulp_close(q, _arrange([a for a, _ in qs], layout, case["how"], positions), exact, "q")
    problem = problem or _ulp_close(scale, _arrange([b for _, b in qs], layout, case["how"], positions,
                                                    pad=_pad_scale(case["quant"])), exact, "scale")
    if problem or case["how"] == "padded":  # padding rows: the gather's scale is the padding scale by contract
        return problem
    problem = _ulp_close(q, q_lib.cpu(), exact, "q against nsa_cp.quantize of the gathered rows")
    return problem or _ulp_close(scale, s_lib.cpu(), exact, "scale against nsa_cp.quantize of the gathered rows")


def _run_scatter_norm(case, rank, world, group, device) -> Optional[str]:
    nsa_cp, dtype, layout, positions = _setup(case, rank, world, device)
    hidden = case["hidden"]
    rows = layout.padded_len if case["how"] == "padded" else layout.total_len
    partials = [_gen(case["seed"], q, rows, hidden, dtype) for q in range(world)]
    n = layout.count(rank)
    if case["how"] == "padded":
        mine = slice(rank * layout.max_rank_len, rank * layout.max_rank_len + n)
        pick = lambda p: p[mine]  # noqa: E731
    elif case["how"] == "compact":
        pick = lambda p: p[layout.offsets[rank]: layout.offsets[rank] + n]  # noqa: E731
    else:
        idx = positions[layout.offsets[rank]: layout.offsets[rank] + n]
        pick = lambda p: p[idx]  # noqa: E731
    h = torch.stack([pick(p).double() for p in partials]).sum(0) if n else torch.zeros((0, hidden), dtype=torch.float64)
    res0 = _gen(case["seed"] + 1, rank, n, hidden, dtype)
    w = _weight(case["seed"], hidden, dtype)
    residual = res0.clone().to(device) if case["residual"] else None  # updated in place
    y, res = nsa_cp.reduce_scatter_fused_add_rmsnorm(
        partials[rank].to(device), residual, w.to(device), EPS, layout, group, compact=case["how"] == "compact",
        backend=case["backend"], positions=None if positions is None else positions.to(device))
    # the reduce-scatter's sum is rounded to the dtype first: an fp64 oracle is within a few ulps of it
    want_y, want_res = _norm(h.to(dtype), res0 if case["residual"] else None, w, dtype)
    tol = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-5}[dtype]
    for got, exp, what in ((y, want_y, "y"), (res, want_res, "residual")):
        got = got.detach().cpu()
        if tuple(got.shape) != (n, hidden):
            return f"{what}: shape {tuple(got.shape)}, expected {(n, hidden)}"
        if not torch.allclose(got.float(), exp.float(), rtol=tol, atol=tol * float(exp.float().abs().max() if n else 1)):
            return f"{what}: max abs error {float((got.float() - exp.float()).abs().max()):.3g} above {tol}"
    if residual is not None and res is not residual:
        return "the returned residual is not the caller's tensor"
    return None


def _run_ordered(case, rank, world, group, device) -> Optional[str]:
    import nsa_cp

    dtype, hidden = DTYPES[case["dtype"]], case["hidden"]
    counts = nsa_cp.in_seq_split(case["seq_lens"], world, case["page_size"])
    per_rank = nsa_cp.in_seq_positions(case["seq_lens"], world, case["page_size"])
    positions = torch.cat(per_rank)
    layout = nsa_cp.ShardLayout(counts)
    batch = _gen(case["seed"], 0, layout.total_len, hidden, dtype)  # the batch in token order
    x = batch[per_rank[rank]]
    full = nsa_cp.cp_all_gather(x.to(device), layout, group, positions=positions.to(device), backend=case["backend"])
    if not torch.equal(full.cpu(), batch):
        return "ordered gather does not restore the batch order"
    partials = [_gen(case["seed"] + 1, q, layout.total_len, hidden, dtype) for q in range(world)]
    got = nsa_cp.cp_reduce_scatter(partials[rank].to(device), layout, group, positions=positions.to(device),
                                   backend=case["backend"])
    mine = torch.stack([p[per_rank[rank]].double() for p in partials])
    want = mine.sum(0)
    # each of the world-1 additions in the dtype rounds once: bounded by the magnitudes summed
    unit = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}[dtype]
    bound = world * unit * mine.abs().sum(0) + 1e-30
    if tuple(got.shape) != (counts[rank], hidden) or bool(((got.cpu().double() - want).abs() > bound).any()):
        return f"ordered reduce-scatter differs from the fp64 sum of this rank's batch rows (shape {tuple(got.shape)})"
    return None


def _run_chain(case, rank, world, group, device) -> Optional[str]:
    """A 3-layer decoder loop through chained (fused) communicators against unfused ones."""
    import nsa_cp

    dtype, hidden = DTYPES[case["dtype"]], case["hidden"]
    layout = nsa_cp.ShardLayout(case["counts"])
    layers = 3

    def build(fuse):
        comms, calls = [], []
        for i in range(layers):
            norms = []
            for j in range(2):
                norm = nsa_cp.RMSNorm(hidden, eps=EPS, dtype=dtype).to(device)
                with torch.no_grad():
                    norm.weight.copy_(_weight(case["seed"] + 10 * i + j, hidden, dtype))
                norm.register_forward_hook(lambda *a, i=i, j=j: calls.append((i, j)))
                norms.append(norm)
            comms.append(nsa_cp.NSACPLayerCommunicator(group, *norms, compact=case["compact"], fuse=fuse,
                                                       quant=case["quant"], backend=case["backend"]))
        if fuse:
            nsa_cp.NSACPLayerCommunicator.chain(comms)
        return comms, calls

    def loop(comms):
        hidden_states = _gen(case["seed"], rank, layout.count(rank), hidden, dtype).to(device)
        residual = None
        for i, comm in enumerate(comms):
            h, residual = comm.prepare_attn(hidden_states, residual, layout)
            h = h * (1.0 + 0.1 * i)  # attention stand-in, local
            full, residual = comm.prepare_mlp(h, residual, layout)
            if case["quant"]:
                full = nsa_cp.dequant_fp8_g128(*full, dtype)
            partials = comm.mlp_output_buffer(layout, full)
            partials.copy_(full * (rank + 1))  # the MoE stand-in writes its partials there
            hidden_states, residual = comm.postprocess_layer(partials, residual, layout)
        return hidden_states, residual

    with torch.no_grad():
        fused, fused_calls = build(True)
        plain, plain_calls = build(False)
        got = loop(fused)
        want = loop(plain)
    if any(j == 0 and i > 0 for i, j in fused_calls) or any(j == 1 for _, j in fused_calls):
        return f"the fused loop called norm modules it should have fused: {fused_calls}"
    exact = device.type == "cpu"
    for a, b, what in zip(got, want, ("hidden", "residual")):
        problem = _ulp_close(a, b.cpu(), exact, f"fused loop {what} against the unfused loop")
        if problem and exact:
            return problem
        if problem:  # a kernel norm against the module's norm: allow a few ulps through 3 layers
            if not torch.allclose(a.float().cpu(), b.float().cpu(), rtol=3e-2, atol=3e-2):
                return problem
    return None


def _run_autograd(case, rank, world, group, device) -> Optional[str]:
    """Tensors with history (outside no_grad, nn.Parameter weights) work by value; results have none."""
    import nsa_cp

    dtype, hidden = DTYPES[case["dtype"]], case["hidden"]
    layout = nsa_cp.ShardLayout(case["counts"])
    lin = torch.nn.Linear(hidden, hidden, dtype=dtype).to(device)
    x = lin(_gen(case["seed"], rank, layout.count(rank), hidden, dtype).to(device))  # has history
    norm = nsa_cp.RMSNorm(hidden, eps=EPS, dtype=dtype).to(device)
    comm = nsa_cp.NSACPLayerCommunicator(group, norm, norm, backend=case["backend"])
    full = nsa_cp.cp_all_gather(x, layout, group, backend=case["backend"])
    gathered, residual = nsa_cp.fused_add_rmsnorm_all_gather(x, None, norm.weight, EPS, layout, group,
                                                             backend=case["backend"])
    full2, res2 = comm.prepare_mlp(x, x.detach().clone(), layout)
    y = nsa_cp.cp_reduce_scatter(full * 1.0, layout, group, backend=case["backend"])
    for name, t in (("cp_all_gather", full), ("fused gather", gathered), ("prepare_mlp", full2),
                    ("cp_reduce_scatter", y)):
        if t.requires_grad:
            return f"{name} returned a tensor with autograd history"
    rows = layout.padded_len
    if tuple(full.shape) != (rows, hidden) or bool(torch.isnan(full).any()):
        return "cp_all_gather on a tensor with history returned wrong rows"
    return None


def _expect_value_error(fn, words) -> Optional[str]:
    try:
        fn()
    except ValueError as err:
        missing = [w for w in words if w not in str(err)]
        return f"ValueError {str(err)!r} does not mention {missing}" if missing else None
    except Exception as err:  # anything else is a defect
        return f"expected ValueError mentioning {words}, got {type(err).__name__}: {err}"
    return f"expected ValueError mentioning {words}, nothing raised"


def _run_errors(case, rank, world, group, device) -> Optional[str]:
    """Every rank passes the same bad argument, so every rank raises before any collective."""
    import nsa_cp

    dtype, hidden = DTYPES[case["dtype"]], case["hidden"]
    layout = nsa_cp.ShardLayout(case["counts"])
    n = layout.count(rank)
    x = _gen(case["seed"], rank, n, hidden, dtype).to(device)
    w = _weight(case["seed"], hidden, dtype).to(device)
    res = x.clone()
    out = torch.full((layout.padded_len, hidden), float("nan"), dtype=dtype, device=device)
    fg = nsa_cp.fused_add_rmsnorm_all_gather
    checks = [
        (lambda: fg(x, res, w[:-1], EPS, layout, group, out=out), ["weight", f"[{hidden}]"]),
        (lambda: fg(x, res, w.to(torch.int32), EPS, layout, group, out=out), ["weight", "int32"]),
        (lambda: fg(x, res[:, :-1], w, EPS, layout, group, out=out), ["residual", str(hidden - 1)]),
        (lambda: fg(x, res, w, EPS, layout, group, quant="fp8_e4m3_g128"), ["x", "128", str(hidden)]),
        (lambda: fg(x, res, w, EPS, layout, group, quant="int4"), ["quant", "int4"]),
        (lambda: fg(x[:, None], res, w, EPS, layout, group), ["x", "2-D"]),
        (lambda: fg(x[1:], res[1:], w, EPS, layout, group, out=out), ["x", f"[{n}, {hidden}]"]),
        (lambda: nsa_cp.cp_all_gather(x, layout, group, positions=torch.arange(layout.total_len + 1, device=device)),
         ["positions", str(layout.total_len + 1)]),
        (lambda: nsa_cp.cp_all_gather(x, layout, group, positions=torch.arange(layout.total_len, device=device,
                                                                               dtype=torch.int32)),
         ["positions", "int32"]),
        (lambda: nsa_cp.cp_all_gather(x, layout, group, quant="fp8_e4m3_g128"), ["x", "128"]),
        (lambda: nsa_cp.reduce_scatter_fused_add_rmsnorm(out, res[:, :3], w, EPS, layout, group),
         ["residual", f"[{n}, {hidden}]"]),
    ]
    before = out.clone()
    for fn, words in checks:
        problem = _expect_value_error(fn, words)
        if problem:
            return problem
        if not torch.equal(out.cpu().view(torch.uint8), before.cpu().view(torch.uint8)) or not torch.equal(res, x):
            return f"a call that raised wrote to out or residual ({words})"
    # positions out of range never write outside the result
    bad = torch.full((layout.total_len,), 10 ** 6, dtype=torch.int64, device=device)
    guard = torch.full((layout.total_len + 8, hidden), float("nan"), dtype=dtype, device=device)
    nsa_cp.cp_all_gather(x, layout, group, positions=bad, out=guard[:layout.total_len])
    if not bool(torch.isnan(guard[layout.total_len:]).all()):
        return "an out-of-range position wrote outside the result"
    return None


_RUNNERS = {
    "norm_gather": _run_norm_gather,
    "quant_gather": _run_quant_gather,
    "scatter_norm": _run_scatter_norm,
    "ordered": _run_ordered,
    "chain": _run_chain,
    "autograd": _run_autograd,
    "errors": _run_errors,
}


def run_cases(rank: int, world: int, payload: dict) -> Dict[str, Optional[str]]:
    """Entry point in every rank (``dist_harness.run_world``): every case through its runner, None or the
    failure text per case (``dist_harness.run_each``); first the P2P transport when the payload names one."""
    import torch.distributed as dist

    device = torch.device("cuda", rank) if payload["device"] == "cuda" else torch.device("cpu")
    group = dist.group.WORLD
    if payload.get("p2p"):
        import nsa_cp

        nsa_cp.init_p2p(group, 256, payload["p2p"], torch.bfloat16)
    return run_each(payload["cases"], lambda case: _RUNNERS[case["op"]](case, rank, world, group, device))
