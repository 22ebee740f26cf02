"""Plans: everything about a call that does not change from call to call, resolved once and cached.

``call(request, ...)`` is the one eager entry point (the public functions when not compiling, and the
torch.library ops of nsa_cp/ops.py when a compiled graph runs): it finds the cached plan of the
``Request`` (built on a miss), runs the call checks, the rank agreement when asked, and the plan's one
runner. A plan holds the choices (backend, algorithm, source stage) and a runner bound to its
transport: a P2P runner of the transport's native state, or an NCCL/gloo runner of nsa_cp/dist_path.py
bound to the process group. ``init_p2p`` / ``init_nccl`` and their ``destroy_*`` empty the cache.
docs/design.md ("Plans") has the design record.
"""

from __future__ import annotations

import atexit
import logging
import math
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from . import checks, dist_path, envs, validation
from .layout import ShardLayout
from .norm import fused_add_rmsnorm_into, norm_in_place
from .request import Request
from .support import Support
from .transport import nccl_native, p2p, registry, torch_dist

__all__ = ["call", "lookup", "buffer", "GatherPlan", "ScatterPlan", "clear_cache", "cache_size"]

logger = logging.getLogger("nsa_cp")

_ALGOS = ("auto", "padded", "coalesced")
_BACKENDS = ("auto", "nccl", "p2p")
_CACHE: dict = {}
_CACHE_LIMIT = 1024
_state = {"generation": None}
_VALIDATE = envs.reader("NSA_CP_VALIDATE")


def clear_cache() -> None:
    _CACHE.clear()


def cache_size() -> int:
    return len(_CACHE)


# A plan holds its process group: a destroyed group's plans go at the next miss. Emptied at exit, before the
# interpreter finalizes, a gloo group is destroyed while its threads can still take the GIL; left to
# finalization, a worker thread that released the last collective's tensor aborted the process (SIGABRT).
atexit.register(clear_cache)


def lookup(req: Request):
    """The cached plan of ``req`` (its key: the request, the resolved group, ``envs.plan_state()``);
    built, running the plan checks, on a miss."""
    pg = torch_dist.resolve_group(req.group)
    generation = registry.latest_generation()  # P2P transports and native NCCL communicators alike
    if generation != _state["generation"]:
        _CACHE.clear()  # a transport came or went: drop every plan (and the references they hold)
        _state["generation"] = generation
    key = (req, pg, envs.plan_state())
    try:
        plan = _CACHE.get(key)
    except TypeError:  # an unhashable layout: the plan checks say what is wrong with it
        plan, key = None, None
    if plan is None:
        torch_dist.forget_destroyed_groups(_CACHE)  # on a miss only: a new group may follow destroyed ones
        plan = (GatherPlan if req.is_gather else ScatterPlan)(req, pg)
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
    if validate:
        plan = _agreed(req, t, out, device_counts, positions, norm_args)
    else:
        if req.row_shape is None:  # not a tensor of 2+ dims (Request.of)
            checks.check_tensor(req.input_name, t, "tokens")
        plan = lookup(req)
        plan.check(t, out, device_counts, positions, norm_args)
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


def _agreed(req, t, out, device_counts, positions, norm_args):
    """The plan after every rank's checks agreed: one small all-reduce whatever this rank's own checks
    said, so a rank with bad input or another layout makes every rank raise instead of leaving the others
    in a collective (nsa_cp/validation.py). Positions are then also checked to be a permutation."""
    rank, size = torch_dist.group_rank_and_size(req.group)
    try:
        if req.row_shape is None:  # not a tensor of 2+ dims (Request.of)
            checks.check_tensor(req.input_name, t, "tokens")
        plan, error = lookup(req), None
        plan.check(t, out, device_counts, positions, norm_args)
        if positions is not None:
            checks.check_permutation(positions, req.layout.total_len)
    except ValueError as err:
        plan, error = None, err
    layout = req.layout if isinstance(req.layout, ShardLayout) else None
    validation.agree(req.op, layout, req.group, rank, size, req.device or _comm_device(req.group), error,
                     plan.signature if plan is not None else "")
    return plan


def _comm_device(group) -> torch.device:
    """Where the agreement's all-reduce runs when the call's tensor is not one: the group's device."""
    nccl = dist.get_backend(torch_dist.resolve_group(group)) == "nccl"
    return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")


