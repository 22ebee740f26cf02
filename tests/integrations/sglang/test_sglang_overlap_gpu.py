"""The overlapped boundary inside SGLang (NSA_CP_SGLANG_OVERLAP=1) on a GPU, against SGLang 0.5.23's own code:
ranks sharing one GPU (a gloo group; the P2P transport maps the peers' buffers through CUDA IPC), worlds 2, 3,
4 and 8, one spawned world per size with every case inside it.

What runs, per rank: two of SGLang's ``DeepseekV2DecoderLayer``s with SGLang's own ``DeepseekV2MoE``
(tests/support/sglang_layer.py: the stages from the class's ``_build_stages``, a stand-in attention), its
weights and rows on the GPU, in bf16 (the dtype of the P2P transport, created once per world with
``nsa_cp.init_p2p`` on SGLang's attention-CP group); SGLang's zigzag metadata with uneven counts, zero-token
ranks and an even split; padded and compact; the shared expert TP-sharded (SGLang's default) and replicated
(``SGLANG_SHARED_EXPERT_TP1=1``); one case with NSA_CP_SGLANG_OVERLAP_CHUNK_ROWS=5.

The MoE path driven, and why: ``DeepseekV2MoE.forward`` -> ``forward_normal`` -> ``FusedMoE`` with
``UnquantizedFusedMoEMethod.forward_native`` (SGLang aliases it to ``forward_cpu``) -> ``moe_forward_native``
(tokens sorted by expert, one matmul per expert), with the native top-k, gate and SiluAndMul, all on CUDA
tensors. The GPU machine has no ``sgl_kernel`` (SGLang travels as wheels without it), and SGLang's CUDA MoE
path (``forward_cuda``: the Triton / FlashInfer runners, the fused top-k) imports it. So SGLang's modules are
imported as sglang_env.prepare_process imports them there (``torch.cuda.is_available()`` reading False
during the import, SGLang's cached ``is_cuda()`` False: ``sglang_layer.import_model``), and SGLang's op
dispatch then picks each op's ``forward_native``. It is the structure users run on GPUs
(``forward_normal``: gate, top-k, experts, shared expert), with pure-torch expert kernels.

Three runs per case, on the same weights and inputs: the plugin off (SGLang's own moves, over the gloo group
on the CPU: SGLang's collectives take CPU tensors on gloo, as in test_sglang_boundary_gpu), the serialized
plugin (``install()``: the P2P gather and reduce-scatter on the GPU), and the overlap (``install()`` with
NSA_CP_SGLANG_OVERLAP=1, on the GPU). Checked:

* the overlap ran: ``status()["overlap"]`` (2 layers, nothing declined, nothing serialized), its read step
  fused (``fused_add_rmsnorm_overlapped``), no batch on the NCCL path; each ``cp_overlapped_boundary`` call
  ran on the P2P transport (``nsa_cp.explain`` of the call's own arguments names backend "p2p"); its consumer
  got CUDA rows;
* the MoE got each rank's real rows per chunk (at most chunk_rows rows), never the gathered tensor; the
  serialized plugin's MoE the gathered one (padded ``[M * cp, H]`` or compact ``[sum(n), H]``);
* overlap == serialized plugin BIT FOR BIT where both sum alike and the MoE is row-independent: the
  TP-sharded shared expert (its partial joins the routed one in the consumer, as in the serialized MoE), the
  serialized reduce-scatter being P2P's (fp32, rank order 0..P-1, rounded once, as the overlap sums: every
  world), and every rank's MoE giving each real row the same bits on the chunks as on the serialized input
  on this GPU (``sglang_layer.row_independent`` on the device, agreed over the ranks: rank r's result sums
  every rank's partials);
* otherwise within 4 bf16 roundings relative to the rows' size (4 * 2^-7 * (1 + max |row|), as the CPU test:
  per layer one rounding of the sum and one of the shared add apart, carried into the second layer); with
  the replicated shared expert the overlap adds it once in fp32 before the one rounding, where the serialized
  MoE adds it on rank 0 in bf16 before the sum;
* the overlap and the serialized plugin against the plugin off within ``world + 4`` bf16 roundings relative
  to the rows' size: the 4 above, plus gloo summing the plugin-off run's bf16 partials with a rounding per add
  (``world - 1``) and the CPU's expert kernels rounding their bf16 intermediates apart from the GPU's (one);
* every real row finite.

Routing-aware: SGLang's ``select_experts`` is recorded in all three runs (tests/support/sglang_routing.py;
the overlap's per-chunk calls merged rank-major). Rounding apart is enough to flip a token's MoE top-k where
it is a near tie (seen on 1x H100: a replicated-shared-expert case at 3 ranks, one token of 122 flipping at
a margin of 0.12 bf16 ulp, the GPU's own kernels against the CPU's; its output then differs by far more than
a rounding). So in every comparison that is not bitwise, the tokens whose top-k id set differs between the
two runs at any layer (on any rank: each routes every token) must each be a near tie (margin at the first
layer it flips <= NEAR_TIE_ULPS = 4 bf16 ulps in at least one of the two runs) and few (at most
``max(1, tokens // 40)``); their rows are checked finite only, every other row within the bound above. Each
flip is reported (a warning naming the comparison, token, ids and margins), never hidden. Bitwise
comparisons exclude nothing.

The replicated shared expert (``SGLANG_SHARED_EXPERT_TP1=1``) runs as every other case: served by the
serialized plugin and overlapped on CUDA (overlap, 2 layers), checked against the serialized plugin within
4 roundings (not bitwise: the shared expert joins the sum apart) and both against the plugin off.

The even split runs with NSA_CP_BACKEND=p2p, as in test_sglang_boundary_gpu: in production an even batch keeps
the plain NCCL collective, which two ranks on one GPU cannot have (and gloo has no CUDA reduce-scatter).

Skips cleanly without CUDA, nsa_cp._C or SGLang (scripts/gpu_sglang.sh carries it). scripts/gpu_test_line.sh's
"sglang_gpu" shard. The case runner takes a device: on "cpu" the same checks run over gloo without P2P (the
torch.distributed pipeline; bitwise then only at 2 ranks, where gloo's reduce-scatter sums as the overlap).
"""

