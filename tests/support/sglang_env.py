"""SGLang 0.5.23's own code on CPU / gloo, for tests/integrations/sglang/.

``require_sglang()`` skips (or, with NSA_TEST_REQUIRE_SGLANG=1 as .ci/run sets, fails) where SGLang's
modules do not import. Two shims make them run on a CPU-only machine (both only in the test process):

* ``SGLANG_NCCL_SO_PATH`` points at nothing, so SGLang does not look for libnccl at import;
* ``parallel_state._is_cpu = True`` sends SGLang's GroupCoordinator collectives down its own CPU branch
  (``torch.distributed`` on the group) instead of its CUDA custom ops.

SGLang imports torchvision at import time: CI installs SGLang's pin (torch 2.14.1 + torchvision 0.29.1),
the GPU machine has its own torchvision.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from unittest import mock

import engines
from dist_harness import run_spawned  # noqa: F401  (the SGLang tests call it from here)

REQUIRED = os.environ.get("NSA_TEST_REQUIRE_SGLANG", "") == "1"
MODULES = (
    "sglang.srt.layers.layer_boundary.boundary", "sglang.srt.layers.layer_boundary.construction",
    "sglang.srt.layers.layer_boundary.factories", "sglang.srt.layers.layer_boundary.prepare",
    "sglang.srt.layers.cp.zigzag", "sglang.srt.layers.cp.padding", "sglang.srt.distributed.parallel_state",
    "sglang.srt.plugins", "sglang.srt.runtime_context",
)


# imported with CUDA hidden on a GPU machine without sgl_kernel (see prepare_process)
_CPU_VIEW = MODULES + ("sglang.srt.layers.layernorm", "sglang.srt.model_executor.forward_batch_info",
                       "sglang.srt.layers.layer_boundary.residual.add_norm", "sglang.srt.layers.cp.interleave",
                       "sglang.srt.model_executor.model_runner")


_CPU_VIEW_SET: list = []


def prepare_process() -> None:
    """The shims, before anything imports SGLang (in every process that will).

    On a GPU machine without SGLang's CUDA kernels (``sgl_kernel``, gigabytes, not carried: the GPU tests
    run SGLang's native norms and its CPU-branch collectives on CUDA tensors), SGLang's modules are imported
    with ``torch.cuda.is_available()`` reading False, and its cached ``is_cuda()`` keeps that answer, so
    no module imports ``sgl_kernel``. nsa_cp and the tests see the GPU as it is."""
    os.environ.setdefault("SGLANG_NCCL_SO_PATH", "/nonexistent/libnccl.so")
    import torch

    if (not torch.cuda.is_available() or importlib.util.find_spec("sgl_kernel") is not None
            or importlib.util.find_spec("sglang") is None or _CPU_VIEW_SET):
        return
    _CPU_VIEW_SET.append(True)
    with mock.patch.object(torch.cuda, "is_available", return_value=False):
        from sglang.srt.utils import common

        common.is_cuda.cache_clear()  # an earlier import may have cached True
        common.is_cuda()  # cached: False from here on
        for name in _CPU_VIEW:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001  import_error() reports it, with the cause
                break


def import_error():
    """None when SGLang's modules import here, else the reason."""
    prepare_process()
    return engines.import_error("sglang", MODULES, "0.5.23")


def require_sglang() -> None:
    engines.require(import_error(), "NSA_TEST_REQUIRE_SGLANG", "sglang==0.5.23 (.ci/install_sglang.sh)")


def setup_parallel(rank: int, world: int):
    """SGLang's real parallel state for one attention-CP group over every rank of the (already
    initialised, gloo) default group: its world group and an attention-CP GroupCoordinator built by its
    own constructors, published through ``get_parallel().override_permanently``. (Its full
    ``initialize_model_parallel`` imports the sampler and the OpenAI protocol: far more packages.)"""
    prepare_process()
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.runtime_context import get_parallel

    ps._is_cpu = True
    import torch

    # SGLang's GroupCoordinator puts a tensor on cuda:<local_rank>: ranks sharing one GPU all use cuda:0
    local_rank = rank % torch.cuda.device_count() if torch.cuda.is_available() else rank
    parallel = get_parallel()
    parallel.override_permanently(tp_size=world, attn_cp_size=world, attn_dp_size=1, pp_size=1, moe_ep_size=1,
                                  moe_dp_size=1, attn_dcp_size=1, shared_experts_tp_size=None)
    ps.init_distributed_environment(world_size=world, rank=rank, local_rank=local_rank, backend="gloo",
                                    distributed_init_method="file:///unused")
    group = ps.init_model_parallel_group([list(range(world))], local_rank, "gloo", use_pynccl=False,
                                         use_custom_allreduce=False, use_mscclpp=False,
                                         use_torch_symm_mem_allreduce=False, group_name="attn_cp")
    parallel.override_permanently(attn_cp_group=group, attn_cp_rank=group.rank_in_group, attn_tp_size=1,
                                  attn_tp_rank=0, attn_dp_rank=0)
    return group


def build_metadata(seq_lens, cp: int, strategy: str = "zigzag"):
    """SGLang's metadata for one extend under its ``zigzag`` or ``interleave`` strategy (a server argument,
    stated here), padded as ``prepare_cp_forward`` does. Returns ``(md, logical counts)``."""
    from sglang.srt.layers.cp import padding
    from sglang.srt.layers.cp.interleave import InterleaveCPStrategy
    from sglang.srt.layers.cp.zigzag import ZigzagCPStrategy

    cls = ZigzagCPStrategy if strategy == "zigzag" else InterleaveCPStrategy

    from sglang.srt.runtime_context import get_parallel

    # the widths it reads (the same as setup_parallel's in a world of cp ranks)
    widths = dict(tp_size=cp, attn_cp_size=cp, attn_dp_size=1, pp_size=1, moe_ep_size=1, moe_dp_size=1,
                  attn_dcp_size=1, shared_experts_tp_size=None, attn_tp_size=1)
    with get_parallel().override(**widths), \
            mock.patch("sglang.srt.layers.cp.base.is_zigzag", return_value=strategy == "zigzag"), \
            mock.patch.object(cls, "cp_rank", new=property(lambda self: 0)):
        md = cls(cp).build_metadata(num_tokens=sum(seq_lens), seqs_len=list(seq_lens),
                                                 extend_seqs_len=list(seq_lens))
        logical = list(md.per_rank_actual_token)
        padding.pad_logical_token_to_physical(md)
    return md, logical


def sglang_moves():
    """SGLang's own DSA/MLA CP moves (what its ``_cp_moves()`` returns when the CP gathers over attention CP)."""
    from sglang.srt.layers.layer_boundary import boundary

    return boundary.CpMoves(gather=boundary._then_attn_cp_gather, take_back=boundary.attn_cp_take_back_output,
                            reduce_scatter=boundary.attn_cp_reduce_scatter_output,
                            reduce_scatter_group=lambda: boundary.get_parallel().attn_cp_group)


def read_step():
    """SGLang's inner read step of the FFN entry: write the attention output into the residual, norm."""
    from functools import partial

    from sglang.srt.layers.layer_boundary.prepare import _update_read
    from sglang.srt.layers.layer_boundary.residual.add_norm import NORM_READOUT

    return partial(_update_read, pre_move=None, enters_stack=False, read=NORM_READOUT)
