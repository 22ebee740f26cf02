"""SGLang 0.5.23's own DeepSeek decoder layers, its own MoE inside, on CPU / gloo with ranks = the
attention-CP group (tests/support/sglang_env.py's parallel state), for the overlapped boundary's tests.

What runs is SGLang's code, with one stand-in: the attention.

* The layer: a ``DeepseekV2DecoderLayer`` whose ``forward`` is SGLang's (the method nsa_cp's overlap hooks),
  built without its ``__init__`` (which builds MLA attention, CUDA-only kernels): the attributes ``forward``
  reads are set as ``__init__`` sets them, the stages come from the class's own ``_build_stages`` (its
  ``stage_facts``: ``declare_attn()``, ``declare_ffn(sparse=True, next_layer_sparse=True)``) inside
  SGLang's ``layer_stack()``, with SGLang's ``RMSNorm(force_native=True)`` norms.
* The MoE: SGLang's ``DeepseekV2MoE(config, layer_id, reduce_results=False)``, as the layer builds it, with
  seeded weights: its gate (replicated: the same on every rank), its ``FusedMoE`` experts sharded over
  the MoE TP group (= the CP group here: each rank's own seed) and its shared expert, TP-sharded (SGLang's
  default for the FULL-mode MoE) or replicated (``SGLANG_SHARED_EXPERT_TP1=1``, :func:`run_layers`'s
  ``shared_tp1``). On CPU ``forward`` takes ``forward_normal`` and ``FusedMoE`` takes
  ``UnquantizedFusedMoEMethod.forward_cpu`` -> ``moe_forward_native`` (tokens sorted by expert, one
  matmul per expert). That is the MoE path this machine can run; the path users run on GPUs
  (``forward_normal`` with the Triton / FlashInfer runner) has the same structure, its experts' kernels
  differing only.
* The stand-in attention: a fixed per-row map of this rank's ``[physical, H]`` rows (sglang_stack's).

The forward is ``DeepseekV2Model.forward``'s: ``residual_batch.start``, each layer's ``forward(positions,
hidden_states, forward_batch, zero_allocator)``, then ``complete_output`` and ``final_norm``.
"""

from __future__ import annotations

import contextlib
import os
from types import SimpleNamespace as NS

import torch

import sglang_env
import sglang_stack

H = 16
EPS = 1e-6
# divisible by every world of the tests (TP shards of the experts' and the shared expert's width)
MOE_INTERMEDIATE = 24
EXPERTS = 8


# SGLang's modules the layers and the overlap import beyond sglang_env's: the model, the native MoE it runs
MODEL_MODULES = ("sglang.srt.models.deepseek_v2", "sglang.srt.layers.moe.fused_moe_native",
                 "sglang.srt.layers.moe.mega_moe")


def import_model() -> None:
    """Import :data:`MODEL_MODULES` the way ``sglang_env.prepare_process`` imports SGLang's CP modules: on a
    GPU machine without ``sgl_kernel``, with ``torch.cuda.is_available()`` reading False during the import
    (SGLang's cached ``is_cuda()`` is False already), so no module imports a CUDA-only kernel and SGLang's op
    dispatch picks each op's ``forward_native`` (the MoE: ``moe_forward_native``); elsewhere a plain import.
    Call it before anything else imports them (every rank process that runs the layers on a GPU)."""
    import importlib
    import importlib.util
    from unittest import mock

    sglang_env.prepare_process()
    hide = torch.cuda.is_available() and importlib.util.find_spec("sgl_kernel") is None
    with mock.patch.object(torch.cuda, "is_available", return_value=False) if hide else contextlib.nullcontext():
        for name in MODEL_MODULES:
            importlib.import_module(name)


