"""Plans: everything about a call that does not change from call to call, resolved once and cached.

``call(request, ...)`` is the one eager entry point (the public functions when not compiling, and the
torch.library ops of nsa_cp/api/ops.py when a compiled graph runs): it finds the cached plan of the
``Request`` (built on a miss), runs the call checks, the rank agreement when asked, and the plan's one
runner. A plan holds the choices (transport, algorithm, source stage) and the runner of the route its
transport gave: the first registered transport whose verdict is yes (nsa_cp/transport/base.py; the
torch.distributed one serves every call and is asked last). ``init_p2p`` / ``init_nccl``, their
``destroy_*`` and registering a transport empty the cache. docs/design.md ("Plans") has the design record.
"""

from __future__ import annotations

import atexit
import functools
import logging
from typing import Optional

import torch

from . import checks, validation
from .route import route as _route
from .. import envs
from ..rows.norm import norm_after, norm_before
from .request import Request
from ..geometry.stage import COPY, NORM
from ..transport import base, groups

__all__ = ["call", "lookup", "buffer", "GatherPlan", "ScatterPlan", "clear_cache", "cache_size"]

logger = logging.getLogger("nsa_cp")

_ALGOS = ("auto", "padded", "coalesced")
_CACHE: dict = {}
_CACHE_LIMIT = 1024
_state = {"generation": None}
_VALIDATE = envs.reader("NSA_CP_VALIDATE")


def clear_cache() -> None:
    _CACHE.clear()


def cache_size() -> int:
    return len(_CACHE)


# A plan holds its process group: a destroyed group's plans go at the next miss. Emptied at exit: left to
# finalization, a gloo worker thread that released the last collective's tensor aborted the process.
atexit.register(clear_cache)


def validate_default() -> bool:
    """NSA_CP_VALIDATE, read as every call reads it."""
    return _VALIDATE()


def lookup(req, plan_type=None):
    """The cached plan of ``req`` (its key: the request, the resolved group, ``envs.plan_state()``);
    built, running the plan checks, on a miss: a ``plan_type(req, group)`` (default: the request's gather
    or reduce-scatter plan)."""
    pg = groups.resolve_group(req.group)
    generation = groups.latest_generation()  # P2P transports and native NCCL communicators alike
    if generation != _state["generation"]:
        _CACHE.clear()  # a transport came or went: drop every plan (and the references they hold)
        _state["generation"] = generation
    key = (req, pg, envs.plan_state())
    try:
        plan = _CACHE.get(key)
    except TypeError:  # an unhashable layout: the plan checks say what is wrong with it
        plan, key = None, None
    if plan is None:
        groups.forget_destroyed_groups(_CACHE)  # on a miss only: a new group may follow destroyed ones
        plan = (plan_type or (GatherPlan if req.is_gather else ScatterPlan))(req, pg)
        if key is not None:
            if len(_CACHE) >= _CACHE_LIMIT:
                del _CACHE[next(iter(_CACHE))]  # the oldest: plans are cheap to rebuild
            _CACHE[key] = plan
    return plan


def _values(t):
    """The collectives are not differentiable: they work on values and return tensors without history."""
    return t.detach() if isinstance(t, torch.Tensor) and t.requires_grad else t


def call(req: Request, t: torch.Tensor, out=None, device_counts=None, positions=None, norm_args=None,
         validate: Optional[bool] = None):
    """Run one public call: plan, call checks (and with ``validate`` the rank agreement), the runner.
    ``norm_args``: ``(residual, weight, eps)`` of the norm ops. Returns what the plan's runner returns."""
    if validate is None:
        validate = _VALIDATE()
    try:
        if req.row_shape is None:  # not a tensor of 2+ dims (Request.of)
            checks.check_tensor(req.input_name, t, "tokens")
        plan = lookup(req)
        plan.check(t, out, device_counts, positions, norm_args)
    except ValueError as err:
        if not validate:
            raise
        plan, error = None, err
    else:
        error = None
    if validate:  # every rank learns whether every rank's checks passed, and raises together if not
        validation.agree_on_plan(req, plan, error, positions)
    if norm_args is not None:
        norm_args = (_values(norm_args[0]), _values(norm_args[1]), float(norm_args[2]))
    if t.requires_grad:  # _values, inlined (a tensor here: the plan checks passed)
        t = t.detach()
    return plan.run(t, out, device_counts, positions, norm_args)


def buffer(req: Request, like) -> torch.Tensor:
    """``cp_reduce_scatter_buffer``: where the reduce-scatter of ``req`` wants its input (``ScatterPlan.buffer``)."""
    if req.row_shape is None:
        checks.check_tensor(req.input_name, like, "tokens")
    return lookup(req).buffer()


# --------------------------------------------------------------------------- the transport (when a plan is built)
# --------------------------------------------------------------------------- plans
class _Plan:
    """What gathers and reduce-scatters share: the plan checks of the request and the route's words."""

    __slots__ = ("request", "rank", "rows", "layout", "device", "signature", "backend", "algo", "_runner")

    def __init__(self, req: Request, pg, dtypes):
        checks.check_plan(req, pg.size(), dtypes, _ALGOS, base.names())
        self.request, self.rank, self.layout, self.device = req, pg.rank(), req.layout, req.device

    def _take(self, route) -> None:
        self.backend, self.algo = route.backend, route.algo
        self.signature = f"{self.request.describe()}|backend={self.backend}|algo={self.algo}"
        logger.debug("nsa_cp plan: %s on %r", self.signature, self.layout)


