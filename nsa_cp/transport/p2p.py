"""Intranode P2P transport: move only real rows over NVLink, straight into the peers' buffers.

Design record
-------------
Buffers. At construction every rank allocates peer-mapped tensors and exchanges their addresses: a
gather buffer and a reduce buffer of ``cp_size * max_tokens_per_rank`` rows of ``hidden_size`` elements
each, a second gather buffer of ``cp_size * double_buffer_tokens`` rows (see "Reuse safety"), and a
small signal area. They come from ``torch.distributed._symmetric_memory`` (``empty`` + ``rendezvous``),
or, when the ranks share one GPU (which symmetric memory refuses), from ordinary allocations whose CUDA
IPC handles go round the group (as torch.multiprocessing shares CUDA tensors; across GPUs this failed
and is refused, see ``_memory_problem``). The kernels see raw pointers either way. All sizes are fixed
up front (before any CUDA-graph capture) and never regrown: a layout that needs more raises ValueError
naming both numbers and the setting to raise.

Gather (``all_gather``). Every rank writes its ``n_r`` rows into every rank's gather buffer at its slot
(padded: ``r*M``; compact: ``offsets[r]``) and zeroes the padding rows of its own buffer locally, so no
padding crosses the link. Two engines:
  * "sm": one kernel of nsa_cp._C (csrc/p2p_gather.cu): entry barrier (see "Reuse safety"), local
    zeroing, 16-byte vector stores to all ranks, then each block adds its share to a done counter in
    every rank's signal pad and the last block waits for every rank's (no block funnels the others'
    completion: measured 1.5 us faster at M = 256 than a grid barrier). Small calls are a single launch.
  * "ce": the copy engine (cudaMemcpyAsync through ``Tensor.copy_`` onto the peer's mapped buffer), so no
    SM is busy moving bytes; two one-block barrier kernels around the copies.
The result is a view of this rank's gather buffer (either one), valid until the next gather on this
transport.

Reduce-scatter (``reduce_scatter``). The MoE writes its partials straight into this rank's reduce
buffer (``reduce_buffer()`` hands it out; any other tensor is copied in first). One kernel
(csrc/p2p_reduce_scatter.cu) waits until every rank's partials are complete, pulls this rank's ``n_r``
rows from every rank, sums them in fp32 in rank order 0..P-1 and writes ``[n_r, H]``; a done barrier
keeps every rank from overwriting its reduce buffer while a peer still reads it.

Reuse safety. A rank writes into a peer's gather buffer only when no reader of that buffer's previous
contents can still run on the peer. Two ways, chosen per call on the device:
  * entry barrier: wait until the peer has entered the same call, i.e. all earlier work on the peer's
    stream is done. Always for the reduce-scatter and the copy engine;
  * double buffering (sm gathers): gathers of at most ``double_buffer_tokens`` rows per rank alternate
    between the two gather buffers (the host picks, the same on every rank). When the previous gather
    wrote the other buffer, its done phase already proved that every peer had entered it, so the
    readers of anything older are done and the kernel waits for nobody at entry: a small call costs one
    signal latency instead of two. The kernel compares with the buffer the previous gather wrote
    (device memory), so eager calls interleaved with CUDA-graph replays, which the host never sees,
    still wait whenever two gathers in a row use the same buffer.
Epochs live on the device, so CUDA-graph replays stay in step. All of this is ordered on the calling
stream: readers of a result (or writers of the reduce buffer) on other streams must be joined into it
before the next call on the transport is enqueued (README, "Streams").

Faults. Every wait has a timeout (NSA_CP_P2P_TIMEOUT_MS). A kernel that times out records which call
and which peer into host-mapped memory and gives up; the next call on the transport (or
``check_error()``) raises P2PTimeoutError naming them, and the transport stays unusable.
"""

from __future__ import annotations

import logging
import math
import socket
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from .. import _native, envs, workspace
from ..layout import ShardLayout

