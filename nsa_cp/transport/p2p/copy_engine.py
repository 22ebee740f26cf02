"""The P2P transport's copy-engine gather: which engine a plain gather takes, and the copy engine's runner.

The SM engine (the gather kernel) serves every call; the copy engine (``cudaMemcpyAsync`` into every
peer's mapped buffer between two barriers) serves plain gathers with host counts, and wins on large
slots (NSA_CP_P2P_CE_MIN_BYTES; docs/design.md, "Engines").
"""

from __future__ import annotations

from ... import envs
from ...geometry.layout import ShardLayout

__all__ = ["ENGINES", "choose", "runner"]

ENGINES = ("auto", "sm", "ce")


def choose(engine: str, slot_bytes: int, *, kernel_only: bool = False) -> str:
    """'sm' or 'ce' for an engine request ("auto": NSA_CP_P2P_ENGINE, then by ``slot_bytes``, one rank's
    slot). ``kernel_only``: the call needs the kernel (fp8, ordered): 'auto' means 'sm', 'ce' is refused."""
    if engine not in ENGINES:
        raise ValueError(f"engine: expected one of {ENGINES}, got {engine!r}")
    if kernel_only:
        if engine == "ce":
            raise ValueError("engine: 'ce' (the copy engine) cannot quantize or reorder rows; use 'sm' or 'auto'")
        return "sm"
    if engine == "auto":
        engine = envs.NSA_CP_P2P_ENGINE
    if engine == "auto":
        engine = "ce" if slot_bytes >= envs.NSA_CP_P2P_CE_MIN_BYTES else "sm"
    return engine


def runner(transport, layout: ShardLayout, compact: bool, row_shape):
    """The copy engine's gather into ``transport``'s buffer 0 (a P2PTransport): entry barrier, one copy per
    rank, local zeroing of padding, done barrier (host counts only). ``run(x, device_counts=None,
    positions=None)`` returns the gathered view, as the SM runner does."""
    t = transport
    start, stop = layout.rows(t.rank, compact)
    n = stop - start
    result = t._buffers.rows_view(t._gathers[0], layout.global_len(compact), row_shape)
    targets = [peer[start:stop].view(n, *row_shape) for peer in t._buffers.peer_gather] if n else []
    padding = []
    if not compact:
        m, flat = layout.max_rank_len, t._gathers[0].view(-1)
        for q, count in enumerate(layout.per_rank_actual_token):
            if count < m:
                padding.append(flat[(q * m + count) * t.hidden_size: (q + 1) * m * t.hidden_size])
    begin, end = t._guard(t._state.copy_engine_begin), t._state.copy_engine_end
    stream, index = t._stream, t.device.index

    def run(x, device_counts=None, positions=None):
        if device_counts is not None:
            raise ValueError("engine: device_counts needs the 'sm' engine (the copy engine reads host counts), got 'ce'")
        begin(stream(index))
        for target in targets:
            target.copy_(x)
        for rows_ in padding:
            rows_.zero_()
        end(stream(index))
        return result

    return run
