"""A DeepSeek-V3.2-like decoder layer stack, bound by SGLang 0.5.23's own layer-boundary code, run on
CPU / gloo with ranks = the attention-CP group (tests/support/sglang_env.py's parallel state).

What it builds, with SGLang's API only (nothing of SGLang's is copied):

* the stack: ``layer_boundary.factories.layer_stack()`` and, per layer, ``append_stages(...)`` of
  ``declare_attn()`` and ``declare_ffn(sparse=True, next_layer_sparse=True)``, each with SGLang's own
  ``layers.layernorm.RMSNorm(H, eps, force_native=True)`` (seeded weights): what
  ``DeepseekV2DecoderLayer.stage_facts`` / ``_build_stages`` append for a MoE layer of a config whose
  every layer is sparse (no attention output transform, no fusions: prefill CP turns cutedsl off;
  ``qkv_latent_func`` None, the stand-in attention has no QKV hook). The stack closes, so its stages
  bind, inside :func:`run_stack`: whatever ``_cp_moves`` the boundary modules bind then (SGLang's, or
  nsa_cp's after ``nsa_cp.integrations.sglang.install()`` or its plugin hook) is what the stack uses.
* optionally full-row attention stages: ``declare_attn(tp_group=SumGroup.TP)``, how
  ``Glm5NextDecoderLayer.stage_facts`` declares a KDA layer when linear attention partitions its heads
  over TP. Under prefill CP with ``attn_cp_size == tp_size`` its compute rows are all rows, so its entry
  is ``_select_entry_step``'s ``gathered == {TokenAxis.ATTN_CP}`` branch: ``partial(cp_moves.gather,
  gather=<the read on this rank's chunk>)``; its output owes the ATTN_CP sum (factories canonicalises TP
  to ATTN_CP there), which the next FFN's entry completes with ``cp_moves.reduce_scatter`` (the
  "head-parallel mixer" branch) before its own ``cp_moves.gather``. ``in_token_order=True`` (a scan)
  gathers through ``cp_gather_in_token_order`` instead, never ``cp_moves``; it is not built here.
* the forward, as ``DeepseekV2Model.forward`` / ``DeepseekV2DecoderLayer.forward`` run it:
  ``residual_batch.start``; per layer ``attn_boundary.prepare`` -> stand-in attention ->
  ``attn_boundary.finish`` -> ``ffn_boundary.prepare`` -> ``with ffn_boundary.exit(fb) as e:`` stand-in
  MoE -> ``e.finish``; then ``residual_batch.complete_output`` and ``residual_batch.final_norm`` with the
  final RMSNorm (its ``capture`` gives the residual).

The batch is SGLang's real ``ForwardBatch`` (a dataclass): ``forward_mode=EXTEND``
(``is_context_parallel_extend()``), ``attn_cp_metadata`` from ``sglang_env.build_metadata`` (SGLang's
zigzag / interleave ``build_metadata`` + ``pad_logical_token_to_physical``), ``input_ids`` of the whole
extend (as SGLang keeps it under CP; ``_ffn_has_tokens`` reads its length), placeholders for the other
required fields; the boundaries set ``residual_stream``. ``StagePlan.variant_for`` picks
CONTEXT_PARALLEL from ``dsa_use_prefill_cp``: the metadata, the forward mode and DSA prefill CP.

SGLang runtime settings, for the duration of :func:`run_stack` (all scoped, restored on exit):

* a dummy published config, ``get_context().override_server_args(...)`` (SGLang's own test seam): the
  ``exec`` / ``spec`` / ``lora`` / ``model`` namespaces construction and the exits read
  (``boundary_reduction`` "rs+rsv", no speculative algorithm, no LoRA), ``enable_prefill_cp=True`` and
  ``cp_strategy``; and ``_model_config`` seeded with an hf_config SGLang's ``is_deepseek_dsa`` accepts
  (``DeepseekV32ForCausalLM`` with ``index_topk``), so ``is_dsa_enable_prefill_cp()`` and with it
  ``_cp_gathers_over_attn_cp()`` hold: the DSA kind of CP moves (the one with a reduce-scatter).
* ``get_parallel().override(tp_group=..., moe_tp_group=..., moe_tp_size=world, tp_rank / moe_tp_rank)``,
  the groups being the attention-CP GroupCoordinator: TP spans the CP group (tp_size = world, attention
  TP 1, as setup_parallel stamps; SGLang's ``initialize_model_parallel`` aliases them at this topology),
  and with EP 1 the MoE TP group is the TP group. The MoE output's sum group,
  ``post_experts_reduction_group()`` (the MoE TP group when EP is 1), must span the ranks of
  ``cp_moves.reduce_scatter_group()`` for the FFN exit to bind ``cp_moves.reduce_scatter``; moe_tp_size
  keeps SGLang's check ``tp_size == moe_ep_size * moe_dp_size * moe_tp_size`` against the published
  config.

Stand-ins (``_row_fn``: elementwise with a fixed column roll, so exactly per row whatever the row count):
the attention maps this rank's [physical, H] rows to [physical, H]; a full-row attention and the MoE
return ``f(x) * w_r`` (weights summing to 1 over ranks: the TP-partial output whose sum is f(x)); the
MoE writes it into the tensor it receives (``x.copy_``), as SGLang's in-place MoE does. Both accept any
row count (SGLang's padded [physical * cp, H], nsa_cp's compact [sum(real), H]) and record it.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace as NS

import torch

import sglang_env

H = 16
EPS = 1e-6
# what SGLang's is_deepseek_dsa() takes for a DSA model (DeepSeek-V3.2): DSA prefill CP
DSA_HF_CONFIG = NS(architectures=["DeepseekV32ForCausalLM"], index_topk=2048)
_PARALLEL = {}


def ensure_parallel(rank: int, world: int):
    """``sglang_env.setup_parallel(rank, world)`` once per process; the attention-CP GroupCoordinator."""
    if _PARALLEL.get("world") != world:
        if _PARALLEL:
            raise RuntimeError(f"this process set up world {_PARALLEL['world']}, not {world}")
        _PARALLEL.update(world=world, group=sglang_env.setup_parallel(rank, world))
    return _PARALLEL["group"]


@contextlib.contextmanager
def sglang_runtime(strategy: str):
    """The published config and parallel overrides SGLang's construction and forward read (module doc)."""
    from sglang.srt.runtime_context import get_context, get_parallel

    parallel = get_parallel()
    group = parallel.attn_cp_group
    with get_context().override_server_args(device="cpu", enable_prefill_cp=True, cp_strategy=strategy,
                                            _model_config=NS(hf_config=DSA_HF_CONFIG)), \
            parallel.override(tp_group=group, tp_rank=group.rank_in_group, moe_tp_size=group.world_size,
                              moe_tp_group=group, moe_tp_rank=group.rank_in_group):
        yield


