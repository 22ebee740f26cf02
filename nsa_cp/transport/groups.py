"""One object per process group (a P2P transport, a native NCCL communicator), and one generation for
all of them.

``latest_generation()`` is an integer that changes on every ``put`` and ``pop`` of any registry and is
never reused: the plan cache keys on it, so an object created, replaced or destroyed never leaves a
stale decision behind. ``None`` stands for the default group.
"""

from __future__ import annotations

import itertools
from typing import Any, Optional

import torch.distributed as dist

__all__ = ["GroupRegistry", "latest_generation", "advance"]

_counter = itertools.count(1)
_latest = 0


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