def config():
    """A DeepSeek-V3-like MoE config, every layer sparse (first_k_dense_replace 0)."""
    return NS(hidden_size=H, moe_intermediate_size=MOE_INTERMEDIATE, n_routed_experts=EXPERTS, num_experts_per_tok=2,
              n_shared_experts=1, routed_scaling_factor=2.5, hidden_act="silu", norm_topk_prob=True, n_group=2,
              topk_group=1, scoring_func="sigmoid", topk_method="noaux_tc", first_k_dense_replace=0,
              moe_layer_freq=1, rms_norm_eps=EPS)


@contextlib.contextmanager
def moe_runtime(strategy: str):
    """sglang_stack's runtime, plus the expert-parallel ranks FusedMoE reads (EP 1)."""
    from sglang.srt.runtime_context import get_parallel

    with sglang_stack.sglang_runtime(strategy):
        with get_parallel().override(moe_ep_rank=0, moe_dp_rank=0):
            yield


class StandInAttention(torch.nn.Module):
    """The attention's place in ``DeepseekV2DecoderLayer.forward``: a per-row map of this rank's rows."""

    def __init__(self, f):
        super().__init__()
        self.f = f

    @contextlib.contextmanager
    def maybe_use_decode_attn_tp(self, forward_batch):
        yield

    def forward(self, positions, hidden_states, forward_batch, zero_allocator, **kwargs):
        return self.f(hidden_states)


def _seeded(module, seed: int, scale: float, names=None):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if names is None or any(name.startswith(n) for n in names):
                p.copy_(scale * torch.randn(p.shape, generator=g))


def build_moe(rank, layer_id, dtype, seed, shared_tp1: bool, device="cpu"):
    """SGLang's DeepseekV2MoE for this rank: replicated parts seeded alike on every rank, sharded parts per rank.
    Built and seeded on the CPU (the same weights whatever ``device``), then moved to ``device``."""
    from sglang.srt.models.deepseek_v2 import DeepseekV2MoE

    old = os.environ.get("SGLANG_SHARED_EXPERT_TP1")
    os.environ["SGLANG_SHARED_EXPERT_TP1"] = "1" if shared_tp1 else "0"
    try:
        moe = DeepseekV2MoE(config(), layer_id=layer_id, reduce_results=False)
    finally:
        if old is None:
            os.environ.pop("SGLANG_SHARED_EXPERT_TP1")
        else:
            os.environ["SGLANG_SHARED_EXPERT_TP1"] = old
    assert moe._shared_expert_tp1 == shared_tp1
    _seeded(moe, seed * 100 + layer_id, 0.5, ("gate.",))
    _seeded(moe, seed * 100 + layer_id + 7 * (rank + 1), 0.3, ("experts.",))
    _seeded(moe, seed * 100 + layer_id + (50 if shared_tp1 else 11 * (rank + 1)), 0.3, ("shared_experts.",))
    moe = moe.to(dtype)
    moe.gate.e_score_correction_bias.data = moe.gate.e_score_correction_bias.data.float()
    return moe if torch.device(device).type == "cpu" else moe.to(device)


def build_layer(rank, layer_id, dtype, seed, shared_tp1: bool, device="cpu"):
    """SGLang's DeepseekV2DecoderLayer (module docstring) with SGLang's MoE and a stand-in attention, its
    weights on ``device``."""
    from sglang.srt.models.deepseek_v2 import DeepseekV2DecoderLayer

    cfg = config()
    layer = DeepseekV2DecoderLayer.__new__(DeepseekV2DecoderLayer)
    torch.nn.Module.__init__(layer)
    layer.hidden_size, layer.config, layer.layer_id, layer.is_nextn = H, cfg, layer_id, False
    layer.self_attn = StandInAttention(sglang_stack._row_fn(seed + 101 + layer_id))
    layer.is_layer_sparse = True
    layer.mlp = build_moe(rank, layer_id, dtype, seed, shared_tp1, device)
    layer.input_layernorm = sglang_stack._norm(seed + 10 * layer_id + 1, dtype).to(device)
    layer.post_attention_layernorm = sglang_stack._norm(seed + 10 * layer_id + 2, dtype).to(device)
    layer._gfx95_quant_format = ""
    layer.attn_boundary, layer.ffn_boundary = layer._build_stages(
        input_layernorm=layer.input_layernorm, post_attention_layernorm=layer.post_attention_layernorm,
        qkv_latent_func=None)
    return layer


