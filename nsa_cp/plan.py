"""Plans: everything about a call that does not change from call to call, resolved once and cached.

Design record
-------------
A public call is ``public function -> (compile branch: nsa_cp/ops.py) -> plan -> transport -> kernel``.
The plan of a call is looked up by its *key*: the operation, the layout (by value: an equal layout built
anew finds the same plan), the trailing row shape, dtype and device of the input, compact, whether
``out`` / ``device_counts`` / ``positions`` are given, the algorithm and backend requests, the
quantization, the process group, and the raw values of the environment variables that steer choices
(``envs.PLAN_VARIABLES``). ``init_p2p`` / ``destroy_p2p`` and ``init_nccl`` / ``destroy_nccl`` empty
the cache (the registries' generation changes), so no plan outlives the transport or communicator it
holds.

Building a plan runs the *plan checks* (nsa_cp/checks.py) and every choice: backend (P2P or
NCCL/gloo, one ``Support`` verdict with its reason), algorithm (even / padded / padded+compact /
coalesced / ordered), the source stage (copy, FP8 quantization, fused add + RMSNorm) and the runner
that moves the bytes (a P2P runner bound to the transport's native state, or an NCCL/gloo runner of
nsa_cp/algorithms.py bound to the process group). A cached plan then costs a key, a dict lookup and
the *call checks*: the row count of the input, ``out``, ``device_counts``, ``positions`` and the
norm's tensors, which differ from call to call and are never trusted from an earlier call.

The collectives are not differentiable: inputs with autograd history are used by value (detached);
results carry no history.
"""

from __future__ import annotations

import atexit
import logging
import math
from typing import Any, Callable, Optional, Tuple

import torch

from . import algorithms, checks, envs, reference
from .layout import ShardLayout
from .support import Support
from .transport import nccl, nccl_native, registry
from .transport import p2p

__all__ = ["GatherPlan", "ScatterPlan", "gather_plan", "scatter_plan", "clear_cache", "cache_size"]

logger = logging.getLogger("nsa_cp")

_ALGOS = ("auto", "padded", "coalesced")
_BACKENDS = ("auto", "nccl", "p2p")
_CACHE: dict = {}
_CACHE_LIMIT = 1024
_state = {"generation": None}


def clear_cache() -> None:
    _CACHE.clear()


def cache_size() -> int:
    return len(_CACHE)


# A plan's runner is bound to its process group, so this cache keeps a group alive after
# dist.destroy_process_group(). Emptied at exit, before the interpreter finalizes, such a gloo group is
# destroyed while its worker threads can still take the GIL; left to finalization, a worker thread that
# released the last collective's tensor then aborted the process ("terminate called without an active
# exception", SIGABRT, after the program's last line).
atexit.register(clear_cache)


def _transport_generation():
    return registry.latest_generation()  # P2P transports and native NCCL communicators alike


def _lookup(key) -> Optional[Any]:
    generation = _transport_generation()
    if generation != _state["generation"]:
        _CACHE.clear()  # a transport came or went: drop every plan (and the references they hold)
        _state["generation"] = generation
    return _CACHE.get(key)


def _store(key, plan) -> None:
    if len(_CACHE) >= _CACHE_LIMIT:
        del _CACHE[next(iter(_CACHE))]  # the oldest: plans are cheap to rebuild
    _CACHE[key] = plan


# --------------------------------------------------------------------------- backend choice
def _transport(backend: str, group, layout: ShardLayout, row_shape, dtype, device, name: str, quant=None,
               norm: bool = False):
    """``(transport, fused)``: the P2P transport this plan uses (None for NCCL/gloo; the same answer on
    every rank), and whether it runs the plan's fused stage in its own kernel.

    ``quant`` / ``norm``: the fused stage the plan asks of it (the transport's ``support`` says whether it
    serves it). A norm it cannot fuse (rows of an odd byte size) runs as a kernel of its own before the
    P2P move (``fused`` False); a quantization it cannot serve, or rows it cannot move at all, take NCCL
    under backend "auto" and raise, saying why, under "p2p"."""
    if backend == "auto":
        backend = envs.NSA_CP_BACKEND
    if backend == "nccl" or (backend == "auto" and (device.type != "cuda" or not p2p.any_registered())):
        return None, False
    transport = p2p.get_p2p(group)
    fused = norm or quant is not None
    if transport is None:
        verdict = Support.no("'p2p' needs nsa_cp.init_p2p(group, max_tokens_per_rank, hidden_size, dtype) first")
    else:
        verdict = transport.support(layout, row_shape, dtype, device, quant=quant, norm=norm)
        if not verdict and norm and quant is None:
            plain = transport.support(layout, row_shape, dtype, device)
            if plain:
                verdict, fused = plain, False
    if backend == "p2p":
        if not verdict:
            raise ValueError(f"backend: 'p2p' cannot serve this call ({name}): {verdict.reason}")
        return transport, fused
    # auto: the even layout keeps the plain NCCL collective (the contract); P2P where it serves
    if layout.is_even or not verdict:
        return None, False
    return transport, fused


