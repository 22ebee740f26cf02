#!/usr/bin/env python3
"""Routing-flip diagnostic for tests/integrations/sglang/test_sglang_overlap_gpu.py's replicated-shared-expert
(SGLANG_SHARED_EXPERT_TP1) cases: does the serialized plugin on the GPU differ from the plugin off (CPU, gloo)
only on rows whose MoE top-k flips at a near tie?

It runs the test's cases (``CASES[world][case]``: seq_lens, compact, shared_tp1; default both uneven TP1 cases
at world 3) with the test's own ``setup_rank`` and ``_run`` in one world (ranks sharing one GPU over gloo, the
P2P transport on it, as the test runs them), four runs per case (``--runs``):

* ``off``: the plugin off, the layers on the CPU (SGLang's moves over gloo), the test's reference;
* ``ser``: the serialized plugin (``install()``), the layers on ``--device`` (on CUDA: P2P's reduce-scatter,
  fp32 in rank order, rounded once); the adapter's SGLANG_SHARED_EXPERT_TP1 decline patched off, so that
  nsa_cp's moves run (the line "ser: nsa_cp gathers ..." says which ran);
* ``p2psum``: the plugin off on the CPU, SGLang's attention-CP reduce-scatter replaced by P2P's summation
  (every rank's bf16 partial summed in fp32, rank order 0..P-1, rounded once): ``off`` vs ``p2psum`` is the
  sum order alone, ``p2psum`` vs ``ser`` the CPU's kernels vs the device's;
* ``ovl``: the overlap (NSA_CP_SGLANG_OVERLAP=1) on ``--device``, its TP1-on-CUDA decline patched off (the
  "open defect" overlap.layer_reason names): ``ser`` vs ``ovl`` is what that decline hides.

SGLang's ``select_experts`` is hooked: per layer (0 and 1) it records the router logits, the correction bias,
the chosen ids and the gate's input rows. Printed: per run and layer, the near ties (margin < --near-ulps);
per pair of runs and layer, how many gate inputs / logits differ and every token whose top-k set differs, with
its margins in both runs; then the outputs' max diff, on every real row and without the flipped tokens, in
bf16 roundings relative to the rows' size (the test's measure; its bound is world + 4), and a VERDICT line.
A token's margin: DeepSeek's grouped biased top-k (biased_grouped_topk_impl): the smaller of the group choice's
(best group score - next) and the k-th vs (k+1)-th score inside the chosen group, in bf16 ulps of the sigmoid
score at the tie. Tokens are numbered rank-major over the real rows (the compact gathered order).

On the GPU machine (SGLang carried in .whl/, nsa_cp._C built), about a minute:
    source scripts/gpu_sglang.sh && python3 scripts/tp1_routing_diag.py
Here (CPU, gloo; ``ser`` is then the plugin's gloo path):
    NSA_TEST_REQUIRE_SGLANG=1 PYTHONPATH=. <sglang venv>/bin/python scripts/tp1_routing_diag.py --device cpu
Options: --world N, --case KEY (repeatable), --runs off,ser,p2psum,ovl, --fp32-router (the gate's weight in fp32:
SGLang's MoEGate then computes fp32 logits), --save PREFIX (torch.save the records per case).
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time
from unittest import mock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (os.path.join(ROOT, "tests", "integrations", "sglang"), os.path.join(ROOT, "tests", "support"), ROOT):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402

RUNS = ("off", "ser", "p2psum", "ovl")


# --------------------------------------------------------------------------- in each rank
def _p2p_sum(coordinator):
    """A reduce_scatter_tensor for SGLang's GroupCoordinator that sums as nsa_cp's P2P reduce-scatter does:
    every rank's partial in fp32, in rank order 0..P-1, rounded once to the output's dtype."""
    import torch.distributed as dist

    def reduce_scatter_tensor(output, input):
        parts = [torch.empty_like(input) for _ in range(coordinator.world_size)]
        dist.all_gather(parts, input.contiguous(), group=coordinator.device_group)
        n, rank = output.numel(), coordinator.rank_in_group
        acc = torch.zeros(n, dtype=torch.float32, device=input.device)
        for part in parts:
            acc += part.reshape(-1)[rank * n: (rank + 1) * n].float()
        output.copy_(acc.to(output.dtype).view_as(output))

    return reduce_scatter_tensor


def _hook_select_experts(records):
    """Record every select_experts call: layer id, router logits, correction bias, chosen ids, gate input."""
    from sglang.srt.layers.moe import topk as tk

    real = tk.select_experts

    def spy(hidden_states, router_logits, topk_config, **kw):
        out = real(hidden_states, router_logits, topk_config, **kw)
        bias = kw.get("dynamic_expert_bias")
        bias = topk_config.correction_bias if bias is None else bias
        records.append({"layer": kw.get("layer_id"), "logits": router_logits.detach().cpu().clone(),
                        "bias": None if bias is None else bias.detach().float().cpu().clone(),
                        "ids": out.topk_ids.detach().cpu().long().clone(), "x": hidden_states.detach().cpu().clone(),
                        "cfg": (topk_config.top_k, topk_config.num_expert_group, topk_config.topk_group,
                                topk_config.use_grouped_topk, topk_config.num_shared_topk_slots)})
        return out

    return mock.patch.object(tk, "select_experts", spy)


def _fp32_router():
    import sglang_layer

    real = sglang_layer.build_moe

    def build(*args, **kwargs):
        moe = real(*args, **kwargs)
        moe.gate.weight.data = moe.gate.weight.data.float()
        return moe

    return mock.patch.object(sglang_layer, "build_moe", build)


def _overlap_admits_tp1():
    """Patch the overlap's ``layer_reason`` to see the rows as not CUDA's: its SGLANG_SHARED_EXPERT_TP1-on-CUDA
    decline (the only check that reads ``is_cuda``) then lets the overlap run; every other check as it is."""
    from nsa_cp.integrations.sglang import overlap as ov

    real = ov.layer_reason

    class _Rows:
        is_cuda = False

        def __init__(self, x):
            self._x = x

        def __getattr__(self, name):
            return getattr(self._x, name)

    def layer_reason(layer, forward_batch, hidden_states):
        rows = _Rows(hidden_states) if isinstance(hidden_states, torch.Tensor) else hidden_states
        return real(layer, forward_batch, rows)

    return mock.patch.object(ov, "layer_reason", layer_reason)


def _merge_chunks(records, calls):
    """The overlap's MoE runs once per chunk (each source rank's real rows): one record per layer, its rows
    rank-major (the compact gathered order), from the chunk sources the boundary spy saw, in call order."""
    layers = sorted({r["layer"] for r in records})
    if len(layers) != len(calls):
        return []
    merged = []
    for layer, call in zip(layers, calls):
        recs = [r for r in records if r["layer"] == layer]
        sources = [q for q, rows, _ in call["chunks"] if rows]
        if len(recs) != len(sources):
            return []
        order = sorted(range(len(recs)), key=lambda j: sources[j])
        merged.append({**recs[0], **{k: torch.cat([recs[j][k] for j in order]) for k in ("logits", "ids", "x")}})
    return merged


def _run_case(rank, world, device, case, runs, fp32_router, coordinator):
    import contextlib

    import test_sglang_overlap_gpu as T
    from nsa_cp.integrations.sglang import runtime as nsa_runtime

    seq_lens, compact, shared_tp1, _chunk_rows, even = case
    kw = dict(seq_lens=seq_lens, strategy="zigzag", dtype=T.DTYPE, layers=2, shared_tp1=shared_tp1)
    backend = "p2p" if even and torch.device(device).type == "cuda" else None
    out = {}
    for name in runs:
        records = []
        patches = [_hook_select_experts(records)]
        if fp32_router:
            patches.append(_fp32_router())
        if name == "p2psum":
            patches.append(mock.patch.object(coordinator, "reduce_scatter_tensor", _p2p_sum(coordinator)))
        if name in ("ser", "ovl"):  # nsa_cp's moves, whatever the adapter says of SGLANG_SHARED_EXPERT_TP1
            patches.append(mock.patch.object(nsa_runtime, "shared_expert_tp1", lambda: False))
        if name == "ovl":
            patches.append(_overlap_admits_tp1())
        with contextlib.ExitStack() as stack:
            for p in patches:
                stack.enter_context(p)
            t0 = time.monotonic()
            plugin = name in ("ser", "ovl")
            res, status, calls = T._run(rank, world, {**kw, "device": device if plugin else "cpu"},
                                    plugin=plugin, overlap=name == "ovl", compact=compact, backend=backend)
            if res["hidden"].is_cuda:
                torch.cuda.synchronize()
        if name == "ovl":
            records = _merge_chunks(records, calls)
        n = res["n_real"]
        out[name] = {"hidden": res["hidden"][:n].cpu(), "residual": res["residual"][:n].cpu(),
                     "records": records if rank == 0 else None, "n": n, "physical": res["physical"],
                     "logical": res["logical"], "s": time.monotonic() - t0,
                     "moves": None if status is None else {k: status[k] for k in
                                                           ("gathers", "reduce_scatters", "declined", "p2p",
                                                                            "overlap")}}
    return out


def _worker(rank, world, payload):
    import io
    import traceback

    import sglang_stack
    import test_sglang_overlap_gpu as T

    device = payload["device"]
    if device == "cuda":
        from dist_harness import rank_device

        device = rank_device(rank)
        torch.cuda.set_device(device)
    try:
        T.setup_rank(rank, world, device)
        coordinator = sglang_stack.ensure_parallel(rank, world)
        blobs = {}
        for name, case in payload["cases"].items():
            out = _run_case(rank, world, device, case, payload["runs"], payload["fp32_router"], coordinator)
            buf = io.BytesIO()  # bytes, not tensors: a queued tensor is shared by fd and dies with the rank
            torch.save(out, buf)
            blobs[name] = buf.getvalue()
        return {"blobs": blobs}
    except Exception:  # noqa: BLE001
        return {"__world__": traceback.format_exc()}


# --------------------------------------------------------------------------- analysis (parent)
def _ulp_bf16(v):
    """The bf16 ulp at |v| (2^(floor(log2|v|) - 7)), elementwise; the smallest normal's for 0."""
    a = v.abs().clamp_min(2.0 ** -126)
    return torch.exp2(torch.floor(torch.log2(a)) - 7)


