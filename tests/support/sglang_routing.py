"""SGLang's MoE routing, recorded per layer, for comparing runs of sglang_layer's layers (the GPU oracle,
tests/integrations/sglang/test_sglang_overlap_gpu.py, and scripts/tp1_routing_diag.py).

Two runs of the same layers on the same inputs can route a token differently where its top-k is a near tie:
the runs' own kernels (the CPU's vs the GPU's, one sum order vs another) move the router's scores by an ulp
or so, the top-k set flips, and the token's output then differs by far more than a rounding. This module says
which tokens flipped and how near a tie each was, so a comparison can tell a flip at a tie from a wrong sum.

* :func:`hook_select_experts` records every ``select_experts`` call of SGLang's MoE (layer id, router logits
  ``[rows, E]``, the fp32 correction bias ``[E]``, SGLang's chosen ids ``[rows, k]`` as int64, the gate's input
  rows ``[rows, H]``, the top-k config), all copied to the CPU;
* :func:`merge_chunks`: the overlap's MoE runs once per chunk (each source rank's real rows): one record per
  layer from them, rows rank-major;
* tokens: every real row of the batch, numbered rank-major (rank 0's real rows, then rank 1's, ...: the compact
  gathered order); :func:`real_rows` maps them onto a record's rows (padded: ``physical`` rows per rank;
  compact: the real rows only);
* :func:`routing`: per layer and token, SGLang's top-k id set (sorted ``[T, k]``) and the token's margin;
* :func:`flips`: the tokens whose top-k id set differs between two runs at any layer, with their margins at
  the first layer where they differ.

A token's margin: how far its routing decision is from a tie, in bf16 ulps, under DeepSeek's grouped biased
top-k as SGLang's ``biased_grouped_topk_impl`` computes it (scores = sigmoid(logits) in the logits' dtype, +
the fp32 bias; a group's score = the sum of its top 2; the top ``topk_group`` groups; the top k inside them):
the smaller of the group choice's (``topk_group``-th best group score - the next) in ulps of the largest
sigmoid score, and the k-th vs (k+1)-th score inside the chosen groups in ulps of the k-th's sigmoid score.
A margin under 1 ulp is a tie one rounding of the logits can break.
"""

from __future__ import annotations

from unittest import mock

import torch


def hook_select_experts(records: list):
    """A patch of SGLang's ``select_experts`` appending one record per call to ``records`` (module docstring);
    the call itself runs unchanged."""
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


def merge_chunks(records: list, calls: list) -> list:
    """The overlap's records (one per chunk) as one record per layer, its rows rank-major (the compact gathered
    order): the chunk sources from the boundary calls the test's spy recorded (``call["chunks"]``: ``(source,
    rows, device)`` in call order, one call per layer); ``[]`` where they do not match the records."""
    layers = sorted({r["layer"] for r in records}, key=lambda v: (v is None, v))
    if len(layers) != len(calls):
        return []
    merged = []
    for layer, call in zip(layers, calls):
        recs = [r for r in records if r["layer"] == layer]
        sources = [q for q, rows, _ in call["chunks"] if rows]
        if len(recs) != len(sources):
            return []
        order = sorted(range(len(recs)), key=lambda j: sources[j])  # stable: a source's chunks in row order
        merged.append({**recs[0], **{k: torch.cat([recs[j][k] for j in order]) for k in ("logits", "ids", "x")}})
    return merged


def ulp_bf16(v: torch.Tensor) -> torch.Tensor:
    """The bf16 ulp at |v| (2^(floor(log2|v|) - 7)), elementwise; the smallest normal's for 0."""
    a = v.abs().clamp_min(2.0 ** -126)
    return torch.exp2(torch.floor(torch.log2(a)) - 7)


def decisions(rec: dict):
    """Per row of a record: ``(ids [rows, k] recomputed and sorted, margin in ulps [rows], which decision is the
    tighter [rows]: 1 the group choice, 0 the expert choice, expert margin [rows], group margin [rows])``
    (module docstring)."""
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
    e_unit = ulp_bf16(sig.gather(1, sorder[:, k - 1: k]).squeeze(1))
    g_unit = ulp_bf16(sig.max(dim=-1)[0])
    e_ulps, g_ulps = e_margin / e_unit, g_margin / g_unit
    ids = sorder[:, :k].sort(dim=-1)[0]
    return ids, torch.minimum(e_ulps, g_ulps), torch.where(g_ulps < e_ulps, 1, 0), e_margin, g_margin


def real_rows(physical: int, logical, compact: bool):
    """``(row index [T] of every token in a gathered tensor, [(rank, local row)] per token)``: tokens
    rank-major; ``compact``: the gathered tensor holds the real rows only, else ``physical`` rows per rank."""
    rows, who, off = [], [], 0
    for q, n in enumerate(logical):
        base = off if compact else q * physical
        rows += [base + i for i in range(n)]
        who += [(q, i) for i in range(n)]
        off += n
    return torch.tensor(rows, dtype=torch.long), who


def by_layer(records: list) -> dict:
    """layer id (the call's index where SGLang passed none) -> its first record."""
    out = {}
    for i, rec in enumerate(records):
        out.setdefault(rec["layer"] if rec["layer"] is not None else i, rec)
    return out


def routing(records: list, physical: int, logical) -> dict:
    """layer -> per token (rank-major): ``ids`` (SGLang's top-k, sorted, ``[T, k]``), ``ulps`` (margin,
    ``[T]``), ``kind`` (1: the group choice is the tighter), ``x`` and ``logits`` (fp32, ``[T, H]`` /
    ``[T, E]``), ``recompute_mismatch`` (tokens whose recomputed top-k is not SGLang's: the margin does not
    describe them). A record's rows are the compact gathered ones where it has ``sum(logical)`` rows, else
    ``physical`` per rank (SGLang's moves and the padded plugin)."""
    out = {}
    for layer, rec in sorted(by_layer(records).items()):
        rows = real_rows(physical, logical, rec["x"].shape[0] == sum(logical))[0]
        ids, ulps, kind, _, _ = decisions(rec)
        got = rec["ids"].sort(dim=-1)[0]
        out[layer] = {"ids": got[rows], "ulps": ulps[rows], "kind": kind[rows], "x": rec["x"][rows].float(),
                      "logits": rec["logits"][rows].float(),
                      "recompute_mismatch": (got[rows] != ids[rows]).any(-1).sum().item()}
    return out


def flips(a: dict, b: dict) -> dict:
    """Tokens whose top-k id set differs between two :func:`routing` results at any layer: token -> ``{"layer":
    the first such layer, "ids": (a's, b's), "ulps": (a's margin, b's) there}``."""
    out = {}
    for layer in sorted(set(a) & set(b)):
        da, db = a[layer], b[layer]
        for t in (da["ids"] != db["ids"]).any(-1).nonzero().flatten().tolist():
            if t not in out:
                out[t] = {"layer": layer, "ids": (da["ids"][t].tolist(), db["ids"][t].tolist()),
                          "ulps": (da["ulps"][t].item(), db["ulps"][t].item())}
    return out
