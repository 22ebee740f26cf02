"""torch.compile of cp_all_gather / cp_reduce_scatter (nsa_cp/api/ops.py).

* gloo, world 2, spawned once: ``torch.compile(fullgraph=True)`` with the "eager", "aot_eager" and
  "inductor" backends (Inductor's C++ backend on CPU) of a function calling cp_all_gather, torch ops and
  cp_reduce_scatter, for padded and compact, uneven and even layouts and a zero-token rank; one graph, no
  graph break, the same results as eager; plus dead-code elimination, new layouts, ``out=``, the eager
  bypass and ``torch.library.opcheck`` (see compile_cases.py).
* The fake implementations alone, under FakeTensorMode, without a process group.
* NCCL, world 2, bf16, Inductor: the same checks plus the P2P backend; needs >= 2 CUDA GPUs.
* On a machine with one GPU: the P2P cases (bf16, Inductor) with two ranks sharing the GPU over gloo.
"""

import functools
import os
import re
import shutil

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

import compile_cases
import nsa_cp
import nsa_cp.api.ops  # noqa: F401  registers torch.ops.nsa_cp.*
from dist_harness import case_failures, run_world, scoped_env

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def _inductor_cpu_reason():
    cxx = os.environ.get("CXX") or "g++"
    return None if shutil.which(cxx) else f"Inductor on CPU needs a C++ compiler; {cxx!r} not found"


CPU_CASES = compile_cases.make_cases(("eager", "aot_eager", "inductor"))
if _inductor_cpu_reason() is not None:  # reported as skips, not run
    _SKIPPED_CPU = [c["id"] for c in CPU_CASES if c.get("backend") == "inductor"]
    CPU_CASES = [c for c in CPU_CASES if c.get("backend") != "inductor"]
else:
    _SKIPPED_CPU = []
GPU_CASES = compile_cases.make_cases(("inductor",), p2p=True)
SHARED_GPU_CASES = [c for c in GPU_CASES if c["op"] == "p2p"]


@functools.lru_cache(maxsize=None)
def _world_results(device):
    # a rank stuck in a collective (a dropped collective on the other rank) fails in 2 minutes, not 5
    with scoped_env({"NSA_TEST_PG_TIMEOUT_S": "120"}, keep_set=True):
        if device == "cpu":
            return run_world(2, "gloo", compile_cases.run_compile_cases,
                             {"device": "cpu", "dtype": "fp32", "cases": CPU_CASES}, timeout_s=300)
        if device == "shared-gpu":
            return run_world(2, "gloo-shared-gpu", compile_cases.run_compile_cases,
                             {"device": "cuda", "dtype": "bf16", "cases": SHARED_GPU_CASES}, timeout_s=600)
        return run_world(2, "nccl", compile_cases.run_compile_cases,
                         {"device": "cuda", "dtype": "bf16", "cases": GPU_CASES}, timeout_s=600)


def _check(device, case_id):
    per_rank = _world_results(device)
    skips = [r.get(case_id) for r in per_rank if isinstance(r.get(case_id), str) and r[case_id].startswith("SKIP:")]
    if skips and len(skips) == len(per_rank):
        pytest.skip(skips[0][len("SKIP:"):].strip())
    failures = case_failures(per_rank, case_id)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("case_id", [c["id"] for c in CPU_CASES] + [
    pytest.param(i, marks=pytest.mark.skip(reason=str(_inductor_cpu_reason()))) for i in _SKIPPED_CPU])
def test_compile_gloo(case_id):
    _check("cpu", case_id)


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 2, reason=f"needs >= 2 CUDA GPUs for NCCL, found {GPUS}")
@pytest.mark.parametrize("case_id", [c["id"] for c in GPU_CASES])
def test_compile_nccl(case_id):
    _check("cuda", case_id)


