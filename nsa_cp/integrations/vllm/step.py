"""The per-step PCP layout, kept where vLLM's ``PCPManager`` computes it; imports no vLLM.

Contract:

* ``PCPManager._build_batch_layout`` computes the per-rank token counts of a step (host lists) and
  ``partition_batch`` then hands the rank-local batch on, with its MoE padding mask ``is_padding``
  (``[P * M]`` rank-major, True on padding rows). vLLM keeps neither count in ``PCPBatchMetadata``.
  The plugin wraps both methods (:func:`build_batch_layout`, :func:`partition_batch`) and keeps one
  :class:`StepLayout` per process: the counts, ``M`` (the padded rows per rank: ``max(counts)``, or
  the CUDA-graph bucket's size) and the padding mask vLLM put on the batch.
* The MoE moves take a step's layout only for the forward whose ``forward_context.is_padding`` IS that
  mask (:func:`for_forward`): a dummy, profile, capture or micro-batched run carries another mask (or
  none) and keeps vLLM's own moves. No device tensor is read: no host sync.
* :meth:`StepLayout.compact_padding` is the mask of the compact rows (``[T]``, all False), which the
  routers read while a compact MoE runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ...geometry.layout import ShardLayout

__all__ = ["StepLayout", "current", "set_current", "for_forward", "build_batch_layout", "partition_batch"]


@dataclass
class StepLayout:
    """One PCP step's geometry: ``layout`` (the real counts, ``max_rank_len == rows``), ``rows`` (``M``,
    every rank's local rows, padding last) and ``is_padding`` (the mask vLLM set on the batch)."""

    layout: ShardLayout
    rows: int
    is_padding: Optional[torch.Tensor]
    _compact: Optional[torch.Tensor] = field(default=None, repr=False)

    @classmethod
    def from_counts(cls, counts: List[int], rows: int, is_padding: Optional[torch.Tensor]) -> "StepLayout":
        """vLLM's counts and M -> the layout whose padded rows are vLLM's gathered rows (``align=M``: under a
        CUDA-graph bucket M exceeds the largest count, and rank r still sits at ``r * M``)."""
        return cls(ShardLayout([int(c) for c in counts], align=max(int(rows), 1)), int(rows), is_padding)

    def compact_padding(self, like: torch.Tensor) -> torch.Tensor:
        """``[T]`` bool, all False: the compact rows are all real (cached per step)."""
        if self._compact is None or self._compact.device != like.device:
            self._compact = torch.zeros(self.layout.total_len, dtype=torch.bool, device=like.device)
        return self._compact


_CURRENT: List[Optional[StepLayout]] = [None]
# id(manager) -> (counts, M) between a manager's _build_batch_layout and its partition_batch: kept here,
# never on vLLM's objects, and dropped when partition_batch ends (raised or not)
_BUILT: Dict[int, Tuple[List[int], int]] = {}


def current() -> Optional[StepLayout]:
    return _CURRENT[0]


def set_current(step: Optional[StepLayout]) -> None:
    _CURRENT[0] = step


def for_forward(forward_context: Any) -> Optional[StepLayout]:
    """The step's layout when ``forward_context`` is that step's forward (its ``is_padding`` is the mask
    vLLM set on the partitioned batch), else None."""
    step = _CURRENT[0]
    if step is None or forward_context is None or step.is_padding is None:
        return None
    return step if getattr(forward_context, "is_padding", None) is step.is_padding else None


def build_batch_layout(original: Callable, manager: Any, *args, **kwargs):
    """Around ``PCPManager._build_batch_layout``: vLLM's result; the counts and M are kept (by nsa_cp, for
    this manager) until its :func:`partition_batch`."""
    result = original(manager, *args, **kwargs)
    _, counts = result
    padded = kwargs.get("padded_num_tokens", args[4] if len(args) > 4 else None)
    _BUILT[id(manager)] = (list(counts), max(counts) if padded is None else int(padded))
    return result


def partition_batch(original: Callable, manager: Any, *args, **kwargs):
    """Around ``PCPManager.partition_batch``: vLLM's rank-local batch; the step's layout becomes current,
    tied to the batch's padding mask."""
    set_current(None)
    try:
        local = original(manager, *args, **kwargs)
    finally:  # this build's counts serve this partition only
        kept = _BUILT.pop(id(manager), None)
    if kept is not None:
        counts, rows = kept
        set_current(StepLayout.from_counts(counts, rows, getattr(local, "is_padding", None)))
    return local
