"""vLLM's own PCP code (0.33.0 or 0.34.0, each in a venv of its own) on CPU / gloo, for tests/integrations/vllm/.

``require_vllm()`` skips (or, with NSA_TEST_REQUIRE_VLLM=1 as .ci/run sets, fails) where vLLM's modules do
not import. These settings make them run on a CPU-only machine (``prepare_process``, in every process that
imports vLLM): ``VLLM_TARGET_DEVICE=cpu``, ``VLLM_USE_V2_MODEL_RUNNER=1`` (PCP runs on Model Runner V2
only) and a current ``VllmConfig`` with the PCP size (``setup_parallel``). For vLLM 0.34 two more, the
narrowest way past one check: its ``CpuPlatform.check_and_update_config`` raises "vLLM on x86 CPUs requires
Triton (triton-cpu)" where ``vllm.triton_utils.HAS_TRITON`` is False, and no triton-cpu is on the registry.
With the stock ``triton`` installed and ``CUDA_VISIBLE_DEVICES=""`` (vLLM's own "devices not visible yet"
case), vLLM keeps ``HAS_TRITON`` on without an active driver, and ``TRITON_INTERPRET=1`` makes its Triton
kernels (the per-token-group FP8 quantizer the FP8 tests compare against) run in Triton's interpreter on
CPU tensors. Nothing of vLLM's is patched.

* :func:`setup_parallel`: vLLM's own ``init_distributed_environment`` / ``initialize_model_parallel`` with
  ``prefill_context_model_parallel_size = world`` over the (already initialised, gloo) default group;
* :func:`manager` / :func:`partition`: vLLM's own ``PCPManager`` and its ``partition_batch`` on a global
  batch of the given query lengths (eager, or under a CUDA-graph bucket of ``graph_tokens`` rows);
* :func:`runner`: the ``MoERunner`` fields its ``_maybe_dispatch`` / ``_maybe_combine`` read (a stand-in
  ``self``: building a real one needs a quantised FusedMoE layer), so vLLM's own bodies run on it.
"""

from __future__ import annotations

import contextlib
import os
import types

import engines
from dist_harness import run_world, world_case_test

TESTED = ("0.33.0", "0.34.0")
MODULES = (
    "vllm.distributed.parallel_state", "vllm.v1.worker.gpu.pcp_manager", "vllm.forward_context",
    "vllm.model_executor.layers.fused_moe.runner.moe_runner", "vllm.v1.worker.gpu_worker", "vllm.plugins",
)


def prepare_process() -> None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
    if not _has_cuda():  # vLLM 0.34 on a CPU-only machine (module docstring); a GPU machine keeps its devices
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
        os.environ.setdefault("TRITON_INTERPRET", "1")


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def version():
    """The installed vLLM's version string (None where it is not installed)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("vllm")
    except PackageNotFoundError:
        return None


def padding_mask(num_tokens: int):
    """The routers' padding-mask read, from wherever the running vLLM keeps it (0.33: the fused top-k
    router's ``_get_padding_mask``; 0.34: ``base_router.get_moe_padding_mask``)."""
    try:
        from vllm.model_executor.layers.fused_moe.router.base_router import get_moe_padding_mask
    except ImportError:
        from vllm.model_executor.layers.fused_moe.router.fused_topk_router import (
            _get_padding_mask as get_moe_padding_mask,
        )
    return get_moe_padding_mask(num_tokens)


def import_error():
    """None when vLLM's modules import here, else the reason."""
    prepare_process()
    return engines.import_error("vllm", MODULES, TESTED)


def require_vllm() -> None:
    engines.require(import_error(), "NSA_TEST_REQUIRE_VLLM", "vllm==0.33.0 or 0.34.0 (.ci/install_vllm.sh)")


_CONFIG: list = []


def setup_parallel(rank: int, world: int):
    """vLLM's parallel state with one PCP group of every rank; returns ``(vllm_config, pcp GroupCoordinator)``.
    The config stays current for the process (vLLM's layers and PCPManager read it)."""
    prepare_process()
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    if not _CONFIG:
        config = VllmConfig(parallel_config=ParallelConfig(prefill_context_parallel_size=world))
        context = set_current_vllm_config(config)
        context.__enter__()
        ps.init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo",
                                        distributed_init_method="file:///unused")
        ps.initialize_model_parallel(prefill_context_model_parallel_size=world, backend="gloo")
        _CONFIG.append((config, context))
    return _CONFIG[0][0], ps.get_pcp_group()


