"""SGLang's CP metadata read as nsa_cp's geometry; imports no SGLang.

Contract:

* :func:`layout_from_cp_metadata` ``(md) -> ShardLayout`` of the real tokens. ``md`` is SGLang's
  ``forward_batch.attn_cp_metadata`` (or a duck-typed stand-in with its field names): the real counts are
  ``per_rank_logical_token`` where SGLang padded the shards, else ``per_rank_actual_token``. With padding,
  ``max_rank_len`` is the physical length, so the padded layout ``[physical * cp, H]`` is SGLang's
  gathered buffer row for row.
* :func:`physical_rows` ``(md, rank, layout) -> int``: the rows of this rank's local tensors in SGLang.

Bad metadata is a ValueError naming the field, the expected and the actual value.
"""

from __future__ import annotations

import logging
import operator
from typing import Any, List, Optional

import torch

from ...geometry.layout import ShardLayout

logger = logging.getLogger("nsa_cp")


def int_list(md: Any, name: str) -> Optional[List[int]]:
    """``md.<name>`` as a list of ints (None when absent or None); ValueError when it is not ints."""
    value = getattr(md, name, None)
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    try:
        return [operator.index(v) if not isinstance(v, torch.Tensor) else int(v) for v in value]
    except TypeError:
        raise ValueError(f"md.{name}: expected a list of ints, got {value!r}") from None


def layout_from_cp_metadata(md: Any, *, align: Optional[int] = None) -> ShardLayout:
    """SGLang's ``forward_batch.attn_cp_metadata`` -> the ShardLayout of the real tokens.

    Reads ``per_rank_logical_token`` (the real counts once SGLang padded the shards) or, where that is
    None or empty, ``per_rank_actual_token``. When SGLang padded (logical counts present), the layout's
    ``max_rank_len`` is the physical length ``per_rank_actual_token[0]``, so the padded layout
    ``[physical * cp, H]`` is exactly SGLang's gathered buffer; ``align`` then defaults to that length
    (the smallest multiple >= the longest real shard; SGLang's own alignment, ``2 * attn_cp_size`` for
    zigzag, gives the same length). Without padding ``align`` defaults to 1.

    Args:
        md: an object with SGLang's field names (``ZigzagContextParallelMetadata``,
            ``InterleaveContextParallelMetadata``, or any duck-typed stand-in).
        align: override the alignment of ``max_rank_len``.

    Raises:
        ValueError naming the field when the counts are missing, negative or inconsistent.
    """
    actual = int_list(md, "per_rank_actual_token")
    logical = int_list(md, "per_rank_logical_token")
    if not logical:
        if not actual:
            raise ValueError(
                "md.per_rank_actual_token: expected a list of per-rank token counts, got "
                f"{getattr(md, 'per_rank_actual_token', None)!r} (and no per_rank_logical_token)"
            )
        return ShardLayout(actual, align=1 if align is None else align)
    if actual is None:
        return ShardLayout(logical, align=1 if align is None else align)
    if len(actual) != len(logical):
        raise ValueError(
            f"md.per_rank_logical_token: expected {len(actual)} counts (one per rank, as "
            f"per_rank_actual_token {actual}), got {logical}"
        )
    physical = max(actual)
    if any(n < 0 for n in logical) or max(logical) > physical:
        raise ValueError(
            f"md.per_rank_logical_token: expected counts in [0, {physical}] (the physical length "
            f"per_rank_actual_token {actual}), got {logical}"
        )
    if align is None:
        align = physical if physical > 0 else 1
    layout = ShardLayout(logical, align=align)
    if physical and layout.max_rank_len != physical:
        logger.debug("layout_from_cp_metadata: max_rank_len %d differs from the physical %d (align=%d)",
                     layout.max_rank_len, physical, align)
    return layout


def physical_rows(md: Any, rank: int, layout: ShardLayout) -> int:
    """Rows of this rank's local tensors in SGLang: its physical (padded) count."""
    actual = int_list(md, "per_rank_actual_token")
    return actual[rank] if actual else layout.count(rank)