from __future__ import annotations

import os
import re
import traceback
import warnings
from unittest import mock

import pytest
import torch

import sglang_env
from dist_harness import case_failures, rank_device, run_world
from nsa_cp.rows import _native

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS < 1, reason=f"needs a CUDA GPU, found {GPUS}"),
    pytest.mark.skipif(not _native.available(), reason=f"nsa_cp._C unavailable: {_native.unavailable_reason()}"),
]
DTYPE = torch.bfloat16  # the serving dtype; the P2P transport holds one
MAX_TOKENS_PER_RANK = 256  # above every case's physical rows per rank
UNEVEN = [37, 64, 21]
ZERO = {2: [1], 3: [1], 4: [2], 8: [3]}  # zigzag puts these few tokens on some ranks only
EVEN = {2: [8], 4: [16]}  # zigzag: 2 * cp chunks of 2 tokens, 4 tokens per rank


def _cases(world):
    """name -> (seq_lens, compact, shared_tp1, chunk_rows, even)."""
    zero = ZERO[world]
    if world == 8:  # the largest world: the cases that differ most
        return {"uneven-padded-tp-shared": (UNEVEN, False, False, None, False),
                "zero-token-ranks-compact-tp1-shared": (zero, True, True, None, False),
                "uneven-compact-tp-shared-chunk5": (UNEVEN, True, False, 5, False)}
    out = {f"uneven-{lay}-{sh}-shared": (UNEVEN, lay == "compact", sh == "tp1", None, False)
           for lay in ("padded", "compact") for sh in ("tp", "tp1")}
    out["zero-token-ranks-padded-tp-shared"] = (zero, False, False, None, False)
    out["zero-token-ranks-compact-tp1-shared"] = (zero, True, True, None, False)
    if world in EVEN:
        out["even-padded-tp-shared"] = (EVEN[world], False, False, None, True)
        out["even-compact-tp1-shared"] = (EVEN[world], True, True, None, True)
    out["uneven-padded-tp-shared-chunk5"] = (UNEVEN, False, False, 5, False)
    return out


WORLDS = (2, 3, 4, 8)
CASES = {w: _cases(w) for w in WORLDS}


# --------------------------------------------------------------------------- one case, on any device
def _chunks(rows, chunk_rows):
    if rows == 0:
        return []
    if not chunk_rows:
        return [rows]
    return [min(chunk_rows, rows - s) for s in range(0, rows, chunk_rows)]