def _row_fn(seed: int):
    """A fixed per-row map f (float32 inside, the input's dtype out): elementwise plus a column roll,
    so each output row depends on that row's values only, bit for bit, whatever the row count."""
    g = torch.Generator().manual_seed(seed)
    a, b, c = (torch.randn(H, generator=g) for _ in range(3))
    def f(x):
        k = [t.to(x.device) for t in (a, b, c)]
        return torch.tanh(x.float() * k[0] + x.float().roll(1, dims=-1) * k[1] + k[2]).to(x.dtype)

    return f


def _stand_ins(seed: int):
    """(attention, full-row attention, MoE) per-row maps."""
    return _row_fn(seed + 101), _row_fn(seed + 102), _row_fn(seed + 103)


def _share(rank: int, world: int) -> float:
    """w_r: this rank's share of a TP-partial output; the shares sum to 1 over the ranks."""
    return (rank + 1) / (world * (world + 1) / 2)


def _norm(seed: int, dtype):
    """SGLang's RMSNorm, its forward_native forced (its CPU path wants sgl_kernel's AMX ops)."""
    from sglang.srt.layers.layernorm import RMSNorm

    norm = RMSNorm(H, eps=EPS, force_native=True)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(H, generator=torch.Generator().manual_seed(seed)))
    return norm.to(dtype)


