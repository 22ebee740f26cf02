"""torch.distributed's groups as nsa_cp sees them: the checks every call makes of a ``group`` argument
(``check_group``, ``resolve_group``, ``group_rank_and_size``), and one object per process group (a P2P
transport, a native NCCL communicator) with one generation for all of them.

``latest_generation()`` is an integer that changes on every ``put`` and ``pop`` of any registry and is
never reused: the plan cache keys on it, so an object created, replaced or destroyed never leaves a
stale decision behind. ``None`` stands for the default group.
"""

from __future__ import annotations

import itertools
from typing import Any, Optional

import torch.distributed as dist
from torch.distributed import distributed_c10d as _c10d

__all__ = ["GroupRegistry", "latest_generation", "advance", "check_group", "resolve_group", "group_rank_and_size",
           "forget_destroyed_groups"]

_counter = itertools.count(1)
_latest = 0


def check_group(group) -> None:
    """ValueError naming ``group`` unless it is None or a ProcessGroup this process is a member of
    (``dist.new_group`` hands a non-member a marker, not a group; a name or a rank is no group)."""
    if group is None or isinstance(group, dist.ProcessGroup):
        return
    if group is _c10d.GroupMember.NON_GROUP_MEMBER:
        rank = dist.get_rank() if dist.is_initialized() else "?"
        raise ValueError(f"group: expected a process group this rank is a member of (or None: the default group), "
                         f"got GroupMember.NON_GROUP_MEMBER: global rank {rank} is not in the group "
                         f"dist.new_group(ranks) made; call the collective on that group's ranks only")
    raise ValueError(f"group: expected a torch.distributed ProcessGroup (or None: the default group), got "
                     f"{group!r} ({type(group).__name__})")


def resolve_group(group: Optional[dist.ProcessGroup]) -> dist.ProcessGroup:
    """``group``, or the default group for None (raises when torch.distributed is not initialized);
    ValueError naming ``group`` for anything that is not a group of this rank (``check_group``)."""
    if group is not None:
        if not isinstance(group, dist.ProcessGroup):
            check_group(group)
        return group
    world = _c10d.GroupMember.WORLD  # the default group once initialized: an attribute read, not a call
    if world is not None:
        return world
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("nsa_cp collectives need torch.distributed to be initialized")
    return _c10d._get_default_group()


def forget_destroyed_groups(cache: dict) -> None:
    """Drop the entries of a plan cache (keys ``(request, group, ...)``) whose group
    ``dist.destroy_process_group`` has destroyed, and with them the plans' buffers and the group itself."""
    live = getattr(getattr(_c10d, "_world", None), "pg_map", None)
    if live is None:  # torch moved it: keep everything (the cache's size limit still bounds it)
        return
    dead = [key for key in cache if key[1] not in live]
    for key in dead:
        del cache[key]


def group_rank_and_size(group: Optional[dist.ProcessGroup]):
    """``(rank, size)`` of this process in ``group`` (None: the default group)."""
    # ProcessGroup.rank()/size() are plain C++ getters: dist.get_rank() costs microseconds of checks
    group = resolve_group(group)
    return group.rank(), group.size()


def latest_generation() -> int:
    """A new value after every ``put`` / ``pop`` of any registry (never reused): the plan-cache key."""
    return _latest


def advance() -> None:
    """A new generation: every cached plan is dropped at the next call (a transport came or went)."""
    global _latest
    _latest = next(_counter)


class GroupRegistry:
    def __init__(self):
        self._items: dict = {}

    @staticmethod
    def _key(group):
        return dist.group.WORLD if group is None else group

    def put(self, group, obj) -> Optional[Any]:
        """Register ``obj`` for ``group``; returns the object it replaces (the caller releases it), or None."""
        old = self._items.pop(self._key(group), None)
        self._items[self._key(group)] = obj
        advance()
        return old

    def pop(self, group) -> Optional[Any]:
        """Unregister and return the object of ``group`` (None when there is none; the generation changes
        either way)."""
        obj = self._items.pop(self._key(group), None)
        advance()
        return obj

    def get(self, group) -> Optional[Any]:
        return self._items.get(self._key(group)) if self._items else None

    def __bool__(self) -> bool:
        return bool(self._items)
