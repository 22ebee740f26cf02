"""What a failed P2P call says: the exception types and the text of a device-side error record.

A P2P kernel that fails records the first error into host-mapped memory (csrc/common.cuh): the code,
the call (channel * 2 + phase), a rank and the call's epoch. The transport reads it before its next
launch (the native state refuses to launch while it is set) and raises the error built here; the
transport stays unusable after it, because the ranks' signal state no longer agrees.
"""

from __future__ import annotations

from typing import Sequence, Tuple, Type

__all__ = ["P2PError", "P2PTimeoutError", "describe_error", "error_from_record"]


class P2PError(RuntimeError):
    """A P2P call failed on the device (its error record was set); the transport is unusable after it."""


class P2PTimeoutError(P2PError):
    """A peer never arrived at a P2P call within NSA_CP_P2P_TIMEOUT_MS."""


# csrc/ops.h: kErrTimeout, kErrBadDeviceArg, kErrBadPosition
_ERR_TIMEOUT, _ERR_BAD_DEVICE_ARG, _ERR_BAD_POSITION = 1, 2, 3
_PHASE_NAMES = ("entry barrier", "done barrier")
_CHANNEL_NAMES = ("all-gather", "reduce-scatter")


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
                f"[0, max_rank_len], compact offsets that are not the prefix sum of the counts, more rows than "
                f"positions, or a null or misaligned buffer (check device_counts). No rows were moved.")
    elif code == _ERR_BAD_POSITION:
        what = (f"{where}) on rank {rank} rejected the device-side geometry of its positions: a value outside "
                f"[0, T) (check positions: a permutation of range(T), the same on every rank). It was clamped, "
                f"so nothing outside the buffers was touched, but rows of that call went to wrong places.")
    else:
        what = f"{where}) on rank {rank} failed with unknown error code {code} (peer {peer})."
    return what + " The transport is unusable; results of that call and later ones are invalid."


def error_from_record(record: Sequence[int], rank: int, timeout_ms: float) -> Tuple[Type[P2PError], str]:
    """``(exception class, message)`` for an error record ``[code, slot, peer, epoch]`` (code != 0)."""
    code, slot, peer, epoch = (int(v) for v in record[:4])
    error = P2PTimeoutError if code == _ERR_TIMEOUT else P2PError
    return error, describe_error(code, slot, peer, epoch, rank, timeout_ms)
