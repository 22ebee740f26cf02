"""What a call does to rows, as objects: the op kinds of the public calls and a gather's source stage.

``Op``: one per public function (its name, what it calls its tensor, gather or reduce-scatter, whether the
add + RMSNorm is part of it); ``OPS`` by name. ``Stage``: what a rank's rows become before they move (a
copy, the add + RMSNorm, a wire format's quantization, or both), with the result streams a gather
returns. A transport accepts or refuses a stage with a reason (``Transport.support``); nothing outside
this module compares their names.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch

from .wire import FP8_DTYPES, WireFormat, format_of

__all__ = ["Op", "OPS", "ALL_GATHER", "NORM_ALL_GATHER", "REDUCE_SCATTER", "NORM_REDUCE_SCATTER", "SCATTER_BUFFER",
           "OVERLAPPED_BOUNDARY",
           "Stage", "stage_of", "COPY", "NORM"]


class Op(NamedTuple):
    """A public call: ``name`` (the function), ``input_name`` (its tensor, for errors), ``is_gather``,
    ``norm`` (the fused add + RMSNorm is part of it)."""

    name: str
    input_name: str
    is_gather: bool
    norm: bool


ALL_GATHER = Op("cp_all_gather", "x", True, False)
NORM_ALL_GATHER = Op("fused_add_rmsnorm_all_gather", "x", True, True)
REDUCE_SCATTER = Op("cp_reduce_scatter", "y", False, False)
NORM_REDUCE_SCATTER = Op("reduce_scatter_fused_add_rmsnorm", "partials", False, True)
SCATTER_BUFFER = Op("cp_reduce_scatter_buffer", "like", False, False)
OVERLAPPED_BOUNDARY = Op("cp_overlapped_boundary", "x", True, False)  # a gather and a reduce-scatter, pipelined
OPS = {op.name: op for op in (ALL_GATHER, NORM_ALL_GATHER, REDUCE_SCATTER, NORM_REDUCE_SCATTER, SCATTER_BUFFER,
                              OVERLAPPED_BOUNDARY)}


class Stage(NamedTuple):
    """A gather's source stage: ``norm`` (the add + RMSNorm of the rows, residual updated) and ``fmt``
    (the wire format the rows are quantized to; None: they move in their dtype)."""

    name: str
    norm: bool
    fmt: Optional[WireFormat]

    def streams(self, row_shape: Tuple[int, ...], dtype: torch.dtype) -> tuple:
        """The result streams ``(row shape, result dtype, dtype on the wire)``: one, or the format's
        (q, scale). FP8 rows of a plain copy move as their bytes."""
        if self.fmt is not None:
            return self.fmt.streams(row_shape[-1])
        wire = torch.uint8 if dtype in FP8_DTYPES else dtype
        return ((row_shape, dtype, wire),)

    @property
    def unnormed(self) -> "Stage":
        """This stage without the add + RMSNorm (what a transport that cannot fuse the norm moves)."""
        return stage_of(False, None if self.fmt is None else self.fmt.name)


_STAGES = {}


def stage_of(norm: bool, quant: Optional[str]) -> Stage:
    """The stage of a call: ``norm`` part of it, ``quant`` the wire format's name (or None)."""
    key = (bool(norm), quant)
    stage = _STAGES.get(key)
    if stage is None:
        fmt = format_of(quant)
        name = "+".join(part for part in ("norm" if norm else "", "" if fmt is None else fmt.name) if part) or "copy"
        stage = _STAGES[key] = Stage(name, bool(norm), fmt)
    return stage


COPY = stage_of(False, None)
NORM = stage_of(True, None)