logger = logging.getLogger("nsa_cp")

__all__ = ["P2PTransport", "P2PError", "P2PTimeoutError", "p2p_unavailable_reason", "describe_error"]

_CHANNEL_GATHER = 0
_CHANNEL_SCATTER = 1
_DTYPE_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
_ENGINES = ("auto", "sm", "ce")
_PHASE_NAMES = ("entry barrier", "done barrier")
_CHANNEL_NAMES = ("all-gather", "reduce-scatter")


class P2PError(RuntimeError):
    """A P2P call failed on the device (its error record was set); the transport is unusable after it."""


class P2PTimeoutError(P2PError):
    """A peer never arrived at a P2P call within NSA_CP_P2P_TIMEOUT_MS."""


_ERR_TIMEOUT, _ERR_BAD_DEVICE_ARG = 1, 2  # csrc/ops.h kErrTimeout, kErrBadDeviceArg


def describe_error(code: int, slot: int, peer: int, epoch: int, rank: int, timeout_ms: float) -> str:
    """The message of a P2P call's device-side error record (csrc/common.cuh): what failed, where, why."""
    channel, phase = divmod(slot, 2)
    call = _CHANNEL_NAMES[channel] if channel < len(_CHANNEL_NAMES) else f"channel {channel}"
    where = f"nsa_cp P2P {call} (call #{epoch}"
    if code == _ERR_TIMEOUT:
        what = (f"{where}, {_PHASE_NAMES[phase]}) on rank {rank} timed out: rank {peer} never arrived within "
                f"{timeout_ms:.0f} ms (NSA_CP_P2P_TIMEOUT_MS).")
    elif code == _ERR_BAD_DEVICE_ARG:
        what = (f"{where}) on rank {rank} rejected the device-side geometry of rank {peer}: a count outside "
                f"[0, max_rank_len], compact offsets that are not the prefix sum of the counts, or a null or "
                f"misaligned buffer (check device_counts). No rows were moved.")
    else:
        what = f"{where}) on rank {rank} failed with unknown error code {code} (peer {peer})."
    return what + " The transport is unusable; results of that call and later ones are invalid."


def p2p_unavailable_reason(group: Optional[dist.ProcessGroup] = None, device=None) -> Optional[str]:
    """Why the P2P transport cannot serve ``group`` here, or None when it can (collective call).

    Every rank must call it: each rank's own verdict, hostname and device index go round in one
    all_gather_object, so every rank returns the same answer (never some ranks in a collective and
    others not, as a rank without a GPU or without nsa_cp._C would otherwise cause).
    """
    return _survey(group, device)[0]


def _survey(group, device, config: Optional[dict] = None) -> Tuple[Optional[str], list]:
    """``(p2p_unavailable_reason, every rank's device index)`` from one all_gather_object (collective).

    ``config``: settings every rank must share (the transport's sizes); a difference raises ValueError
    on every rank, naming each rank's value, because the kernels would silently disagree on where rows
    go (e.g. one rank double-buffering a call that another writes into its first buffer).
    """
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
        local = _native.device_unsupported_reason(index) or None
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
    different GPUs it failed on 2x H200 (run 19 of docs/gpu_runs.md: illegal memory access in every
    check), so it is refused there until that is understood.
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
                "illegal memory access on 2x H200); use auto or symm_mem")
    return None


def _memory_kind(indices) -> str:
    """'symm_mem' or 'cuda_ipc' for ranks on these device indices (where _memory_problem finds none):
    NSA_CP_P2P_MEMORY, with 'auto' taking CUDA IPC only when the ranks share a GPU."""
    setting = envs.NSA_CP_P2P_MEMORY
    if setting == "auto":
        return "cuda_ipc" if len(set(indices)) < len(indices) else "symm_mem"
    return setting


