"""The P2P transport's side of the transport seam (nsa_cp/transport/base.py): :class:`P2PRoutes`, the
base ``P2PTransport`` takes its verdict and routes from (one object answers the planner; its provider is
``registry.PROVIDER``).

A route adapts the transport's runners (nsa_cp/transport/p2p/transport.py, built ``checked=True``: the
verdict was given once, by :meth:`P2PRoutes.serves`) to the planner's call shape: a gather's result comes
back as a view of the transport's gather buffer (copied into ``out=`` when the caller gave one), FP8 as
the pair; the fused kernels move 16-byte words, so an unaligned input is cloned and an unaligned residual
staged through an aligned copy (the aligned case adds no frame).
"""

from __future__ import annotations

from typing import Optional

import torch

from ...support import Support
from ..base import Route
from . import pulls

__all__ = ["P2PRoutes"]


class P2PRoutes:
    """The planner's Transport protocol over a transport's ``support`` and runners (``P2PTransport``'s base).

    What it reads of its subclass is declared here: the ``device`` and the error record (``_broken``,
    ``check_error``), the verdict (``support``) and the runners and buffer (nsa_cp/transport/p2p/transport.py
    says what each does)."""

    device: torch.device
    _broken: Optional[tuple]

    def support(self, layout, row_shape, dtype, device, *, quant=None, norm=False) -> Support:
        raise NotImplementedError

    def check_error(self) -> None:
        raise NotImplementedError

    def gather_runner(self, layout, compact, row_shape, *, engine="auto", quant=None, ordered=False, checked=False):
        raise NotImplementedError

    def norm_gather_runner(self, layout, compact, row_shape, *, quant=None, ordered=False, checked=False):
        raise NotImplementedError

    def reduce_scatter_runner(self, layout, compact, row_shape, *, ordered=False, norm=False, checked=False):
        raise NotImplementedError

    def reduce_buffer(self, layout, compact, row_shape=None) -> torch.Tensor:
        raise NotImplementedError

    def serves(self, req, stage) -> Support:
        fmt = stage.fmt
        return self.support(req.layout, tuple(req.row_shape), req.dtype, req.device,
                                      quant=None if fmt is None else fmt.name, norm=stage.norm)

    def gather(self, req, stage) -> Route:
        layout, compact, row_shape, ordered = req.layout, req.compact, tuple(req.row_shape), req.ordered
        quant = None if stage.fmt is None else stage.fmt.name
        algo = "ordered" if ordered else ("compact" if compact else "padded")
        if not stage.norm:
            runner = self.gather_runner(layout, compact, row_shape, quant=quant, ordered=ordered, checked=True)
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
            norm_runner = self.norm_gather_runner(layout, compact, row_shape, quant=quant, ordered=ordered,
                                                  checked=True)

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
            return Route(self.reduce_scatter_runner(layout, compact, row_shape, ordered=ordered, checked=True), "p2p",
                         algo)
        fused = self.reduce_scatter_runner(layout, compact, row_shape, ordered=ordered, norm=True, checked=True)

        def run(y, out, dc, pos, norm_args):  # one kernel: the pull's rows are normed before they are stored
            residual, weight, eps = norm_args
            if residual is None or not _unaligned(residual):
                return fused(y, residual, weight, eps, None, dc, pos)
            return _staged(fused, y, residual, weight, eps, None, dc, pos)
        return Route(run, "p2p", algo, True)

    def buffer(self, req) -> torch.Tensor:
        """The transport's reduce buffer: the MoE writes its partials there, no copy in before the pull."""
        return self.reduce_buffer(req.layout, req.compact or req.ordered, tuple(req.row_shape))

    def serves_overlap(self, req) -> Support:
        """Whether the overlapped boundary ``req`` (an OverlapRequest) can run as copy-engine pulls."""
        return pulls.supports(self, req)

    def overlap(self, req):
        """``(start, mechanism)``: ``start(x, timeout_ms)`` stages this rank's rows, enqueues the entry barrier
        and every chunk's pull, and returns the :class:`~nsa_cp.transport.p2p.pulls.PullPipeline` (the
        transport's own timeout governs its waits)."""
        route = pulls.PullRoute(self, req)

        def start(x, timeout_ms):
            if self._broken is not None:
                self.check_error()
            return route.start(x, self.side_streams())

        return start, pulls.MECHANISM

    def side_streams(self):
        """The (pull, push) streams of this transport's copy-engine transfers, made once."""
        streams = getattr(self, "_side_streams", None)
        if streams is None:
            streams = self._side_streams = (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device))
        return streams


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
