"""Plumbing shared by the two-GPU diagnostics (host_overhead.py, p2p_latency.py): one NCCL rank per GPU,
spawned over a FileStore through harness.spawn (the first failing rank ends the run with its traceback),
with NVLink multicast kept off. A helper, not a script."""

import os
import tempfile

import torch
import torch.distributed as dist

import harness


def init_nccl_rank(rank: int, world: int, store_path: str) -> None:
    """This process's GPU and its NCCL process group."""
    harness.keep_multicast_off()
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))


def spawn_ranks(worker, args, script: str, min_gpus: int) -> None:
    """``worker(rank, world, args)`` on min(2, visible GPUs) ranks; ``args.store`` is set for
    ``init_nccl_rank``. Exits saying why (status 2) when fewer than ``min_gpus`` GPUs are visible."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    world = min(2, gpus)
    if world < min_gpus:
        raise SystemExit(f"{script} needs {min_gpus} CUDA GPU(s) with NCCL, found {gpus}: nothing to measure here")
    args.store = os.path.join(tempfile.mkdtemp(), "store")
    harness.spawn(worker, world, (args,), what=script)