class P2PTransport:
    """Peer-mapped buffers of one CP group (symmetric memory or CUDA IPC) and the kernels that move rows
    through them.

    Args:
        group: the CP process group (None: default group). All ranks on one node.
        max_tokens_per_rank: capacity, the largest ``max_rank_len`` any call may use.
        hidden_size: row length in elements (trailing dims flattened).
        dtype: bf16, fp16 or fp32.
        device: this rank's CUDA device (default: the current one).
        timeout_ms: per-wait timeout (default NSA_CP_P2P_TIMEOUT_MS; 0 waits forever).
        workspace_bytes: optional budget; the transport always allocates exactly
            ``nsa_cp.workspace_bytes(cp_size, max_tokens_per_rank, hidden_size, dtype,
            double_buffer_tokens)`` and logs a warning (with both numbers and the value to set) when the
            budget is smaller.
        double_buffer_tokens: tokens per rank of the second gather buffer (capped at
            ``max_tokens_per_rank``; 0: none; default NSA_CP_P2P_DOUBLE_BUFFER_TOKENS, 1024). Costs
            ``cp_size * tokens * hidden * element size`` bytes; gathers up to that size skip the entry
            barrier (module docstring, "Reuse safety"). The same on every rank.
    """

    def __init__(
        self,
        group: Optional[dist.ProcessGroup],
        max_tokens_per_rank: int,
        hidden_size: int,
        dtype: torch.dtype = torch.bfloat16,
        device=None,
        *,
        timeout_ms: Optional[int] = None,
        workspace_bytes: Optional[int] = None,
        double_buffer_tokens: Optional[int] = None,
    ):
        if max_tokens_per_rank < 1:
            raise ValueError(f"max_tokens_per_rank: expected an int >= 1, got {max_tokens_per_rank}")
        if hidden_size < 1:
            raise ValueError(f"hidden_size: expected an int >= 1, got {hidden_size}")
        if dtype not in _DTYPE_CODES:
            raise ValueError(f"dtype: expected one of {list(_DTYPE_CODES)}, got {dtype}")
        double_buffer_rows = workspace.double_buffer_rows(int(max_tokens_per_rank), double_buffer_tokens)
        config = {"max_tokens_per_rank": int(max_tokens_per_rank), "hidden_size": int(hidden_size),
                  "dtype": str(dtype), "double_buffer_tokens": double_buffer_rows}
        reason, indices = _survey(group, device, config)
        if reason is not None:
            raise RuntimeError(f"nsa_cp P2P transport unavailable: {reason}")
        self._C = _native.load()
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.device = torch.device(device if device is not None else "cuda")
        if self.device.index is None:  # "cuda": the current device, so that tensors' devices compare equal
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.max_tokens_per_rank = int(max_tokens_per_rank)
        self.hidden_size = int(hidden_size)
        self.dtype = dtype
        self.timeout_ns = (envs.NSA_CP_P2P_TIMEOUT_MS if timeout_ms is None else int(timeout_ms)) * 1_000_000
        self.capacity_rows = self.world * self.max_tokens_per_rank
        self._row_bytes = self.hidden_size * torch.empty((), dtype=dtype).element_size()
        self._sm_count = torch.cuda.get_device_properties(self.device).multi_processor_count
        self._broken = None  # (exception class, message) once a call failed on the device

        # every device buffer comes from the plan, so nsa_cp.workspace_bytes() is exact
        self.double_buffer_tokens = double_buffer_rows
        plan = workspace.workspace_plan(
            self.world, self.max_tokens_per_rank, self.hidden_size, dtype, self.double_buffer_tokens
        )
        required = workspace.check_budget(
            workspace_bytes, self.world, self.max_tokens_per_rank, self.hidden_size, dtype, self.double_buffer_tokens
        )
        handles = {}
        self.memory = _memory_kind(indices)
        share = _symmetric if self.memory == "symm_mem" else _cuda_ipc

        def symmetric(entry):
            tensor, handles[entry.name] = share(entry.shape, entry.dtype, self.device, group)
            return tensor

        def local(entry):
            return torch.zeros(entry.shape, dtype=entry.dtype, device=self.device)

        buffers = workspace.allocate(plan, symmetric, local)
        self.workspace_bytes = required
        self._gather, self._reduce, self._signals = buffers["gather"], buffers["reduce"], buffers["signals"]
        # gather buffer 0 and 1 (1 is 0 again without double buffering: then never chosen)
        self._gathers = (self._gather, buffers.get("gather_alt", self._gather))
        self._signals.zero_()
        alt = "gather_alt" if "gather_alt" in handles else "gather"
        buffers["gather_ptrs"].copy_(
            torch.tensor([handles["gather"].buffer_ptrs, handles[alt].buffer_ptrs], dtype=torch.int64)
        )
        for name, handle in (("reduce_ptrs", "reduce"), ("pad_ptrs", "signals")):
            buffers[name].copy_(torch.tensor(handles[handle].buffer_ptrs, dtype=torch.int64))
        self._gather_ptrs, self._reduce_ptrs, self._pad_ptrs = (
            buffers["gather_ptrs"], buffers["reduce_ptrs"], buffers["pad_ptrs"]
        )
        self._seq, self._arrive, self._gather_state = buffers["seq"], buffers["arrive"], buffers["gather_state"]
        # addresses the sm gather passes per buffer (kept, not recomputed per call: host time)
        self._gather_args = [(self._gather_ptrs[b].data_ptr(), self._gather_state.data_ptr()) for b in (0, 1)]
        self._last_buffer = 0  # host's guess of the buffer the last gather wrote (the device knows)
        # the copy engine writes into peers' gather buffers through these mapped views
        shape = list(self._gather.shape)
        self._peer_gather = [handles["gather"].get_buffer(peer, shape, dtype, 0) for peer in range(self.world)]
        self._err_host, self._err_dev = self._C.alloc_host_mapped_u32(4)
        self._handles = handles  # keep the mappings alive
        torch.cuda.synchronize(self.device)
        dist.barrier(group=group)  # every rank's signal area is zero before anyone signals
        logger.info(
            "nsa_cp P2P transport: rank %d/%d, %d tokens/rank x %d x %s, %.1f MiB per buffer, second "
            "gather buffer for %d tokens/rank (%s)",
            self.rank, self.world, self.max_tokens_per_rank, self.hidden_size, dtype,
            self._gather.numel() * self._gather.element_size() / 2**20, self.double_buffer_tokens, self.memory,
        )

    # ------------------------------------------------------------------ sizing and checks
    def fits(self, t: torch.Tensor, layout: ShardLayout) -> bool:
        """Whether a call on ``t`` (rows of this transport's dtype and hidden size) and ``layout`` fits."""
        return (
            t.is_cuda
            and t.device == self.device
            and t.dtype == self.dtype
            and math.prod(t.shape[1:]) == self.hidden_size
            and layout.cp_size == self.world
            and layout.max_rank_len <= self.max_tokens_per_rank
        )

    def check_fits(self, name: str, t: torch.Tensor, layout: ShardLayout) -> None:
        """Raise ValueError saying why ``t`` / ``layout`` cannot use this transport (nothing is written)."""
        if layout.max_rank_len > self.max_tokens_per_rank:
            raise ValueError(
                f"layout: max_rank_len {layout.max_rank_len} exceeds the P2P capacity of "
                f"{self.max_tokens_per_rank} tokens per rank; raise max_tokens_per_rank "
                f"(nsa_cp.init_p2p / NSACPLayerCommunicator(p2p_max_tokens_per_rank=...)) to at least "
                f"{layout.max_rank_len}"
            )
        if t.dtype != self.dtype:
            raise ValueError(f"{name}: expected dtype {self.dtype} (the P2P transport's), got {t.dtype}")
        if math.prod(t.shape[1:]) != self.hidden_size:
            raise ValueError(
                f"{name}: expected rows of {self.hidden_size} elements (the P2P transport's hidden_size), "
                f"got shape {list(t.shape)}"
            )
        if t.device != self.device:
            raise ValueError(f"{name}: expected device {self.device} (the P2P transport's), got {t.device}")

    def check_error(self) -> None:
        """Raise if an earlier call failed on the device: P2PTimeoutError when a peer never arrived,
        P2PError for a rejected device-side geometry (reads host-mapped memory, no sync)."""
        if self._broken is not None:
            raise self._broken[0](self._broken[1])
        code = self._C.read_u32(self._err_host, 0)
        if code == 0:
            return
        slot, peer, epoch = (self._C.read_u32(self._err_host, i) for i in (1, 2, 3))
        error = P2PTimeoutError if code == _ERR_TIMEOUT else P2PError
        self._broken = (error, describe_error(code, slot, peer, epoch, self.rank, self.timeout_ns / 1e6))
        raise error(self._broken[1])

    def _view(self, buffer: torch.Tensor, layout: ShardLayout, compact: bool, rest) -> torch.Tensor:
        """The first rows of ``buffer`` (``[capacity rows, hidden]``) that ``layout`` fills, as
        ``[rows, *rest]`` (``rest``: the trailing shape, ``hidden`` elements in all)."""
        rows = layout.global_len(compact)
        head = buffer[:rows]  # one slice: the host cost of every call's result (1.9 against 3.4 us)
        return head if len(rest) == 1 else head.view(rows, *rest)

    def _blocks(self, total_bytes: int) -> int:
        # Every SM from 4 MB up: a small call is latency-bound, and more blocks keep more 16-byte
        # stores in flight (28 blocks for 7 MB took 26 us on 2x H200, against ~18 us predicted).
        return max(1, min(self._sm_count, -(-total_bytes // (32 << 10))))

    def _signal_args(self, channel: int):
        return (
            self._pad_ptrs.data_ptr(),
            channel,
            self._seq.data_ptr() + 4 * channel,
            self._arrive.data_ptr() + 4 * channel,
            self.timeout_ns,
            self._err_dev,
        )

    # ------------------------------------------------------------------ gather
    def choose_engine(self, engine: str, layout: ShardLayout) -> str:
        if engine not in _ENGINES:
            raise ValueError(f"engine: expected one of {_ENGINES}, got {engine!r}")
        if engine == "auto":
            engine = envs.NSA_CP_P2P_ENGINE
        if engine == "auto":
            slot_bytes = layout.max_rank_len * self._row_bytes
            engine = "ce" if slot_bytes >= envs.NSA_CP_P2P_CE_MIN_BYTES else "sm"
        return engine

    def _device_counts(self, layout: ShardLayout, device_counts):
        if device_counts is None:
            return layout.device_tensors(self.device)
        counts, offsets = device_counts
        for name, t in (("device_counts[0]", counts), ("device_counts[1]", offsets)):
            if t.dtype != torch.int32 or t.device != self.device or tuple(t.shape) != (self.world,):
                raise ValueError(
                    f"{name}: expected int32 [{self.world}] on {self.device}, got {t.dtype} {list(t.shape)} on {t.device}"
                )
        return counts, offsets

    def all_gather(
        self, x: torch.Tensor, layout: ShardLayout, *, compact: bool, engine: str = "auto", device_counts=None
    ) -> torch.Tensor:
        """Gather into this rank's gather buffer; returns its ``[global_len, *x.shape[1:]]`` view.

        The view stays valid until the next gather on this transport. Inputs are checked by the caller.
        ``device_counts=(counts, offsets)`` (int32 ``[cp_size]`` device tensors) replaces the layout's
        counts on the device, for CUDA graphs captured once per bucket: ``layout`` then gives only the
        geometry (``max_rank_len``), every count must stay <= it, and the engine must be "sm".
        """
        self.check_error()
        self.check_fits("x", x, layout)
        engine = self.choose_engine(engine, layout)
        if device_counts is not None and engine != "sm":
            raise ValueError(f"engine: device_counts needs the 'sm' engine (the copy engine reads host counts), got {engine!r}")
        rows = x.reshape(x.shape[0], self.hidden_size)
        if rows.shape[0] and rows.stride(1) != 1:
            rows = rows.contiguous()
        counts, offsets = self._device_counts(layout, device_counts)
        with _native.launch_device(self.device):  # _C launches on the current device
            return self._enqueue_gather(rows, layout, compact, engine, counts, offsets, x.shape[1:])

    def _enqueue_gather(self, rows, layout, compact, engine, counts, offsets, rest) -> torch.Tensor:
        """all_gather's launches, on this transport's device (checked arguments)."""
        stream = _native.current_stream(self.device)
        pads, channel, seq, arrive, timeout, err = self._signal_args(_CHANNEL_GATHER)
        if engine == "sm":
            buffer = self._next_buffer(layout)
            bufs, state = self._gather_args[buffer]
            moved = layout.max_rank_len * self._row_bytes * self.world
            self._C.p2p_gather(
                rows.data_ptr(), rows.stride(0) * rows.element_size(), self._row_bytes,
                bufs, counts.data_ptr(), offsets.data_ptr(),
                layout.max_rank_len, compact, self.rank, self.world, pads, channel, seq, arrive,
                timeout, err, self._blocks(moved), stream, buffer, state,
            )
            return self._view(self._gathers[buffer], layout, compact, rest)
        # copy engine, on buffer 0: entry barrier, one copy per rank, local zeroing of padding, done
        # barrier; then the record of the last buffer written, which the next sm gather reads
        self._last_buffer = 0
        result = self._view(self._gather, layout, compact, rest)
        self._C.barrier(pads, self.rank, self.world, channel, 0, seq, False, timeout, err, stream)
        start, stop = layout.rows(self.rank, compact)
        if stop > start:
            for peer in range(self.world):
                self._peer_gather[peer][start:stop].copy_(rows)
        if not compact:
            m = layout.max_rank_len
            flat = self._gather.view(-1)
            for q, n in enumerate(layout.per_rank_actual_token):
                if n < m:
                    flat[(q * m + n) * self.hidden_size : (q + 1) * m * self.hidden_size].zero_()
        self._C.barrier(pads, self.rank, self.world, channel, 1, seq, True, timeout, err, stream)
        self._gather_state[:1].zero_()  # the tag of the buffer written: 0
        return result

    def barrier(self) -> None:
        """Enqueue a barrier of the group on the current stream (one small kernel; the host does not
        wait): the work after it starts on every rank within one signal latency of the others. Collective:
        every rank must call it at the same point of its call sequence. Benchmarks use it to release the
        ranks together before a timed call."""
        self.check_error()
        pads, channel, seq, _, timeout, err = self._signal_args(_CHANNEL_GATHER)
        stream = _native.current_stream(self.device)
        with _native.launch_device(self.device):
            self._C.barrier(pads, self.rank, self.world, channel, 1, seq, True, timeout, err, stream)

    def _next_buffer(self, layout: ShardLayout) -> int:
        """The gather buffer of the next sm gather: the other one than last time when the layout fits the
        second buffer, else buffer 0. Every rank makes the same calls, so every rank picks the same."""
        fits_second = layout.max_rank_len <= self.double_buffer_tokens
        self._last_buffer = 1 - self._last_buffer if fits_second else 0
        return self._last_buffer

    # ------------------------------------------------------------------ reduce-scatter
    def reduce_buffer(self, layout: ShardLayout, compact: bool, rest=None) -> torch.Tensor:
        """This rank's reduce buffer as ``[global_len, hidden]`` (or ``[global_len, *rest]``).

        Write the MoE partials here and pass this tensor to reduce_scatter: no copy in.
        """
        if layout.max_rank_len > self.max_tokens_per_rank:
            self.check_fits("reduce_buffer", self._reduce, layout)
        return self._view(self._reduce, layout, compact, rest if rest is not None else (self.hidden_size,))

    def reduce_scatter(
        self,
        y: torch.Tensor,
        layout: ShardLayout,
        *,
        compact: bool,
        out: Optional[torch.Tensor] = None,
        device_counts=None,
    ) -> torch.Tensor:
        """Sum every rank's partials for this rank's rows; returns ``[n_r, *y.shape[1:]]``.

        ``device_counts`` as for ``all_gather``: rows past this replay's count are left untouched.
        """
        self.check_error()
        self.check_fits("y", y, layout)
        staged = self._view(self._reduce, layout, compact, y.shape[1:])
        if y.data_ptr() != staged.data_ptr() or y.stride() != staged.stride():
            staged.copy_(y)
        n = layout.count(self.rank)
        if out is None:
            out = y.new_empty((n, *y.shape[1:]))
        out_rows = out.view(n, self.hidden_size)
        counts, offsets = self._device_counts(layout, device_counts)
        stream = _native.current_stream(self.device)
        pads, channel, seq, arrive, timeout, err = self._signal_args(_CHANNEL_SCATTER)
        moved = layout.max_rank_len * self._row_bytes * self.world
        with _native.launch_device(self.device):
            self._C.p2p_reduce_scatter(
                out_rows.data_ptr(), self._row_bytes, self._reduce_ptrs.data_ptr(), counts.data_ptr(),
                offsets.data_ptr(), layout.max_rank_len, compact, self.hidden_size, _DTYPE_CODES[self.dtype],
                self.rank, self.world, pads, channel, seq, arrive, timeout, err,
                self._blocks(moved), stream,
            )
        return out

    def close(self) -> None:
        if getattr(self, "_err_host", None):
            self._C.free_host_mapped(self._err_host)
            self._err_host = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: nothing useful to do
            pass


# ---------------------------------------------------------------------- one transport per group
_REGISTRY = {}


def _group_key(group):
    return dist.group.WORLD if group is None else group


def init_p2p(
    group: Optional[dist.ProcessGroup],
    max_tokens_per_rank: int,
    hidden_size: int,
    dtype: torch.dtype = torch.bfloat16,
    device=None,
    *,
    timeout_ms: Optional[int] = None,
    workspace_bytes: Optional[int] = None,
    double_buffer_tokens: Optional[int] = None,
) -> P2PTransport:
    """Create (collectively, on every rank of ``group``) and register the P2P transport of ``group``.

    Afterwards ``cp_all_gather`` / ``cp_reduce_scatter`` with ``backend="auto"`` use it for uneven
    layouts that fit. Creating it again for the same group replaces the old one.
    """
    transport = P2PTransport(
        group, max_tokens_per_rank, hidden_size, dtype, device, timeout_ms=timeout_ms,
        workspace_bytes=workspace_bytes, double_buffer_tokens=double_buffer_tokens,
    )
    old = _REGISTRY.pop(_group_key(group), None)
    if old is not None:
        old.close()
    _REGISTRY[_group_key(group)] = transport
    return transport


def any_registered() -> bool:
    return bool(_REGISTRY)


def get_p2p(group: Optional[dist.ProcessGroup]) -> Optional[P2PTransport]:
    """The registered transport of ``group``, or None."""
    return _REGISTRY.get(_group_key(group))


def destroy_p2p(group: Optional[dist.ProcessGroup] = None) -> None:
    """Unregister and release the transport of ``group`` (no-op when there is none)."""
    transport = _REGISTRY.pop(_group_key(group), None)
    if transport is not None:
        transport.close()