# --------------------------------------------------------------------------- choices (when a plan is built)
def _transport(req: Request, norm: bool) -> Tuple[object, bool]:
    """``(transport, fused)``: the P2P transport this plan uses (None for NCCL/gloo; the same answer on
    every rank), and whether it runs the plan's fused stage (norm, FP8) in its own kernel.

    A norm it cannot fuse (rows of an odd byte size) runs as a kernel of its own before the P2P move
    (``fused`` False); a quantization it cannot serve, or rows it cannot move at all, take NCCL under
    backend "auto" and raise, saying why, under "p2p"."""
    backend = envs.NSA_CP_BACKEND if req.backend == "auto" else req.backend
    if backend == "nccl" or (backend == "auto" and (req.device.type != "cuda" or not p2p.any_registered())):
        return None, False
    transport = p2p.get_p2p(req.group)
    row_shape, fused = tuple(req.row_shape), norm or req.quant is not None
    if transport is None:
        verdict = Support.no("'p2p' needs nsa_cp.init_p2p(group, max_tokens_per_rank, hidden_size, dtype) first")
    else:
        verdict = transport.support(req.layout, row_shape, req.dtype, req.device, quant=req.quant, norm=norm)
        if not verdict and norm and req.quant is None:
            plain = transport.support(req.layout, row_shape, req.dtype, req.device)
            if plain:
                verdict, fused = plain, False
    if backend == "p2p":
        if not verdict:
            raise ValueError(f"backend: 'p2p' cannot serve this call ({req.input_name}): {verdict.reason}")
        return transport, fused
    # auto: the even layout keeps the plain NCCL collective (the contract); P2P where it serves
    if req.layout.is_even or not verdict:
        return None, False
    return transport, fused


def _collectives(pg, device: torch.device, algo: str) -> torch_dist.Collectives:
    """The plan's collectives: with the group's native NCCL communicator (``init_nccl``) for an uneven
    movement on its device; the even movement always keeps torch's collective."""
    native = nccl_native.get_nccl(pg) if device.type == "cuda" and algo != "even" else None
    if native is not None and (native.device != device or native.closed):
        native = None
    return torch_dist.Collectives(pg, native)


def _algo(req: Request, min_bytes: int) -> str:
    """The NCCL/gloo movement: even, padded, padded+compact or coalesced (nsa_cp/dist_path.py)."""
    layout = req.layout
    if layout.is_even and not req.has_device_counts:
        return "even"
    if not (req.compact or req.ordered):
        return "padded"
    algo = envs.NSA_CP_COMPACT_ALGO if req.algo == "auto" else req.algo
    if req.device.type != "cuda":
        return "padded+compact"  # gloo has no uneven-list collectives
    if algo == "auto":
        slot_bytes = layout.max_rank_len * math.prod(req.row_shape) * req.dtype.itemsize
        algo = "coalesced" if slot_bytes >= min_bytes else "padded"
    return "coalesced" if algo == "coalesced" else "padded+compact"


# --------------------------------------------------------------------------- plans
class _Plan:
    """What gathers and reduce-scatters share: the plan checks of the request and the backend choice."""

    __slots__ = ("request", "rank", "rows", "layout", "device", "signature", "backend", "algo", "transport", "fused",
                 "_runner")

    def __init__(self, req: Request, pg, dtypes, norm: bool):
        layout = req.layout
        checks.check_layout(layout, pg.size())
        checks.check_choice("algo", req.algo, _ALGOS)
        checks.check_choice("backend", req.backend, _BACKENDS)
        checks.check_dtype(req.input_name, req, dtypes)
        if req.has_device_counts and (req.compact or req.ordered):
            raise ValueError("device_counts: supported for the padded layout only (compact and ordered shapes depend "
                             f"on the counts), got compact={req.compact}, "
                             f"positions={'given' if req.ordered else None}")
        self.request, self.rank, self.layout, self.device = req, pg.rank(), layout, req.device
        self.transport, self.fused = _transport(req, norm)
        if self.transport is not None and not layout.total_len:
            self.transport = None  # nothing moves: the NCCL/gloo runner returns empty results
        if self.transport is not None:
            self.backend, self.algo = "p2p", "ordered" if req.ordered else ("compact" if req.compact else "padded")

    def _dist(self, pg, min_bytes: int) -> torch_dist.Collectives:
        self.algo = _algo(self.request, min_bytes)
        coll = _collectives(pg, self.device, self.algo)
        self.backend = "nccl+native" if coll.native is not None else ("nccl" if self.device.type == "cuda" else "gloo")
        return coll

    def _sign(self) -> None:
        self.signature = f"{self.request.describe()}|backend={self.backend}|algo={self.algo}"
        logger.debug("nsa_cp plan: %s on %r", self.signature, self.layout)


class GatherPlan(_Plan):
    """A resolved gather (``request.mode``: copy, quant, norm, norm_quant): ``check`` then ``run``.
    Results: one tensor, or ``(q, scale)`` for the quant modes."""

    __slots__ = ("out_shapes", "out_dtypes")

    def __init__(self, req: Request, pg):
        checks.check_choice("quant", req.quant, checks.QUANTS)
        mode = req.mode
        super().__init__(req, pg, checks.GATHER_DTYPES if mode == "copy" else checks.NORM_DTYPES, mode.startswith("norm"))
        if mode != "copy":
            checks.check_row_stage(req)
        source = dist_path.Source(mode, tuple(req.row_shape), req.dtype)
        rows = req.result_rows
        self.rows = self.layout.count(self.rank)
        self.out_shapes = tuple((rows, *shape) for shape, _, _ in source.streams)
        self.out_dtypes = tuple(dtype for _, dtype, _ in source.streams)
        if self.transport is not None:
            self._runner = _p2p_gather(self.transport, mode if self.fused or mode == "copy" else "copy_after_norm", req)
        else:
            coll = self._dist(pg, envs.NSA_CP_COALESCED_GATHER_MIN_BYTES)
            self._runner = dist_path.gather_runner(coll, req, self.rank, source, self.algo)
        self._sign()

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


