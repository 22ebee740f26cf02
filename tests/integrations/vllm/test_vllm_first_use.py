"""The vLLM plugin's first-use checks against drifts a static contract cannot see, on CPU / gloo, worlds 2 and 3.

Each drift keeps every contract nsa_cp knows (the plugin installs) and changes what the values mean; each is
planted in vLLM's own code path (``tests/support/vllm_drift.py``, or the quantizer vLLM calls):

* ``reordered``: ``_maybe_dispatch`` returns ``(hidden, scale, logits)``; the drifted forward unpacks it so;
* ``e8m0-scales``: the quantizer returns its scales as ``float8_e8m0fnu`` (the dtype DeepGEMM takes);
* ``padding-first``: ``PCPManager.partition_batch`` puts each rank's padding rows first (its ``is_padding``);
* ``zero-group-scale``: the quantizer gives an all-zero group the scale 1 where nsa_cp's wire writes
  ``1e-10 / 448`` (what it takes for "padding rows as vLLM's quantizer gives them").

For each: the first call of its kind is checked, differs, is declined for the process with one warning naming
what differed and recorded in ``status()["first_use"]``; that call and the next return vLLM's own result, so the
forward (dispatch and combine) is bitwise the plugin-off forward. ``undrifted``: the checks pass and nsa_cp
serves. ``reordered-unchecked`` (``NSA_CP_FIRST_USE_CHECKS=0``): nothing is checked and the reordered values go
wrong, which is what the check is for. Runs where vLLM 0.34 is installed (its dispatch quantizes first); the
``padding-first`` and ``undrifted`` cases, unquantized, also run on 0.33.
"""

from __future__ import annotations

import logging
import os
import zlib

import torch

import engines
import vllm_drift
import vllm_env
from dist_harness import run_cases

H, E = 256, 8
LENS, PREFILL = [37, 1, 1, 1, 10], [True, False, False, False, True]


def _quantizer(variant):
    import vllm.model_executor.layers.fused_moe.utils as moe_utils
    from vllm.model_executor.layers.quantization.utils import fp8_utils

    def quant(x, group_size, *args, **kwargs):
        q, s = vllm_env.cuda_group_quant(x, group_size, *args, **{**kwargs, "use_ue8m0": True})
        if variant == "e8m0-scales":
            s = s.to(torch.float8_e8m0fnu)  # the values are powers of two: exact in e8m0
        if variant == "zero-group-scale":
            groups = x.float().reshape(x.shape[0], -1, group_size).abs().amax(-1)
            s = torch.where(groups == 0, torch.ones_like(s), s)
        return q, s

    moe_utils.per_token_group_quant_fp8 = quant
    fp8_utils.is_deep_gemm_e8m0_used = lambda: True


def _hidden(rank, rows, real, padding_first):
    g = torch.Generator().manual_seed(zlib.crc32(f"first-use:{rank}".encode()))
    x = (torch.randn(rows, H, generator=g) * torch.logspace(-2, 2, H)).to(torch.bfloat16)
    if real:
        x[-real if padding_first else 0, :128] = 0  # one all-zero group in a real row
    return x


def _forward(config, local, h, runner, quantized, order):
    """One MoE layer's moves as the (drifted) vLLM runs them: dispatch, a per-row stand-in expert, combine."""
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    logits = h.float() @ torch.linspace(-1, 1, H * E).reshape(H, E) / H
    with set_forward_context(None, config, is_padding=local.is_padding):
        out = vllm_env.dispatch(runner, h, logits)
        hidden, lg, scale = (out[0], out[2], out[1]) if order == "reordered" else out
        x = hidden.float() if not quantized else \
            (hidden.float().reshape(hidden.shape[0], -1, 128) * scale.float().reshape(hidden.shape[0], -1, 1)).reshape(
                hidden.shape)
        partial = (x * lg.float().sum(-1, keepdim=True)).to(torch.bfloat16)
        return out, MoERunner._maybe_combine(runner, None, partial)


def _counts(world):
    import torch.distributed as dist

    local = vllm_env.partition(vllm_env.manager(dist.get_rank(), world), LENS, PREFILL)
    counts = [None] * world
    dist.all_gather_object(counts, local.num_tokens)
    return counts


def _same(a, b):
    if a is None or b is None:
        return a is b
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.element_size() == 1 else torch.equal(a, b)