def _collectives(pg, device: torch.device, algo: str) -> nccl.Collectives:
    """The plan's collectives: with the group's native NCCL communicator (``init_nccl``) for an uneven
    movement on its device; the even movement always keeps torch's collective."""
    native = nccl_native.get_nccl(pg) if device.type == "cuda" and algo != "even" else None
    if native is not None and (native.device != device or native.closed):
        native = None
    return nccl.Collectives(pg, native)


def _algo(algo: str, layout: ShardLayout, compact: bool, on_cuda: bool, slot_bytes: int, min_bytes: int,
          has_device_counts: bool) -> str:
    """The NCCL/gloo movement: even, padded, padded+compact or coalesced (nsa_cp/algorithms.py)."""
    if layout.is_even and not has_device_counts:
        return "even"
    if not compact:
        return "padded"
    if algo == "auto":
        algo = envs.NSA_CP_COMPACT_ALGO
    if not on_cuda:
        return "padded+compact"  # gloo has no uneven-list collectives
    if algo == "auto":
        algo = "coalesced" if slot_bytes >= min_bytes else "padded"
    return "coalesced" if algo == "coalesced" else "padded+compact"


# --------------------------------------------------------------------------- gathers
class GatherPlan:
    """A resolved gather: ``check`` (call checks) then ``run``.

    ``mode``: copy (``cp_all_gather``), quant (``quant=``), norm / norm_quant
    (``fused_add_rmsnorm_all_gather``). Results: one tensor, or ``(q, scale)`` for the quant modes.
    """

    __slots__ = ("op", "mode", "rank", "rows", "layout", "device", "out_shapes", "out_dtypes", "signature",
                 "backend", "algo", "_run", "_p2p")

    def check(self, x: torch.Tensor, out, device_counts, positions) -> None:
        if x.shape[0] != self.rows:
            checks.check_rows("x", x, self.rows, f"this rank's per_rank_actual_token[{self.rank}] rows")
        if out is not None:
            self._check_out(out)
        if device_counts is not None:
            checks.check_device_counts(device_counts, self.layout, self.device, False)
        if positions is not None:
            checks.check_positions(positions, self.layout, self.device)

    def _check_out(self, out) -> None:
        if len(self.out_shapes) == 1:
            checks.check_out("out", out, self.out_shapes[0], self.out_dtypes[0], self.device)
            return
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise ValueError(f"out: expected a (q, scale) pair of tensors, got {type(out).__name__}")
        for name, t, shape, dtype in zip(("out[0]", "out[1]"), out, self.out_shapes, self.out_dtypes):
            checks.check_out(name, t, shape, dtype, self.device)

    def run(self, x, out, device_counts, positions, norm_args=None):
        """The result (``out`` when given): a tensor, or ``(q, scale)``."""
        if positions is not None:  # always a permutation from here on: every result row written once
            positions = checks.ordered_rows(positions, self.layout.total_len)
        if self._p2p is not None:
            results = self._p2p(x, device_counts, positions, norm_args)
            if out is not None:
                outs = (out,) if len(self.out_shapes) == 1 else tuple(out)
                for o, r in zip(outs, results):
                    o.copy_(r)
                results = outs
        else:
            outs = None if out is None else ((out,) if len(self.out_shapes) == 1 else tuple(out))
            results = self._run(x, outs, device_counts, positions, norm_args)
        return results[0] if len(results) == 1 else (results[0], results[1])


