"""vLLM 0.33.0's own PCP code on CPU / gloo, for tests/integrations/vllm/.

``require_vllm()`` skips (or, with NSA_TEST_REQUIRE_VLLM=1 as .ci/run sets, fails) where vLLM's modules do
not import. Three settings make them run on a CPU-only machine (``prepare_process``, in every process that
imports vLLM): ``VLLM_TARGET_DEVICE=cpu``, ``VLLM_USE_V2_MODEL_RUNNER=1`` (PCP runs on Model Runner V2
only) and a current ``VllmConfig`` with the PCP size (``setup_parallel``).

* :func:`setup_parallel`: vLLM's own ``init_distributed_environment`` / ``initialize_model_parallel`` with
  ``prefill_context_model_parallel_size = world`` over the (already initialised, gloo) default group;
* :func:`manager` / :func:`partition`: vLLM's own ``PCPManager`` and its ``partition_batch`` on a global
  batch of the given query lengths (eager, or under a CUDA-graph bucket of ``graph_tokens`` rows);
* :func:`runner`: the ``MoERunner`` fields its ``_maybe_dispatch`` / ``_maybe_combine`` read (a stand-in
  ``self``: building a real one needs a quantised FusedMoE layer), so vLLM's own bodies run on it.
"""

from __future__ import annotations

import os
import types

import engines

TESTED = "0.33.0"
MODULES = (
    "vllm.distributed.parallel_state", "vllm.v1.worker.gpu.pcp_manager", "vllm.forward_context",
    "vllm.model_executor.layers.fused_moe.runner.moe_runner", "vllm.v1.worker.gpu_worker", "vllm.plugins",
)


def prepare_process() -> None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")


def import_error():
    """None when vLLM's modules import here, else the reason."""
    prepare_process()
    return engines.import_error("vllm", MODULES, TESTED)


def require_vllm() -> None:
    engines.require(import_error(), "NSA_TEST_REQUIRE_VLLM", "vllm==0.33.0 (.ci/install_vllm.sh)")


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


def runner(world: int, shared_experts=None):
    """What ``MoERunner._maybe_dispatch`` / ``_maybe_combine`` read of ``self`` (no EP, no DP); imports no vLLM."""
    return types.SimpleNamespace(
        do_naive_dispatch_combine=False, shared_experts=shared_experts,
        moe_config=types.SimpleNamespace(pcp_size=world,
                                         moe_parallel_config=types.SimpleNamespace(use_all2all_kernels=False)),
    )