def _p2p_gather(transport, mode: str, req: Request):
    """The P2P runner as ``run(x, outs, device_counts, positions, norm_args) -> results`` (a tuple)."""
    layout, compact, row_shape, quant, ordered = req.layout, req.compact, tuple(req.row_shape), req.quant, req.ordered
    if mode in ("copy", "quant"):
        runner = transport.gather_runner(layout, compact, row_shape, quant=quant, ordered=ordered)
        if quant is None:
            def move(x, outs, dc, pos, norm_args):
                return (runner(x, dc, pos),)
        else:
            def move(x, outs, dc, pos, norm_args):
                return runner(x, dc, pos)
    elif mode == "copy_after_norm":  # the transport cannot fuse this row size: the norm kernel, then the move
        runner = transport.gather_runner(layout, compact, row_shape, ordered=ordered)

        def move(x, outs, dc, pos, norm_args):
            y, _ = fused_add_rmsnorm_into(x, *norm_args, out=torch.empty_like(x))
            return (runner(y, dc, pos),)
    else:
        runner = transport.norm_gather_runner(layout, compact, row_shape, quant=quant, ordered=ordered)

        def move(x, outs, dc, pos, norm_args):
            residual, weight, eps = norm_args
            # the fused kernel moves 16-byte words: an unaligned view (rare: a slice) goes through an aligned copy
            if _unaligned(x):
                x = x.clone()
            if residual is None or not _unaligned(residual):
                result = runner(x, residual, weight, eps, dc, pos)
            else:
                result = _staged(runner, x, residual, weight, eps, dc, pos)
            return (result,) if quant is None else result

    if not req.has_out:
        return move  # views of the transport's gather buffer
    if mode == "copy":  # the common out= gather: no frame between this and the transport's runner
        def copy_out(x, outs, dc, pos, norm_args):
            outs[0].copy_(runner(x, dc, pos))
            return outs
        return copy_out

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


class ScatterPlan(_Plan):
    """A resolved reduce-scatter (with ``reduce_scatter_fused_add_rmsnorm``: then the add + RMSNorm):
    ``check`` then ``run``; ``buffer`` hands out where to write partials."""

    __slots__ = ("dtype", "row_shape", "out_shape", "compact")

    def __init__(self, req: Request, pg):
        super().__init__(req, pg, checks.SUM_DTYPES, req.norm and req.residual)
        if req.norm:  # plan checks of the norm: 2-D rows of a norm dtype
            if len(req.row_shape) != 1:
                raise ValueError(f"partials: expected a 2-D tensor [rows, hidden], got shape "
                                 f"{checks.shape_str((req.result_rows, *req.row_shape))}")
            checks.check_dtype("partials", req, checks.NORM_DTYPES)
        self.dtype, self.row_shape, self.compact = req.dtype, tuple(req.row_shape), req.compact or req.ordered
        self.rows = req.result_rows
        self.out_shape = (self.layout.count(self.rank), *self.row_shape)
        if self.transport is not None:
            move = self.transport.reduce_scatter_runner(self.layout, req.compact, self.row_shape, ordered=req.ordered)
            fused = None
            if req.norm and self.fused:  # one kernel: the pull's rows are normed before they are stored
                fused = self.transport.reduce_scatter_runner(self.layout, req.compact, self.row_shape,
                                                             ordered=req.ordered, norm=True)
        else:
            coll = self._dist(pg, envs.NSA_CP_COALESCED_SCATTER_MIN_BYTES)
            move, fused = dist_path.scatter_runner(coll, req, self.rank, self.algo), None
        if not req.norm:  # ``run`` calls it without norm_args: no frame around the transport's runner
            self._runner = move
        elif fused is not None:
            self._runner = _fused_scatter(fused)
        else:
            self._runner = lambda y, out, dc, pos, norm_args: norm_in_place(move(y, None, dc, pos), *norm_args)
        self._sign()

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
        if self.transport is not None:
            return self.transport.reduce_buffer(self.layout, self.compact, self.row_shape)
        return torch.empty((self.rows, *self.row_shape), dtype=self.dtype, device=self.device)


def _fused_scatter(fused):
    """The plan's ``run(y, out, dc, pos, norm_args)`` over a fused P2P reduce-scatter + norm runner."""
    def run(y, out, dc, pos, norm_args):
        residual, weight, eps = norm_args
        if residual is None or not _unaligned(residual):
            return fused(y, residual, weight, eps, None, dc, pos)
        return _staged(fused, y, residual, weight, eps, None, dc, pos)
    return run
