"""The P2P transport's memory and native state: rendezvous, peer-mapped allocation, peer pointer tables,
the host-mapped error record, and the ``nsa_cp._C.P2PState`` built from one ``P2PConfig``.

``P2PBuffers(...)`` is collective (every rank of the group, the same sizes). It allocates exactly
``nsa_cp.transport.workspace_bytes(cp_size, max_tokens_per_rank, hidden_size, dtype, double_buffer_tokens)``
per rank (``nsa_cp.geometry.workspace``'s plan): gather buffer 0 and the reduce buffer of ``cp_size *
max_tokens_per_rank`` rows of ``hidden_size`` elements, gather buffer 1 of ``cp_size *
double_buffer_tokens`` rows, the signal pads, and the local epoch / arrive / gather-state words.
Everything is sized up front (before any CUDA-graph capture) and never regrown. Design record:
docs/design.md, "The P2P transport".
"""

from __future__ import annotations

import logging
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from ...rows import _native
from ... import envs
from ...geometry import workspace
from .memory import memory_kind, share_function, survey

logger = logging.getLogger("nsa_cp")

__all__ = ["P2PBuffers", "dtype_codes"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def dtype_codes(C) -> dict:
    """torch dtype -> the native module's code of it (csrc/codes.h, exported as ``_C.DTYPE_*``)."""
    return {torch.bfloat16: C.DTYPE_BF16, torch.float16: C.DTYPE_FP16, torch.float32: C.DTYPE_FP32}


class P2PBuffers:
    """One rank's peer-mapped buffers and the native state that points into them.

    Attributes: ``C`` (the ``nsa_cp._C`` module), ``state`` (``P2PState``), ``group``, ``rank``,
    ``world``, ``device`` (with its index), ``max_tokens_per_rank``, ``hidden_size``, ``dtype``,
    ``double_buffer_tokens`` (rows per rank of gather buffer 1, 0: none), ``timeout_ns``,
    ``workspace_bytes`` (what was allocated), ``memory`` ('symm_mem' or 'cuda_ipc'), ``gathers``
    (gather buffers 0 and 1 as ``[rows, hidden]``; 1 is 0 again without double buffering),
    ``reduce`` (``[cp_size * max_tokens_per_rank, hidden]``), ``peer_gather`` (every rank's gather
    buffer 0 mapped here, for the copy engine), ``peer_reduce`` (every rank's reduce buffer mapped here, for the
    overlapped boundary's copy-engine pushes). Arguments: ``P2PTransport``.
    """

    def __init__(self, group: Optional[dist.ProcessGroup], max_tokens_per_rank: int, hidden_size: int,
                 dtype: torch.dtype, device, *, timeout_ms: Optional[int], workspace_bytes: Optional[int],
                 double_buffer_tokens: Optional[int], check_layout: bool):
        if max_tokens_per_rank < 1:
            raise ValueError(f"max_tokens_per_rank: expected an int >= 1, got {max_tokens_per_rank}")
        if hidden_size < 1:
            raise ValueError(f"hidden_size: expected an int >= 1, got {hidden_size}")
        if dtype not in _DTYPES:
            raise ValueError(f"dtype: expected one of {list(_DTYPES)}, got {dtype}")
        self.max_tokens_per_rank, self.hidden_size, self.dtype = int(max_tokens_per_rank), int(hidden_size), dtype
        self.double_buffer_tokens = workspace.double_buffer_rows(self.max_tokens_per_rank, double_buffer_tokens)
        config = {"max_tokens_per_rank": self.max_tokens_per_rank, "hidden_size": self.hidden_size,
                  "dtype": str(dtype), "double_buffer_tokens": self.double_buffer_tokens}
        reason, indices = survey(group, device, config)
        if reason is not None:
            raise RuntimeError(f"nsa_cp P2P transport unavailable: {reason}")
        self.C = _native.load()
        self.state = None
        self._err_host = None
        self.group, self.rank, self.world = group, dist.get_rank(group), dist.get_world_size(group)
        self.device = torch.device(device if device is not None else "cuda")
        if self.device.index is None:  # "cuda": the current device, so that tensors' devices compare equal
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.timeout_ns = (envs.NSA_CP_P2P_TIMEOUT_MS if timeout_ms is None else int(timeout_ms)) * 1_000_000
        sizes = (self.world, self.max_tokens_per_rank, self.hidden_size, dtype, self.double_buffer_tokens)
        self.workspace_bytes = workspace.check_budget(workspace_bytes, *sizes)
        self.memory = memory_kind(indices)
        self._allocate(workspace.workspace_plan(*sizes), share_function(self.memory))
        try:
            self.state = self.C.P2PState(self._config(check_layout))
        except BaseException:
            self.close()  # frees the error record
            raise
        torch.cuda.synchronize(self.device)
        dist.barrier(group=group)  # every rank's signal area is zero before anyone signals
        logger.info(
            "nsa_cp P2P transport: rank %d/%d, %d tokens/rank x %d x %s, %.1f MiB per buffer, second "
            "gather buffer for %d tokens/rank (%s)",
            self.rank, self.world, self.max_tokens_per_rank, self.hidden_size, dtype,
            self.gathers[0].numel() * self.gathers[0].element_size() / 2**20, self.double_buffer_tokens,
            self.memory,
        )

    def _allocate(self, plan, share) -> None:
        """Every buffer of the workspace plan (peer-mapped or local), the peers' pointer tables, the
        copy engine's views of the peers' gather buffer 0, and the host-mapped error record."""
        handles = {}

        def symmetric(entry):
            tensor, handles[entry.name] = share(entry.shape, entry.dtype, self.device, self.group)
            return tensor

        def local(entry):
            return torch.zeros(entry.shape, dtype=entry.dtype, device=self.device)

        buffers = workspace.allocate(plan, symmetric, local)
        gather = buffers["gather"]
        self.gathers = (gather, buffers.get("gather_alt", gather))
        self.reduce = buffers["reduce"]
        buffers["signals"].zero_()
        alt = "gather_alt" if "gather_alt" in handles else "gather"
        tables = {"gather_ptrs": [handles["gather"].buffer_ptrs, handles[alt].buffer_ptrs],
                  "reduce_ptrs": handles["reduce"].buffer_ptrs, "pad_ptrs": handles["signals"].buffer_ptrs}
        for name, ptrs in tables.items():
            buffers[name].copy_(torch.tensor(ptrs, dtype=torch.int64))
        self._local = buffers  # the native state points into these: keep them for its lifetime
        self._handles = handles  # keep the mappings alive
        shape = list(gather.shape)
        self.peer_gather = [handles["gather"].get_buffer(peer, shape, self.dtype, 0) for peer in range(self.world)]
        self.peer_reduce = [handles["reduce"].get_buffer(peer, list(self.reduce.shape), self.dtype, 0)
                            for peer in range(self.world)]
        self._err_host, self._err_dev = self.C.alloc_host_mapped_u32(self.C.ERR_RECORD_WORDS)

    def _config(self, check_layout: bool):
        b = self._local
        return self.C.P2PConfig(
            device=self.device.index, rank=self.rank, world=self.world, gather_ptrs=b["gather_ptrs"].data_ptr(),
            reduce_ptrs=b["reduce_ptrs"].data_ptr(), pads=b["pad_ptrs"].data_ptr(), seq=b["seq"].data_ptr(),
            arrive=b["arrive"].data_ptr(), gather_state=b["gather_state"].data_ptr(), err_host=self._err_host,
            err_dev=self._err_dev, timeout_ns=self.timeout_ns, hidden=self.hidden_size, dtype=dtype_codes(self.C)[self.dtype],
            sm_count=torch.cuda.get_device_properties(self.device).multi_processor_count,
            max_rows_per_rank=self.max_tokens_per_rank, double_buffer_rows=self.double_buffer_tokens,
            check_layout=bool(check_layout),
        )

    def rows_view(self, buffer: torch.Tensor, rows: int, row_shape: Tuple[int, ...]) -> torch.Tensor:
        """The first ``rows`` rows of ``buffer`` as ``[rows, *row_shape]``."""
        head = buffer[:rows]
        return head if row_shape == (self.hidden_size,) else head.view(rows, *row_shape)

    def quant_views(self, fmt, buffer: int, rows: int, peer: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(q [rows, H] in the format's dtype, scale [rows, H / group] float32)`` over gather buffer
        ``buffer`` (docs/design.md, "FP8 layout"); ``peer``: over that rank's gather buffer 0, as mapped here."""
        raw = (self.gathers[buffer] if peer is None else self.peer_gather[peer]).view(-1).view(torch.uint8)
        h, groups = self.hidden_size, self.hidden_size // fmt.group
        q = raw[: rows * h].view(fmt.dtype).view(rows, h)
        start = self.state.scale_offset(buffer)
        scale = raw[start: start + rows * groups * 4].view(torch.float32).view(rows, groups)
        return q, scale

    def close(self) -> None:
        """Refuse every later launch of the native state, then free the host-mapped error record."""
        if self.state is not None:
            self.state.close()
        if self._err_host:
            self.C.free_host_mapped(self._err_host)
            self._err_host = None
