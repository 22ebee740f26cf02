"""Spawn a process group once per world size and run many checks inside it.

``run_world(world_size, backend, fn, payload)`` starts ``world_size`` spawned processes, initialises
torch.distributed over a FileStore, calls ``fn(rank, world_size, payload)`` in each (it returns a
``{case_id: None | error text}`` dict) and returns the per-rank dicts. A rank that dies or hangs past
``timeout_s`` fails the whole world with its traceback, never a hang.
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing as mp
import os
import queue
import tempfile
import traceback
from typing import Any, Callable, Dict, List

Results = Dict[str, Any]


def rank_log(message: str) -> None:
    """Progress line into $NSA_TEST_LOG_DIR/rank<R>.log when that is set (GPU runs keep these)."""
    stream = _LOG.get("file")
    if stream is not None:
        stream.write(f"{datetime.datetime.now().strftime('%H:%M:%S.%f')[:-3]} {message}\n")
        stream.flush()


_LOG = {}


def _entry(rank, world_size, backend, store_path, fn, payload, results):
    log_dir = os.environ.get("NSA_TEST_LOG_DIR")
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
        _LOG["file"] = open(os.path.join(log_dir, f"rank{rank}.log"), "a")
        # a rank that stops making progress dumps every thread's stack, then keeps waiting
        faulthandler.dump_traceback_later(int(os.environ.get("NSA_TEST_STACK_DUMP_S", "120")), repeat=True, file=_LOG["file"])
        rank_log(f"rank {rank}/{world_size} {backend} start: {getattr(fn, '__name__', fn)}")
    try:
        import torch
        import torch.distributed as dist

        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        if backend == "nccl":
            torch.cuda.set_device(rank)
        store = dist.FileStore(store_path, world_size)
        kwargs = {"device_id": torch.device("cuda", rank)} if backend == "nccl" else {}
        # a collective that never completes (a rank left the sequence) fails after this, not never
        kwargs["timeout"] = datetime.timedelta(seconds=int(os.environ.get("NSA_TEST_PG_TIMEOUT_S", "300")))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, **kwargs)
        try:
            results.put((rank, fn(rank, world_size, payload)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # report, never swallow: the parent turns this into a failure
        rank_log(traceback.format_exc())
        results.put((rank, {"__world__": traceback.format_exc()}))
    finally:
        faulthandler.cancel_dump_traceback_later()
        rank_log("exit")


def run_world(
    world_size: int, backend: str, fn: Callable, payload: Any, timeout_s: float = 600.0
) -> List[Results]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_entry,
                args=(rank, world_size, backend, store_path, fn, payload, results),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        per_rank: Dict[int, Results] = {}
        try:
            while len(per_rank) < world_size:
                rank, result = results.get(timeout=timeout_s)
                per_rank[rank] = result
        except queue.Empty:
            missing = sorted(set(range(world_size)) - set(per_rank))
            for rank in missing:
                per_rank[rank] = {"__world__": f"rank {rank} sent no result within {timeout_s:.0f} s"}
        finally:
            for proc in procs:
                proc.join(timeout=30)
                if proc.is_alive():
                    proc.kill()
    return [per_rank[r] for r in range(world_size)]


def case_failures(per_rank: List[Results], case_id: str) -> List[str]:
    """Error texts for one case across ranks (world-level failures count for every case)."""
    errors = []
    for rank, result in enumerate(per_rank):
        if "__world__" in result:
            errors.append(f"rank {rank}: world failed:\n{result['__world__']}")
        elif case_id not in result:
            errors.append(f"rank {rank}: case {case_id} did not run")
        elif result[case_id] is not None:
            errors.append(f"rank {rank}: {result[case_id]}")
    return errors
