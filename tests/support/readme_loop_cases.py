"""The README's decoder loop, run as printed on every rank (tests/package/test_readme_loop.py).

Each case builds the same small model on every rank (seeded): an embedding, layers whose attention is a
per-token linear map (CP-local) and whose MoE stand-in is one dense matrix per rank (the partials of an
expert-parallel MoE: their sum over ranks is the layer's MLP). The README's code block is then executed
with ``layers``, ``embed``, ``tokens`` (this rank's shard), ``layout`` and ``quant`` defined, and its final
``h`` / ``residual`` are compared with the same model run on the whole batch without CP.
"""

from __future__ import annotations

import traceback


def make_cases():
    cases = []
    for counts in ([5, 3], [0, 6], [4, 4]):
        for quant in (None, "fp8_e4m3_g128"):
            cases.append({"id": f"counts{'-'.join(map(str, counts))}-{quant or 'bf16'}", "counts": counts,
                          "quant": quant, "norm": "nsa"})
    # torch.nn.RMSNorm (eps=None, no residual argument) in the same loop
    for quant in (None, "fp8_e4m3_g128"):
        cases.append({"id": f"torch-rmsnorm-counts5-3-{quant or 'bf16'}", "counts": [5, 3], "quant": quant,
                      "norm": "torch"})
    return cases


def apply_norm(norm, h, residual):
    """The reference's add + norm, ``(y, residual)``: nsa_cp.RMSNorm's convention; for torch.nn.RMSNorm the
    sum in fp32 normed by torch itself (its eps=None, its arithmetic), rounded once."""
    import torch

    if not isinstance(norm, torch.nn.RMSNorm):
        return (norm(h), h) if residual is None else norm(h, residual)
    s = h.float() if residual is None else h.float() + residual.float()
    y = torch.nn.functional.rms_norm(s, norm.normalized_shape, norm.weight.float(), norm.eps).to(h.dtype)
    return y, (h if residual is None else s.to(h.dtype))


def _model(world: int, hidden: int, vocab: int, n_layers: int, seed: int, norm_kind: str = "nsa"):
    import torch

    import nsa_cp

    g = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    class Layer:
        def __init__(self):
            if norm_kind == "torch":
                self.input_layernorm = torch.nn.RMSNorm(hidden, dtype=dtype)  # eps=None
                self.post_attention_layernorm = torch.nn.RMSNorm(hidden, dtype=dtype)
            else:
                self.input_layernorm = nsa_cp.RMSNorm(hidden, eps=1e-6, dtype=dtype)
                self.post_attention_layernorm = nsa_cp.RMSNorm(hidden, eps=1e-6, dtype=dtype)
            for norm in (self.input_layernorm, self.post_attention_layernorm):
                norm.weight.data.copy_(1 + randn(hidden, scale=0.1))
                norm.weight.requires_grad_(False)
            self.w_attn = randn(hidden, hidden, scale=hidden ** -0.5)
            self.w_mlp = [randn(hidden, hidden, scale=hidden ** -0.5) for _ in range(world)]
            self.rank = None
            self.partials_dtypes = []

        def self_attn(self, h):
            return (h.float() @ self.w_attn.float()).to(dtype)

        def mlp_rows(self, h, rank):
            if isinstance(h, tuple):  # the FP8 wire: what an FP8 block-scale MoE reads
                h = nsa_cp.dequant_fp8_g128(*h, dtype)
            return (h.float() @ self.w_mlp[rank].float()).to(dtype)

        def mlp(self, h, out):
            self.partials_dtypes.append(out.dtype)
            out.copy_(self.mlp_rows(h, self.rank))
            return out

    return [Layer() for _ in range(n_layers)], randn(vocab, hidden)


def _reference(layers, emb, tokens, world, quant):
    """The model on the whole batch, no CP: ``(h, residual)`` of every token."""
    import torch

    import nsa_cp

    h, residual = emb[tokens], None
    for layer in layers:
        h, residual = apply_norm(layer.input_layernorm, h, residual)
        h = layer.self_attn(h)
        h, residual = apply_norm(layer.post_attention_layernorm, h, residual)
        if quant is not None:
            h = nsa_cp.quant_fp8_g128(h)
        h = sum(layer.mlp_rows(h, r).float() for r in range(world)).to(torch.bfloat16)
    return h, residual


def _case(rank: int, world: int, block: str, case) -> str | None:
    import torch

    import nsa_cp

    hidden, vocab, n_layers = 256, 32, 2
    counts = case["counts"]
    layout = nsa_cp.ShardLayout(per_rank_actual_token=counts)
    tokens_all = torch.randint(0, vocab, (layout.total_len,), generator=torch.Generator().manual_seed(7))
    start = layout.offsets[rank]
    mine = tokens_all[start:start + counts[rank]]

    layers, emb = _model(world, hidden, vocab, n_layers, seed=11, norm_kind=case["norm"])
    for layer in layers:
        layer.rank = rank
    scope = {"nsa_cp": nsa_cp, "torch": torch, "layers": layers, "embed": lambda t: emb[t], "tokens": mine,
             "layout": layout, "quant": case["quant"]}
    exec(compile(block, "README.md (decoder loop)", "exec"), scope)  # noqa: S102 - the README's own code
    got_h, got_res = scope["h"], scope["residual"]

    ref_layers, ref_emb = _model(world, hidden, vocab, n_layers, seed=11, norm_kind=case["norm"])
    ref_h, ref_res = _reference(ref_layers, ref_emb, tokens_all, world, case["quant"])
    want_h, want_res = ref_h[start:start + counts[rank]], ref_res[start:start + counts[rank]]
    bad_dtypes = [d for layer in layers for d in layer.partials_dtypes if d != torch.bfloat16]
    if bad_dtypes:
        return f"mlp_output_buffer gave partial buffers of {bad_dtypes}, expected torch.bfloat16 (the model's)"
    if len(layers[0].partials_dtypes) != 1:
        return f"the MoE ran {len(layers[0].partials_dtypes)} times in layer 0, expected once"
    for name, got, want in (("h", got_h, want_h), ("residual", got_res, want_res)):
        if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
            desc = f"{got.dtype} {list(got.shape)}" if isinstance(got, torch.Tensor) else type(got).__name__
            return f"{name}: expected {want.dtype} {list(want.shape)}, got {desc}"
        # the same arithmetic as the reference up to the order of the ranks' sums: within 2 bf16 ulps
        err = (got.float() - want.float()).abs()
        tol = 2 * 2.0 ** -7 * want.float().abs() + 1e-3
        if got.numel() and not bool((err <= tol).all()):
            return f"{name}: differs from the no-CP reference by up to {err.max().item():.4g} (rows {counts[rank]})"
    return None


def run_cases(rank: int, world: int, payload):
    results = {}
    for case in payload["cases"]:
        try:
            results[case["id"]] = _case(rank, world, payload["block"], case)
        except Exception:  # reported per case, the world goes on
            results[case["id"]] = traceback.format_exc()
    return results
