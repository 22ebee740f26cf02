"""An NCCL communicator owned by ``nsa_cp._C`` for a process group: ``init_nccl``, ``get_nccl``, ``destroy_nccl``.

Why: torch's c10d op around an NCCL collective (work object, stream bookkeeping, dispatch) costs the
host several times what the ``ncclAllGather`` call itself costs (docs/performance.md). An uneven
call of the NCCL path adds a pack and a slice to it, so it costs more host time than the plain
collective however lean the Python around it is. This communicator calls NCCL directly from C++
(vLLM's and SGLang's pynccl pattern): libnccl is the copy torch loaded (``NSA_CP_NCCL_LIBRARY`` names
another), the unique id goes from the group's rank 0 to the others once, through the group.

After ``init_nccl(group)``, the NCCL path's uneven movements of that group (the padded gather with its
pack in the same host call, the padded reduce-scatter, the coalesced compact gather and reduce-scatter)
use it under ``NSA_CP_NCCL_CALL=auto`` (the default). The even layout keeps torch's collective (its
contract: bitwise the plain equal-shard collective), and so does a call inside torch's coalescing manager.

Ordering: its collectives run on the calling stream, in program order with everything else on it,
like the P2P transport. Across communicators NCCL needs every rank to issue collectives in the same
order; the library issues them in program order, so a model that calls nsa_cp and torch.distributed in
the same order on every rank (as SPMD code does) is safe. It holds NCCL's own buffers (their size set by
NCCL_BUFFSIZE and the channel count), released by ``destroy_nccl``.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.distributed as dist

from ...rows import _native
from ... import envs
from ...support import Support
from ..groups import GroupRegistry, check_group, resolve_group

__all__ = ["NativeNccl", "init_nccl", "get_nccl", "destroy_nccl", "nccl_support", "nccl_unavailable_reason", "NCCL_DTYPES"]

logger = logging.getLogger("nsa_cp")

# torch dtype -> ncclDataType_t (nccl.h; stable since NCCL 2.10)
NCCL_DTYPES = {
    torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.int64: 4, torch.float16: 6, torch.float32: 7,
    torch.float64: 8, torch.bfloat16: 9,
}
_NCCL_UINT8 = 1

_REGISTRY = GroupRegistry()


def nccl_support(group: Optional[dist.ProcessGroup] = None) -> Support:
    """Whether ``init_nccl(group)`` can work here, and why not (ValueError for a ``group`` that is none)."""
    check_group(group)
    mod = _native.load()
    if mod is None or not hasattr(mod, "NcclComm"):
        return Support.no(_native.unavailable_reason() or "nsa_cp._C has no NcclComm (built before it existed)")
    if not _native.available():
        return _native.support()
    backend = dist.get_backend(resolve_group(group))
    if "nccl" not in str(backend).lower():
        return Support.no(f"the group's backend is {backend!r}, not NCCL")
    try:
        mod.nccl_library(envs.NSA_CP_NCCL_LIBRARY)
    except (RuntimeError, ValueError) as err:
        return Support.no(str(err))
    return Support.yes()


def nccl_unavailable_reason(group: Optional[dist.ProcessGroup] = None) -> Optional[str]:
    """None when ``init_nccl(group)`` can work here, else why not (a sentence): ``nccl_support``'s reason,
    as ``p2p_unavailable_reason`` for the P2P transport."""
    return nccl_support(group).reason or None


class NativeNccl:
    """One rank's ``_C.NcclComm`` for a group, with torch-tensor entries.

    Every entry takes contiguous CUDA tensors of the communicator's device and enqueues on the current
    stream; the caller (a plan) has checked shapes and dtypes.
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None, device=None):
        verdict = nccl_support(group)
        if not verdict:
            raise RuntimeError(f"nsa_cp.init_nccl: {verdict.reason}")
        pg = resolve_group(group)
        mod = _native.load()
        self.group, self.rank, self.world = pg, pg.rank(), pg.size()
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = torch.device(device)
        if self.device.type != "cuda" or self.device.index is None:
            raise ValueError(f"device: expected a CUDA device with an index, got {device!r}")
        library = envs.NSA_CP_NCCL_LIBRARY
        uid = mod.nccl_unique_id(library) if self.rank == 0 else bytes(mod.NCCL_UNIQUE_ID_BYTES)
        wire = torch.tensor(list(uid), dtype=torch.uint8, device=self.device)
        dist.broadcast(wire, src=dist.get_global_rank(pg, 0), group=pg)
        uid = bytes(wire.tolist())
        self.library = mod.nccl_library(library)
        self.version = mod.nccl_version(library)
        with torch.cuda.device(self.device):
            torch.cuda.synchronize()  # nothing of ours still queued on the device NCCL initialises on
            self._comm = mod.NcclComm(uid, self.world, self.rank, self.device.index, library)
        self._stream = _native.stream_getter()
        self._index = self.device.index
        logger.info("nsa_cp native NCCL communicator: rank %d of %d on %s, %s (version %d)", self.rank,
                    self.world, self.device, self.library, self.version)

    # ---- collectives (contiguous CUDA tensors on self.device) --------------------------------------
    def all_gather(self, out: torch.Tensor, shard: torch.Tensor) -> None:
        """``out [P*m, ...]`` <- every rank's ``shard [m, ...]``, as bytes (any dtype); ``shard`` may be
        ``out``'s own slot."""
        self._comm.all_gather(shard.data_ptr(), out.data_ptr(), shard.numel() * shard.element_size(), _NCCL_UINT8,
                              self._stream(self._index))

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor) -> None:
        """``out [m, ...]`` <- the sum over ranks of this rank's chunk of ``full [P*m, ...]``."""
        self._comm.reduce_scatter(full.data_ptr(), out.data_ptr(), out.numel(), NCCL_DTYPES[out.dtype],
                                  self._stream(self._index))

    def pack_gather_launcher(self, rows_per_rank: int, row_bytes: int, count: torch.Tensor):
        """``launch(x, out)``: pack ``x [n, row]`` (unit inner stride) into this rank's slot of the dense
        ``out [P*rows_per_rank, row]`` (rows past ``*count`` zeroed), then the in-place all-gather: one
        host call. ``count``: device int32 scalar (kept alive by the launcher)."""
        comm, stream, index, count_ptr = self._comm, self._stream, self._index, count.data_ptr()
        place, device = _native.launch_device, self.device

        def launch(x: torch.Tensor, out: torch.Tensor) -> None:
            with place(device):  # the pack launches on the current device
                    comm.pack_all_gather(x.data_ptr(), x.stride(0) * x.element_size(), x.shape[0], out.data_ptr(),
                                     rows_per_rank, row_bytes, count_ptr, stream(index))

        launch.keep = count
        return launch

    def all_gather_rows(self, out: torch.Tensor, shard: torch.Tensor, counts, offsets, row_bytes: int) -> None:
        """Uneven: rank q's ``counts[q]`` rows land at row ``offsets[q]`` of ``out``; ``shard`` holds this
        rank's rows. ``counts`` / ``offsets``: per rank, in bytes (rows times ``row_bytes``)."""
        self._comm.all_gather_v(shard.data_ptr() if shard.numel() else 0, out.data_ptr(), counts, offsets,
                                _NCCL_UINT8, 1, self._stream(self._index))

    def reduce_scatter_rows(self, out: torch.Tensor, full: torch.Tensor, counts, offsets) -> None:
        """Uneven: ``out`` <- the sum over ranks of their rows at this rank's place in ``full``.
        ``counts`` / ``offsets``: per rank, in elements."""
        self._comm.reduce_scatter_v(full.data_ptr(), out.data_ptr() if out.numel() else 0, counts, offsets,
                                    NCCL_DTYPES[full.dtype], full.element_size(), self._stream(self._index))

    def async_error(self) -> str:
        return self._comm.async_error()

    def close(self, abort: bool = False) -> None:
        """Destroy the communicator (collective, like init) or abort it (local, for error paths)."""
        if not self._comm.closed:
            with torch.cuda.device(self.device):
                if not abort:
                    torch.cuda.synchronize()  # nothing of ours still queued on this device
                self._comm.close(abort)

    @property
    def closed(self) -> bool:
        return self._comm.closed


def init_nccl(group: Optional[dist.ProcessGroup] = None, device=None) -> NativeNccl:
    """Create (collectively, on every rank of ``group``) and register the native NCCL communicator of
    ``group`` (an NCCL group, one GPU per rank; ``device``: this rank's, default the current one).

    The NCCL path's uneven calls of that group then take it (``NSA_CP_NCCL_CALL=auto``). Creating it
    again for the same group replaces (and destroys) the old one. Raises RuntimeError, saying why,
    where it cannot work (no ``nsa_cp._C``, no GPU, a non-NCCL group, no libnccl).
    """
    comm = NativeNccl(group, device)
    old = _REGISTRY.put(group, comm)
    if old is not None:
        old.close()
    return comm


def get_nccl(group: Optional[dist.ProcessGroup]) -> Optional[NativeNccl]:
    """The registered communicator of ``group``, or None."""
    return _REGISTRY.get(group)


def destroy_nccl(group: Optional[dist.ProcessGroup] = None) -> None:
    """Unregister and destroy (collectively) the communicator of ``group``; a no-op when there is none."""
    comm = _REGISTRY.pop(group)
    if comm is not None:
        comm.close()
