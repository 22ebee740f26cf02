"""What a failed P2P call says: the exception types and the text of a device-side error record.

A P2P kernel that fails records the first error into host-mapped memory (csrc/common.cuh): the code,
the call (channel * 2 + phase), a rank and the call's epoch, and for a layout mismatch both ranks'
call fingerprints. The transport reads it before its next launch (the native state refuses to launch
while it is set) and raises the error built here; the transport stays unusable after it, because the
ranks' signal state no longer agrees.
"""

from __future__ import annotations

from typing import Sequence, Tuple, Type

from ... import errors
from ...geometry.wire import FORMATS

__all__ = ["P2PError", "P2PTimeoutError", "LayoutMismatchError", "describe_error", "error_from_record", "RECORD_WORDS"]


class P2PError(RuntimeError):
    """A P2P call failed on the device (its error record was set); the transport is unusable after it."""


class P2PTimeoutError(P2PError):
    """A peer never arrived at a P2P call within NSA_CP_P2P_TIMEOUT_MS."""


class LayoutMismatchError(P2PError, errors.LayoutMismatchError):
    """Ranks entered the same P2P call assuming different things: layout counts or max_rank_len, row
    bytes, compact / ordered / norm / wire format, or the call number (csrc/common.cuh, the call fingerprint).
    Also a ``nsa_cp.LayoutMismatchError`` (what ``validate=True`` raises before a call), so one except
    clause catches both."""


# csrc/ops.h: kErrTimeout, kErrBadDeviceArg, kErrBadPosition, kErrLayoutMismatch, kErrRecordWords
_ERR_TIMEOUT, _ERR_BAD_DEVICE_ARG, _ERR_BAD_POSITION, _ERR_LAYOUT_MISMATCH = 1, 2, 3, 4
RECORD_WORDS = 12
_PHASE_NAMES = ("entry barrier", "done barrier")
_CHANNEL_NAMES = ("all-gather", "reduce-scatter")
# csrc/common.cuh: kFpCompact, kFpOrdered, kFpNorm, kFpScatter (bits of a fingerprint's desc) and, in bits
# kFpFormatShift.., the wire format's code
FP_OVERLAP = 8  # the overlapped boundary's entry barrier (its fingerprint computed by the host)
_FP_FLAGS = ((1, "compact"), (2, "ordered"), (4, "norm"),
             (FP_OVERLAP, "overlapped boundary (layout, wire format, chunk_rows, output rows, shared)"),
             (16, "reduce-scatter"))
FP_FORMAT_SHIFT = _FP_FORMAT_SHIFT = 5
_FORMAT_NAMES = {fmt.code: fmt.name for fmt in FORMATS.values()}


def describe_fingerprint(hash_: int, desc: int, epoch: int) -> str:
    """One side of a layout mismatch: what the call assumed, as the fingerprint carries it."""
    flags = [name for bit, name in _FP_FLAGS if desc & bit]
    code = (desc >> _FP_FORMAT_SHIFT) & 7
    if code:
        flags.append(_FORMAT_NAMES.get(code, f"wire format #{code}"))
    layout = "compact" if desc & 1 else "padded"
    kind = ", ".join([layout] + [f for f in flags if f != "compact"])
    return f"{desc >> 8} rows in total, {kind}, call #{epoch}, layout hash {hash_:#010x}"


def describe_error(code: int, slot: int, peer: int, epoch: int, rank: int, timeout_ms: float,
                   fingerprints: Sequence[int] = ()) -> str:
    """The message of a P2P call's device-side error record (csrc/common.cuh): what failed, where, why.
    ``fingerprints``: for a layout mismatch, the record's words 4..8 (own hash, own desc, the peer's hash,
    desc and epoch)."""
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
    elif code == _ERR_LAYOUT_MISMATCH:
        own_hash, own_desc, peer_hash, peer_desc, peer_epoch = (list(fingerprints) + [0] * 5)[:5]
        after = ("No row of that call was read." if channel == 1 else
                 "No row of that call was moved." if phase == 0 else
                 "Its result on this rank was overwritten with NaN.")
        what = (f"{where}) on rank {rank}: the ranks disagree on the call: rank {rank} assumed "
                f"{describe_fingerprint(own_hash, own_desc, epoch)}; rank {peer} assumed "
                f"{describe_fingerprint(peer_hash, peer_desc, peer_epoch)} (the hash covers every rank's count, "
                f"max_rank_len, the positions count and the row bytes). Every rank must make the same calls with "
                f"the same ShardLayout (and device counts). {after}")
    else:
        what = f"{where}) on rank {rank} failed with unknown error code {code} (peer {peer})."
    return what + " The transport is unusable; results of that call and later ones are invalid."


def error_from_record(record: Sequence[int], rank: int, timeout_ms: float) -> Tuple[Type[P2PError], str]:
    """``(exception class, message)`` for an error record ``[code, slot, peer, epoch, ...]`` (code != 0;
    a layout mismatch also carries words 4..8, the two fingerprints)."""
    code, slot, peer, epoch = (int(v) for v in record[:4])
    error = {_ERR_TIMEOUT: P2PTimeoutError, _ERR_LAYOUT_MISMATCH: LayoutMismatchError}.get(code, P2PError)
    return error, describe_error(code, slot, peer, epoch, rank, timeout_ms, [int(v) for v in record[4:9]])