def gather_plan(op: str, mode: str, x: torch.Tensor, layout, group, compact: bool, out, algo: str, backend: str,
                device_counts, positions, quant) -> GatherPlan:
    """The cached plan of a gather (``mode``: copy, quant, norm, norm_quant); builds it on a miss."""
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        checks.check_tensor("x", x, "tokens")
    pg = nccl.resolve_group(group)
    key = (op, mode, layout, x.shape[1:], x.dtype, x.device, compact, out is None, algo, backend,
           device_counts is None, positions is None, quant, pg, envs.plan_state())
    try:
        plan = _lookup(key)
    except TypeError:  # an unhashable layout: the plan checks say what is wrong with it
        plan, key = None, None
    if plan is None:
        plan = _build_gather(op, mode, x, layout, pg, group, compact, algo, backend, device_counts is not None,
                             positions is not None, quant)
        if key is not None:
            _store(key, plan)
    return plan


def _build_gather(op, mode, x, layout, pg, group, compact, algo, backend, has_dc, ordered, quant) -> GatherPlan:
    rank, size = pg.rank(), pg.size()
    checks.check_layout(layout, size)
    checks.check_choice("algo", algo, _ALGOS)
    checks.check_choice("backend", backend, _BACKENDS)
    checks.check_choice("quant", quant, checks.QUANTS)
    if mode == "copy":
        checks.check_dtype("x", x, checks.GATHER_DTYPES)
    else:
        checks.check_dtype("x", x, checks.NORM_DTYPES)
        if x.dim() != 2:
            raise ValueError(f"x: expected a 2-D tensor [n_r, hidden], got shape {checks.shape_str(x.shape)}")
        if quant is not None and x.shape[1] % checks.FP8_GROUP:
            raise ValueError(f"x: quant={quant!r} needs a hidden size that is a multiple of {checks.FP8_GROUP}, "
                             f"got shape {checks.shape_str(x.shape)}")
    if has_dc and (compact or ordered):
        raise ValueError("device_counts: supported for the padded layout only (compact and ordered shapes depend "
                         f"on the counts), got compact={compact}, positions={'given' if ordered else None}")
    row_shape = tuple(x.shape[1:])
    result_len = layout.total_len if (compact or ordered) else layout.padded_len
    source = algorithms.Source(mode, row_shape, x.dtype)

    plan = GatherPlan()
    plan.op, plan.mode, plan.rank, plan.layout, plan.device = op, mode, rank, layout, x.device
    plan.rows = layout.count(rank)
    plan.out_shapes = tuple((result_len, *shape) for shape, _, _ in source.streams)
    plan.out_dtypes = tuple(dtype for _, dtype, _ in source.streams)
    transport, fused = _transport(backend, group, layout, row_shape, x.dtype, x.device, "x", quant,
                                  mode.startswith("norm"))
    plan._p2p, plan._run = None, None
    if transport is not None and layout.total_len:
        plan.backend, plan.algo = "p2p", "ordered" if ordered else ("compact" if compact else "padded")
        plan._p2p = _p2p_gather(transport, mode if fused or mode == "copy" else "copy_after_norm", layout, compact,
                                row_shape, quant, ordered)
    else:
        row_bytes = math.prod(row_shape) * x.element_size()
        chosen = _algo(algo, layout, compact or ordered, x.is_cuda, layout.max_rank_len * row_bytes,
                       envs.NSA_CP_COALESCED_GATHER_MIN_BYTES, has_dc)
        plan.backend, plan.algo = ("nccl" if x.is_cuda else "gloo"), chosen
        coll = _collectives(pg, x.device, chosen)
        plan.backend = "nccl+native" if coll.native is not None else plan.backend
        plan._run = algorithms.gather_runner(coll, layout, rank, source, compact, chosen, ordered,
                                             has_dc, x.device)
    plan.signature = (f"{op}|{mode}|compact={compact}|dtype={x.dtype}|row={row_shape}|backend={plan.backend}|"
                      f"algo={plan.algo}|device_counts={has_dc}|ordered={ordered}|quant={quant}")
    logger.debug("nsa_cp plan: %s on %r", plan.signature, layout)
    return plan


