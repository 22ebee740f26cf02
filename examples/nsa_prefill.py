"""A DeepSeek-V3.2-shaped prefill under context parallelism, checked against the same model without CP.

Launch (one process per CP rank)::

    torchrun --nproc-per-node 2 examples/nsa_prefill.py --device cpu                     # gloo, fp32
    torchrun --nproc-per-node 2 examples/nsa_prefill.py --device cuda \\
        --enable-nsa-prefill-cp-shared-kv --comm both                                    # NCCL, bf16
    torchrun --nproc-per-node 8 examples/nsa_prefill.py --device cuda --comm all \\
        --enable-nsa-prefill-cp-shared-kv                                   # one GPU: 8 ranks share it

One GPU (more local ranks than GPUs, cp = 2..8): the ranks share it. NCCL refuses two ranks on one GPU,
so the group is gloo and nsa_cp's data goes over the P2P transport, which maps the peers' buffers
through CUDA IPC (``NSA_CP_P2P_MEMORY=auto`` picks it; the KV gather gets a group and transport of its
own width). The baseline runs its collectives over gloo on host copies: checked, not timed. The GPU
time-slices the ranks, so the times are the total work of all ranks, not the latency of a run at that
cp. ``examples/nsa_prefill_sweep.py`` runs several configurations in one launch, and
``examples/one_gpu_check.sh`` is the whole one-GPU check and measurement (docs/development.md).

Each layer, every rank holding only its own tokens (the residual stream stays local ``[n_r, H]``)::

    RMSNorm -> MLA-like attention -> RMSNorm -> FULL-mode MoE
    attention: q, the KV latent, the rotary key and the indexer key for the rank's own tokens; the
               latent/keys of every rank gathered in the batch's token order (shared KV: the ORDERED
               gather, ``nsa_cp.cp_all_gather(x, layout, group, positions=pos)``); causal attention of
               the local queries at their global positions, per request; optionally (``--nsa-index-topk
               K``) an NSA-like selection: each query keeps the K causal keys with the best indexer score.
    MoE:       the communicator gathers every rank's normed tokens (``prepare_mlp``), the router picks
               top-k routed experts per token (padding rows' ids -> -1, ``mask_padding_topk_ids``), each
               rank runs only its own experts (experts sharded over the CP ranks) and writes its partial
               sums into ``mlp_output_buffer``; ``postprocess_layer`` reduce-scatters them back to the
               rank's tokens (the shared expert, run on the rank's own tokens, is added into its own slot
               of the partials first). nsa_cp's communicators are chained: the reduce-scatter also runs
               the next layer's residual add + input norm, and the MoE gather applies the post-attention
               norm inside the collective.

Flags that choose the path:

* ``--enable-nsa-prefill-cp-shared-kv``: the page-aligned in-seq split (``in_seq_split(seq_lens, cp,
  page_size)``), uneven shards, no padding rows anywhere. Without it, the old path: SGLang's token
  zigzag split with every shard padded to one physical length (multiple of 2 * cp_size), so every
  collective is even and every layer computes on the padding rows (``nsa_cp`` then reduces to the plain
  NCCL collectives).
* ``--comm``: a comma list of ``nsa_cp`` (padded MoE gather unless ``--compact``), ``nsa_cp_compact``,
  ``nsa_cp_overlap``, ``baseline``, or ``both`` (nsa_cp,baseline) or ``all`` (nsa_cp, nsa_cp_compact and
  baseline). ``baseline`` is what a user writes
  by hand: ``F.pad`` to the longest shard + ``all_gather_into_tensor`` (+ ``index_select`` into token
  order for the KV) and ``reduce_scatter_tensor`` + a slice of the first ``n_r`` rows.
* ``--compact``: nsa_cp's MoE runs on the compact ``[total_len, H]`` gather (no padding rows at all).
* ``nsa_cp_overlap``: the MoE gather, the MoE and the reduce-scatter in one call,
  ``NSACPLayerCommunicator.overlapped_mlp``: the routed experts run on each rank's rows as they land (this
  rank's first), a finished slot's partials go back while the next computes, and the shared expert (on
  the rank's own normed rows) joins the final fp32 sum. ``--overlap-chunk-rows N`` splits the slots
  further. Its ``moe`` phase holds the gather and the reduce-scatter. On ranks sharing one GPU its group is
  gloo, which stages the rows through host memory: checked, not timed.
* ``--moe-padding masked|routed|both``: a padded gather's padding rows get routed ids -1 (a MoE that
  honours -1, triton fused_moe) or are routed like real rows (a MoE that routes inside its kernel,
  flashinfer's trtllm MoE); ``both`` runs each padded method both ways. Each method prints its MoE rows.
* ``--quant fp8_e4m3_g128`` (SGLang's) or ``fp8_e4m3_g128_ue8m0`` (power-of-two scales, vLLM's; every format
  of ``nsa_cp.geometry.wire.FORMATS``): the MoE gather moves per-token-group FP8 rows (``prepare_mlp``
  returns ``(q, scale)``; the baseline quantizes with ``nsa_cp.quantize`` and gathers both); this
  example's MoE runs on the dequantized rows. The model without CP quantizes its MoE input at the same
  point, and the check takes the median token's error (TOLERANCE_FP8 says why).
* ``--backend auto|nccl|p2p``: nsa_cp's transport; auto takes the intranode P2P transport where
  ``nsa_cp.init_p2p`` works (the communicators create it) and NCCL elsewhere.

Output (rank 0): ``max_rel_err=<value>`` per method, the largest over ranks of the relative L2 error of
the rank's final hidden states against the one-process model (with ``--quant``: of the median token's
relative error); the run exits 1 above ``--tol`` (default 1e-4 for fp32, 1e-1 for bf16).

The check replays the reference's discrete choices. The indexer's top-k keys and the router's top-k
experts are discrete functions of scores that the CP run computes in another summation order: where the
k-th and (k+1)-th scores nearly tie, the two runs pick differently, and a single flipped key or expert
moves a token's output far more than rounding does (at cp = 3 with ``--nsa-index-topk 256`` an fp32 run
missed 1e-4 for every method, the hand-written baseline included, so the check could not tell a near-tie
from a broken collective). So the reference runs first (rank 0), records its choices per token and
layer, and every CP run takes them for its own tokens while computing every score, probability, weight
and value itself. What remains is rounding, which the tolerance bounds per dtype; a wrong row, a lost
padding or a misordered gather still changes values (``--fault kv_order`` and ``--fault one_rank_row``, one
rank's rows wrong, must fail). Each method also
prints how many of its rows' own choices differed from the reference's. On CUDA it then prints the prefill time end to end and per phase (attention with its
KV gather, the KV gather alone, the MoE gather, the MoE, the reduce-scatter) for each method: CUDA events,
``--warmup`` untimed rounds, the median over ``--iters`` rounds (methods interleaved), the largest over
ranks.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

import nsa_cp
from nsa_cp.geometry.wire import FORMATS as WIRE_FORMATS

# the baseline is written with the collectives users know; torch 2.13 renamed them (FutureWarning)
warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use `torch\.distributed\.", category=FutureWarning)

CPU_DEFAULTS = dict(
    hidden=128, layers=2, heads=4, head_dim=16, rope_dim=8, kv_lora_rank=32, index_heads=2, index_dim=16,
    experts=12, topk=2, moe_intermediate=64, shared_intermediate=64, seq_lens="37,64,21,9", page_size=8,
    dtype="float32", comm="nsa_cp",
)
CUDA_DEFAULTS = dict(
    hidden=7168, layers=4, heads=128, head_dim=64, rope_dim=32, kv_lora_rank=512, index_heads=16, index_dim=64,
    experts=32, topk=8, moe_intermediate=2048, shared_intermediate=2048, seq_lens="700x64", page_size=64,
    dtype="bfloat16", comm="both",
)
# fp32: the CP run and the reference differ only by summation order (the discrete choices are replayed:
# class Selections). bf16: rounding of every step, amplified through the layers; a bf16 proxy on CPU (H=512,
# 4 layers, 32 experts top-8, indexer top-256, 2200 tokens) measured 2.7e-2 before the replay.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-1, torch.float16: 5e-2}
# The FP8 wire (--quant): both runs quantize the MoE input per group of 128 at the same point, but their
# inputs differ by the rounding above, and an element that close to the midpoint of two e4m3 values rounds
# the other way in the other run: a step of up to 1/8 of it (3 mantissa bits). Through a router near-tie
# that moves a few tokens a lot, and attention spreads it to the tokens after them, so an L2 over a rank's
# tokens would need a tolerance that no longer tells a quantized wire from an unquantized one. With
# --quant the checked error is the MEDIAN over a rank's tokens of each token's relative error: in fp32 it
# stays at rounding level, orders of magnitude under the error of a reference without the quantization
# (--fault ref_without_quant, which the tests require to fail). In bf16 the runs flip many e4m3 roundings:
# that check catches wrong rows, not a missing quantization; the fp32 run checks the wire's values.
TOLERANCE_FP8 = {torch.float32: 1e-4, torch.bfloat16: 1e-1, torch.float16: 1e-1}
COMM_METHODS = ("nsa_cp", "nsa_cp_compact", "nsa_cp_overlap", "baseline")
COMM_ALIASES = {"both": "nsa_cp,baseline", "all": "nsa_cp,nsa_cp_compact,baseline"}
PHASES = ("attention", "kv_gather", "moe_gather", "moe", "reduce_scatter")


# ----------------------------------------------------------------------------- arguments
def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    one_gpu = next(part for part in __doc__.split("\n\n") if part.startswith("One GPU"))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=one_gpu,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: gloo; cuda: NCCL (and P2P where it works), or with more ranks than GPUs the one-GPU "
                        "mode: a gloo group, nsa_cp's data over P2P through CUDA IPC")
    p.add_argument("--comm", default=None,
                   help=f"what to run and check: a comma list of {', '.join(COMM_METHODS)}, or "
                        f"{', '.join(f'{k} ({v})' for k, v in COMM_ALIASES.items())} (default: nsa_cp on cpu, both on cuda)")
    p.add_argument("--quant", choices=("none", *WIRE_FORMATS), default="none",
                   help="the MoE gather's wire: an FP8 format moves per-token-group FP8 rows (checked against the "
                        "model without CP quantizing the MoE input at the same point)")
    p.add_argument("--moe-padding", choices=("masked", "routed", "both"), default="masked",
                   help="a padded MoE gather's padding rows: masked to -1 (nsa_cp.mask_padding_topk_ids, a MoE that "
                        "honours -1: triton fused_moe), routed like real rows (a MoE routing inside its kernel: "
                        "flashinfer's trtllm MoE), or both (each padded method twice)")
    p.add_argument("--enable-nsa-prefill-cp-shared-kv", action="store_true",
                   help="page-aligned in-seq split, uneven shards (else: token split padded to even shards)")
    p.add_argument("--seq-lens", default=None, help="request lengths: '700x64' (64 requests of 700) or '37,64,21' or a mix '4000,700x8'")
    p.add_argument("--page-size", type=int, default=None, help="KV page size of the shared-KV split")
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--heads", type=int, default=None, help="attention heads")
    p.add_argument("--head-dim", type=int, default=None, help="per-head dim of q/k (non-rotary part) and v")
    p.add_argument("--rope-dim", type=int, default=None, help="rotary part of q/k per head (shared key across heads, MLA-like)")
    p.add_argument("--kv-lora-rank", type=int, default=None, help="KV latent width (what the KV gather moves, MLA-like)")
    p.add_argument("--index-heads", type=int, default=None, help="NSA indexer heads")
    p.add_argument("--index-dim", type=int, default=None, help="NSA indexer key/query dim")
    p.add_argument("--nsa-index-topk", type=int, default=0, help="NSA-like key selection: keys kept per query (0: dense causal)")
    p.add_argument("--query-chunk", type=int, default=0, help="attention queries per chunk (0: sized from the request length, heads and indexer heads)")
    p.add_argument("--experts", type=int, default=None, help="routed experts (a multiple of the CP size)")
    p.add_argument("--topk", type=int, default=None, help="routed experts per token")
    p.add_argument("--moe-intermediate", type=int, default=None)
    p.add_argument("--shared-intermediate", type=int, default=None)
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None)
    p.add_argument("--backend", choices=("auto", "nccl", "p2p"), default="auto", help="nsa_cp transport (auto: P2P where init_p2p works)")
    p.add_argument("--compact", action="store_true",
                   help="nsa_cp: the MoE runs on the compact [total_len, H] gather (no padding rows to route); "
                        "the method nsa_cp_compact does so whatever this says")
    p.add_argument("--overlap-chunk-rows", type=int, default=None,
                   help="nsa_cp_overlap: at most this many rows per MoE call (default: one call per rank's slot)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tol", type=float, default=None, help="max_rel_err above this exits 1 (default per dtype)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--no-check", action="store_true", help="skip the one-process reference (timing only)")
    # deliberate bugs for the tests, to show the check bites: the KV reaches attention out of order; the
    # reference leaves out the FP8 wire's quantization (so the check tells an FP8 run from a bf16/fp32 one)
    p.add_argument("--fault", choices=("none", "kv_order", "one_rank_row", "ref_without_quant"), default="none",
                   help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    defaults = CUDA_DEFAULTS if args.device == "cuda" else CPU_DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def parse_seq_lens(text: str) -> List[int]:
    lens: List[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "x" in part:
            length, count = part.split("x")
            lens.extend([int(length)] * int(count))
        else:
            lens.append(int(part))
    if not lens or any(n < 0 for n in lens):
        raise SystemExit(f"--seq-lens: expected non-negative lengths, got {text!r}")
    return lens


# ----------------------------------------------------------------------------- model
@dataclass
class Shape:
    hidden: int
    heads: int
    head_dim: int
    rope_dim: int
    kv_lora_rank: int
    index_heads: int
    index_dim: int
    experts: int
    topk: int
    moe_intermediate: int
    shared_intermediate: int
    nsa_index_topk: int
    query_chunk: int = 0

    @property
    def kv_width(self) -> int:
        """Columns of what the attention gathers per token: latent | rotary key | indexer key."""
        return self.kv_lora_rank + self.rope_dim + self.index_dim


def _param(seed: int, *tag: int, shape, fan_in: int, device, dtype) -> torch.Tensor:
    """Seeded from (seed, tag): the same tensor on every rank and in the reference, whoever makes it."""
    g = torch.Generator(device=device)
    g.manual_seed(hash((seed,) + tag) & 0x7FFF_FFFF_FFFF)
    return (torch.randn(shape, generator=g, device=device, dtype=torch.float32) / math.sqrt(fan_in)).to(dtype)


class Layer:
    """One decoder layer's weights; ``experts`` holds only the routed experts in ``expert_ids``."""

    def __init__(self, s: Shape, index: int, expert_ids: Sequence[int], seed: int, device, dtype):
        H, nh, d, dr, r = s.hidden, s.heads, s.head_dim, s.rope_dim, s.kv_lora_rank

        def w(tag, shape, fan_in):
            return _param(seed, index, tag, shape=shape, fan_in=fan_in, device=device, dtype=dtype)

        self.input_norm = nsa_cp.RMSNorm(H, eps=1e-6, dtype=dtype, device=device)
        self.post_attention_norm = nsa_cp.RMSNorm(H, eps=1e-6, dtype=dtype, device=device)
        with torch.no_grad():
            self.input_norm.weight.copy_(1 + 0.1 * w(1, (H,), 1).float())
            self.post_attention_norm.weight.copy_(1 + 0.1 * w(2, (H,), 1).float())
        self.w_q = w(3, (H, nh * (d + dr)), H)
        self.w_kv = w(4, (H, r + dr), H)                      # latent | rotary key
        self.w_uk = w(5, (r, nh * d), r)
        self.w_uv = w(6, (r, nh * d), r)
        self.w_o = w(7, (nh * d, H), nh * d)
        self.w_index_q = w(8, (H, s.index_heads * s.index_dim), H)
        self.w_index_k = w(9, (H, s.index_dim), H)
        self.w_index_weights = w(10, (H, s.index_heads), H)
        self.w_router = w(11, (H, s.experts), H).float()
        self.w_shared_gate_up = w(12, (H, 2 * s.shared_intermediate), H)
        self.w_shared_down = w(13, (s.shared_intermediate, H), s.shared_intermediate)
        self.expert_ids = list(expert_ids)
        self.experts = {
            e: (w(100 + 2 * e, (H, 2 * s.moe_intermediate), H), w(101 + 2 * e, (s.moe_intermediate, H), s.moe_intermediate))
            for e in self.expert_ids
        }


def swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    g, u = (x @ gate_up).chunk(2, dim=-1)
    return (F.silu(g) * u) @ down


def rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rotary embedding over the last dim of ``x [n, ..., dr]`` at integer positions ``pos [n]``."""
    dr = x.shape[-1]
    if dr == 0:
        return x
    inv = 1.0 / (10000 ** (torch.arange(0, dr, 2, device=x.device, dtype=torch.float32) / dr))
    ang = pos.to(torch.float32)[:, None] * inv[None, :]               # [n, dr/2]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (dr // 2,)
    cos, sin = ang.cos().view(shape), ang.sin().view(shape)
    x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
    out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
    return out.to(x.dtype)


@dataclass
class Batch:
    """The batch's geometry for one rank's queries: which local rows belong to which request."""

    seq_lens: List[int]
    req_start: List[int]
    # per request: local row indices, their position inside the request (device tensors), or None
    groups: List[Optional[tuple]]
    pos_in_req: torch.Tensor          # [rows] position of each local row inside its request (0 for padding)


def make_batch(seq_lens: List[int], positions: torch.Tensor, rows: int, device) -> Batch:
    """``positions``: batch positions of the first ``len(positions)`` local rows (the rest is padding)."""
    starts = [0]
    for n in seq_lens:
        starts.append(starts[-1] + n)
    req_of = torch.bucketize(positions, torch.tensor(starts[1:], dtype=torch.int64), right=True)
    groups = []
    pos_in_req = torch.zeros(rows, dtype=torch.int64)
    pos_in_req[: positions.numel()] = positions - torch.tensor(starts[:-1], dtype=torch.int64)[req_of]
    for i in range(len(seq_lens)):
        local = torch.nonzero(req_of == i).flatten()
        if local.numel() == 0:
            groups.append(None)
            continue
        groups.append((local.to(device), pos_in_req[local].to(device)))
    return Batch(seq_lens, starts[:-1], groups, pos_in_req.to(device))


class Selections:
    """The reference's discrete choices, which the check's CP runs replay (``--check`` below says why).

    Per layer: the indexer's top-k keys of every query token (``index``: [T, K], key positions inside the
    token's request; requests with at most K keys select nothing) and the router's top-k experts of every
    token (``route``: [T, topk]). The reference records them (``recording``); a CP run then takes the
    reference's choice for each of its real tokens, computes everything else itself (scores, router
    probabilities, expert weights, values) and counts the tokens whose own choice differs (``flips``)."""

    def __init__(self, layers: int):
        self.index: List[Optional[torch.Tensor]] = [None] * layers
        self.route: List[Optional[torch.Tensor]] = [None] * layers
        self.recording = True
        self.flips = {"index": [0, 0], "route": [0, 0]}  # [differing, chosen] token counts

    def choose(self, kind: str, layer: int, tokens: torch.Tensor, own: torch.Tensor, total: int) -> torch.Tensor:
        """``own`` [n, k]: this run's choice for ``tokens`` [n] (batch positions; -1: a padding row, which
        keeps its own). Recording: stored. Replaying: the reference's, with the flips counted."""
        table = getattr(self, kind)
        if self.recording:
            if table[layer] is None:
                table[layer] = torch.full((total, own.shape[1]), -1, dtype=torch.int64, device=own.device)
            table[layer][tokens] = own
            return own
        real = tokens >= 0
        chosen = own.clone()
        ref = table[layer].to(own.device)[tokens[real]]
        chosen[real] = ref
        differ = (own[real].sort(dim=1).values != ref.sort(dim=1).values).any(dim=1)
        self.flips[kind][0] += int(differ.sum())
        self.flips[kind][1] += int(real.sum())
        return chosen


