"""The torch.distributed transport checks on every call, without ``validate=``, that the ranks agree on it.

Each plan holds its call's fingerprint: one 31-bit word per field the ranks must agree on (the request's
``fields()``: call, layout counts and align, compact, positions, wire format, row shape and dtype, device
counts, algo; and the movement this transport chose), each a CRC of ``name=value`` as the P2P pulls hash
their request. Every call all-gathers the words, ``[P, F]`` int32, beside its rows (docs/design.md, "Rank
agreement on every call"):

* host-visible (gloo, CPU tensors): the words go first, in a collective of their own whose size no layout
  changes; every rank compares the table and raises LayoutMismatchError naming the fields and ranks that
  differ before any row moves (so a different ``max_rank_len`` is caught, never a hang or a short read);
* on the device (NCCL, CUDA): no host sync. The words ride in the same NCCL group as the equal-shard
  collective (torch's process group, ``_start_coalescing``), else in a tiny all-gather just before it (the
  native communicator, the uneven-list collectives), in place (this rank's row of the table is its send
  buffer); after the rows, one kernel compares the table and, on a mismatch, overwrites the result with NaN
  (FP8: its fp32 scales) and sets the group's error record, on the device and in its pinned host copy (mapped
  into the device's address space: no copy per call), which the host reads at the group's next call: that
  call raises LayoutMismatchError naming the fields. Per call, nothing is allocated or copied to the device:
  the words, the table and the record are the plan's and the group's.

``NSA_CP_AGREEMENT=off`` turns it off, ``separate`` always sends the words alone first (``validate=`` keeps its
own up-front check either way).
"""

from __future__ import annotations

import zlib
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ... import envs
from ...errors import LayoutMismatchError

__all__ = ["Agreement", "agreement_for", "checked", "agree_now", "compare", "FORCE_DEVICE_CHECK"]

FORCE_DEVICE_CHECK = False  # tests: the device check on a host-visible group (gloo), to exercise it anywhere
_READ = envs.reader("NSA_CP_AGREEMENT")
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _word(name: str, value) -> int:
    return zlib.crc32(f"{name}={value}".encode()) & 0x7FFFFFFF


class _Record:
    """One group's device-side error record (int32 ``[mask]``, bits from nsa_cp/rows/kernels/agree.py) and its
    host copy (pinned on CUDA). The check kernel reads ``device`` and, when it sets the record, writes the value
    to ``device`` and to ``sink``: the host copy itself (pinned memory is mapped into the device's address
    space under CUDA's unified addressing), else ``device`` again, and the host copy is refreshed by a
    non-blocking copy after every check (``mapped`` False: where Triton finds the pinned copy out of reach)."""

    __slots__ = ("device", "host", "view", "names", "sink")

    def __init__(self, device: torch.device):
        self.device = torch.zeros(1, dtype=torch.int32, device=device)
        host = torch.zeros(1, dtype=torch.int32)
        self.host = host.pin_memory() if device.type == "cuda" else host
        self.view = self.host.numpy()  # read on every call: an array element costs far less than a tensor's
        self.names = ()
        self.sink = self.host

    @property
    def mapped(self) -> bool:
        return self.sink is self.host

    def check(self, kernel: Callable, table: torch.Tensor, rank: int, target: torch.Tensor) -> None:
        """``kernel`` (nsa_cp/rows/kernels/agree.py's check_and_poison) on this record: one launch, no copy
        while the host copy is mapped."""
        if self.mapped:
            try:
                kernel(table, rank, self.device, target, self.sink)
                return
            except ValueError:  # Triton: "cannot be accessed" (raised before any launch); copy from now on
                self.sink = self.device
        kernel(table, rank, self.device, target, self.sink)
        self.host.copy_(self.device, non_blocking=True)

    def raise_pending(self, call: str, rank: int) -> None:
        mask = int(self.view[0])
        if not mask:
            return
        self.view[0] = 0
        self.device.zero_()  # stream-ordered: calls enqueued after this raise start clean
        differ = [name for i, name in enumerate(self.names) if mask >> i & 1] or ["(unknown fields)"]
        raise LayoutMismatchError(
            f"{call}: an earlier call on this group saw the ranks disagree on {', '.join(differ)} (the "
            f"fingerprints gathered beside its rows, checked on the device; rank {rank}). Its result and any "
            f"later one's before this error were overwritten with NaN. Every rank of the group must pass the same "
            f"{', '.join(differ)}; NSA_CP_VALIDATE=1 checks up front and names the values")


_RECORDS: dict = {}


def _record(group, device: torch.device) -> _Record:
    key = (group, device)
    rec = _RECORDS.get(key)
    if rec is None:
        rec = _RECORDS[key] = _Record(device)
    return rec