def _p2p_gather(transport, mode, layout, compact, row_shape, quant, ordered) -> Callable:
    """The P2P runner wrapped to the plan's ``(x, device_counts, positions, norm_args) -> results``."""
    if mode in ("copy", "quant"):
        runner = transport.gather_runner(layout, compact, row_shape, quant=quant, ordered=ordered)
        if quant is None:
            return lambda x, dc, pos, norm_args: (runner(x, dc, pos),)
        return lambda x, dc, pos, norm_args: runner(x, dc, pos)
    if mode == "copy_after_norm":  # the transport cannot fuse this row size: the norm kernel, then the move
        runner = transport.gather_runner(layout, compact, row_shape, ordered=ordered)

        def run_after_norm(x, dc, pos, norm_args):
            from .norm import fused_add_rmsnorm_into

            y, _ = fused_add_rmsnorm_into(x, *norm_args, out=torch.empty_like(x))
            return (runner(y, dc, pos),)
        return run_after_norm
    runner = transport.norm_gather_runner(layout, compact, row_shape, quant=quant, ordered=ordered)

    def run(x, dc, pos, norm_args):
        residual, weight, eps = norm_args
        # the fused kernel moves 16-byte words: an unaligned view (rare: a slice) goes through an aligned copy
        if _unaligned(x):
            x = x.clone()
        if residual is not None and _unaligned(residual):
            staged = residual.clone()
            result = runner(x, staged, weight, eps, dc, pos)
            residual.copy_(staged)
        else:
            result = runner(x, residual, weight, eps, dc, pos)
        return (result,) if quant is None else result
    return run


def _unaligned(t: torch.Tensor) -> bool:
    return bool((t.data_ptr() | (t.stride(0) * t.element_size())) & 15) if t.shape[0] else False


# --------------------------------------------------------------------------- reduce-scatters
class ScatterPlan:
    """A resolved reduce-scatter: ``check`` then ``run``; ``buffer`` hands out where to write partials."""

    __slots__ = ("op", "rank", "rows", "layout", "device", "dtype", "row_shape", "out_shape", "signature", "backend",
                 "algo", "compact", "_run", "_transport", "_p2p", "_p2p_norm")

    def check(self, y: torch.Tensor, out, device_counts, positions, name: str = "y") -> None:
        if y.shape[0] != self.rows:
            what = "batch order [total_len" if positions is not None else (
                "compact [total_len" if self.compact else "padded [max_rank_len * cp_size")
            checks.check_rows(name, y, self.rows, f"the {what}, ...] layout")
        if out is not None:
            checks.check_out("out", out, self.out_shape, self.dtype, self.device)
        if device_counts is not None:
            checks.check_device_counts(device_counts, self.layout, self.device, False)
        if positions is not None:
            checks.check_positions(positions, self.layout, self.device)

    def run(self, y, out, device_counts, positions):
        if positions is not None:  # the inverse of the ordered gather's rows (checks.ordered_rows)
            positions = checks.ordered_rows(positions, self.layout.total_len)
        if self._p2p is not None:
            return self._p2p(y, out, device_counts, positions)
        return self._run(y, out, positions)

    def run_norm(self, y, residual, weight, eps, device_counts, positions):
        """The reduce-scatter, then the add + RMSNorm on this rank's rows: ``(normed, residual)``."""
        if self._p2p_norm is not None:  # one kernel: the pull's rows are normed before they are stored
            if positions is not None:
                positions = checks.ordered_rows(positions, self.layout.total_len)
            if _unaligned(residual):
                staged = residual.clone()
                out, _ = self._p2p_norm(y, staged, weight, eps, None, device_counts, positions)
                residual.copy_(staged)
                return out, residual
            return self._p2p_norm(y, residual, weight, eps, None, device_counts, positions)
        return norm_in_place(self.run(y, None, device_counts, positions), residual, weight, eps)

    def buffer(self) -> torch.Tensor:
        """Where the MoE writes its partials ``[rows, *row]``: the P2P transport's reduce buffer (no copy
        in before the pull), else a fresh tensor (NCCL reads any tensor)."""
        if self._transport is not None:
            return self._transport.reduce_buffer(self.layout, self.compact, self.row_shape)
        return torch.empty((self.rows, *self.row_shape), dtype=self.dtype, device=self.device)