def _decisions(rec):
    """Per token: (recomputed ids set as a sorted tensor, margin, margin in ulps, which decision is tighter).
    DeepSeek's biased grouped top-k as biased_grouped_topk_impl computes it: scores = sigmoid(logits) in the
    logits' dtype, + the fp32 bias; group score = sum of its top 2; top ``topk_group`` groups; top-k inside."""
    top_k, n_group, topk_group, grouped, shared_slots = rec["cfg"]
    logits = rec["logits"]
    sig = logits.sigmoid().float()
    bias = rec["bias"] if rec["bias"] is not None else torch.zeros(logits.shape[1])
    s = sig + bias.view(1, -1)
    t, e = s.shape
    n_group = n_group if grouped and n_group else 1
    topk_group = topk_group if grouped and topk_group else 1
    per = e // n_group
    gs = s.view(t, n_group, per).topk(min(2, per), dim=-1)[0].sum(-1)  # [t, groups]
    gsorted, gorder = gs.sort(dim=-1, descending=True)
    g_margin = (gsorted[:, topk_group - 1] - gsorted[:, topk_group]) if n_group > topk_group else \
        torch.full((t,), float("inf"))
    mask = torch.zeros(t, n_group, dtype=torch.bool)
    mask.scatter_(1, gorder[:, :topk_group], True)
    masked = s.masked_fill(~mask.repeat_interleave(per, dim=1), float("-inf"))
    k = top_k - shared_slots
    ssorted, sorder = masked.sort(dim=-1, descending=True)
    e_margin = ssorted[:, k - 1] - ssorted[:, k]
    # the unit: one bf16 ulp of the sigmoid scores at the tie (what a 1-ulp logit change moves them by, or less)
    e_unit = _ulp_bf16(sig.gather(1, sorder[:, k - 1: k]).squeeze(1))
    g_unit = _ulp_bf16(sig.max(dim=-1)[0])
    e_ulps, g_ulps = e_margin / e_unit, g_margin / g_unit
    ids = sorder[:, :k].sort(dim=-1)[0]
    return ids, torch.minimum(e_ulps, g_ulps), torch.where(g_ulps < e_ulps, 1, 0), e_margin, g_margin