def _spy_boundary(calls):
    """A stand-in for the plugin's ``cp_overlapped_boundary`` that records, per call, what ``nsa_cp.explain``
    says of these very arguments (the plan the call looks up) and every consumer call's rows, then runs it."""
    import nsa_cp
    from nsa_cp.integrations.sglang import overlap as ov

    real = ov.cp_overlapped_boundary

    def spy(x, layout, consumer, group=None, **kw):
        text = nsa_cp.explain(x, layout, group, out_dtype=kw.get("out_dtype"), chunk_rows=kw.get("chunk_rows"),
                              shared=kw.get("shared") is not None, backend=kw.get("backend", "auto"))
        found = re.search(r"backend '([^']+)'", text)
        call = {"backend": found.group(1) if found else None, "explain": text, "x": (x.device, x.shape[0]),
                "chunks": []}
        calls.append(call)

        def consumer_spy(rows, chunk):
            call["chunks"].append((chunk.source, rows.shape[0], rows.device))
            return consumer(rows, chunk)

        return real(x, layout, consumer_spy, group, **kw)

    return mock.patch.object(ov, "cp_overlapped_boundary", spy)


def _run(rank, world, kw, *, plugin, overlap, compact, chunk_rows=None, backend=None):
    """One forward of sglang_layer's layers: plugin off, serialized (``install()``) or overlapped; returns
    ``(result, status() while installed, the boundary calls recorded)``."""
    import nsa_cp.integrations.sglang as nsa_sglang
    import sglang_layer
    from nsa_cp.integrations.sglang import overlap as ov
    from nsa_cp.integrations.sglang import state

    if not plugin:
        return sglang_layer.run_layers(rank, world, **kw), None, []
    env = {"NSA_CP_SGLANG_COMPACT": "1" if compact else "0", "NSA_CP_SGLANG_OVERLAP": "1" if overlap else "0",
           "NSA_CP_SGLANG_OVERLAP_MIN_ROWS": "0"}  # these small batches overlap too
    if chunk_rows:
        env["NSA_CP_SGLANG_OVERLAP_CHUNK_ROWS"] = str(chunk_rows)
    if backend:
        env["NSA_CP_BACKEND"] = backend
    calls = []
    with mock.patch.dict(os.environ, env), _spy_boundary(calls):
        state.reset()
        ov.reset()
        handle = nsa_sglang.install()
        try:  # status() while installed: what this run did
            out = sglang_layer.run_layers(rank, world, **kw)
            if out["hidden"].is_cuda:
                torch.cuda.synchronize()
            return out, nsa_sglang.status(), calls
        finally:
            handle.uninstall()


def _same(a, b, what):
    assert torch.equal(a, b), f"{what}: not bit for bit (max diff {(a.double() - b.double()).abs().max().item()})"


def _close(a, b, tol, what):
    err = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    scale = 1 + (b.double().abs().max().item() if b.numel() else 0.0)
    assert err <= tol * scale, f"{what}: max diff {err} > {tol} * {scale}"


