"""torch.compile support: ``nsa_cp::cp_all_gather`` / ``nsa_cp::cp_reduce_scatter`` as torch.library ops.

Design record:

* Why custom ops. Dynamo cannot trace the eager collectives (process groups, Triton launches, the P2P
  transport's raw pointers): without help every call is a graph break. A ``torch.library.custom_op`` is
  one opaque node: Dynamo, AOTAutograd and Inductor see only its schema and its fake implementation,
  which computes the output shape from the layout without communicating (gather
  ``[layout.global_len(compact), *x.shape[1:]]``, reduce-scatter ``[counts[rank], *y.shape[1:]]``).
  The real implementation calls the eager entry point (nsa_cp/eager.py), which the public function also
  calls when not compiling: one code path moves the data, and no import goes back up to the public
  module.
* Schema-friendly arguments: the layout travels as ``counts: List[int], align: int`` (rebuilt into a
  cached ShardLayout when the op runs), the group as its ``group_name`` (None: the default group,
  resolved when the op runs, as eager ``group=None``), ``device_counts`` as two optional tensors, and
  the rank as an int read from the group while tracing, because the reduce-scatter's fake needs it.
* Ops: ``cp_all_gather`` (with ``positions``), ``cp_all_gather_fp8`` (``quant=``, two results),
  ``cp_reduce_scatter``, ``fused_add_rmsnorm_all_gather`` (and ``_fp8``) and
  ``reduce_scatter_fused_add_rmsnorm``; the fused ones mutate ``residual`` (declared in
  ``mutates_args``) and return only new tensors; the Python wrapper returns the residual itself.
* Eager bypass (QuACK's pattern): the public functions start with
  ``if torch.compiler.is_compiling(): return ops...``, so only traced calls use the op and eager calls
  never pay the dispatcher (~0.15 us for the check; the dispatcher costs ~16 us of host time per call on
  CPU: benchmarks/dispatch_overhead.py).
* No aliasing: a custom op's output must be a new tensor that aliases no input; the compiled graph owns
  it. The gather op allocates its output and passes it as ``out=``: NCCL/gloo write into it directly,
  as they would into the tensor they allocate; the P2P backend, whose eager result is a view of the
  transport's persistent gather buffer (overwritten by the next gather), pays one ``[global_len, H]``
  device copy per compiled call. The reduce-scatter op returns the eager result unchanged: a fresh
  tensor, or on the padded uneven path the first ``n_r`` rows of a fresh ``[max_rank_len, H]`` buffer
  that nothing else holds (no storage shared with an input, which is what torch checks): no copy.
* Side effects: both ops are registered with ``torch.fx.node.has_side_effect``. Without it dead-code
  elimination drops a gather whose result is unused, and Inductor drops a reduce-scatter with zero
  output rows (a rank without tokens): that rank skips the collective and the other ranks hang.
* Layouts: Dynamo reads the counts while tracing and specializes on them; the first new layout
  recompiles once with the counts as symbolic ints (automatic dynamic, as for sizes; counts of 0 or 1
  stay specialized) and that graph serves later layouts. The fakes therefore accept SymInt counts.
* ``out=`` is refused while compiling (ValueError naming ``out``): it would make the op mutate a graph
  input. Dynamo treats an exception raised while tracing as "this frame raises": with
  ``fullgraph=True`` compilation fails with the ValueError's text; without it Dynamo runs that frame
  eagerly, where ``out=`` works.
"""

import functools
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from . import checks, eager
from .layout import ShardLayout

__all__ = ["all_gather", "reduce_scatter", "fused_add_rmsnorm_all_gather", "reduce_scatter_fused_add_rmsnorm"]


@functools.lru_cache(maxsize=256)
def _layout(counts: Tuple[int, ...], align: int) -> ShardLayout:
    # cached: a ShardLayout keeps the device copies of its counts that the CUDA kernels read
    return ShardLayout(counts, align)


def _group(group_name: Optional[str]):
    if group_name is None:
        return None  # the default group, as eager group=None
    return dist.distributed_c10d._resolve_process_group(group_name)


def _pair(counts: Optional[torch.Tensor], offsets: Optional[torch.Tensor]):
    return None if counts is None and offsets is None else (counts, offsets)


