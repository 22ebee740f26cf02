"""The P2P transport behind the transport seam (nsa_cp/transport/base.py): ``P2PProvider`` finds a group's
``P2PTransport`` (``init_p2p``), ``P2PRoutes`` answers the planner with its verdicts and routes.

A route adapts the transport's runners (nsa_cp/transport/p2p/transport.py) to the planner's call shape:
a gather's result comes back as a view of the transport's gather buffer (copied into ``out=`` when the
caller gave one), FP8 as the pair; the fused kernels move 16-byte words, so an unaligned input is
cloned and an unaligned residual staged through an aligned copy (the aligned case adds no frame).
"""

from __future__ import annotations

from typing import Union

import torch

from ...support import Support
from ..base import Route
from .registry import any_registered, get_p2p
from .transport import P2PTransport

__all__ = ["P2PProvider", "P2PRoutes"]

_MISSING = Support.no("'p2p' needs nsa_cp.init_p2p(group, max_tokens_per_rank, hidden_size, dtype) first")
# Said instead of _MISSING for tensors no init_p2p call can help (a registered transport judges its own).
_NOT_CUDA = ("'p2p' cannot serve {device} tensors: the P2P transport moves rows between GPUs' memory with "
             "nsa_cp._C's CUDA kernels (peer access over NVLink or PCIe), so it needs CUDA tensors on GPUs of one "
             "node; on CPU use backend='nccl' (the process group's collectives, gloo) or 'auto'")


class P2PProvider:
    """The group's P2P transport, where ``init_p2p`` made one."""

    name = "p2p"

    def open(self, req, group) -> Union["P2PRoutes", Support]:
        transport = get_p2p(req.group) if any_registered() else None
        if transport is None and req.device is not None and req.device.type != "cuda":
            return Support.no(_NOT_CUDA.format(device=req.device.type))
        return _MISSING if transport is None else P2PRoutes(transport)


PROVIDER = P2PProvider()  # its row in nsa_cp/transports.py


class P2PRoutes:
    """One ``P2PTransport`` as the planner's Transport."""

    def __init__(self, transport: P2PTransport):
        self.transport = transport

    def support(self, req, stage) -> Support:
        fmt = stage.fmt
        return self.transport.support(req.layout, tuple(req.row_shape), req.dtype, req.device,
                                      quant=None if fmt is None else fmt.name, norm=stage.norm)

    def gather(self, req, stage) -> Route:
        layout, compact, row_shape, ordered = req.layout, req.compact, tuple(req.row_shape), req.ordered
        quant = None if stage.fmt is None else stage.fmt.name
        algo = "ordered" if ordered else ("compact" if compact else "padded")
        if not stage.norm:
            runner = self.transport.gather_runner(layout, compact, row_shape, quant=quant, ordered=ordered)
            if req.has_out and quant is None:  # the common out= gather: no frame between this and the runner
                def copy_out(x, outs, dc, pos, norm_args):
                    outs[0].copy_(runner(x, dc, pos))
                    return outs
                return Route(copy_out, "p2p", algo)
            if quant is None:
                def move(x, outs, dc, pos, norm_args):
                    return (runner(x, dc, pos),)
            else:
                def move(x, outs, dc, pos, norm_args):
                    return runner(x, dc, pos)
        else:
            norm_runner = self.transport.norm_gather_runner(layout, compact, row_shape, quant=quant, ordered=ordered)

            def move(x, outs, dc, pos, norm_args):
                residual, weight, eps = norm_args
                if _unaligned(x):  # rare: a slice
                    x = x.clone()
                if residual is None or not _unaligned(residual):
                    result = norm_runner(x, residual, weight, eps, dc, pos)
                else:
                    result = _staged(norm_runner, x, residual, weight, eps, dc, pos)
                return (result,) if quant is None else result
        return Route(_into_out(move) if req.has_out else move, "p2p", algo, stage.norm)

    def scatter(self, req, stage) -> Route:
        layout, compact, row_shape, ordered = req.layout, req.compact, tuple(req.row_shape), req.ordered
        algo = "ordered" if ordered else ("compact" if compact else "padded")
        if not stage.norm:  # the runner itself: no frame around it
            return Route(self.transport.reduce_scatter_runner(layout, compact, row_shape, ordered=ordered), "p2p", algo)
        fused = self.transport.reduce_scatter_runner(layout, compact, row_shape, ordered=ordered, norm=True)

        def run(y, out, dc, pos, norm_args):  # one kernel: the pull's rows are normed before they are stored
            residual, weight, eps = norm_args
            if residual is None or not _unaligned(residual):
                return fused(y, residual, weight, eps, None, dc, pos)
            return _staged(fused, y, residual, weight, eps, None, dc, pos)
        return Route(run, "p2p", algo, True)

    def buffer(self, req) -> torch.Tensor:
        """The transport's reduce buffer: the MoE writes its partials there, no copy in before the pull."""
        return self.transport.reduce_buffer(req.layout, req.compact or req.ordered, tuple(req.row_shape))


def _into_out(move):
    def into_out(x, outs, dc, pos, norm_args):
        for o, r in zip(outs, move(x, outs, dc, pos, norm_args)):
            o.copy_(r)
        return outs
    return into_out


def _unaligned(t: torch.Tensor) -> bool:  # the fused P2P kernels move 16-byte words
    return bool((t.data_ptr() | (t.stride(0) * t.element_size())) & 15) if t.shape[0] else False


def _staged(runner, t, residual, *rest):
    """``runner(t, residual, *rest)`` (a fused P2P runner, residual updated in place: 16-byte words) through
    an aligned copy of ``residual``; the callers test ``_unaligned(residual)``, so the aligned case has no frame."""
    staged = residual.clone()
    result = runner(t, staged, *rest)
    residual.copy_(staged)
    return result
