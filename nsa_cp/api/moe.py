"""MoE helpers for the gathered (FULL-mode) token set.

``mask_padding_topk_ids``: after a padded ``cp_all_gather`` every rank routes ``[max_rank_len * cp_size,
H]`` rows, and the rows ``[r*M + n_r, (r+1)*M)`` of each rank slot are padding (zeros). Their routed
expert ids are set to -1, the drop sentinel SGLang's fused MoE and DeepGEMM honour (SGLang masks its DP
padding the same way, ``mask_dp_pad_moe_topk_ids``), so no expert spends work on them and no partial is
written for them.

The compact layout ``[total_len, H]`` has no padding rows: a compact-shaped ``topk_ids`` is returned
unchanged (a no-op, not an error, so one call site serves both layouts). When the layout is even the two
layouts coincide and there is nothing to mask either.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..planning.checks import check_device_counts, shape_str
from ..geometry.layout import ShardLayout

__all__ = ["mask_padding_topk_ids"]

_ID_DTYPES = (torch.int16, torch.int32, torch.int64)


def mask_padding_topk_ids(
    topk_ids: torch.Tensor,
    layout: ShardLayout,
    device_counts: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
) -> torch.Tensor:
    """Set the routed expert ids of the padded layout's padding rows to -1, in place.

    Args:
        topk_ids: ``[max_rank_len * cp_size, top_k]`` signed integer ids (int16/int32/int64) of the rows
            of a padded gather, rank-major: rank r's real rows are ``[r*M, r*M + n_r)``. A compact-shaped
            ``[total_len, top_k]`` tensor has no padding rows and is returned untouched.
        layout: the gather's ShardLayout (with ``device_counts``: the CUDA-graph bucket, whose
            ``max_rank_len`` fixes the shape).
        device_counts: ``(counts, offsets)``, int32 ``[cp_size]`` tensors on topk_ids' device, as for
            ``cp_all_gather``: the real per-rank counts are read on the device (no host sync, safe inside
            a CUDA-graph capture; update them before a replay). Padded shape only.

    Returns:
        ``topk_ids`` itself (modified in place).

    Raises:
        ValueError naming the tensor, the expected and the actual shape or dtype; nothing is written.

    Without ``device_counts`` the counts come from ``layout``; on CUDA their device copy is created on
    the first call per device (``ShardLayout.device_tensors``), so make that first call outside a graph
    capture or pass ``device_counts``.
    """
    if not isinstance(layout, ShardLayout):
        raise ValueError(f"layout: expected an nsa_cp.ShardLayout, got {type(layout).__name__}")
    if not isinstance(topk_ids, torch.Tensor):
        raise ValueError(f"topk_ids: expected a torch.Tensor, got {type(topk_ids).__name__}")
    padded, compact = layout.padded_len, layout.total_len
    if topk_ids.dim() != 2:
        raise ValueError(
            f"topk_ids: expected a 2-D tensor [{padded}, top_k] (padded layout) or [{compact}, top_k] "
            f"(compact), got shape {shape_str(topk_ids.shape)}"
        )
    if topk_ids.dtype not in _ID_DTYPES:
        raise ValueError(
            f"topk_ids: expected a signed integer dtype (int16, int32, int64) to hold -1, got {topk_ids.dtype}"
        )
    rows = topk_ids.shape[0]
    if device_counts is not None:
        check_device_counts(device_counts, layout, topk_ids.device)
        counts = device_counts[0]
        if rows != padded:
            raise ValueError(
                f"topk_ids: expected shape [{padded}, {topk_ids.shape[1]}] (the padded bucket "
                f"max_rank_len * cp_size; device_counts needs the padded layout), got {shape_str(topk_ids.shape)}"
            )
    else:
        if rows not in (padded, compact):
            raise ValueError(
                f"topk_ids: expected shape [{padded}, {topk_ids.shape[1]}] (padded layout) or "
                f"[{compact}, {topk_ids.shape[1]}] (compact), got {shape_str(topk_ids.shape)}"
            )
        if rows != padded or layout.padding_rows == 0:
            return topk_ids  # compact, or padded without padding rows: nothing to mask
        counts = layout.device_tensors(topk_ids.device)[0]
    if rows == 0 or topk_ids.shape[1] == 0:
        return topk_ids
    m = layout.max_rank_len
    # row -> (slot, row in slot); padding where the row in slot is past the slot's real count. Built
    # on the device from the counts tensor, so the counts are never read back to the host.
    row = torch.arange(rows, device=topk_ids.device, dtype=torch.int32)
    slot_count = counts.repeat_interleave(m, output_size=rows) if m else counts[:0]
    is_pad = (row % m) >= slot_count
    topk_ids.masked_fill_(is_pad.unsqueeze(1), -1)
    return topk_ids