def _real_rows(physical, logical, compact):
    """Gathered row index of every real token (rank-major), and its (rank, local row)."""
    rows, who, off = [], [], 0
    for q, n in enumerate(logical):
        base = off if compact else q * physical
        rows += [base + i for i in range(n)]
        who += [(q, i) for i in range(n)]
        off += n
    return torch.tensor(rows), who


def _by_layer(records):
    out = {}
    for i, rec in enumerate(records):
        out.setdefault(rec["layer"] if rec["layer"] is not None else i, rec)
    return out


def analyse(per_rank, world, case_name, case, runs, near_ulps):
    seq_lens, compact, shared_tp1 = case[0], case[1], case[2]
    r0 = per_rank[0]
    physical, logical = r0[runs[0]]["physical"], r0[runs[0]]["logical"]
    who = _real_rows(physical, logical, True)[1]
    print(f"case {case_name}: world {world}, seq_lens {seq_lens}, counts {logical}, physical {physical}, "
          f"{'compact' if compact else 'padded'}, shared expert {'replicated (TP1)' if shared_tp1 else 'TP-sharded'}")
    print("tokens: rank-major real rows (a token's index is its row in the compact gathered order)")
    print("run seconds (rank 0): " + ", ".join(f"{r} {r0[r]['s']:.1f}" for r in runs))
    for r in ("ser", "ovl"):
        if r in runs:
            m = r0[r]["moves"]
            p2p, ovl = m["p2p"] or {}, m["overlap"] or {}
            print(f"{r}: nsa_cp gathers {m['gathers']}, reduce-scatters {m['reduce_scatters']}, declined "
                  f"{m['declined']}, p2p on={p2p.get('on')} transport={p2p.get('transport')}; overlapped layers "
                  f"{ovl.get('layers')}, serialized {ovl.get('serialized')}")
    dec = {}
    for r in runs:
        if not r0[r]["records"]:
            print(f"  {r}: no routing records (its chunks could not be put in order)")
        layers = _by_layer(r0[r]["records"])
        dec[r] = {}
        for layer, rec in sorted(layers.items()):
            # the gate's rows: SGLang's moves (and the padded plugin) gather physical rows per rank, the
            # compact plugin the real rows only
            rows = _real_rows(physical, logical, rec["x"].shape[0] == sum(logical))[0]
            ids, ulps, kind, _, _ = _decisions(rec)
            got = rec["ids"].sort(dim=-1)[0]
            bad = (got[rows] != ids[rows]).any(-1).sum().item()
            dec[r][layer] = {"ids": got[rows], "ulps": ulps[rows], "kind": kind[rows], "x": rec["x"][rows].float(),
                             "logits": rec["logits"][rows].float(), "recompute_mismatch": bad}
        for layer, d in sorted(dec[r].items()):
            u = d["ulps"]
            print(f"  {r:6s} layer {layer}: {len(u)} tokens; margin min {u.min().item():.2f} ulp; tokens with "
                  f"margin < 1/2/{near_ulps} ulp: {(u < 1).sum().item()}/{(u < 2).sum().item()}/"
                  f"{(u < near_ulps).sum().item()}" + (f"  (recomputed top-k != SGLang's on {d['recompute_mismatch']}"
                                                       " tokens)" if d["recompute_mismatch"] else ""))
            near = (u < near_ulps).nonzero().flatten().tolist()
            if near:
                print("      near ties (token: margin ulp, ids, tighter choice): " + "; ".join(
                    f"{t}: {u[t].item():.2f}, {d['ids'][t].tolist()}, {'group' if d['kind'][t] else 'expert'}"
                    for t in near))
    pairs = [(a, b) for a, b in (("off", "ser"), ("off", "p2psum"), ("p2psum", "ser"), ("off", "ovl"),
                                 ("ser", "ovl")) if a in runs and b in runs]
    rounding = 2.0 ** -7
    for a, b in pairs:
        print(f"-- {a} vs {b}")
        flipped = set()
        for layer in sorted(set(dec[a]) & set(dec[b])):
            da, db = dec[a][layer], dec[b][layer]
            dx = (da["x"] - db["x"]).abs()
            dl = (da["logits"] - db["logits"]).abs()
            print(f"  layer {layer}: gate input differs on {(dx.amax(-1) > 0).sum().item()} tokens "
                  f"(max {dx.max().item():.3g}), logits on {(dl.amax(-1) > 0).sum().item()} "
                  f"(max {dl.max().item():.3g})")
            diff = (da["ids"] != db["ids"]).any(-1).nonzero().flatten().tolist()
            for t in diff:
                flipped.add(t)
                q, i = who[t]
                print(f"    FLIP token {t} (rank {q} row {i}): ids {da['ids'][t].tolist()}"
                      f" vs {db['ids'][t].tolist()}; margin {da['ulps'][t].item():.2f} / {db['ulps'][t].item():.2f} ulp"
                      f" ({'group' if da['kind'][t] else 'expert'} choice); gate input max diff "
                      f"{dx[t].max().item():.3g}, logits max diff {dl[t].max().item():.3g}")
            if not diff:
                print("    no top-k flips")
        verdict = []
        for key in ("hidden", "residual"):
            # in bf16 roundings relative to the rows' size, per rank, as the test's _close: diff / (2^-7 (1 + max|b|))
            worst = worst_kept = raw = raw_kept = 0.0
            off = 0
            for q in range(world):
                x, y = per_rank[q][a][key].double(), per_rank[q][b][key].double()
                n = x.shape[0]
                if n:
                    keep = torch.tensor([off + i not in flipped for i in range(n)], dtype=torch.bool)
                    d = (x - y).abs()
                    unit = rounding * (1 + y.abs().max().item())
                    worst, raw = max(worst, d.max().item() / unit), max(raw, d.max().item())
                    if keep.any():
                        worst_kept = max(worst_kept, d[keep].max().item() / unit)
                        raw_kept = max(raw_kept, d[keep].max().item())
                    for i in range(n):
                        if d[i].max().item() > 0.1:
                            print(f"    {key}: rank {q} row {i} (token {off + i}) max diff {d[i].max().item():.3g}"
                                  f"{' [flipped]' if off + i in flipped else ''}")
                off += n
            print(f"  {key}: max diff {raw:.4g} = {worst:.2f} roundings; without the {len(flipped)} flipped tokens "
                  f"{raw_kept:.4g} = {worst_kept:.2f} roundings (the test's bound: {world + 4})")
            verdict.append(f"{key} {'within' if worst <= world + 4 else 'OVER'}, without flips "
                           f"{'within' if worst_kept <= world + 4 else 'OVER'}")
        print(f"  VERDICT {a} vs {b}: {len(flipped)} token(s) flipped {sorted(flipped)}; " + "; ".join(verdict))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--world", type=int, default=3)
    ap.add_argument("--case", action="append", help="a key of the GPU test's CASES[world] (repeatable); "
                    "default uneven-padded-tp1-shared and uneven-compact-tp1-shared")
    ap.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {RUNS}")
    ap.add_argument("--fp32-router", action="store_true", help="the gate's weight in fp32 (fp32 logits)")
    ap.add_argument("--save", help="also torch.save each case's records to SAVE.<case>.pt")
    ap.add_argument("--near-ulps", type=float, default=4.0)
    args = ap.parse_args()
    os.environ.setdefault("NSA_TEST_PG_TIMEOUT_S", "120")
    import test_sglang_overlap_gpu as T
    from dist_harness import run_world

    runs = [r for r in args.runs.split(",") if r]
    assert set(runs) <= set(RUNS) and runs, runs
    cases = args.case or ["uneven-padded-tp1-shared", "uneven-compact-tp1-shared"]
    backend = "gloo-shared-gpu" if args.device == "cuda" else "gloo"
    if args.device == "cuda":
        os.environ.setdefault("NSA_CP_P2P_MEMORY", "cuda_ipc")
        print(f"device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}")
    print(f"runs {runs}; router {'fp32' if args.fp32_router else 'bf16 (SGLang with CUDA hidden)'}", flush=True)
    t0 = time.monotonic()
    chosen = {name: T.CASES[args.world][name] for name in cases}
    per_rank = run_world(args.world, backend, _worker, {"device": args.device, "cases": chosen, "runs": runs,
                                                        "fp32_router": args.fp32_router}, timeout_s=300)
    bad = [r.get("__world__") for r in per_rank if "__world__" in r]
    if bad:
        print("FAILED\n" + "\n".join(b for b in bad if b))
        sys.exit(1)
    print(f"world ran in {time.monotonic() - t0:.1f} s\n", flush=True)
    for name, case in chosen.items():
        got = [torch.load(io.BytesIO(r["blobs"][name]), weights_only=False) for r in per_rank]
        if args.save:
            torch.save({"case": name, "world": args.world, "per_rank": got}, f"{args.save}.{name}.pt")
        analyse(got, args.world, name, case, runs, args.near_ulps)
        print(flush=True)


if __name__ == "__main__":
    main()