class Agreement:
    """One plan's fingerprint and how its calls check it (the module docstring). ``before()`` at the start of
    every call (host: raises), ``after(targets)`` once its result is written (device: check and poison)."""

    __slots__ = ("coll", "rank", "size", "call", "names", "values", "device_check", "grouped", "send", "table",
                 "record", "kernel", "nothing")

    def __init__(self, coll, req, rank: int, size: int, movement: str, device_check: bool, grouped: bool,
                 in_place: bool = False):
        fields = dict(req.fields())
        fields["movement"] = movement
        self.coll, self.rank, self.size, self.call = coll, rank, size, fields["call"]
        self.names, self.values = tuple(fields), fields
        self.device_check, self.grouped = device_check, grouped and device_check
        device = req.device if device_check else torch.device("cpu")
        words = torch.tensor([_word(k, v) for k, v in fields.items()], dtype=torch.int32)
        self.table = torch.zeros((size, len(fields)), dtype=torch.int32, device=device)
        self.table[rank] = words.to(device)  # once per plan: an in-place gather keeps this row
        # in_place: the gather's send buffer is this rank's row of the table (NCCL: nothing copied on one rank)
        self.send = self.table[rank] if in_place else words.to(device)
        self.record = _record(coll.group, device) if device_check else None
        self.kernel = self.nothing = None
        if self.record is not None:
            from ...rows.kernels.agree import check_and_poison

            self.record.names = self.names  # the same field names in the same order for every request
            self.kernel, self.nothing = check_and_poison, self.table[:0]

    def before(self) -> None:
        """Host-visible: exchange and compare now, raising on every rank. Device: raise for an earlier call's
        mismatch, then send the words (grouped with the first equal-shard collective, or alone, now)."""
        if not self.device_check:  # CPU words through the group's own collective (gloo's: never a native one)
            _all_gather_single(self.table.view(-1), self.send, group=self.coll.group)
            self._compare(self.table.tolist())
            return
        self.record.raise_pending(self.call, self.rank)
        if self.grouped:
            self.coll.rider = (self.table.view(-1), self.send)
        else:
            self.coll.all_gather_equal(self.table.view(-1), self.send)

    def after(self, target: Optional[torch.Tensor]) -> None:
        """The device check (nothing for a host-visible one): on a mismatch ``target`` becomes NaN."""
        if not self.device_check:
            return
        if self.coll.rider is not None:  # no equal-shard collective took it (none ran): the words go alone
            self.coll.rider = None
            self.coll.all_gather_equal(self.table.view(-1), self.send)
        self.record.check(self.kernel, self.table, self.rank, target if target is not None else self.nothing)

    def _compare(self, table) -> None:
        compare(self.values["call"], self.values, table, self.rank, "the fingerprints gathered before any row moved")


def compare(call: str, values: dict, table, rank: int, when: str) -> None:
    """Raise LayoutMismatchError naming the fields (``values``' names, in order) whose words differ between
    the rows of ``table`` (one list of words per rank), and which ranks pass this rank's value."""
    names, mine = tuple(values), table[rank]
    differ = [i for i in range(len(names)) if any(row[i] != mine[i] for row in table)]
    if not differ:
        return
    parts = []
    for i in differ:
        same = [q for q, row in enumerate(table) if row[i] == mine[i]]
        other = [q for q in range(len(table)) if q not in same]
        parts.append(f"{names[i]} (ranks {same} pass {values[names[i]]}; ranks {other} another)")
    raise LayoutMismatchError(
        f"{call}: the ranks disagree on {'; '.join(parts)} (this rank {rank}; {when}). Every rank of the group "
        f"must make the same call with the same {', '.join(names[i] for i in differ)}; nothing moved")


def agree_now(group, call: str, fields: dict, rank: int, size: int) -> None:
    """Host-visible, collective: all-gather ``fields``' words (CPU int32, a size no field changes) and raise on
    every rank where they differ (the overlapped boundary over gloo, before it posts any transfer)."""
    words = torch.tensor([_word(k, v) for k, v in fields.items()], dtype=torch.int32)
    table = torch.empty((size, len(fields)), dtype=torch.int32)
    _all_gather_single(table.view(-1), words, group=group)
    compare(call, fields, table.tolist(), rank, "the fingerprints gathered before any transfer was posted")


def agreement_for(coll, req, rank: int, size: int, algo: str) -> Optional[Agreement]:
    """The plan's Agreement, or None when NSA_CP_AGREEMENT is off. It runs when no row moves too (a layout of
    zero tokens): a peer that holds another layout would otherwise wait for it."""
    mode = _READ()
    if mode == "off":
        return None
    on_device = req.device.type == "cuda" and "nccl" in str(dist.get_backend(coll.group)).lower()
    device_check = on_device or FORCE_DEVICE_CHECK
    # grouped with torch's equal-shard collective in one NCCL launch; the native communicator and the
    # uneven-list collectives take the words in a tiny all-gather of their own, just before
    grouped = (on_device and mode == "auto" and coll.native is None and algo in ("even", "padded", "padded+compact")
               and req.layout.total_len > 0)
    movement = f"{'native' if coll.native is not None else 'torch'}:{algo}"
    # NCCL gathers the words in place; gloo (the host-visible check, or the device check forced) from a
    # buffer of their own
    return Agreement(coll, req, rank, size, movement, device_check, grouped, in_place=on_device)


def checked(agreement, target: int, run: Callable) -> Callable:
    """``run`` between the agreement's halves (nsa_cp/transport/dist/agreement.py), or itself when it is off.
    ``target``: which result a device-side mismatch poisons (None: the one result)."""
    if agreement is None:
        return run
    before, after = agreement.before, agreement.after

    def run_checked(*args):
        before()
        results = run(*args)
        after(results if target is None else results[target])
        return results
    return run_checked