def _gather_rows(counts, align, compact: bool):
    """``ShardLayout.global_len`` in arithmetic that also holds for SymInt counts (dynamic shapes)."""
    if compact:
        return sum(counts)
    return -(-functools.reduce(torch.sym_max, counts) // align) * align * len(counts)


def _kw(counts, align, group_name, compact, algo, backend, validate, device_counts, device_offsets, positions):
    """The eager keyword arguments from an op's schema-friendly ones."""
    return dict(layout=_layout(tuple(counts), align), group=_group(group_name), compact=compact, algo=algo,
                backend=backend, validate=validate, device_counts=_pair(device_counts, device_offsets),
                positions=positions)


def _owned(result: torch.Tensor) -> torch.Tensor:
    # a P2P gather returns a view of the transport's buffer, overwritten by the next gather: an op's
    # output must be its own
    return result.clone() if result._base is not None else result


# --------------------------------------------------------------------------- the ops
@torch.library.custom_op("nsa_cp::cp_all_gather", mutates_args=())
def _cp_all_gather(
    x: torch.Tensor, counts: List[int], align: int, group_name: Optional[str], rank: int, compact: bool, algo: str,
    backend: str, validate: Optional[bool], device_counts: Optional[torch.Tensor],
    device_offsets: Optional[torch.Tensor], positions: Optional[torch.Tensor],
) -> torch.Tensor:
    """``nsa_cp.cp_all_gather`` as an op; ``rank`` is for the fake implementations."""
    kw = _kw(counts, align, group_name, compact, algo, backend, validate, device_counts, device_offsets, positions)
    rows = kw["layout"].total_len if positions is not None else kw["layout"].global_len(compact)
    out = x.new_empty((rows, *x.shape[1:]))  # owned by the op, never a view
    return eager.all_gather(x, out=out, **kw)


@_cp_all_gather.register_fake
def _(x, counts, align, group_name, rank, compact, algo, backend, validate, device_counts, device_offsets, positions):
    return x.new_empty((_gather_rows(counts, align, compact or positions is not None), *x.shape[1:]))


@torch.library.custom_op("nsa_cp::cp_all_gather_fp8", mutates_args=())
def _cp_all_gather_fp8(
    x: torch.Tensor, counts: List[int], align: int, group_name: Optional[str], rank: int, compact: bool, algo: str,
    backend: str, validate: Optional[bool], device_counts: Optional[torch.Tensor],
    device_offsets: Optional[torch.Tensor], positions: Optional[torch.Tensor],
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``nsa_cp.cp_all_gather(..., quant="fp8_e4m3_g128")`` as an op."""
    kw = _kw(counts, align, group_name, compact, algo, backend, validate, device_counts, device_offsets, positions)
    q, scale = eager.all_gather(x, quant="fp8_e4m3_g128", **kw)
    return _owned(q), _owned(scale)


@_cp_all_gather_fp8.register_fake
def _(x, counts, align, group_name, rank, compact, algo, backend, validate, device_counts, device_offsets, positions):
    return _fp8_fakes(x, counts, align, compact or positions is not None)


def _fp8_fakes(x, counts, align, compact):
    rows = _gather_rows(counts, align, compact)
    hidden = x.shape[-1]
    return (x.new_empty((rows, hidden), dtype=torch.float8_e4m3fn),
            x.new_empty((rows, hidden // checks.FP8_GROUP), dtype=torch.float32))


@torch.library.custom_op("nsa_cp::cp_reduce_scatter", mutates_args=())
def _cp_reduce_scatter(
    y: torch.Tensor, counts: List[int], align: int, group_name: Optional[str], rank: int, compact: bool, algo: str,
    backend: str, validate: Optional[bool], device_counts: Optional[torch.Tensor],
    device_offsets: Optional[torch.Tensor], positions: Optional[torch.Tensor],
) -> torch.Tensor:
    """``nsa_cp.cp_reduce_scatter`` as an op; ``rank`` is for the fake implementation."""
    # a fresh tensor or a view of a fresh private buffer, never an input's memory: no copy
    kw = _kw(counts, align, group_name, compact, algo, backend, validate, device_counts, device_offsets, positions)
    return eager.reduce_scatter(y, **kw)


@_cp_reduce_scatter.register_fake
def _(y, counts, align, group_name, rank, compact, algo, backend, validate, device_counts, device_offsets, positions):
    return _local_fake(y, counts, rank)


def _local_fake(y, counts, rank):
    # a rank outside the counts is a cp_size mismatch: the real call raises the eager ValueError
    rows = counts[rank] if 0 <= rank < len(counts) else 0
    return y.new_empty((rows, *y.shape[1:]))


@torch.library.custom_op("nsa_cp::fused_add_rmsnorm_all_gather", mutates_args=("residual",))
def _fused_gather(
    x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float, counts: List[int], align: int,
    group_name: Optional[str], rank: int, compact: bool, algo: str, backend: str, validate: Optional[bool],
    device_counts: Optional[torch.Tensor], device_offsets: Optional[torch.Tensor], positions: Optional[torch.Tensor],
) -> torch.Tensor:
    """``nsa_cp.fused_add_rmsnorm_all_gather`` as an op (residual updated in place)."""
    kw = _kw(counts, align, group_name, compact, algo, backend, validate, device_counts, device_offsets, positions)
    gathered, _ = eager.fused_add_rmsnorm_all_gather(x, residual, weight, eps, **kw)
    return _owned(gathered)


@_fused_gather.register_fake
def _(x, residual, weight, eps, counts, align, group_name, rank, compact, algo, backend, validate, device_counts,
      device_offsets, positions):
    return x.new_empty((_gather_rows(counts, align, compact or positions is not None), *x.shape[1:]))


@torch.library.custom_op("nsa_cp::fused_add_rmsnorm_all_gather_fp8", mutates_args=("residual",))
def _fused_gather_fp8(
    x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float, counts: List[int], align: int,
    group_name: Optional[str], rank: int, compact: bool, algo: str, backend: str, validate: Optional[bool],
    device_counts: Optional[torch.Tensor], device_offsets: Optional[torch.Tensor], positions: Optional[torch.Tensor],
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``nsa_cp.fused_add_rmsnorm_all_gather(..., quant="fp8_e4m3_g128")`` as an op."""
    kw = _kw(counts, align, group_name, compact, algo, backend, validate, device_counts, device_offsets, positions)
    (q, scale), _ = eager.fused_add_rmsnorm_all_gather(x, residual, weight, eps, quant="fp8_e4m3_g128", **kw)
    return _owned(q), _owned(scale)


@_fused_gather_fp8.register_fake
def _(x, residual, weight, eps, counts, align, group_name, rank, compact, algo, backend, validate, device_counts,
      device_offsets, positions):
    return _fp8_fakes(x, counts, align, compact or positions is not None)


@torch.library.custom_op("nsa_cp::reduce_scatter_fused_add_rmsnorm", mutates_args=("residual",))
def _scatter_norm(
    partials: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float, counts: List[int],
    align: int, group_name: Optional[str], rank: int, compact: bool, algo: str, backend: str,
    validate: Optional[bool], device_counts: Optional[torch.Tensor], device_offsets: Optional[torch.Tensor],
    positions: Optional[torch.Tensor],
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``nsa_cp.reduce_scatter_fused_add_rmsnorm`` as an op: ``(y, h)`` where h is the reduced rows (the
    residual when ``residual`` is None; else unused)."""
    kw = _kw(counts, align, group_name, compact, algo, backend, validate, device_counts, device_offsets, positions)
    y, new_residual = eager.reduce_scatter_fused_add_rmsnorm(partials, residual, weight, eps, **kw)
    if residual is None:
        return y, new_residual
    return y, y.new_empty((0, *y.shape[1:]))


@_scatter_norm.register_fake
def _(partials, residual, weight, eps, counts, align, group_name, rank, compact, algo, backend, validate,
      device_counts, device_offsets, positions):
    y = _local_fake(partials, counts, rank)
    return y, (torch.empty_like(y) if residual is None else y.new_empty((0, *y.shape[1:])))


# Collectives must run on every rank whatever becomes of their outputs (module docstring). Dynamo's
# graph holds the packet, AOTAutograd's and Inductor's the overload.
for _op in (torch.ops.nsa_cp.cp_all_gather, torch.ops.nsa_cp.cp_all_gather_fp8, torch.ops.nsa_cp.cp_reduce_scatter,
            torch.ops.nsa_cp.fused_add_rmsnorm_all_gather, torch.ops.nsa_cp.fused_add_rmsnorm_all_gather_fp8,
            torch.ops.nsa_cp.reduce_scatter_fused_add_rmsnorm):
    torch.fx.node.has_side_effect(_op)
    torch.fx.node.has_side_effect(_op.default)


# --------------------------------------------------------------------------- trace-time entry points
def _trace_args(layout, group, out, device_counts):
    """The op's arguments after the tensors, computed while Dynamo traces (so it guards on them)."""
    if out is not None:
        raise ValueError(
            "out: not supported inside torch.compile (the compiled op returns a new tensor; use the return value)"
        )
    # dist.get_world_size / get_rank / group.group_name: Dynamo folds these to constants on torch 2.11..2.13
    checks.check_layout(layout, dist.get_world_size(group))
    name = None if group is None else group.group_name
    if device_counts is None:
        pair = (None, None)
    elif isinstance(device_counts, (tuple, list)) and len(device_counts) == 2:
        pair = tuple(device_counts)  # the op checks them as eager does
    else:
        kind = type(device_counts).__name__
        raise ValueError(f"device_counts: expected a (counts, offsets) pair of tensors, got {kind}")
    return list(layout.per_rank_actual_token), layout.align, name, dist.get_rank(group), pair


def all_gather(x, layout, group=None, *, compact=False, out=None, algo="auto", backend="auto", validate=None,
               device_counts=None, positions=None, quant=None):
    """``cp_all_gather`` while compiling: one ``nsa_cp::cp_all_gather`` (or ``_fp8``) node."""
    counts, align, name, rank, pair = _trace_args(layout, group, out, device_counts)
    checks.check_choice("quant", quant, checks.QUANTS)
    op = torch.ops.nsa_cp.cp_all_gather if quant is None else torch.ops.nsa_cp.cp_all_gather_fp8
    return op(x, counts, align, name, rank, compact, algo, backend, validate, *pair, positions)


def reduce_scatter(y, layout, group=None, *, compact=False, out=None, algo="auto", backend="auto", validate=None,
                   device_counts=None, positions=None):
    """``cp_reduce_scatter`` while compiling: one ``nsa_cp::cp_reduce_scatter`` node."""
    counts, align, name, rank, pair = _trace_args(layout, group, out, device_counts)
    return torch.ops.nsa_cp.cp_reduce_scatter(y, counts, align, name, rank, compact, algo, backend, validate, *pair,
                                              positions)


def fused_add_rmsnorm_all_gather(x, residual, weight, eps, layout, group=None, *, compact=False, quant=None, out=None,
                                 algo="auto", backend="auto", validate=None, device_counts=None, positions=None):
    """``fused_add_rmsnorm_all_gather`` while compiling: one node; returns ``(gathered, residual)``."""
    counts, align, name, rank, pair = _trace_args(layout, group, out, device_counts)
    checks.check_choice("quant", quant, checks.QUANTS)
    op = (torch.ops.nsa_cp.fused_add_rmsnorm_all_gather if quant is None
          else torch.ops.nsa_cp.fused_add_rmsnorm_all_gather_fp8)
    gathered = op(x, residual, weight, float(eps), counts, align, name, rank, compact, algo, backend, validate, *pair,
                  positions)
    return gathered, (x if residual is None else residual)


def reduce_scatter_fused_add_rmsnorm(partials, residual, weight, eps, layout, group=None, *, compact=False,
                                     algo="auto", backend="auto", validate=None, device_counts=None, positions=None):
    """``reduce_scatter_fused_add_rmsnorm`` while compiling: one node; returns ``(y, residual)``."""
    counts, align, name, rank, pair = _trace_args(layout, group, None, device_counts)
    y, reduced = torch.ops.nsa_cp.reduce_scatter_fused_add_rmsnorm(
        partials, residual, weight, float(eps), counts, align, name, rank, compact, algo, backend, validate, *pair,
        positions)
    return y, (reduced if residual is None else residual)