def manager(rank: int, world: int, shard_decode_requests: bool = True, max_num_tokens: int = 4096):
    import torch
    from vllm.v1.worker.gpu.pcp_manager import PCPManager

    return PCPManager(pcp_world_size=world, pcp_rank=rank, device=torch.device("cpu"),
                      shard_decode_requests=shard_decode_requests, max_num_reqs=64, max_num_tokens=max_num_tokens,
                      moe_gathers_tokens=True)


def partition(mgr, query_lens, is_prefilling, graph_tokens=None):
    """vLLM's ``partition_batch`` of one global step (``query_lens`` per request; ``graph_tokens``: the
    CUDA-graph bucket, PIECEWISE, else eager). Returns the rank-local InputBatch."""
    from dataclasses import replace

    import numpy as np
    import torch
    from vllm.config import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor
    from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers

    nst = np.array(query_lens, dtype=np.int32)
    isp = np.array(is_prefilling, dtype=np.bool_)
    qsl = np.zeros(len(nst) + 1, dtype=np.int32)
    np.cumsum(nst, out=qsl[1:])
    n = int(nst.sum())
    buffers = InputBuffers(64, 4096, torch.device("cpu"))
    batch = InputBatch.make_dummy(len(nst), n, buffers, is_padding=False)
    positions = torch.cat([torch.arange(int(length)) for length in nst])
    batch = replace(batch, num_scheduled_tokens=nst, query_start_loc_np=qsl,
                    query_start_loc=torch.from_numpy(qsl.copy()), is_prefilling_np=isp, has_prefill=bool(isp.any()),
                    prefill_len_np=np.where(isp, nst, 0).astype(np.int32),
                    input_ids=torch.arange(n, dtype=torch.int32), positions=positions,
                    seq_lens_cpu_upper_bound=torch.from_numpy(nst.copy()))
    mode = CUDAGraphMode.NONE if graph_tokens is None else CUDAGraphMode.PIECEWISE
    desc = BatchExecutionDescriptor(cg_mode=mode, num_tokens=graph_tokens or n, num_reqs=None)
    return mgr.partition_batch(batch, desc)


def step_off(rank: int, world: int, query_lens, is_prefilling, graph_tokens=None):
    """One global step (as ``partition`` takes it) with the plugin uninstalled: ``(local, m, n, counts)``,
    this rank's InputBatch, its rows with and without padding, and every rank's real row count."""
    import torch.distributed as dist

    import nsa_cp.integrations.vllm as nsa_vllm

    nsa_vllm.uninstall()
    local = partition(manager(rank, world), query_lens, is_prefilling, graph_tokens)
    m, n = local.num_tokens_after_padding, local.num_tokens
    counts = [None] * world
    dist.all_gather_object(counts, n)
    return local, m, n, counts


@contextlib.contextmanager
def plugin_on(compact: bool):
    """The plugin installed for the ``with`` block, its state reset and ``NSA_CP_VLLM_COMPACT`` set from
    ``compact``; uninstalled after it, the variable unset."""
    import nsa_cp.integrations.vllm as nsa_vllm
    from nsa_cp.integrations.vllm import moe

    os.environ["NSA_CP_VLLM_COMPACT"] = "1" if compact else "0"
    moe.STATE.reset()
    nsa_vllm.install()
    try:
        yield
    finally:
        nsa_vllm.uninstall()
        os.environ.pop("NSA_CP_VLLM_COMPACT")


def runner(world: int, shared_experts=None, quant_config=None):
    """What ``MoERunner._maybe_dispatch`` / ``_maybe_combine`` read of ``self`` (no EP, no DP); imports no vLLM.
    ``quant_config``: vLLM 0.34's ``FusedMoEQuantConfig`` of experts that take their input quantized before
    the PCP gather (``_quantizes_before_pcp_gather()`` is then True), None for unquantized experts."""
    return types.SimpleNamespace(
        do_naive_dispatch_combine=False, shared_experts=shared_experts,
        moe_config=types.SimpleNamespace(pcp_size=world,
                                         moe_parallel_config=types.SimpleNamespace(use_all2all_kernels=False)),
        _quant_method=types.SimpleNamespace(moe_quant_config=quant_config),
        _quantizes_before_pcp_gather=lambda: quant_config is not None,
    )


