"""What one public call asks for, described once: the ``Request`` record.

Every public collective builds one ``Request`` from its arguments (``Request.of``) and hands it on
unchanged: it is the plan-cache key (with the resolved process group and the environment that steers
choices: nsa_cp/planning/plan.py), the one argument the plan constructors take, and what the torch.library ops'
schema arguments are derived from (nsa_cp/api/ops.py). Its fields are the call's choices and the facts about
its input that a plan depends on; the tensors themselves (and ``validate``, ``eps``) travel beside it.
docs/design.md ("A call, described once") has the design record.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ..geometry.stage import OPS, Op, Stage, stage_of

__all__ = ["Request", "OverlapRequest"]


class Request(NamedTuple):
    """One call: ``op`` (the public function's name), the layout and group as passed, the choices
    (compact, algo, backend, quant), the input's row shape ``x.shape[1:]``, dtype and device, and which
    optional tensors are given (``out``, ``device_counts``, ``positions``, a norm ``residual``)."""

    op: str
    layout: object  # a ShardLayout once the plan checks passed
    group: object  # Optional[ProcessGroup]: None is the default group
    compact: bool
    algo: str
    backend: str
    quant: Optional[str]
    row_shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    has_out: bool
    has_device_counts: bool
    ordered: bool  # positions given: batch order
    residual: bool  # a norm's residual given (a first layer's is None)

    @classmethod
    def of(cls, op: str, t, layout, group, compact=False, algo="auto", backend="auto", quant=None, out=None,
           device_counts=None, positions=None, residual=None) -> "Request":
        """The request of ``op`` on the tensor ``t`` (x, y, partials or like). Never raises: when ``t`` is
        not a tensor of 2 or more dims, ``row_shape``, ``dtype`` and ``device`` are None and the plan
        raises the ValueError naming ``t`` (after the rank agreement, when asked: ``plan.call``)."""
        if isinstance(t, torch.Tensor) and t.dim() >= 2:
            shape, dtype, device = t.shape[1:], t.dtype, t.device
        else:
            shape = dtype = device = None
        # tuple.__new__: a NamedTuple's own __new__ is a Python function, one more frame on every call
        return tuple.__new__(cls, (op, layout, group, compact, algo, backend, quant, shape, dtype, device,
                                   out is not None, device_counts is not None, positions is not None,
                                   residual is not None))

    @property
    def kind(self) -> Op:
        """The public call's ``Op`` (nsa_cp/geometry/stage.py)."""
        return OPS[self.op]

    @property
    def input_name(self) -> str:
        return OPS[self.op].input_name

    @property
    def is_gather(self) -> bool:
        return OPS[self.op].is_gather

    @property
    def norm(self) -> bool:
        """The fused add + RMSNorm is part of the call."""
        return OPS[self.op].norm

    @property
    def stage(self) -> Stage:
        """A gather's source stage (copy, norm, a wire format's quantization, or norm and quantization)."""
        return stage_of(OPS[self.op].norm, self.quant)

    @property
    def result_rows(self) -> int:
        """Rows of the gathered result / the reduce-scatter's input: padded, compact or batch order."""
        return self.layout.global_len(self.compact or self.ordered)

    def fields(self) -> dict:
        """What the ranks must agree on, by argument name (the torch.distributed transport's agreement check
        compares one hash of each, nsa_cp/transport/dist/agreement.py, and names the ones that differ)."""
        layout = self.layout
        if hasattr(layout, "per_rank_actual_token"):
            layout = f"{tuple(layout.per_rank_actual_token)} align={layout.align}"
        return {"call": self.op, "layout": layout, "compact": self.compact, "positions": self.ordered,
                "quant": self.quant, "x": f"rows of {tuple(self.row_shape)} {self.dtype}",
                "device_counts": self.has_device_counts, "algo": self.algo}

    def describe(self) -> str:
        """What the ranks must agree on, as text (the plan's signature, validation's fingerprint)."""
        quant = f"|quant={self.quant}" if self.quant is not None or self.is_gather else ""
        return (f"{self.op}|compact={self.compact}|dtype={self.dtype}|row={tuple(self.row_shape)}|"
                f"device_counts={self.has_device_counts}|ordered={self.ordered}{quant}")


class OverlapRequest(NamedTuple):
    """One ``cp_overlapped_boundary`` call: ``call`` (its :class:`Request`: layout, group, backend, the wire
    format and the input's rows) and what the overlapped boundary adds, all of which the ranks must agree on
    (the plan-cache key, validation's fields and the P2P call fingerprint): ``chunk_rows``, the consumer's
    output ``out_row_shape`` and ``out_dtype``, whether a ``shared`` output joins the sum."""

    call: Request
    chunk_rows: Optional[int]
    out_row_shape: tuple
    out_dtype: torch.dtype
    shared: bool

    @property
    def group(self):
        return self.call.group

    @property
    def layout(self):
        return self.call.layout

    def fields(self) -> dict:
        """What the ranks must agree on, by argument name (validation names the ones that differ)."""
        c = self.call.fields()
        return {"layout": c["layout"], "x": c["x"], "quant": c["quant"], "chunk_rows": self.chunk_rows,
                "out_row_shape": self.out_row_shape, "out_dtype": self.out_dtype, "shared": self.shared,
                "backend": self.call.backend}

    def describe(self) -> str:
        return "|".join(f"{k}={v}" for k, v in self.fields().items())