def attention_core(s: Shape, layer: Layer, q: torch.Tensor, kv: torch.Tensor, batch: Batch, index_q, index_w,
                   selections: Optional[Selections] = None, layer_index: int = 0) -> torch.Tensor:
    """Causal (optionally NSA-selected) attention of the local queries over the batch's keys.

    q: [rows, heads, head_dim + rope_dim] (rotary part already rotated); kv: [T, kv_width] in batch token
    order. Returns [rows, heads * head_dim]; rows without a request (padding) get zeros. ``selections``:
    the indexer's top-k keys are recorded there or replayed from there (class Selections).
    """
    nh, d, dr, r = s.heads, s.head_dim, s.rope_dim, s.kv_lora_rank
    out = q.new_zeros((q.shape[0], nh * d))
    scale = 1.0 / math.sqrt(d + dr)
    for i, group in enumerate(batch.groups):
        if group is None:
            continue
        rows, qpos = group
        start, length = batch.req_start[i], batch.seq_lens[i]
        keys = kv[start : start + length]
        latent, k_pe, k_index = keys[:, :r], keys[:, r : r + dr], keys[:, r + dr :]
        k_nope = (latent @ layer.w_uk).view(length, nh, d)
        v = (latent @ layer.w_uv).view(length, nh, d)
        k = torch.cat([k_nope, k_pe[:, None, :].expand(length, nh, dr)], dim=-1)
        kpos = torch.arange(length, device=q.device)
        qk, vk = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        nsa = bool(s.nsa_index_topk) and s.nsa_index_topk < length
        # query chunks bound the [chunk, L] mask, the [chunk, index_heads, L] indexer scores and, should
        # SDPA fall back to its math kernel, the [heads, chunk, L] fp32 scores (a long request has L in
        # the tens of thousands)
        chunk = s.query_chunk or max(1, min((1 << 30) // (length * nh), (1 << 27) // (length * (s.index_heads if nsa else 1))))
        for c in range(0, rows.numel(), chunk):
            rows_c, qpos_c = rows[c : c + chunk], qpos[c : c + chunk]
            allowed = kpos[None, :] <= qpos_c[:, None]                                    # [nq, L]
            if nsa:
                # lightning-indexer-like score: sum_h w_h * relu(q_h . k), fp32; keep the top K causal keys
                iq = index_q[rows_c].float()                                              # [nq, hI, dI]
                score = torch.einsum("qhd,kd->qhk", iq, k_index.float()).relu()
                score = (score * index_w[rows_c].float()[:, :, None]).sum(1)              # [nq, L]
                score = score.masked_fill(~allowed, float("-inf"))
                top = score.topk(s.nsa_index_topk, dim=-1).indices
                if selections is not None:
                    tokens = batch.req_start[i] + qpos_c
                    top = selections.choose("index", layer_index, tokens, top, sum(batch.seq_lens))
                allowed = allowed & torch.zeros_like(allowed).scatter_(1, top, True)
            o = F.scaled_dot_product_attention(
                q[rows_c].transpose(0, 1)[None], qk, vk, attn_mask=allowed[None, None], scale=scale,
            )                                                                             # [1, nh, nq, d]
            out[rows_c] = o[0].transpose(0, 1).reshape(rows_c.numel(), nh * d)
    return out


def project_local(s: Shape, layer: Layer, x: torch.Tensor, batch: Batch):
    """Per-token projections of this rank's normed rows: q (rotated), what the KV gather moves, indexer q."""
    n = x.shape[0]
    q = (x @ layer.w_q).view(n, s.heads, s.head_dim + s.rope_dim)
    q = torch.cat([q[..., : s.head_dim], rope(q[..., s.head_dim :], batch.pos_in_req)], dim=-1)
    ckv = x @ layer.w_kv
    kv = torch.cat([ckv[:, : s.kv_lora_rank], rope(ckv[:, s.kv_lora_rank :], batch.pos_in_req), x @ layer.w_index_k], dim=-1)
    index_q = (x @ layer.w_index_q).view(n, s.index_heads, s.index_dim)
    index_w = x @ layer.w_index_weights
    return q, kv, index_q, index_w


def route(s: Shape, layer: Layer, x: torch.Tensor, selections: Optional[Selections] = None,
          tokens: Optional[torch.Tensor] = None, layer_index: int = 0, total: int = 0):
    """Top-k routed experts per row (fp32 router, softmax, renormalised weights). ``selections``: the ids
    recorded there or replayed from there for the rows' ``tokens`` (batch positions, -1 for padding)."""
    probs = torch.softmax(x.float() @ layer.w_router, dim=-1)
    weights, ids = probs.topk(s.topk, dim=-1)
    if selections is not None:
        ids = selections.choose("route", layer_index, tokens, ids, total)
        weights = probs.gather(1, ids)
    return weights / weights.sum(-1, keepdim=True), ids


def routed_experts(layer: Layer, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """fp32 sum over this process's experts of weight * expert(x) per row; ids -1 are skipped."""
    acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in layer.expert_ids:
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        y = swiglu(x[tok], *layer.experts[e])
        acc.index_add_(0, tok, y.float() * weights[tok, slot, None])
    return acc


# ----------------------------------------------------------------------------- communication
class FaultyKV:
    """Wraps a communication method and swaps two neighbouring rows of every KV gather (``--fault kv_order``)."""

    def __init__(self, inner):
        self.inner, self.name = inner, inner.name

    def __getattr__(self, attr):
        return getattr(self.inner, attr)

    def kv_gather(self, kv_local):
        kv = self.inner.kv_gather(kv_local)
        if kv.shape[0] >= 2:
            kv = torch.cat([kv[1:2], kv[:1], kv[2:]])
        return kv


class FaultyRow:
    """Wraps a communication method; on one rank, the first of its own rows in every MoE gather is replaced
    by its second (``--fault one_rank_row``): one rank's rows wrong, as a broken collective would leave them."""

    def __init__(self, inner, active: bool):
        self.inner, self.name, self.active = inner, inner.name, active

    def __getattr__(self, attr):
        return getattr(self.inner, attr)

    def prepare_mlp(self, i, attn, residual):
        gathered, residual, normed = self.inner.prepare_mlp(i, attn, residual)
        own = self.inner.own
        if self.active and not isinstance(gathered, tuple) and own.stop - own.start >= 2:
            gathered[own.start] = gathered[own.start + 1]
        return gathered, residual, normed

    def overlapped_mlp(self, i, attn, residual, consumer, shared_mlp):
        def faulty(rows, chunk):  # this rank's own first chunk: its first row replaced by its second
            if self.active and chunk.step == 0 and chunk.first == 0 and not isinstance(rows, tuple) and rows.shape[0] >= 2:
                rows = rows.clone()
                rows[0] = rows[1]
            return consumer(rows, chunk)

        return self.inner.overlapped_mlp(i, attn, residual, faulty, shared_mlp)


class NsaComm:
    """nsa_cp: one NSACPLayerCommunicator per layer (it owns the layer's norms) and the ordered KV gather."""

    name = "nsa_cp"

    def __init__(self, group, layers, layout, kv_layout, positions, rank, backend, p2p_args, compact=False,
                 quant=None, route_padding=False, kv_group=None, chain=True):
        self.layout, self.kv_layout, self.positions, self.group, self.backend = layout, kv_layout, positions, group, backend
        # a P2P transport moves rows of its own hidden_size: the KV's narrower rows take a group (and a
        # transport) of their own where there is no NCCL to fall back to
        self.kv_group = group if kv_group is None else kv_group
        self.route_padding = route_padding  # the padded gather's padding rows go through the router and experts
        self.comms = [
            nsa_cp.NSACPLayerCommunicator(group, layer.input_norm, layer.post_attention_norm, mlp_mode="full",
                                          compact=compact, backend=backend, quant=quant, **p2p_args)
            for layer in layers
        ]
        if chain:  # layer i's reduce-scatter also runs layer i+1's residual add + input norm (one fused pass)
            nsa_cp.NSACPLayerCommunicator.chain(self.comms)
        self.own = slice(*layout.rows(rank, compact=compact))
        self.compact = compact

    def prepare_attn(self, i, h, residual):
        return self.comms[i].prepare_attn(h, residual, self.layout)

    def kv_gather(self, kv_local):
        # every rank's rows written straight to their batch positions: no index_select pass
        return nsa_cp.cp_all_gather(kv_local, self.kv_layout, self.kv_group, positions=self.positions, backend=self.backend)

    def prepare_mlp(self, i, attn, residual):
        """-> (gathered [M * cp, H] rank-major, residual, this rank's normed rows [rows, H]); with the FP8
        wire the gathered rows and this rank's are ``(q, scale)`` pairs."""
        gathered, residual = self.comms[i].prepare_mlp(attn, residual, self.layout)
        if isinstance(gathered, tuple):
            return gathered, residual, tuple(t[self.own] for t in gathered)
        return gathered, residual, gathered[self.own]

    def mlp_output_buffer(self, i, like):
        return self.comms[i].mlp_output_buffer(self.layout, like)

    def postprocess_layer(self, i, partials, residual):
        return self.comms[i].postprocess_layer(partials, residual, self.layout)


class NsaOverlapComm(NsaComm):
    """nsa_cp's overlapped boundary: ``overlapped_mlp`` runs the MoE gather, a per-row MoE and the
    reduce-scatter in one call, the MoE on each rank's rows as they land. Its output is not normed for the
    next layer, so the communicators are not chained (each ``prepare_attn`` runs its add + norm)."""

    name = "nsa_cp_overlap"
    overlapped = True

    def __init__(self, *args, chunk_rows=None, **kwargs):
        super().__init__(*args, compact=True, chain=False, **kwargs)
        self.chunk_rows = chunk_rows

    def overlapped_mlp(self, i, attn, residual, consumer, shared_mlp):
        """-> (this rank's MoE output [rows, H], residual); ``consumer(rows, chunk)``: a rank's rows as
        they land (``(q, scale)`` with the FP8 wire), ``chunk.compact_offset`` where they sit in the
        compact gather."""
        return self.comms[i].overlapped_mlp(attn, residual, self.layout, consumer, out_dtype=attn.dtype,
                                            chunk_rows=self.chunk_rows, shared_mlp=shared_mlp)


class BaselineComm:
    """What a user writes by hand: F.pad to the longest shard, equal-shard NCCL collectives, slices.

    ``host_staged``: ranks sharing one GPU have no NCCL (it refuses two ranks on one GPU), so the same
    collectives run over the gloo group on host copies of the CUDA tensors: the check still holds, the
    time does not mean anything (it is not timed). ``quant``: the FP8 wire by hand, quantize the normed
    rows (``nsa_cp.quantize``), then gather q and the scales (padding rows: q = 0, scale = 0)."""

    name = "baseline"
    compact = False

    def __init__(self, group, layers, layout, kv_layout, positions, rank, host_staged=False, quant=None,
                 route_padding=False):
        self.group, self.layers, self.layout, self.kv_layout, self.rank = group, layers, layout, kv_layout, rank
        self.host_staged, self.quant, self.route_padding = host_staged, quant, route_padding
        start = rank * layout.max_rank_len
        self.own = slice(start, start + layout.per_rank_actual_token[rank])
        m = kv_layout.max_rank_len
        # batch position -> row of the padded rank-major gather
        rows = torch.cat([torch.arange(n) + q * m for q, n in enumerate(kv_layout.per_rank_actual_token)]).to(positions.device)
        self.kv_index = torch.empty_like(positions)
        self.kv_index[positions] = rows

    def _pad_gather(self, x, layout):
        m = layout.max_rank_len
        wire = x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x  # gloo has no float8 collectives
        padded = F.pad(wire, (0, 0, 0, m - x.shape[0]))
        out = wire.new_empty((m * layout.cp_size, x.shape[1]))
        return self._collective(dist.all_gather_into_tensor, out, padded).view(x.dtype)

    def _collective(self, collective, out, inp):
        """``collective(out, inp)`` on the group; through host copies when ``host_staged`` (gloo)."""
        if self.host_staged:
            host = out.cpu()
            collective(host, inp.cpu(), group=self.group)
            return out.copy_(host)
        collective(out, inp, group=self.group)
        return out

    def prepare_attn(self, i, h, residual):
        norm = self.layers[i].input_norm
        return (norm(h), h) if residual is None else norm(h, residual)

    def kv_gather(self, kv_local):
        return self._pad_gather(kv_local, self.kv_layout).index_select(0, self.kv_index)

    def prepare_mlp(self, i, attn, residual):
        normed, residual = self.layers[i].post_attention_norm(attn, residual)
        if self.quant is None:
            return self._pad_gather(normed, self.layout), residual, normed
        q, scale = nsa_cp.quantize(normed, self.quant)
        return (self._pad_gather(q, self.layout), self._pad_gather(scale, self.layout)), residual, (q, scale)

    def mlp_output_buffer(self, i, like):
        return torch.empty_like(like)

    def postprocess_layer(self, i, partials, residual):
        m = self.layout.max_rank_len
        out = self._collective(dist.reduce_scatter_tensor, partials.new_empty((m, partials.shape[1])), partials)
        return out[: self.layout.per_rank_actual_token[self.rank]], residual


# ----------------------------------------------------------------------------- forward passes
class Timer:
    """Per-phase CUDA-event timing of one forward (a no-op when disabled)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.events: Dict[str, list] = {p: [] for p in PHASES}

    @contextlib.contextmanager
    def phase(self, name: str):
        if not self.enabled:
            yield
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self.events[name].append((start, end))

    def totals_ms(self) -> Dict[str, float]:
        return {p: sum(s.elapsed_time(e) for s, e in pairs) for p, pairs in self.events.items()}


def moe_input(rows, dtype: torch.dtype) -> torch.Tensor:
    """The MoE's input rows: as gathered, or with the FP8 wire the dequantized ``(q, scale)`` (this example's
    MoE is a bf16/fp32 stand-in; an FP8 block-scale MoE would take q and scale as they are)."""
    return nsa_cp.dequant_fp8_g128(*rows, dtype) if isinstance(rows, tuple) else rows


def forward_cp(s: Shape, layers: List[Layer], final_norm, x: torch.Tensor, batch: Batch, comm, logical_layout, rank,
               timer: Timer, stats: Optional[dict] = None, selections: Optional[Selections] = None,
               tokens: Optional[torch.Tensor] = None):
    """This rank's prefill: x [rows, H] (its tokens, then padding rows on the old path) -> final hidden.

    ``stats``: filled with the MoE's rows per layer (``moe_rows``: rows gathered, ``routed_rows``: rows with a
    routed expert; one host sync per layer, so never while timing). ``selections``: the reference's
    indexer and router choices to replay; ``tokens``: the batch position of each gathered MoE row (-1:
    padding), from ``gathered_tokens``."""
    residual = None
    h = x.clone()  # the fused add + norm updates the residual in place (flashinfer's convention); x is reused
    real = logical_layout.per_rank_actual_token[rank]
    for i, layer in enumerate(layers):
        with timer.phase("attention"):
            normed, residual = comm.prepare_attn(i, h, residual)
            q, kv_local, index_q, index_w = project_local(s, layer, normed, batch)
            with timer.phase("kv_gather"):
                kv = comm.kv_gather(kv_local[:real])                    # [T, kv_width], batch order
            attn = attention_core(s, layer, q, kv, batch, index_q, index_w, selections, i) @ layer.w_o
        if getattr(comm, "overlapped", False):
            with timer.phase("moe"):  # the gather, the MoE and the reduce-scatter: one overlapped call
                h, residual = overlapped_moe(s, layer, i, comm, attn, residual, x.dtype, stats, selections, tokens,
                                             sum(batch.seq_lens))
            continue
        with timer.phase("moe_gather"):
            gathered, residual, normed = comm.prepare_mlp(i, attn, residual)   # [M * cp, H] (or compact [T, H])
        with timer.phase("moe"):
            gathered, normed = moe_input(gathered, x.dtype), moe_input(normed, x.dtype)
            weights, ids = route(s, layer, gathered, selections, tokens, i, sum(batch.seq_lens))
            if not comm.route_padding:
                # padding rows route nowhere, as a MoE that honours -1 can do (compact: there are none)
                nsa_cp.mask_padding_topk_ids(ids, logical_layout)
            if stats is not None:
                stats.setdefault("moe_rows", []).append(gathered.shape[0])
                stats.setdefault("routed_rows", []).append(int((ids >= 0).any(-1).sum().item()))
            partials = comm.mlp_output_buffer(i, gathered)
            partials.copy_(routed_experts(layer, gathered, weights, ids))
            # the shared expert on this rank's tokens only, added into its own slot: the reduce-scatter
            # then counts it exactly once and hands back the layer's whole output
            partials[comm.own] += swiglu(normed, layer.w_shared_gate_up, layer.w_shared_down)
        with timer.phase("reduce_scatter"):
            # nsa_cp chains the communicators: this also runs the next layer's residual add + input norm
            h, residual = comm.postprocess_layer(i, partials, residual)  # [rows, H]
    return final_norm(h, residual)[0] if layers else final_norm(x)


def overlapped_moe(s: Shape, layer: Layer, i: int, comm, attn, residual, dtype: torch.dtype, stats: Optional[dict],
                   selections: Optional[Selections], tokens: Optional[torch.Tensor], total: int):
    """Layer ``i``'s MoE through ``comm.overlapped_mlp``: route and run this rank's experts on each chunk of
    landed rows (``tokens[chunk.compact_offset:]``: their batch positions, -1 for the token split's padding
    rows, which route nowhere unless ``comm.route_padding``); the shared expert on this rank's own normed
    rows, through the same FP8 quantization as the wire where there is one. -> (out [rows, H], residual)."""
    seen = [0, 0]

    def consumer(rows, chunk):
        rows = moe_input(rows, dtype)
        tok = tokens[chunk.compact_offset: chunk.compact_offset + chunk.rows] if tokens is not None else None
        weights, ids = route(s, layer, rows, selections, tok, i, total)
        if tok is not None and not comm.route_padding:
            ids[tok < 0] = -1
        if stats is not None:
            seen[0] += rows.shape[0]
            seen[1] += int((ids >= 0).any(-1).sum().item())
        return routed_experts(layer, rows, weights, ids).to(dtype)

    def shared_mlp(normed):
        if comm.comms[i].quant is not None:
            normed = moe_input(nsa_cp.quantize(normed, comm.comms[i].quant), dtype)
        return swiglu(normed, layer.w_shared_gate_up, layer.w_shared_down)

    out = comm.overlapped_mlp(i, attn, residual, consumer, shared_mlp)
    if stats is not None:
        stats.setdefault("moe_rows", []).append(seen[0])
        stats.setdefault("routed_rows", []).append(seen[1])
    return out


def forward_reference(s: Shape, layers: List[Layer], final_norm, x: torch.Tensor, batch: Batch,
                      quant: Optional[str] = None, selections: Optional[Selections] = None) -> torch.Tensor:
    """The same model on one process: every token, every expert, no communication. ``quant``: the MoE's
    input rows go through the same per-token-group FP8 quantization as the CP run's wire, at the same
    point (after the post-attention norm, before the router, the routed and the shared experts).
    ``selections``: the indexer's and the router's choices are recorded there."""
    residual = None
    h = x
    tokens = torch.arange(x.shape[0], device=x.device)
    for i, layer in enumerate(layers):
        normed, residual = (layer.input_norm(h), h) if residual is None else layer.input_norm(h, residual)
        q, kv, index_q, index_w = project_local(s, layer, normed, batch)
        attn = attention_core(s, layer, q, kv, batch, index_q, index_w, selections, i) @ layer.w_o
        normed, residual = layer.post_attention_norm(attn, residual)
        if quant is not None:
            normed = moe_input(nsa_cp.quantize(normed, quant), normed.dtype)
        weights, ids = route(s, layer, normed, selections, tokens, i, x.shape[0])
        h = routed_experts(layer, normed, weights, ids).to(normed.dtype) + swiglu(normed, layer.w_shared_gate_up, layer.w_shared_down)
    return final_norm(h, residual)[0] if layers else final_norm(x)


def gathered_tokens(layout, counts: List[int], pos_per_rank: List[torch.Tensor], compact: bool, device) -> torch.Tensor:
    """The batch position of every row of the MoE gather over ``layout`` (rank-major: padded slots of
    ``max_rank_len`` rows, or ``compact``), -1 for a padding row. Rank q's first ``counts[q]`` rows are
    its tokens ``pos_per_rank[q]``; the rest of its rows (the token split's padding) are padding."""
    parts = []
    for q, rows in enumerate(layout.per_rank_actual_token):
        part = torch.full((rows if compact else layout.max_rank_len,), -1, dtype=torch.int64)
        part[: counts[q]] = pos_per_rank[q]
        parts.append(part)
    return torch.cat(parts).to(device) if parts else torch.empty(0, dtype=torch.int64, device=device)


# ----------------------------------------------------------------------------- driver
@dataclass
class Method:
    """One way to run the CP prefill: ``kind`` nsa_cp or baseline, the MoE gather compact or padded, and
    whether the padded gather's padding rows go through the router and the experts (``route_padding``)."""

    label: str
    kind: str
    compact: bool
    route_padding: bool
    overlapped: bool = False  # nsa_cp_overlap: the MoE inside the overlapped boundary (compact)


def parse_methods(args, has_padding) -> List[Method]:
    """``--comm`` (a comma list, or an alias) x ``--moe-padding`` -> the methods to run, in order.
    ``has_padding(compact)``: whether that MoE gather holds padding rows (only those run both ways)."""
    names: List[str] = []
    for part in args.comm.split(","):
        for name in COMM_ALIASES.get(part.strip(), part.strip()).split(","):
            if name not in COMM_METHODS:
                raise SystemExit(f"--comm: expected a comma list of {COMM_METHODS} or one of {tuple(COMM_ALIASES)}, got {args.comm!r}")
            if name not in names:
                names.append(name)
    modes = ("masked", "routed") if args.moe_padding == "both" else (args.moe_padding,)
    methods = []
    for name in names:
        compact = name in ("nsa_cp_compact", "nsa_cp_overlap") or (name == "nsa_cp" and args.compact)
        kind = "baseline" if name == "baseline" else "nsa_cp"
        overlapped = name == "nsa_cp_overlap"
        if len(modes) == 1 or not has_padding(compact and kind == "nsa_cp"):
            methods.append(Method(name, kind, compact, modes[0] == "routed", overlapped))
        else:
            methods.extend(Method(f"{name}/{mode}", kind, compact, mode == "routed", overlapped) for mode in modes)
    return methods


def _setup(args):
    """Initialize the process group unless the caller did: gloo on CPU; on CUDA, NCCL with a GPU per
    local rank, gloo where the local ranks outnumber the GPUs (they share them: one-GPU mode)."""
    own_group = not dist.is_initialized()
    if own_group:
        backend = "gloo"
        if args.device == "cuda":
            gpus = torch.cuda.device_count()
            if gpus == 0:
                raise SystemExit("--device cuda: no CUDA device visible")
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local_rank % gpus)
            # NVLink multicast is off on the machines we measure: nothing here may depend on it
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
            os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
            # NCCL refuses two ranks on one GPU ("Duplicate GPU detected"): ranks sharing GPUs take gloo
            backend = "nccl" if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) <= gpus else "gloo"
        dist.init_process_group(backend)
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    return own_group, device