@pytest.mark.gpu
@pytest.mark.skipif(GPUS != 1, reason=f"for a machine with exactly one CUDA GPU (found {GPUS}); more run test_compile_nccl")
@pytest.mark.parametrize("case_id", [c["id"] for c in SHARED_GPU_CASES])
def test_compile_p2p_shared_gpu(case_id):
    _check("shared-gpu", case_id)


# --------------------------------------------------------------------------- fakes, no process group
FAKE_LAYOUTS = [([5, 3], 1), ([5, 3], 4), ([4, 0], 1), ([0, 0, 0], 1), ([4, 4], 1), ([7, 1, 0, 2], 8)]


@pytest.mark.parametrize("counts,align", FAKE_LAYOUTS)
@pytest.mark.parametrize("compact", [False, True])
def test_fake_shapes(counts, align, compact):
    layout = nsa_cp.ShardLayout(counts, align=align)
    ops = torch.ops.nsa_cp
    tail = (compact, "auto", "auto", None, None, None)
    with FakeTensorMode():
        for rank, n in enumerate(counts):
            x = torch.empty(n, 3, 5, dtype=torch.bfloat16)
            full = ops.cp_all_gather(x, counts, align, None, rank, *tail, None)
            assert isinstance(full, FakeTensor)
            assert tuple(full.shape) == (layout.global_len(compact), 3, 5) and full.dtype == torch.bfloat16
            ordered = ops.cp_all_gather(x, counts, align, None, rank, *tail, torch.empty(layout.total_len, dtype=torch.int64))
            assert tuple(ordered.shape) == (layout.total_len, 3, 5)
            y = torch.empty(layout.global_len(compact), 7, dtype=torch.float32)
            mine = ops.cp_reduce_scatter(y, counts, align, "any-group", rank, *tail, None)
            assert isinstance(mine, FakeTensor)
            assert tuple(mine.shape) == (n, 7) and mine.dtype == torch.float32
            x2 = torch.empty(n, 256, dtype=torch.bfloat16)
            q, scale = ops.cp_all_gather_fp8(x2, counts, align, None, rank, *tail, None)
            rows = layout.global_len(compact)
            assert (tuple(q.shape), q.dtype) == ((rows, 256), torch.float8_e4m3fn)
            assert (tuple(scale.shape), scale.dtype) == ((rows, 2), torch.float32)
            w = torch.empty(256, dtype=torch.bfloat16)
            y2 = ops.fused_add_rmsnorm_all_gather(x2, x2.clone(), w, 1e-6, counts, align, None, rank, *tail, None)
            assert tuple(y2.shape) == (rows, 256)
            q2, s2 = ops.fused_add_rmsnorm_all_gather_fp8(x2, None, w, 1e-6, counts, align, None, rank, *tail, None)
            assert tuple(q2.shape) == (rows, 256) and tuple(s2.shape) == (rows, 2)
            p = torch.empty(rows, 256, dtype=torch.bfloat16)
            out, h = ops.reduce_scatter_fused_add_rmsnorm(p, None, w, 1e-6, counts, align, None, rank, *tail, None)
            assert tuple(out.shape) == (n, 256) and tuple(h.shape) == (n, 256)


def test_op_schemas():
    args = ("SymInt[] counts, SymInt align, str? group_name, SymInt rank, bool compact, str algo, str backend, "
            "bool? validate, Tensor? device_counts, Tensor? device_offsets, Tensor? positions)")
    for name in ("cp_all_gather", "cp_reduce_scatter", "cp_all_gather_fp8"):
        schema = str(getattr(torch.ops.nsa_cp, name).default._schema)
        assert args in schema, schema
        assert "(a" not in schema and "!" not in schema, schema  # functional: no alias, no mutation
    for name in ("fused_add_rmsnorm_all_gather", "fused_add_rmsnorm_all_gather_fp8", "reduce_scatter_fused_add_rmsnorm"):
        schema = str(getattr(torch.ops.nsa_cp, name).default._schema)
        assert args in schema and re.search(r"Tensor\(a\d+!\)\? residual", schema), schema  # declared mutated
        assert schema.count("!") == 1, schema