def dispatch(runner_, hidden_states, router_logits):
    """``MoERunner._maybe_dispatch`` as the running vLLM defines it, always as ``(hidden, logits, scale)``
    (0.33 returns two values: its scale is None)."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    out = MoERunner._maybe_dispatch(runner_, hidden_states, router_logits)
    return tuple(out) if len(out) == 3 else (*out, None)


def cuda_group_quant(x, group_size, eps=1e-10, dtype=None, column_major_scales=False, tma_aligned_scales=False,
                     out_q=None, use_ue8m0=None):
    """vLLM 0.34's ``per_token_group_quant_fp8`` as it runs on a CUDA GPU, for CPU tests: its allocation
    (row- or column-major fp32 scales) and its CUDA kernel's arithmetic (``per_token_group_quant_8bit`` in
    csrc/quantization/w8a8/fp8/per_token_group_quant.cu, transcribed in torch): per row and group, the
    absmax starts at ``eps``, ``y_s = absmax / fp8_max`` (a division), UE8M0 rounds ``y_s`` up to a power of
    two, and ``q = clamp(x / y_s, -fp8_max, fp8_max)`` as float8_e4m3fn. vLLM's CPU path is its Triton
    fallback, which multiplies by ``1 / fp8_max`` (a scale may differ in its last bit) and whose fp8 cast the
    Triton interpreter does not round to nearest even: neither is what a CUDA vLLM computes."""
    import torch
    from vllm.model_executor.layers.quantization.utils import fp8_utils

    if use_ue8m0 is None:
        use_ue8m0 = fp8_utils.is_deep_gemm_e8m0_used()
    fp8_min, fp8_max = fp8_utils.get_fp8_min_max()
    dtype = dtype or torch.float8_e4m3fn
    rows, h = x.shape[-2], x.shape[-1]
    groups = x.detach().to(torch.float32).reshape(-1, h // group_size, group_size)
    amax = groups.abs().amax(dim=-1, keepdim=True).clamp_min(torch.tensor(eps, dtype=torch.float32))
    y_s = amax / torch.full_like(amax, fp8_max)
    if use_ue8m0:
        y_s = torch.exp2(torch.ceil(torch.log2(y_s.abs().clamp_min(1e-10))))
    q = (groups / y_s).clamp(fp8_min, fp8_max).to(dtype).reshape(x.shape)
    if out_q is not None:
        out_q.copy_(q)
        q = out_q
    scale = y_s.reshape(*x.shape[:-1], h // group_size)
    if column_major_scales:
        scale = scale.transpose(-1, -2).contiguous().transpose(-1, -2)
    return q, scale


def fp8_quant_config(block=(128, 128), transposed=False):
    """vLLM's own ``FusedMoEQuantConfig`` of block-quantized FP8 experts with dynamic activation scales
    (what makes 0.34 quantize before the PCP gather)."""
    import torch
    from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config

    return fp8_w8a8_moe_quant_config(w1_scale=torch.ones(1), w2_scale=torch.ones(1), block_shape=list(block),
                                     is_scale_transposed=transposed)


def trtllm_quant_config():
    """vLLM's own quant config (``oracle/fp8.py`` ``make_fp8_moe_quant_config``) for FP8 128x128 block experts on
    FLASHINFER_TRTLLM, its selector's choice on Blackwell without EP: ``is_scale_transposed`` set, so vLLM
    quantizes before the PCP gather with column-major scales."""
    import torch
    from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend, make_fp8_moe_quant_config

    return make_fp8_moe_quant_config(Fp8MoeBackend.FLASHINFER_TRTLLM, w1_scale=torch.ones(1), w2_scale=torch.ones(1),
                                     a1_scale=None, a2_scale=None, block_shape=[128, 128])


def cuda_like_gather(pcp_group) -> None:
    """vLLM's CUDA all-gather on gloo: the input made contiguous (``cuda_communicator.py`` ``all_gather``, the
    pynccl path, which a CUDA worker takes), one-byte floats moved as bytes (gloo carries no float8)."""
    import torch

    gather = pcp_group.all_gather

    def all_gather(t, dim=0):
        t = t.contiguous()
        if t.element_size() == 1 and t.dtype.is_floating_point:
            return gather(t.view(torch.uint8), dim).view(t.dtype)
        return gather(t, dim)

    pcp_group.all_gather = all_gather


def quantizes_first() -> bool:
    """Whether the installed vLLM may quantize before the PCP gather (0.34)."""
    return str(version() or "").startswith("0.34")


def case_test(worker, cases, timeout_s: float = 900):
    """The test of a case table ``{world: {key: payload}}``: one item per (world, key), each world spawned
    once on gloo (``worker(rank, world, cases[world])``); an item skips (or fails) without vLLM first."""
    return world_case_test([(w, k) for w in cases for k in cases[w]],
                           lambda world: run_world(world, "gloo", worker, cases[world], timeout_s=timeout_s),
                           before=require_vllm)