def run(args: argparse.Namespace) -> dict:
    """Run the example on this rank; returns {method: max_rel_err} and the timings (rank 0's view)."""
    own_group, device = _setup(args)
    ok = False
    try:
        report = _run(args, device)
        ok = True
        return report
    finally:
        if own_group:
            if ok:
                # collective: only on the way out of a run every rank finished. The plans nsa_cp cached
                # for the group go at exit (nsa_cp/planning/plan.py).
                nsa_cp.transport.destroy_p2p(None)
                nsa_cp.transport.destroy_nccl(None)
            dist.destroy_process_group()


def _run(args, device) -> dict:
    group = None
    rank, cp = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, args.dtype)
    quant = None if args.quant == "none" else args.quant
    s = Shape(args.hidden, args.heads, args.head_dim, args.rope_dim, args.kv_lora_rank, args.index_heads, args.index_dim,
              args.experts, args.topk, args.moe_intermediate, args.shared_intermediate, args.nsa_index_topk,
              args.query_chunk)
    if s.experts % cp:
        raise SystemExit(f"--experts: expected a multiple of the CP size {cp}, got {s.experts}")
    if s.topk > s.experts:
        raise SystemExit(f"--topk: expected <= --experts {s.experts}, got {s.topk}")
    if quant is not None and s.hidden % 128:
        raise SystemExit(f"--quant {quant}: expected --hidden a multiple of 128 (groups of 128), got {s.hidden}")
    seq_lens = parse_seq_lens(args.seq_lens)
    total = sum(seq_lens)
    # ranks sharing one GPU: a gloo group for control, nsa_cp's data over the P2P transport (CUDA IPC)
    shared_gpu = device.type == "cuda" and "nccl" not in str(dist.get_backend(group)).lower()
    ctrl = torch.device("cpu") if "gloo" in str(dist.get_backend(group)).lower() else device  # the check's tensors

    # the split: shared KV -> page-aligned in-seq split, uneven, no padding; else the token split padded
    # to SGLang's physical length (a multiple of 2 * cp), even collectives, padding rows in every layer
    page = args.page_size if args.enable_nsa_prefill_cp_shared_kv else 1
    counts = nsa_cp.in_seq_split(seq_lens, cp, page)
    pos_per_rank = nsa_cp.in_seq_positions(seq_lens, cp, page)
    positions = torch.cat(pos_per_rank).to(device)
    logical = nsa_cp.ShardLayout(counts)
    if args.enable_nsa_prefill_cp_shared_kv:
        layout = logical
    else:
        physical = -(-max(counts) // (2 * cp)) * (2 * cp)
        layout = nsa_cp.ShardLayout([physical] * cp)
        logical = nsa_cp.ShardLayout(counts, align=physical) if physical else logical
    rows = layout.per_rank_actual_token[rank]
    methods = parse_methods(args, lambda compact: layout.global_len(compact) > total)

    backend = args.backend
    if shared_gpu and any(m.kind == "nsa_cp" for m in methods):
        if backend == "nccl":
            raise SystemExit("--backend nccl: the ranks share a GPU, which NCCL refuses; use auto or p2p")
        reason = nsa_cp.p2p_unavailable_reason(group, device)  # collective: the same verdict on every rank
        if reason:
            raise SystemExit(f"ranks sharing a GPU need nsa_cp's P2P transport (CUDA IPC), unavailable here: {reason}")
        backend = "p2p"  # never the gloo path with CUDA tensors
    kv_group = None
    if backend == "p2p" and device.type == "cuda" and any(m.kind == "nsa_cp" for m in methods):
        # the KV gather moves [n, kv_width] rows, not [n, H]: a transport of that width on a second group
        kv_group = dist.new_group(list(range(cp)), backend="gloo" if shared_gpu else None)
        nsa_cp.init_p2p(kv_group, max(logical.max_rank_len, 1), s.kv_width, dtype, device)

    # the batch's input hidden states (seeded, same on every rank); this rank's rows, then zero padding
    x_all = _param(args.seed, -1, shape=(total, s.hidden), fan_in=1, device=device, dtype=dtype)
    x_local = x_all.new_zeros((rows, s.hidden))
    x_local[: counts[rank]] = x_all[pos_per_rank[rank].to(device)]
    batch = make_batch(seq_lens, pos_per_rank[rank], rows, device)

    per_rank = s.experts // cp
    layers = [Layer(s, i, range(rank * per_rank, (rank + 1) * per_rank), args.seed, device, dtype) for i in range(args.layers)]
    final_norm = nsa_cp.RMSNorm(s.hidden, eps=1e-6, dtype=dtype, device=device)
    with torch.no_grad():
        final_norm.weight.copy_(1 + 0.1 * _param(args.seed, -2, shape=(s.hidden,), fan_in=1, device=device, dtype=dtype).float())

    comms = {}
    for m in methods:
        if m.kind == "nsa_cp":
            if device.type == "cuda" and not shared_gpu and not nsa_cp.nccl_unavailable_reason(group):
                nsa_cp.init_nccl(group, device)  # NCCL-path calls skip torch's c10d op (once per group)
            p2p_args = {}
            if device.type == "cuda" and backend != "nccl":
                p2p_args = dict(p2p_max_tokens_per_rank=max(layout.max_rank_len, 1), hidden_size=s.hidden, dtype=dtype)
            if m.overlapped:
                comm = NsaOverlapComm(group, layers, layout, logical, positions, rank, backend, p2p_args, quant=quant,
                                      route_padding=m.route_padding, kv_group=kv_group,
                                      chunk_rows=args.overlap_chunk_rows)
            else:
                comm = NsaComm(group, layers, layout, logical, positions, rank, backend, p2p_args, compact=m.compact,
                               quant=quant, route_padding=m.route_padding, kv_group=kv_group)
        else:
            comm = BaselineComm(group, layers, layout, logical, positions, rank, host_staged=shared_gpu, quant=quant,
                                route_padding=m.route_padding)
        if args.fault == "kv_order":
            comm = FaultyKV(comm)
        elif args.fault == "one_rank_row":
            comm = FaultyRow(comm, active=rank == cp - 1)
        comms[m.label] = comm

    report = {"rank": rank, "counts": counts, "rows": layout.per_rank_actual_token, "errors": {}, "times": {},
              "moe_rows": {}}
    if rank == 0:
        split = "page-aligned in-seq split (shared KV)" if args.enable_nsa_prefill_cp_shared_kv else "token split padded to even shards"
        transport = "p2p" if nsa_cp.transport.get_p2p(group) is not None else "nccl/gloo"
        print(f"nsa_prefill: cp={cp} device={device.type} dtype={args.dtype} quant={args.quant} tokens={total} "
              f"requests={len(seq_lens)} split={split} page={page} per_rank={counts} rows={list(layout.per_rank_actual_token)} "
              f"layers={args.layers} H={s.hidden} heads={s.heads}x{s.head_dim}+{s.rope_dim} kv_lora={s.kv_lora_rank} "
              f"experts={s.experts} top{s.topk} nsa_index_topk={s.nsa_index_topk} methods={[m.label for m in methods]} "
              f"nsa_cp_transport={transport}"
              f"{' gpu=' + torch.cuda.get_device_name(device) if device.type == 'cuda' else ''}", flush=True)
        if shared_gpu:
            print(f"one-GPU mode: {cp} ranks share {device} (gloo group for control, nsa_cp's data over P2P/CUDA IPC); "
                  "baseline: F.pad + gloo collectives on host copies (NCCL refuses two ranks on one GPU), checked, "
                  "not timed", flush=True)

    outputs = {}
    with torch.no_grad():
        # the check's reference first (rank 0), recording its discrete choices for the CP runs to replay
        reference, selections = None, None
        if not args.no_check:
            selections = Selections(args.layers)
            if rank == 0:
                full_layers = [Layer(s, i, range(s.experts), args.seed, device, dtype) for i in range(args.layers)]
                ref_batch = make_batch(seq_lens, torch.arange(total), total, device)
                ref_quant = None if args.fault == "ref_without_quant" else quant
                reference = forward_reference(s, full_layers, final_norm, x_all, ref_batch, ref_quant,
                                              selections).to(ctrl)
                del full_layers
            tables = [[None if t is None else t.to(torch.int32).cpu() for t in selections.index],
                      [None if t is None else t.to(torch.int32).cpu() for t in selections.route]]
            dist.broadcast_object_list(tables, src=0, group=group)
            selections.index = [None if t is None else t.to(device, torch.int64) for t in tables[0]]
            selections.route = [None if t is None else t.to(device, torch.int64) for t in tables[1]]
            selections.recording = False
        for label, comm in comms.items():
            stats: dict = {}
            if selections is not None:
                selections.flips = {"index": [0, 0], "route": [0, 0]}
            tokens = gathered_tokens(layout, counts, pos_per_rank, getattr(comm, "compact", False), device)
            outputs[label] = forward_cp(s, layers, final_norm, x_local, batch, comm, logical, rank, Timer(False),
                                        stats, selections, tokens)[: counts[rank]]
            if selections is not None:
                flips = torch.tensor([n for kind in ("index", "route") for n in selections.flips[kind]], device=ctrl)
                dist.all_reduce(flips, group=group)
                report.setdefault("flips", {})[label] = flips.tolist()
                if rank == 0:
                    print(f"{label}: replayed the reference's choices; its own differed for {flips[0]} of {flips[1]} "
                          f"indexer top-k rows and {flips[2]} of {flips[3]} router top-k rows", flush=True)
            report["moe_rows"][label] = stats
            if rank == 0 and stats:
                moe_rows, routed = stats["moe_rows"][0], stats["routed_rows"][0]
                print(f"{label}: MoE rows per layer {moe_rows} gathered, {routed} routed "
                      f"(padding {1 - total / moe_rows if moe_rows else 0.0:.1%} of the gathered rows; "
                      f"{'routed' if comm.route_padding else 'masked to -1'})", flush=True)

        if not args.no_check:
            default_tol = (TOLERANCE_FP8 if quant else TOLERANCE)[dtype]
            tol = args.tol if args.tol is not None else default_tol
            # every rank's real rows into batch order on rank 0 (plain collectives: the check relies on
            # nothing under test; over gloo on host copies)
            m = max(max(counts), 1)
            place = torch.cat([torch.arange(n) + q * m for q, n in enumerate(counts)])
            for label, out in outputs.items():
                padded = F.pad(out, (0, 0, 0, m - out.shape[0])).to(ctrl)
                gathered = padded.new_empty((m * cp, s.hidden))
                dist.all_gather_into_tensor(gathered, padded.contiguous(), group=group)
                if rank == 0:
                    errs = []
                    for q in range(cp):
                        mine = gathered[place[sum(counts[:q]) : sum(counts[: q + 1])]].float()
                        ref = reference[pos_per_rank[q]].float()
                        if quant is not None:  # the median token's relative error (TOLERANCE_FP8 says why)
                            tok = (mine - ref).norm(dim=1) / ref.norm(dim=1).clamp_min(torch.finfo(torch.float32).tiny)
                            errs.append(tok.median().item() if tok.numel() else 0.0)
                            continue
                        denom = ref.norm().item()
                        errs.append((mine - ref).norm().item() / denom if denom else (mine - ref).norm().item())
                    err = max(errs) if errs else 0.0
                    finite = all(math.isfinite(e) for e in errs)
                    report["errors"][label] = err
                    what = ", median over tokens" if quant is not None else ""
                    print(f"{label}: max_rel_err={err:.3e} (tol {tol:.0e}{what}, per rank {[f'{e:.2e}' for e in errs]})"
                          f"{'' if finite and err <= tol else '  FAILED'}", flush=True)
            report["tol"] = tol

        if device.type == "cuda" and args.iters > 0:
            # ranks sharing one GPU: the baseline and the overlapped boundary run over gloo on host copies
            timed = {k: v for k, v in comms.items()
                     if not (shared_gpu and (isinstance(v, BaselineComm) or getattr(v, "overlapped", False)))}
            if timed:
                report["times"] = _bench(args, s, layers, final_norm, x_local, batch, timed, logical, rank, ctrl,
                                         shared_gpu)
    if kv_group is not None:  # every rank got here: the collective clean-up of the KV's group
        nsa_cp.transport.destroy_p2p(kv_group)
        dist.destroy_process_group(kv_group)
    verdict = torch.tensor([int(all(math.isfinite(e) and e <= report.get("tol", math.inf) for e in report["errors"].values()))],
                           device=ctrl)
    dist.broadcast(verdict, 0, group=group)
    report["ok"] = bool(verdict.item())
    return report


def _bench(args, s, layers, final_norm, x_local, batch, comms, logical, rank, ctrl, shared_gpu) -> dict:
    """Interleaved rounds of every method; median per method and phase, then the max over ranks."""
    samples = {m: {p: [] for p in ("e2e",) + PHASES} for m in comms}
    for it in range(args.warmup + args.iters):
        for method, comm in comms.items():
            dist.barrier()
            torch.cuda.synchronize()
            timer = Timer(True)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            forward_cp(s, layers, final_norm, x_local, batch, comm, logical, rank, timer)
            end.record()
            torch.cuda.synchronize()
            if it >= args.warmup:
                samples[method]["e2e"].append(start.elapsed_time(end))
                for p, v in timer.totals_ms().items():
                    samples[method][p].append(v)
    med = torch.tensor([[statistics.median(samples[m][p]) for p in ("e2e",) + PHASES] for m in comms],
                       dtype=torch.float64, device=ctrl)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    times = {m: dict(zip(("e2e",) + PHASES, med[i].tolist())) for i, m in enumerate(comms)}
    if rank == 0:
        print(f"prefill times, ms (median of {args.iters} after {args.warmup} warm-up, max over ranks; kv_gather is inside attention):")
        if shared_gpu:
            print(f"  the {dist.get_world_size()} ranks share one GPU: each time spans the work of every rank (the GPU "
                  "time-slices between them), so e2e is the total work of one prefill, not the latency of a real "
                  "run at this cp; the phases overlap other ranks' work")
        width = max(10, *(len(m) for m in times))
        print(f"  {'method':<{width}}" + "".join(f"{p:>16}" for p in ("e2e",) + PHASES))
        for m, t in times.items():
            print(f"  {m:<{width}}" + "".join(f"{t[p]:>16.3f}" for p in ("e2e",) + PHASES))
        first = next(iter(times))
        for m, t in times.items():
            if m != first and t["e2e"] > 0:
                print(f"  {m} over {first}: " + ", ".join(f"{p} {t[p] / times[first][p]:.2f}x" for p in ("e2e",) + PHASES
                                                    if times[first][p] > 0))
    return times


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    report = run(args)
    if report["rank"] == 0 and not args.no_check:
        print(f"max_rel_err={max(report['errors'].values()) if report['errors'] else float('nan'):.3e} "
              f"tol={report.get('tol', float('nan')):.0e} ok={report['ok']} wall_s={time.perf_counter() - started:.1f}", flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