class GatherPlan(_Plan):
    """A resolved gather (its ``request.stage``: copy, norm, a wire format's quantization, or both):
    ``check`` then ``run``. Results: one tensor, or ``(q, scale)`` for a wire format."""

    __slots__ = ("out_shapes", "out_dtypes")

    def __init__(self, req: Request, pg):
        checks.format_of(req.quant)  # ValueError naming quant for a format nsa_cp does not know
        stage = req.stage
        super().__init__(req, pg, checks.GATHER_DTYPES if stage == COPY else checks.NORM_DTYPES)
        if stage != COPY:
            checks.check_row_stage(req)
        streams = stage.streams(tuple(req.row_shape), req.dtype)
        rows = req.result_rows
        self.rows = self.layout.count(self.rank)
        self.out_shapes = tuple((rows, *shape) for shape, _, _ in streams)
        self.out_dtypes = tuple(dtype for _, dtype, _ in streams)
        _, route = _route(req, pg, stage, gather=True)
        self._runner = route.run if route.norm or not stage.norm else norm_before(route.run)
        self._take(route)

    def check(self, x: torch.Tensor, out, device_counts, positions, norm_args) -> None:
        """The call checks (what differs from call to call with this plan); ValueError before any write."""
        if x.shape[0] != self.rows:
            checks.check_rows("x", x, self.rows, f"this rank's per_rank_actual_token[{self.rank}] rows")
        if out is not None:
            checks.check_outs(out, self.out_shapes, self.out_dtypes, self.device)
        if device_counts is not None or positions is not None:
            checks.check_call_tensors(device_counts, positions, self.layout, self.device)
        if norm_args is not None:
            checks.check_norm_args(x.shape, x.dtype, x.device, *norm_args)

    def run(self, x, out, device_counts, positions, norm_args):
        """The result (``out`` when given): a tensor, or ``(q, scale)``."""
        if positions is not None:  # always a permutation from here on: every result row written once
            positions = checks.ordered_rows(positions, self.layout.total_len)
        outs = None if out is None else ((out,) if len(self.out_shapes) == 1 else tuple(out))
        results = self._runner(x, outs, device_counts, positions, norm_args)
        return results[0] if len(results) == 1 else (results[0], results[1])


class ScatterPlan(_Plan):
    """A resolved reduce-scatter (with ``reduce_scatter_fused_add_rmsnorm``: then the add + RMSNorm):
    ``check`` then ``run``; ``buffer`` hands out where to write partials."""

    __slots__ = ("dtype", "row_shape", "out_shape", "compact", "_buffer")

    def __init__(self, req: Request, pg):
        super().__init__(req, pg, checks.SUM_DTYPES)
        if req.norm:
            checks.check_norm_partials(req)
        self.dtype, self.row_shape, self.compact = req.dtype, tuple(req.row_shape), req.compact or req.ordered
        self.rows = req.result_rows
        self.out_shape = (self.layout.count(self.rank), *self.row_shape)
        # the norm fuses into the move only with a residual (a first layer's has none: the norm runs after)
        transport, route = _route(req, pg, NORM if req.norm and req.residual else COPY, gather=False)
        # the transport's runner itself (no frame around it), or its move then the norm
        self._runner = route.run if not req.norm or route.norm else norm_after(route.run)
        self._buffer = functools.partial(transport.buffer, req)
        self._take(route)

    def check(self, y: torch.Tensor, out, device_counts, positions, norm_args) -> None:
        if y.shape[0] != self.rows:  # the error's wording is built only on the error path
            what = "batch order [total_len" if self.request.ordered else (
                "compact [total_len" if self.compact else "padded [max_rank_len * cp_size")
            checks.check_rows(self.request.input_name, y, self.rows, f"the {what}, ...] layout")
        if out is not None:
            checks.check_out("out", out, self.out_shape, self.dtype, self.device)
        if device_counts is not None or positions is not None:
            checks.check_call_tensors(device_counts, positions, self.layout, self.device)
        if norm_args is not None:
            checks.check_norm_args(self.out_shape, self.dtype, self.device, *norm_args)

    def run(self, y, out, device_counts, positions, norm_args):
        """``[n_r, ...]`` (``out`` when given), or with the norm ``(normed, residual)``."""
        if positions is not None:  # the inverse of the ordered gather's rows (checks.ordered_rows)
            positions = checks.ordered_rows(positions, self.layout.total_len)
        if norm_args is None:
            return self._runner(y, out, device_counts, positions)
        return self._runner(y, out, device_counts, positions, norm_args)

    def buffer(self) -> torch.Tensor:
        """Where the MoE writes its partials ``[rows, *row]``: the P2P transport's reduce buffer (no copy
        in before the pull), else a fresh tensor (NCCL reads any tensor)."""
        return self._buffer()