def _agree(flag: bool) -> bool:
    """Whether ``flag`` holds on every rank (a MIN over the default gloo group)."""
    import torch.distributed as dist

    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def check_case(rank, world, case, device, want_backend):
    """One case (module docstring) with the layers on ``device``; ``want_backend``: the overlapped boundary's
    backend every call must report ("p2p" on the GPU), or None to accept any."""
    import sglang_layer
    import sglang_routing
    import sglang_stack

    seq_lens, compact, shared_tp1, chunk_rows, even = case
    kw = dict(seq_lens=seq_lens, strategy="zigzag", dtype=DTYPE, layers=2, shared_tp1=shared_tp1)
    backend = "p2p" if even and torch.device(device).type == "cuda" else None
    records = {"off": [], "ser": [], "on": []}  # SGLang's routing per run (sglang_routing)
    with sglang_routing.hook_select_experts(records["off"]):
        off, _, _ = _run(rank, world, {**kw, "device": "cpu"}, plugin=False, overlap=False, compact=compact)
    with sglang_routing.hook_select_experts(records["ser"]):
        ser, ser_status, ser_calls = _run(rank, world, {**kw, "device": device}, plugin=True, overlap=False,
                                          compact=compact, backend=backend)
    with sglang_routing.hook_select_experts(records["on"]):
        on, status, calls = _run(rank, world, {**kw, "device": device}, plugin=True, overlap=True,
                                 compact=compact, chunk_rows=chunk_rows, backend=backend)
    n, physical, logical = off["n_real"], off["physical"], off["logical"]
    assert (len(set(logical)) == 1) == bool(even), f"the case's counts {logical} (even: {even})"
    assert 0 in logical or even or seq_lens == UNEVEN, logical

    overlap = status["overlap"]
    # the overlap ran, on the transport asked for, and nothing took SGLang's or the NCCL path
    assert overlap["declined"] is None and overlap["layers"] == 2 and not overlap["serialized"], overlap
    assert status["gathers"].get("fused_add_rmsnorm_overlapped") == 2, status["gathers"]
    assert ser_status["overlap"]["layers"] == 0 and not ser_calls, ser_status["overlap"]
    assert ser_status["gathers"].get("fused_add_rmsnorm_all_gather") == 2, ser_status["gathers"]
    for st in (ser_status, status):
        assert st["nccl_batches"] == 0 and not st["declined"], st
    assert len(calls) == 2, calls
    for call in calls:
        if want_backend is not None:
            assert call["backend"] == want_backend, call["explain"]
        assert call["x"] == (torch.device(device), n), (call["x"], device, n)
        assert all(d == torch.device(device) for _, _, d in call["chunks"]), call["chunks"]
        # the consumer got each rank's real rows, in chunks of at most chunk_rows, each rank's in row order
        got = sorted((q, r) for q, r, _ in call["chunks"])
        want = sorted((q, c) for q, rows in enumerate(logical) for c in _chunks(rows, chunk_rows))
        assert got == want, (got, want)
    # SGLang's MoE saw the real rows per chunk, never the gathered tensor; the serialized plugin's the gathered one
    per_layer = sorted(c for q in logical for c in _chunks(q, chunk_rows))
    assert sorted(on["moe_rows"]) == sorted(per_layer * 2), (on["moe_rows"], per_layer)
    assert ser["moe_rows"] == [sum(logical) if compact else physical * world] * 2, ser["moe_rows"]

    rounding = sglang_stack.ROUNDING[DTYPE]
    # both sum alike: P2P's reduce-scatter on the GPU (fp32, rank order, one rounding) at every world; gloo's
    # (a rounding per add) only at 2 ranks
    sums_alike = torch.device(device).type == "cuda" or world == 2
    row_independent = _agree(sglang_layer.row_independent(
        rank, world, dtype=DTYPE, shared_tp1=shared_tp1, logical=logical, physical=physical, compact=compact,
        chunks=[c for q in logical for c in _chunks(q, chunk_rows)], device=device))
    bitwise = sums_alike and not shared_tp1 and row_independent
    merged = sglang_routing.merge_chunks(records["on"], calls)
    assert merged, ("the overlap's routing records do not match its chunks",
                    [(r["layer"], r["ids"].shape[0]) for r in records["on"]], [c["chunks"] for c in calls])
    routes = {"off": sglang_routing.routing(records["off"], physical, logical),
              "ser": sglang_routing.routing(records["ser"], physical, logical),
              "on": sglang_routing.routing(merged, physical, logical)}
    for name, route in routes.items():
        assert sorted(route) == [0, 1] and all(r["ids"].shape[0] == sum(logical) for r in route.values()), (name,
                                                                                                           route)
    # every comparison that is not bitwise, with the tokens whose top-k flipped between its two runs (on any
    # rank: each rank routes every token), agreed over the ranks before anything is asserted
    pairs = [("on", "ser", 4 * rounding)] if not bitwise else []
    pairs += [("on", "off", (world + 4) * rounding), ("ser", "off", (world + 4) * rounding)]
    flipped = _union({(a, b): sglang_routing.flips(routes[a], routes[b]) for a, b, _ in pairs})
    total, first = sum(logical), sum(logical[:rank])
    runs = {"on": on, "ser": ser, "off": off}
    for key in ("hidden", "residual"):
        a, b = on[key][:n].cpu(), ser[key][:n].cpu()
        assert torch.isfinite(a).all() and torch.isfinite(b).all(), f"{key}: not finite"
        if bitwise:
            _same(a, b, f"{key}: overlap vs serialized plugin")
        for x, y, tol in pairs:
            flips = flipped[(x, y)]
            # a flip is a near tie one run's kernels broke the other way, and rare; the rows it moved are
            # checked finite only, every other row of this rank within the bound
            for t, f in flips.items():
                assert min(f["ulps"]) <= NEAR_TIE_ULPS, (f"{x} vs {y}: token {t}'s top-k flipped at layer "
                                                         f"{f['layer']} ({f}), not at a near tie")
            assert len(flips) <= max(1, total // 40), f"{x} vs {y}: {len(flips)} tokens flipped: {flips}"
            keep = torch.tensor([first + i not in flips for i in range(n)], dtype=torch.bool)
            _close(runs[x][key][:n].cpu()[keep], runs[y][key][:n].cpu()[keep], tol,
                   f"{key}: {_NAMES[x]} vs {_NAMES[y]} (without the {len(flips)} flipped tokens)")
    reported = [f"{_NAMES[x]} vs {_NAMES[y]}: token {t} (rank {_owner(t, logical)}) top-k {f['ids'][0]} vs "
                f"{f['ids'][1]} at layer {f['layer']}, margin {f['ulps'][0]:.2f} / {f['ulps'][1]:.2f} bf16 ulps"
                for x, y, _ in pairs for t, f in sorted(flipped[(x, y)].items())]
    return {"bitwise": bitwise, "backends": [call["backend"] for call in calls], "flips": reported}


NEAR_TIE_ULPS = 4.0  # a flipped token's margin (sglang_routing) in at least one of the two runs
_NAMES = {"on": "overlap", "ser": "serialized plugin", "off": "plugin off"}


def _owner(token, logical):
    """The rank whose real rows hold ``token`` (tokens rank-major)."""
    for q, c in enumerate(logical):
        if token < c:
            return q
        token -= c
    raise ValueError(token)


def _union(flips: dict) -> dict:
    """Per comparison, the flipped tokens seen on any rank (an all_gather_object over the default gloo group):
    each rank routes every token, and rank r's rows sum every rank's partials."""
    import torch.distributed as dist

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, flips)
    out = {}
    for per_rank in gathered:
        for pair, found in per_rank.items():
            for t, f in found.items():
                out.setdefault(pair, {}).setdefault(t, f)
    return {pair: out.get(pair, {}) for pair in flips}