def _check(rank, world, config, variant, log):
    import nsa_cp.integrations.vllm as nsa_vllm
    from nsa_cp.integrations.vllm import moe

    quantized = variant not in ("padding-first", "undrifted")
    order = "reordered" if variant.startswith("reordered") else "plain"
    _quantizer(variant)
    runner = vllm_env.runner(world, quant_config=vllm_env.trtllm_quant_config() if quantized else None)
    undo = vllm_drift.apply_value(variant.split("-unchecked")[0]) if variant in (
        "reordered", "reordered-unchecked", "padding-first") else (lambda: None)
    checks = "0" if variant.endswith("unchecked") else None
    try:
        nsa_vllm.uninstall()
        offs = []
        for call in range(2):
            local = vllm_env.partition(vllm_env.manager(rank, world), LENS, PREFILL)
            h = _hidden(rank, local.num_tokens_after_padding, local.num_tokens, variant == "padding-first")
            offs.append(_forward(config, local, h, runner, quantized, order))
        moe.STATE.reset()
        if checks is not None:
            os.environ["NSA_CP_FIRST_USE_CHECKS"] = checks
        nsa_vllm.install()
        log.clear()
        ons, raised = [], None
        for call in range(2):
            local = vllm_env.partition(vllm_env.manager(rank, world), LENS, PREFILL)
            h = _hidden(rank, local.num_tokens_after_padding, local.num_tokens, variant == "padding-first")
            try:
                ons.append(_forward(config, local, h, runner, quantized, order))
            except RuntimeError as e:  # only the unchecked drift may get here: its values do not fit
                raised = e
                break
        status = nsa_vllm.status()
    finally:
        nsa_vllm.uninstall()
        undo()
        os.environ.pop("NSA_CP_FIRST_USE_CHECKS", None)
    first = status["first_use"]
    if variant == "reordered-unchecked":
        assert not first["checked"] and not first["declined"], first
        assert raised is not None or not all(_same(a, b) for (d_on, _), (d_off, _) in zip(ons, offs)
                                             for a, b in zip(d_on, d_off)), \
            "unchecked, the reordered values must go wrong (else the check proves nothing)"
        return
    assert raised is None, raised
    if variant == "undrifted":  # served: the real rows are vLLM's, the sums within bf16's rounding
        assert not first["declined"] and first["checked"] == {"dispatch padded": 1, "combine padded": 1}, first
        assert status["gathers"] == {"padded": 2} and not status["declined"], status
        m, counts = ons[0][0][0].shape[0] // world, _counts(world)
        real = torch.cat([torch.arange(q * m, q * m + c) for q, c in enumerate(counts)])
        for (d_on, c_on), (d_off, c_off) in zip(ons, offs):
            assert _same(d_on[0][real], d_off[0][real]) and _same(d_on[1], d_off[1])
            n = counts[rank]
            torch.testing.assert_close(c_on[:n].float(), c_off[:n].float(), rtol=2 ** -7, atol=1e-3)
        return
    same = all(_same(a, b) for (d_on, c_on), (d_off, c_off) in zip(ons, offs)
               for a, b in zip((*d_on, c_on), (*d_off, c_off)))
    assert same, "the forward with the plugin on must be bitwise vLLM's own"
    kind = "dispatch padded" + (" fp8_e4m3_g128_ue8m0 (scales column-major at quantization)" if quantized else "")
    assert list(first["declined"]) == [kind] and first["checked"] == {kind: 1}, first
    want = {"reordered": "_maybe_dispatch[1]: shape", "e8m0-scales": "dtype torch.float32 where the engine gives "
            "torch.float8_e8m0fnu", "padding-first": "forward_context.is_padding",
            "zero-group-scale": "_maybe_dispatch[2]"}[variant]
    assert want in first["declined"][kind], first["declined"][kind]
    assert not status["gathers"] and sum(status["declined"].values()) == 2, status
    warned = [r for r in log if r.levelno == logging.WARNING and "first-use check" in r.getMessage()]
    assert len(warned) == 1 and want.split(":")[0] in warned[0].getMessage(), [r.getMessage() for r in warned]


def _worker(rank, world, payload):
    vllm_env.prepare_process()
    config, pcp = vllm_env.setup_parallel(rank, world)
    vllm_env.cuda_like_gather(pcp)
    log = engines.nsa_cp_records()
    return run_cases({key: (rank, world, config, key, log) for key in payload}, _check)


VARIANTS = ("undrifted", "padding-first") + (
    ("reordered", "reordered-unchecked", "e8m0-scales", "zero-group-scale") if vllm_env.quantizes_first() else ())
CASES = {w: {v: () for v in VARIANTS} for w in (2, 3)}


test_vllm_first_use_check_declines_a_drift_and_the_forward_stays_exact = vllm_env.case_test(_worker, CASES)