def run_layers(rank, world, *, seq_lens, strategy, dtype, layers=2, seed=0, shared_tp1=False, device="cpu") -> dict:
    """Build the layers (now: their stages bind the ``_cp_moves`` in place) and run one prefill-CP extend.
    ``device``: where the weights and rows live ("cpu", or a CUDA device for ranks sharing a GPU over gloo).

    Returns ``hidden`` (the final norm's output) and ``residual``, both [physical, H]; ``n_real``,
    ``physical``, ``logical`` (every rank's real count) and ``moe_rows`` (the row count of every call of
    SGLang's ``DeepseekV2MoE.forward_normal``, chunks included)."""
    from sglang.srt.layers.layer_boundary import layer_stack
    from sglang.srt.layers.layer_boundary.residual import batch as residual_batch
    from sglang.srt.models.deepseek_v2 import DeepseekV2MoE

    sglang_stack.ensure_parallel(rank, world)
    with moe_runtime(strategy), torch.no_grad():
        md, logical = sglang_env.build_metadata(seq_lens, world, strategy)
        physical, real = md.per_rank_actual_token[0], logical[rank]
        with layer_stack():
            stack = [build_layer(rank, i, dtype, seed, shared_tp1, device) for i in range(layers)]
        final = sglang_stack._norm(seed + 3, dtype).to(device)
        moe_rows = []
        normal = DeepseekV2MoE.forward_normal

        def counted(self, hidden_states, *args, **kwargs):
            moe_rows.append(hidden_states.shape[0])
            return normal(self, hidden_states, *args, **kwargs)

        fb = sglang_stack.forward_batch(seq_lens, md)
        hidden = sglang_stack._inputs(rank, physical, real, dtype, seed).to(device)
        positions = torch.arange(physical, device=device)
        residual_batch.start(fb)
        DeepseekV2MoE.forward_normal = counted
        try:
            for layer in stack:
                hidden, _ = layer(positions, hidden, fb, None)
        finally:
            DeepseekV2MoE.forward_normal = normal
        hidden = residual_batch.complete_output(hidden, fb)
        kept = {}
        hidden = residual_batch.final_norm(hidden, fb, final, capture=lambda r: kept.setdefault("r", r.clone()))
        return {"hidden": hidden, "residual": kept["r"], "n_real": real, "physical": physical, "logical": logical,
                "moe_rows": moe_rows}


def row_independent(rank, world, *, dtype, shared_tp1, logical, physical, compact, chunks, seed=0,
                    device="cpu") -> bool:
    """Whether SGLang's MoE (this rank's, as :func:`build_moe` makes it) gives every real row the same bits
    on the serialized boundary's input (every rank's ``logical`` rows, rank-major, each rank padded with zero
    rows to ``physical``, or with ``compact`` not) as on the ``chunks`` (row counts in that order) the
    overlapped boundary hands it, on random rows (on ``device``: the bits are the device's kernels')."""
    sglang_stack.ensure_parallel(rank, world)
    with moe_runtime("zigzag"), torch.no_grad():
        moe = build_moe(rank, 0, dtype, seed, shared_tp1, device)
        x = torch.randn(sum(logical), H, generator=torch.Generator().manual_seed(seed + 9)).to(dtype).to(device)
        if compact:
            whole = moe(x.clone(), None)
        else:
            padded = x.new_zeros(physical * len(logical), H)
            for q, part in enumerate(x.split(list(logical))):
                padded[q * physical: q * physical + part.shape[0]] = part
            out = moe(padded, None)
            whole = torch.cat([out[q * physical: q * physical + n] for q, n in enumerate(logical)])
        parts = [moe(part.clone(), None) for part in x.split(list(chunks)) if part.shape[0]]
        return bool(torch.equal(whole, torch.cat(parts))) if parts else True