def _full_row_layers(full_row_attention, layers):
    """The layer indices whose attention is full-row: True -> the last layer's; an int or indices."""
    if isinstance(full_row_attention, bool) or full_row_attention is None:
        return {layers - 1} if full_row_attention else set()
    return {full_row_attention} if isinstance(full_row_attention, int) else set(full_row_attention)


def build_stack(layers: int, full_rows, dtype, seed: int, device="cpu"):
    """``[(attn_boundary, ffn_boundary, full_row)]`` bound by SGLang's layer_stack, and the final norm."""
    from sglang.srt.layers.layer_boundary import SumGroup, append_stages, declare_attn, declare_ffn, layer_stack

    stack = []
    with layer_stack():
        for i in range(layers):
            attn = declare_attn(tp_group=SumGroup.TP) if i in full_rows else declare_attn()
            ffn = declare_ffn(sparse=True, next_layer_sparse=True)
            a, f = append_stages(
                (attn, _norm(seed + 10 * i + 1, dtype).to(device), {"qkv_latent_func": None, "fusions": None}),
                (ffn, _norm(seed + 10 * i + 2, dtype).to(device), {"fusions": None}))
            stack.append((a, f, i in full_rows))
    return stack, _norm(seed + 3, dtype).to(device)


def forward_batch(seq_lens, md):
    """SGLang's ForwardBatch for a prefill-CP extend of ``seq_lens`` with CP metadata ``md``."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    n, lens = sum(seq_lens), torch.tensor(list(seq_lens), dtype=torch.int64)
    return ForwardBatch(forward_mode=ForwardMode.EXTEND, batch_size=len(seq_lens),
                        input_ids=torch.zeros(n, dtype=torch.int64), req_pool_indices=torch.arange(len(seq_lens)),
                        seq_lens=lens, out_cache_loc=torch.arange(n), seq_lens_sum=n, attn_cp_metadata=md)


def _inputs(rank, physical, real, dtype, seed):
    """This rank's embeddings: random rows, the padding rows [real:] large garbage (never zeros)."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(physical, H, generator=g)
    x[real:] = 1e3 + 1e4 * torch.rand(physical - real, H, generator=g)
    return x.to(dtype)


def run_stack(rank, world, *, seq_lens, strategy, dtype, layers=2, full_row_attention=False, seed=0,
              device="cpu") -> dict:
    """Build the stack (now: it binds the ``_cp_moves`` in place) and run one prefill-CP extend on it.

    ``full_row_attention``: False, True (the last layer's attention is full-row), a layer index or indices.
    ``device``: where the rows live ("cpu", or a CUDA device for ranks sharing a GPU over gloo).
    The stand-ins' calls are recorded; padding rows [n_real:] of the outputs carry what the stack made of
    the garbage there (compare rows [:n_real], e.g. with :func:`reference_rows`).
    Returns ``hidden`` (the final norm's output) and ``residual`` (the updated residual it normed), both
    [physical, H]; ``n_real`` / ``physical`` (this rank's real and padded rows), ``logical`` (every
    rank's real count), ``moe_rows`` (the rows each MoE call got), ``moe_ptrs`` (the address of the tensor
    each MoE call wrote into), ``full_row_rows`` (each full-row
    attention's), ``variant`` (the batch variant the stages took) and ``cp_gather`` (module and name of
    the ``cp_moves.gather`` the first FFN bound: SGLang's ``_then_attn_cp_gather`` or an adapter's).
    """
    from sglang.srt.layers.layer_boundary.adapters.attention import get_attn_tp_context
    from sglang.srt.layers.layer_boundary.residual import batch as residual_batch

    ensure_parallel(rank, world)
    with sglang_runtime(strategy), torch.no_grad():  # a model forward runs without autograd
        md, logical = sglang_env.build_metadata(seq_lens, world, strategy)
        physical, real = md.per_rank_actual_token[0], logical[rank]
        stack, final = build_stack(layers, _full_row_layers(full_row_attention, layers), dtype, seed, device)
        share = _share(rank, world)
        attend, mix, moe_f = _stand_ins(seed)
        moe_rows, moe_ptrs, full_row_rows = [], [], []

        def moe(x):
            moe_rows.append(x.shape[0])
            moe_ptrs.append(x.data_ptr())
            return x.copy_(moe_f(x).float().mul(share).to(x.dtype))

        fb = forward_batch(seq_lens, md)
        hidden = _inputs(rank, physical, real, dtype, seed).to(device)
        residual_batch.start(fb)
        for attn_boundary, ffn_boundary, full_row in stack:
            x = attn_boundary.prepare(hidden, fb)
            if full_row:
                full_row_rows.append(x.shape[0])
                out = mix(x).float().mul(share).to(x.dtype)
            else:
                assert x.shape[0] == physical, (x.shape, physical)
                out = attend(x)
            get_attn_tp_context().clear_attn_inputs()
            hidden = attn_boundary.finish(out, fb)
            x = ffn_boundary.prepare(hidden, fb)
            with ffn_boundary.exit(fb) as ffn_exit:
                out = moe(x)
            hidden = ffn_exit.finish(out)
        hidden = residual_batch.complete_output(hidden, fb)
        kept = {}
        hidden = residual_batch.final_norm(hidden, fb, final, capture=lambda r: kept.setdefault("r", r.clone()))
        plan = stack[0][1].plan
        variant = plan.variant_for(fb)
        moves = plan.edges[variant].cp_moves
        gather = getattr(moves, "gather", None)
        return {"hidden": hidden, "residual": kept["r"], "n_real": real, "physical": physical,
                "logical": logical, "moe_rows": moe_rows, "moe_ptrs": moe_ptrs, "full_row_rows": full_row_rows, "variant": variant.name,
                "cp_gather": f"{getattr(gather, '__module__', None)}.{getattr(gather, '__qualname__', gather)}"}


