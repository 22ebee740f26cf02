"""Peer memory of the P2P transport: can this group use it (the survey), and how its buffers are mapped
into every rank (symmetric memory, or CUDA IPC when the ranks share one GPU).

Symmetric memory (``torch.distributed._symmetric_memory``: ``empty`` + ``rendezvous``) serves ranks on
different GPUs of one node. It refuses two ranks on one GPU; those get ordinary allocations whose CUDA
IPC handles go round the group (as torch.multiprocessing shares CUDA tensors). CUDA IPC across
different GPUs is refused: the kernels hit illegal memory accesses through such mappings, for a cause
not understood (docs/performance.md, "Figures behind the code's choices").
Either way the kernels see raw pointers; the handles returned here expose the same two members
(``buffer_ptrs``, ``get_buffer``).
"""

from __future__ import annotations

import math
import socket
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from ...rows import _native
from ... import envs
from ..groups import check_group

__all__ = ["p2p_unavailable_reason", "survey", "share_function", "memory_kind"]


def p2p_unavailable_reason(group: Optional[dist.ProcessGroup] = None, device=None) -> Optional[str]:
    """Why the P2P transport cannot serve ``group`` here, or None when it can (collective call).

    Every rank must call it: each rank's own verdict, hostname and device index go round in one
    all_gather_object, so every rank returns the same answer (never some ranks in a collective and
    others not, as a rank without a GPU or without nsa_cp._C would otherwise cause). Before
    ``torch.distributed.init_process_group`` there is no group to ask: the reason says so (no error).
    """
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return ("torch.distributed is not initialized: the P2P transport serves a process group "
                "(call torch.distributed.init_process_group first, then ask again on every rank)")
    return survey(group, device)[0]


def survey(group, device, config: Optional[dict] = None) -> Tuple[Optional[str], list]:
    """``(p2p_unavailable_reason, every rank's device index)`` from one all_gather_object (collective).

    ``config``: settings every rank must share (the transport's sizes); a difference raises ValueError
    on every rank, naming each rank's value, because the kernels would silently disagree on where rows
    go (e.g. one rank double-buffering a call that another writes into its first buffer).
    """
    check_group(group)
    local = None
    if _native.load() is None:
        local = _native.unavailable_reason()
    elif not torch.cuda.is_available():
        local = "no CUDA device visible"
    world = dist.get_world_size(group)
    if local is None and world > 8:
        local = f"world size {world} > 8 (the P2P kernels serve up to 8 ranks)"
    index = torch.device(device).index if device is not None else None
    if index is None:  # no device, or "cuda": the current one
        index = torch.cuda.current_device() if local is None else -1
    if local is None:
        verdict = _native.device_support(index)
        local = None if verdict else verdict.reason
    everyone = [None] * world
    dist.all_gather_object(everyone, (socket.gethostname(), index, local, config), group=group)
    for key in config or {}:
        values = [theirs[key] for _, _, _, theirs in everyone]
        if len(set(values)) > 1:
            raise ValueError(f"{key}: expected the same value on every rank of the group, got {values} (by rank)")
    everyone = [entry[:3] for entry in everyone]
    indices = [peer_index for _, peer_index, _ in everyone]
    for rank, (_, _, reason) in enumerate(everyone):
        if reason is not None:
            return f"rank {rank}: {reason}", indices
    hosts = {host for host, _, _ in everyone}
    if len(hosts) != 1:
        return f"the group spans {len(hosts)} hosts ({sorted(hosts)}); P2P is intranode only", indices
    for peer_index in indices:
        if peer_index != index and not torch.cuda.can_device_access_peer(index, peer_index):
            return f"cuda:{index} cannot access cuda:{peer_index} (no peer access)", indices
    return _memory_problem(indices), indices


def _symmetric(shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device, group):
    """A symmetric-memory tensor and its handle (``buffer_ptrs``, ``get_buffer``)."""
    from torch.distributed import _symmetric_memory as symm_mem

    tensor = symm_mem.empty(*shape, dtype=dtype, device=device)
    handle = symm_mem.rendezvous(tensor, dist.group.WORLD if group is None else group)
    return tensor, handle


