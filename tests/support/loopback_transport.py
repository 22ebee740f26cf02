"""A transport written outside nsa_cp, as a user would add one: this module plus one line,
``nsa_cp.transport.register(LoopbackProvider())``.

It serves uneven calls on CPU tensors over gloo with the plainest algorithm there is: every rank's real
rows travel through ``dist.all_gather_object`` (so nothing of nsa_cp's own movement is reused), the
source stage (norm, FP8) comes from nsa_cp.rows.reference, and every call is recorded in ``CALLS`` (op,
stage name) so a test sees that the public functions reached it. The torch.distributed transport stays
registered behind it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from nsa_cp.rows import reference
from nsa_cp.support import Support
from nsa_cp.transport import Route

CALLS = []


class LoopbackProvider:
    name = "loopback"

    def open(self, req, group):
        return Loopback(group)


PROVIDER = LoopbackProvider()  # what a row of nsa_cp/transports.py names


class Loopback:
    """The group's loopback transport: the Transport protocol of nsa_cp/transport/base.py."""

    def __init__(self, group):
        self.group = group

    def serves(self, req, stage):
        if req.device.type != "cpu":
            return Support.no("the loopback transport moves CPU tensors only")
        if req.has_device_counts:
            return Support.no("the loopback transport reads host counts")
        return Support.yes()

    def _rows_of_all(self, rows):
        """Every rank's ``rows`` (a list of tensors), rank order; they travel as bytes (fp8 does not pickle)."""
        everyone = [None] * self.group.size()
        dist.all_gather_object(everyone, [(r.dtype, r.contiguous().view(torch.uint8)) for r in rows], group=self.group)
        return [[raw.view(dtype) for dtype, raw in theirs] for theirs in everyone]

    def gather(self, req, stage):
        layout, rank = req.layout, self.group.rank()
        fmt = stage.fmt

        def run(x, outs, device_counts, positions, norm_args):
            CALLS.append((req.op, stage.name))
            n = layout.count(rank)
            if stage.norm:
                residual, weight, eps = norm_args
                y, _ = reference.fused_add_rmsnorm(x[:n], residual, weight, eps)  # residual updated in place
            else:
                y = x[:n]
            mine = list(fmt.quantize_reference(y)) if fmt is not None else [y]
            everyone = self._rows_of_all(mine)
            results = []
            for s, (shape, dtype, _) in enumerate(stage.streams(tuple(req.row_shape), req.dtype)):
                parts = []
                for q, theirs in enumerate(everyone):
                    part = theirs[s]
                    parts.append(part)
                    if not (req.compact or req.ordered):  # padding rows, what the format gives a zero row
                        pad_rows = layout.max_rank_len - part.shape[0]
                        pad = torch.zeros((pad_rows, *shape), dtype=dtype)
                        if fmt is not None and s == 1:
                            pad.fill_(fmt.pad_scale)
                        parts.append(pad)
                full = torch.cat(parts)
                if req.ordered:
                    full = torch.empty_like(full).index_copy_(0, positions, full)
                if outs is not None:
                    outs[s].copy_(full)
                    full = outs[s]
                results.append(full)
            return tuple(results)
        return Route(run, "loopback", "all_gather_object", stage.norm)

    def scatter(self, req, stage):
        layout, rank = req.layout, self.group.rank()

        def run(y, out, device_counts, positions):
            CALLS.append((req.op, stage.name))
            if req.ordered:
                y = y.index_select(0, positions)
            compact = req.compact or req.ordered
            everyone = self._rows_of_all([y])
            start, stop = layout.rows(rank, compact)
            total = sum(theirs[0][start:stop].double() for theirs in everyone).to(y.dtype)
            if out is None:
                return total
            return out.copy_(total)
        return Route(run, "loopback", "all_gather_object", False)

    def buffer(self, req):
        return torch.empty((req.result_rows, *req.row_shape), dtype=req.dtype, device=req.device)