def reference_rows(rank, world, *, seq_lens, strategy, dtype, layers=2, full_row_attention=False, seed=0):
    """What :func:`run_stack` must give on this rank's real rows, in float64 with no communication:
    every stand-in is per row and the TP-partial shares sum to 1, so each token's row goes through the
    layers alone (the norms' weights rounded to ``dtype`` as in the stack). ``(hidden, residual)``,
    both [n_real, H]; compare with a tolerance for ``dtype`` (the stack rounds to it between steps)."""
    ensure_parallel(rank, world)
    with sglang_runtime(strategy), torch.no_grad():
        md, logical = sglang_env.build_metadata(seq_lens, world, strategy)
        res = _inputs(rank, md.per_rank_actual_token[0], logical[rank], dtype, seed)[: logical[rank]].double()
        full_rows, (attend, mix, moe_f) = _full_row_layers(full_row_attention, layers), _stand_ins(seed)
        hid = torch.zeros_like(res)
        for i in range(layers):
            res = res + hid
            x = _norm(seed + 10 * i + 1, dtype).double().forward_native(res)
            res = res + (mix(x) if i in full_rows else attend(x))
            hid = moe_f(_norm(seed + 10 * i + 2, dtype).double().forward_native(res))
        res = res + hid
        return _norm(seed + 3, dtype).double().forward_native(res), res


# one rounding of the dtype, relative to the rows' size (they are O(1): norms and tanh)
ROUNDING = {torch.float32: 2e-6, torch.bfloat16: 2 ** -7}
# the stack against the float64 reference: the stack rounds to the dtype between its steps
REFERENCE = {torch.float32: 1e-4, torch.bfloat16: 0.1}


def _close(got, want, tol, what):
    err = (got.double() - want.double()).abs().max().item() if want.numel() else 0.0
    assert err <= tol * (1 + want.double().abs().max().item() if want.numel() else 1), f"{what}: max diff {err}"


def compare(on, off, ref, dtype, what, roundings=1):
    """Plugin on against off (``roundings`` roundings of the dtype: one where both sum the MoE partials
    alike) and both against the float64 reference, on this rank's real rows."""
    n = off["n_real"]
    for key, want in zip(("hidden", "residual"), ref):
        _close(on[key][:n].cpu(), off[key][:n].cpu(), roundings * ROUNDING[dtype], f"{what}: {key}, plugin on vs off")
        _close(off[key][:n].cpu(), want, REFERENCE[dtype], f"{what}: {key}, SGLang's own vs reference")
        _close(on[key][:n].cpu(), want, REFERENCE[dtype], f"{what}: {key}, plugin on vs reference")