# --------------------------------------------------------------------------- the world
def setup_rank(rank, world, device):
    """SGLang's model module imported (sglang_layer.import_model), its parallel state, and on CUDA the P2P
    transport of the attention-CP group."""
    import sglang_layer
    import sglang_stack

    sglang_layer.import_model()
    coordinator = sglang_stack.ensure_parallel(rank, world)
    if torch.device(device).type == "cuda":
        import nsa_cp
        from nsa_cp.transport import get_p2p

        group = coordinator.device_group
        nsa_cp.init_p2p(group, MAX_TOKENS_PER_RANK, sglang_layer.H, DTYPE, device)
        assert get_p2p(group) is not None, "no P2P transport registered for the attention-CP group"


def _worker(rank, world, payload):
    device = rank_device(rank)
    torch.cuda.set_device(device)
    results = {}
    try:
        setup_rank(rank, world, device)
        results["setup"] = None
    except Exception:  # noqa: BLE001
        return {"setup": traceback.format_exc()}
    for key, case in payload.items():
        try:
            got = check_case(rank, world, case, device, "p2p")
            results[f"{BITWISE}{key}"], results[f"{FLIPS}{key}"] = got["bitwise"], got["flips"]
            results[key] = None
        except Exception:  # noqa: BLE001
            results[key] = traceback.format_exc()
        torch.cuda.synchronize()
    return results


_WORLDS = {}
BITWISE = "bitwise:"  # the result key of whether a case compared the overlap with the serialized plugin bitwise
FLIPS = "flips:"  # the result key of a case's top-k flips at near ties (check_case's "flips"), reported


def _world(world):
    sglang_env.require_sglang()
    if world not in _WORLDS:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("NSA_CP_P2P_MEMORY", "cuda_ipc")  # inherited by the spawned ranks, then restored
            _WORLDS[world] = run_world(world, "gloo-shared-gpu", _worker, CASES[world], timeout_s=600)
    return _WORLDS[world]


@pytest.mark.parametrize("world,key", [(w, k) for w in WORLDS for k in ["setup", *CASES[w]]])
def test_sglang_overlap_on_gpu(world, key):
    per_rank = _world(world)
    errors = case_failures(per_rank, key)
    assert not errors, "\n".join(errors)
    case = CASES[world].get(key)
    flips = sorted({f for r in per_rank for f in r.get(f"{FLIPS}{key}") or ()})
    if flips:  # near ties the runs' kernels broke apart: their rows were checked finite only, said, not hidden
        warnings.warn(f"world {world} {key}: MoE top-k flipped at near ties (those tokens' rows checked finite "
                      "only): " + "; ".join(flips))
    if case is not None and not case[2] and not all(r.get(f"{BITWISE}{key}") for r in per_rank):
        # the TP-sharded shared expert is compared bitwise where SGLang's MoE is row-independent on this GPU;
        # where the probe says it is not, the case held within the bound only: said, not hidden
        warnings.warn(f"world {world} {key}: SGLang's MoE is not row-independent on this GPU; the overlap was "
                      "checked against the serialized plugin within 4 bf16 roundings, not bit for bit")
