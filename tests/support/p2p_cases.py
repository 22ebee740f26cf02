"""Checks of the intranode P2P transport that run inside a process group: NCCL with one GPU per rank, or
gloo with every rank on one shared GPU ("gloo-shared-gpu", see dist_harness), where the NCCL comparisons
(reduce-scatter error, the auto fallback) cannot run and are left out by the caller.

The checks live by concern in p2p_gather_cases, p2p_scatter_cases, p2p_graph_cases and p2p_fault_cases
(the fingerprint in p2p_fingerprint_cases), sharing p2p_common; ``run_p2p_checks`` runs all of them on
every rank and also returns measured facts under "__info__" (reduce-scatter error of P2P vs NCCL against fp64).
Gathered data is compared exactly (torch.equal) with an oracle built from every rank's inputs, which
every rank derives from seeds; sums against fp64. Outputs are poisoned with NaN before each call.
"""

from __future__ import annotations

import traceback
import zlib
from typing import Dict

import torch
import torch.distributed as dist

import nsa_cp
from nsa_cp.transport import p2p

from dist_harness import rank_device, rank_log, shared_gpu
from p2p_fault_cases import (
    check_bad_geometry, check_bad_positions, check_capacity_errors, check_capacity_fallback,
    check_runner_after_close, check_timeout,
)
from p2p_gather_cases import (
    check_communicator, check_fp8_gather, check_gather_sequence, check_norm_gather, check_ordered, check_stress,
    check_strided_rows,
)
from p2p_graph_cases import check_graph_replay, check_norm_graph_replay, check_slow_readers
from p2p_scatter_cases import check_reduce_copy_in, check_reduce_scatter_norm, check_reduce_scatter_sequence


def run_p2p_checks(rank: int, world: int, payload: dict) -> Dict[str, object]:
    device = rank_device(rank)
    results: Dict[str, object] = {}
    info: Dict[str, object] = {}
    reason = p2p.p2p_unavailable_reason(None, device)
    if reason is not None:
        return {"__world__": f"P2P unavailable on this machine: {reason}"}

    only = payload.get("only")  # kinds to run (a world's representative subset); None: every check

    def run(name, fn, *args, **kwargs):
        if only is not None and not any(name == k or name.startswith(k + "-") for k in only):
            return
        rank_log(f"{name}: start")
        try:
            results[name] = fn(*args, **kwargs)
        except Exception:
            results[name] = traceback.format_exc()
        rank_log(f"{name}: {'ok' if results[name] is None else 'FAILED ' + str(results[name])[-2000:]}")
        torch.cuda.synchronize()
        dist.barrier()

    for hidden, dtype in payload["shapes"]:
        tag = f"{hidden}-{str(dtype).split('.')[-1]}"
        transport = nsa_cp.init_p2p(None, payload["max_tokens"], hidden, dtype, device, timeout_ms=20_000,
                                    double_buffer_tokens=payload.get("double_buffer_tokens", {}).get(tag))
        for engine in ("sm", "ce"):
            for compact in (False, True):
                run(f"gather-{tag}-{engine}-{'compact' if compact else 'padded'}", check_gather_sequence,
                    transport, rank, world, device, engine, compact, seed=zlib.crc32(f"{hidden}-{engine}-{compact}".encode()) % 1000)
        for compact in (False, True):
            run(f"scatter-{tag}-{'compact' if compact else 'padded'}", check_reduce_scatter_sequence,
                transport, rank, world, device, compact, info=info)
        run(f"stress-{tag}", check_stress, transport, rank, world, device)
        run(f"graph-{tag}", check_graph_replay, transport, rank, world, device)
        run(f"slow-readers-{tag}", check_slow_readers, transport, rank, world, device)
        run(f"capacity-{tag}", check_capacity_errors, transport, rank, world, device)
        if not shared_gpu():
            run(f"capacity-fallback-{tag}", check_capacity_fallback, transport, rank, world, device)
        run(f"communicator-{tag}", check_communicator, transport, rank, world, device)
        run(f"strided-{tag}", check_strided_rows, transport, rank, world, device)
        run(f"copy-in-{tag}", check_reduce_copy_in, transport, rank, world, device)
        run(f"norm-{tag}", check_norm_gather, transport, rank, world, device)
        run(f"fp8-{tag}", check_fp8_gather, transport, rank, world, device)
        run(f"ordered-{tag}", check_ordered, transport, rank, world, device)
        run(f"norm-graph-{tag}", check_norm_graph_replay, transport, rank, world, device)
        run(f"scatter-norm-{tag}", check_reduce_scatter_norm, transport, rank, world, device)
        p2p.destroy_p2p(None)
    run("bad-geometry", check_bad_geometry, rank, world, device)
    run("bad-positions", check_bad_positions, rank, world, device)
    run("closed", check_runner_after_close, rank, world, device)
    if world > 1:
        run("timeout", check_timeout, rank, world, device)
    results["__info__"] = info
    return results
