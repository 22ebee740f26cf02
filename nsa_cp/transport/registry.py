"""One object per process group (a P2P transport, a native NCCL communicator), with a generation.

``generation()`` is an integer that changes on every ``put`` and ``pop`` and is never reused: a cache of
decisions that depend on which objects exist (the plan cache) keys on it, so an object created,
replaced or destroyed never leaves a stale decision behind. ``None`` stands for the default group.
"""

from __future__ import annotations

import itertools
from typing import Any, Optional

import torch.distributed as dist

__all__ = ["GroupRegistry", "latest_generation"]

_counter = itertools.count(1)  # shared by every registry: generations never repeat across them
_latest = 0


def latest_generation() -> int:
    """The newest generation of any registry: it changes whenever any registry's does (one int for a
    cache that depends on all of them)."""
    return _latest


def _next() -> int:
    global _latest
    _latest = next(_counter)
    return _latest


class GroupRegistry:
    def __init__(self):
        self._items: dict = {}
        self._generation = 0

    @staticmethod
    def _key(group):
        return dist.group.WORLD if group is None else group

    def generation(self) -> int:
        return self._generation

    def put(self, group, obj) -> Optional[Any]:
        """Register ``obj`` for ``group``; returns the object it replaces (the caller releases it), or None."""
        old = self._items.pop(self._key(group), None)
        self._items[self._key(group)] = obj
        self._generation = _next()
        return old

    def pop(self, group) -> Optional[Any]:
        """Unregister and return the object of ``group`` (None when there is none; the generation changes
        either way)."""
        obj = self._items.pop(self._key(group), None)
        self._generation = _next()
        return obj

    def get(self, group) -> Optional[Any]:
        return self._items.get(self._key(group)) if self._items else None

    def __bool__(self) -> bool:
        return bool(self._items)
