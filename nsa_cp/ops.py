"""torch.compile support: ``nsa_cp::cp_all_gather`` / ``nsa_cp::cp_reduce_scatter`` as torch.library ops.

Design record:

* Why custom ops. Dynamo cannot trace the eager collectives (process groups, Triton launches, the P2P
  transport's raw pointers): without help every call is a graph break. A ``torch.library.custom_op`` is
  one opaque node: Dynamo, AOTAutograd and Inductor see only its schema and its fake implementation,
  which computes the output shape from the layout without communicating (gather
  ``[layout.global_len(compact), *x.shape[1:]]``, reduce-scatter ``[counts[rank], *y.shape[1:]]``).
  The real implementation calls the public eager function: one code path moves the data.
* Schema-friendly arguments: the layout travels as ``counts: List[int], align: int`` (rebuilt into a
  cached ShardLayout when the op runs), the group as its ``group_name`` (None: the default group,
  resolved when the op runs, as eager ``group=None``), ``device_counts`` as two optional tensors, and
  the rank as an int read from the group while tracing, because the reduce-scatter's fake needs it.
* Eager bypass (QuACK's pattern): ``cp_all_gather`` / ``cp_reduce_scatter`` start with
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

from . import collectives
from .layout import ShardLayout

__all__ = ["all_gather", "reduce_scatter"]


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


# --------------------------------------------------------------------------- the ops
@torch.library.custom_op("nsa_cp::cp_all_gather", mutates_args=())
def _cp_all_gather(
    x: torch.Tensor,
    counts: List[int],
    align: int,
    group_name: Optional[str],
    rank: int,
    compact: bool,
    algo: str,
    backend: str,
    validate: Optional[bool],
    device_counts: Optional[torch.Tensor],
    device_offsets: Optional[torch.Tensor],
) -> torch.Tensor:
    """``nsa_cp.cp_all_gather`` as an op; ``rank`` is for the fake implementation."""
    layout = _layout(tuple(counts), align)
    out = x.new_empty((layout.global_len(compact), *x.shape[1:]))  # owned by the op, never a view
    return collectives.cp_all_gather(
        x, layout, _group(group_name), compact=compact, out=out, algo=algo, backend=backend, validate=validate,
        device_counts=_pair(device_counts, device_offsets),
    )


@_cp_all_gather.register_fake
def _(x, counts, align, group_name, rank, compact, algo, backend, validate, device_counts, device_offsets):
    return x.new_empty((_gather_rows(counts, align, compact), *x.shape[1:]))


@torch.library.custom_op("nsa_cp::cp_reduce_scatter", mutates_args=())
def _cp_reduce_scatter(
    y: torch.Tensor,
    counts: List[int],
    align: int,
    group_name: Optional[str],
    rank: int,
    compact: bool,
    algo: str,
    backend: str,
    validate: Optional[bool],
    device_counts: Optional[torch.Tensor],
    device_offsets: Optional[torch.Tensor],
) -> torch.Tensor:
    """``nsa_cp.cp_reduce_scatter`` as an op; ``rank`` is for the fake implementation."""
    # a fresh tensor or a view of a fresh private buffer, never an input's memory: no copy
    return collectives.cp_reduce_scatter(
        y, _layout(tuple(counts), align), _group(group_name), compact=compact, algo=algo, backend=backend,
        validate=validate, device_counts=_pair(device_counts, device_offsets),
    )


@_cp_reduce_scatter.register_fake
def _(y, counts, align, group_name, rank, compact, algo, backend, validate, device_counts, device_offsets):
    # a rank outside the counts is a cp_size mismatch: the real call raises the eager ValueError
    rows = counts[rank] if 0 <= rank < len(counts) else 0
    return y.new_empty((rows, *y.shape[1:]))


# Collectives must run on every rank whatever becomes of their outputs (module docstring). Dynamo's
# graph holds the packet, AOTAutograd's and Inductor's the overload.
for _op in (torch.ops.nsa_cp.cp_all_gather, torch.ops.nsa_cp.cp_reduce_scatter):
    torch.fx.node.has_side_effect(_op)
    torch.fx.node.has_side_effect(_op.default)


# --------------------------------------------------------------------------- trace-time entry points
def _trace_args(layout, group, out, device_counts):
    """The op's arguments after the tensor, computed while Dynamo traces (so it guards on them)."""
    if out is not None:
        raise ValueError(
            "out: not supported inside torch.compile (the compiled op returns a new tensor; "
            "use the return value)"
        )
    # dist.get_world_size / get_rank / group.group_name: Dynamo folds these to constants on torch 2.11..2.13
    collectives._check_layout(layout, dist.get_world_size(group))
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
               device_counts=None):
    """``cp_all_gather`` while compiling: one ``nsa_cp::cp_all_gather`` node."""
    counts, align, name, rank, pair = _trace_args(layout, group, out, device_counts)
    return torch.ops.nsa_cp.cp_all_gather(x, counts, align, name, rank, compact, algo, backend, validate, *pair)


def reduce_scatter(y, layout, group=None, *, compact=False, out=None, algo="auto", backend="auto", validate=None,
                   device_counts=None):
    """``cp_reduce_scatter`` while compiling: one ``nsa_cp::cp_reduce_scatter`` node."""
    counts, align, name, rank, pair = _trace_args(layout, group, out, device_counts)
    return torch.ops.nsa_cp.cp_reduce_scatter(y, counts, align, name, rank, compact, algo, backend, validate, *pair)