class _IpcPeers:
    """The peers' copies of one allocation, opened from their CUDA IPC handles; the same two members
    of a symmetric-memory handle that the transport uses (``buffer_ptrs``, ``get_buffer``)."""

    def __init__(self, tensors):
        self._tensors = tensors  # rank -> tensor; keeps the peers' mappings open
        self.buffer_ptrs = [t.data_ptr() for t in tensors]

    def get_buffer(self, peer: int, shape, dtype: torch.dtype, offset: int) -> torch.Tensor:
        flat = self._tensors[peer].view(-1).view(torch.uint8)[offset:]
        return flat[: math.prod(shape) * torch.empty((), dtype=dtype).element_size()].view(dtype).view(shape)


def _cuda_ipc(shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device, group):
    """An ordinary allocation shared through CUDA IPC: torch.multiprocessing's reduction of a CUDA
    tensor (IPC handle, offset in its allocator block, a ref counter) goes round the group and each rank
    rebuilds its peers' tensors, mapped into its own address space. Only ranks that all share one GPU
    get here (``_memory_problem``); the peer-access call is then a no-op, and is kept for CUDA IPC
    across GPUs, which failed on its one GPU run and is refused until that is understood."""
    from torch.multiprocessing.reductions import reduce_tensor

    tensor = torch.empty(shape, dtype=dtype, device=device)
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, reduce_tensor(tensor), group=group)
    rank = dist.get_rank(group)
    peers = []
    with torch.cuda.device(device):
        for q, (rebuild, args) in enumerate(everyone):
            if q != rank:
                _native.load().enable_peer_access(device.index, _rebuild_device_index(rebuild, args))
            peers.append(tensor if q == rank else rebuild(*args))
    return tensor, _IpcPeers(peers)


def _rebuild_device_index(rebuild, args) -> int:
    """The owner's device index among torch.multiprocessing's rebuild_cuda_tensor arguments (found by
    name, so a reordering across torch versions fails loudly rather than picking another field)."""
    import inspect

    return int(args[list(inspect.signature(rebuild).parameters).index("storage_device")])


def _memory_problem(indices) -> Optional[str]:
    """Why no mapping serves ranks on these device indices under NSA_CP_P2P_MEMORY, or None.

    Symmetric memory refuses two ranks on one GPU. CUDA IPC serves ranks that all share one GPU; across
    different GPUs it is refused (illegal memory accesses there, cause not understood: module docstring).
    """
    setting = envs.NSA_CP_P2P_MEMORY
    gpus = len(set(indices))
    shared = gpus < len(indices)
    if shared and gpus > 1:
        return (f"ranks share some GPUs but not all (device indices {indices}): symmetric memory refuses "
                f"ranks that share a GPU, and CUDA IPC across different GPUs is not supported")
    if shared and setting == "symm_mem":
        return "NSA_CP_P2P_MEMORY=symm_mem with ranks sharing one GPU: symmetric memory refuses it; use auto or cuda_ipc"
    if not shared and gpus > 1 and setting == "cuda_ipc":
        return ("NSA_CP_P2P_MEMORY=cuda_ipc with ranks on different GPUs: not supported (it failed with an "
                "illegal memory access when tried); use auto or symm_mem")
    return None


def memory_kind(indices) -> str:
    """'symm_mem' or 'cuda_ipc' for ranks on these device indices (where _memory_problem finds none):
    NSA_CP_P2P_MEMORY, with 'auto' taking CUDA IPC only when the ranks share a GPU."""
    setting = envs.NSA_CP_P2P_MEMORY
    if setting == "auto":
        return "cuda_ipc" if len(set(indices)) < len(indices) else "symm_mem"
    return setting


def share_function(kind: str):
    """The allocator of shared buffers for a ``memory_kind``: ``(shape, dtype, device, group) -> (tensor,
    handle)`` (collective)."""
    return _symmetric if kind == "symm_mem" else _cuda_ipc
