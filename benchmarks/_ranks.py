"""Plumbing shared by the two-GPU diagnostics (host_overhead.py, p2p_latency.py): one NCCL rank per GPU,
spawned over a FileStore, with NVLink multicast kept off."""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def init_nccl_rank(rank: int, world: int, store_path: str) -> None:
    """This process's GPU and its NCCL process group."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))


def spawn_ranks(worker, args, script: str, min_gpus: int) -> None:
    """``worker(rank, world, args)`` on min(2, visible GPUs) ranks; ``args.store`` is set for
    ``init_nccl_rank``. Exits saying why when fewer than ``min_gpus`` GPUs are visible."""
    world = min(2, torch.cuda.device_count())
    if world < min_gpus:
        raise SystemExit(f"{script} needs {min_gpus} CUDA GPU(s), found {torch.cuda.device_count()}")
    args.store = os.path.join(tempfile.mkdtemp(), "store")
    mp.spawn(worker, args=(world, args), nprocs=world)