def scatter_plan(op: str, y: torch.Tensor, layout, group, compact: bool, out, algo: str, backend: str, device_counts,
                 positions, norm: bool = False, name: str = "y") -> ScatterPlan:
    """The cached plan of a reduce-scatter; ``norm``: followed by the add + RMSNorm with a residual.
    ``name``: what the caller called ``y`` (``partials``, ``like``), for the error messages."""
    if not isinstance(y, torch.Tensor) or y.dim() < 2:
        checks.check_tensor(name, y, "tokens")
    pg = nccl.resolve_group(group)
    key = (op, layout, y.shape[1:], y.dtype, y.device, compact, out is None, algo, backend, device_counts is None,
           positions is None, norm, pg, envs.plan_state())
    try:
        plan = _lookup(key)
    except TypeError:
        plan, key = None, None
    if plan is None:
        plan = _build_scatter(op, y, layout, pg, group, compact, algo, backend, device_counts is not None,
                              positions is not None, norm, name)
        if key is not None:
            _store(key, plan)
    return plan


def _build_scatter(op, y, layout, pg, group, compact, algo, backend, has_dc, ordered, norm, name="y") -> ScatterPlan:
    rank, size = pg.rank(), pg.size()
    checks.check_layout(layout, size)
    checks.check_choice("algo", algo, _ALGOS)
    checks.check_choice("backend", backend, _BACKENDS)
    checks.check_dtype(name, y, checks.SUM_DTYPES)
    if has_dc and (compact or ordered):
        raise ValueError("device_counts: supported for the padded layout only (compact and ordered shapes depend "
                         f"on the counts), got compact={compact}, positions={'given' if ordered else None}")
    row_shape = tuple(y.shape[1:])
    plan = ScatterPlan()
    plan.op, plan.rank, plan.layout, plan.device, plan.dtype = op, rank, layout, y.device, y.dtype
    plan.compact, plan.row_shape = compact or ordered, row_shape
    plan.rows = layout.global_len(compact or ordered)
    plan.out_shape = (layout.count(rank), *row_shape)
    transport, fused = _transport(backend, group, layout, row_shape, y.dtype, y.device, name, norm=norm)
    plan._transport, plan._p2p, plan._p2p_norm, plan._run = None, None, None, None
    if transport is not None and layout.total_len:
        plan.backend, plan.algo, plan._transport = "p2p", "ordered" if ordered else ("compact" if compact else "padded"), transport
        plan._p2p = transport.reduce_scatter_runner(layout, compact, row_shape, ordered=ordered)
        if norm and fused:
            plan._p2p_norm = transport.reduce_scatter_runner(layout, compact, row_shape, ordered=ordered, norm=True)
    else:
        row_bytes = math.prod(row_shape) * y.element_size()
        chosen = _algo(algo, layout, compact or ordered, y.is_cuda, layout.max_rank_len * row_bytes,
                       envs.NSA_CP_COALESCED_SCATTER_MIN_BYTES, has_dc)
        plan.backend, plan.algo = ("nccl" if y.is_cuda else "gloo"), chosen
        coll = _collectives(pg, y.device, chosen)
        plan.backend = "nccl+native" if coll.native is not None else plan.backend
        plan._run = algorithms.scatter_runner(coll, layout, rank, compact, chosen, ordered)
    plan.signature = (f"{op}|compact={compact}|dtype={y.dtype}|row={row_shape}|backend={plan.backend}|"
                      f"algo={plan.algo}|device_counts={has_dc}|ordered={ordered}")
    logger.debug("nsa_cp plan: %s on %r", plan.signature, layout)
    return plan


def norm_in_place(h: torch.Tensor, residual, weight, eps) -> Tuple[torch.Tensor, torch.Tensor]:
    """The fused add + RMSNorm on this rank's reduced rows ``h [n_r, H]``: ``(y, residual)``, residual
    updated in place; with ``residual=None``, ``y = rmsnorm(h)`` and ``h`` is the residual (kept)."""
    if not h.is_cuda:
        return reference.fused_add_rmsnorm(h, residual, weight, eps)
    from .norm import fused_add_rmsnorm_into

    if residual is None:
        y, _ = fused_add_rmsnorm_into(h, None, weight, eps, out=torch.empty_like(h))
        return y, h
    return fused_add_rmsnorm_into(h, residual, weight, eps, out=h)  # y overwrites h (private to this call)
