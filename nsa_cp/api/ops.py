"""torch.compile support: the public collectives as ``torch.ops.nsa_cp.*`` torch.library ops.

While Dynamo traces, a public call becomes one op node (``call``): its schema arguments are derived from
the call's ``Request`` (the layout as ``counts, align``, the group as its name, the choices), and the op's
implementation rebuilds that request and runs ``plan.call``, the eager path. Six ops, one per public
call and result arity: ``cp_all_gather`` (with ``positions``), ``cp_all_gather_fp8``,
``cp_reduce_scatter``, ``fused_add_rmsnorm_all_gather`` (and ``_fp8``) and
``reduce_scatter_fused_add_rmsnorm``; the fused ones mutate ``residual``. Every op returns tensors of its
own and has side effects (it must run on every rank). docs/design.md ("torch.compile") has the design
record: why custom ops, aliasing, side effects, dynamic layouts, ``out=``.
"""

import functools
from typing import NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist

from ..planning import checks, plan
from ..geometry.layout import ShardLayout
from ..planning.request import Request
from ..geometry.stage import ALL_GATHER, NORM_ALL_GATHER, NORM_REDUCE_SCATTER, REDUCE_SCATTER, Op, stage_of
from ..geometry.wire import FORMATS, WireFormat

__all__ = ["call", "body"]

# the arguments every op takes after its tensors (the layout, group and choices of the request)
_TAIL = ("SymInt[] counts, SymInt align, str? group_name, SymInt rank, bool compact, str algo, str backend, "
         "bool? validate, Tensor? device_counts, Tensor? device_offsets, Tensor? positions")
_NORM_INPUTS = "Tensor(a1!)? residual, Tensor weight, float eps, "


class _Spec(NamedTuple):
    name: str  # torch.ops.nsa_cp.<name>
    kind: Op  # the public function
    fmt: Optional[WireFormat]  # a gather's wire format
    returns: str

    @property
    def quant(self) -> Optional[str]:
        return None if self.fmt is None else self.fmt.name


# one op per public call and wire format: a gather per format, the reduce-scatters once
_SPECS = tuple(
    _Spec(kind.name if fmt is None else f"{kind.name}_{fmt.short}", kind, fmt,
          "Tensor" if (kind.is_gather and fmt is None) or kind is REDUCE_SCATTER else "(Tensor, Tensor)")
    for kind in (ALL_GATHER, REDUCE_SCATTER, NORM_ALL_GATHER, NORM_REDUCE_SCATTER)
    for fmt in ((None, *FORMATS.values()) if kind.is_gather else (None,))
)


@functools.lru_cache(maxsize=256)
def _layout(counts: Tuple[int, ...], align: int) -> ShardLayout:
    # cached: a ShardLayout keeps the device copies of its counts that the CUDA kernels read
    return ShardLayout(counts, align)


def _group(group_name: Optional[str]):
    if group_name is None:
        return None  # the default group, as eager group=None
    return dist.distributed_c10d._resolve_process_group(group_name)


def _gather_rows(counts, align, compact: bool):
    """``ShardLayout.global_len`` in arithmetic that also holds for SymInt counts (dynamic shapes)."""
    if compact:
        return sum(counts)
    return -(-functools.reduce(torch.sym_max, counts) // align) * align * len(counts)


def _owned(result: torch.Tensor) -> torch.Tensor:
    # a P2P gather returns a view of the transport's buffer, overwritten by the next gather: an op's
    # output must be its own
    return result.clone() if result._base is not None else result


def _split(spec: _Spec, args):
    """An op's positional arguments as ``(tensor, norm_args or None, tail)``."""
    if spec.kind.norm:
        return args[0], tuple(args[1:4]), args[4:]
    return args[0], None, args[1:]


def _real(spec: _Spec):
    """The op's implementation: the request rebuilt from the schema arguments, then the eager path."""
    def impl(*args):
        t, norm_args, (counts, align, group_name, _rank, compact, algo, backend, validate, dc, do, positions) = \
            _split(spec, args)
        device_counts = None if dc is None and do is None else (dc, do)
        layout = _layout(tuple(counts), align)
        out = None
        if spec.kind is ALL_GATHER and spec.fmt is None:  # owned by the op, never a view: NCCL/gloo write into it
            out = t.new_empty((layout.global_len(compact or positions is not None), *t.shape[1:]))
        req = Request.of(spec.kind.name, t, layout, _group(group_name), compact, algo, backend, spec.quant, out,
                         device_counts, positions, None if norm_args is None else norm_args[0])
        result = plan.call(req, t, out, device_counts, positions, norm_args, validate)
        if spec.kind is NORM_REDUCE_SCATTER:  # (y, h): h only when residual is None
            y, reduced = result
            return (y, reduced) if norm_args[0] is None else (y, y.new_empty((0, *y.shape[1:])))
        if spec.returns == "Tensor":
            return result if out is not None or spec.kind is REDUCE_SCATTER else _owned(result)
        return _owned(result[0]), _owned(result[1])
    return impl


def _fake(spec: _Spec):
    """The op's fake: output shapes from the layout, without communicating."""
    def fake(*args):
        t, norm_args, (counts, align, _group_name, rank, compact, *_, positions) = _split(spec, args)
        if not spec.kind.is_gather:
            # a rank outside the counts is a cp_size mismatch: the real call raises the eager ValueError
            y = t.new_empty((counts[rank] if 0 <= rank < len(counts) else 0, *t.shape[1:]))
            if not spec.kind.norm:
                return y
            return y, (torch.empty_like(y) if norm_args[0] is None else y.new_empty((0, *y.shape[1:])))
        rows = _gather_rows(counts, align, compact or positions is not None)
        streams = stage_of(spec.kind.norm, spec.quant).streams(tuple(t.shape[1:]), t.dtype)
        results = tuple(t.new_empty((rows, *shape), dtype=dtype) for shape, dtype, _ in streams)
        return results[0] if spec.fmt is None else results
    return fake


_OPS = {}  # (Request.op, quant) -> the op packet
_BODIES = {}  # op name -> its implementation without the dispatcher (benchmarks/dispatch_overhead.py)
for _spec in _SPECS:
    _norm = _spec.kind.norm
    _schema = f"(Tensor {_spec.kind.input_name}, {_NORM_INPUTS if _norm else ''}{_TAIL}) -> {_spec.returns}"
    _op = torch.library.custom_op(f"nsa_cp::{_spec.name}", _real(_spec), mutates_args=("residual",) if _norm else (),
                                  schema=_schema)
    _op.register_fake(_fake(_spec))
    # Collectives must run on every rank whatever becomes of their outputs: without this dead-code
    # elimination drops an unused gather, and Inductor a zero-row reduce-scatter. Dynamo's graph holds the
    # packet, AOTAutograd's and Inductor's the overload.
    _packet = getattr(torch.ops.nsa_cp, _spec.name)
    torch.fx.node.has_side_effect(_packet)
    torch.fx.node.has_side_effect(_packet.default)
    _OPS[(_spec.kind.name, _spec.quant)] = _packet
    _BODIES[_spec.name] = _op._init_fn
del _spec, _norm, _schema, _op, _packet


def body(name: str):
    """The implementation of ``torch.ops.nsa_cp.<name>`` without the dispatcher (what a call through the
    op costs beyond it: benchmarks/dispatch_overhead.py)."""
    return _BODIES[name]


def _schema_args(req: Request, out, validate, device_counts, positions) -> tuple:
    """The op's arguments after the tensors, from the request (computed while Dynamo traces, so it guards
    on them)."""
    if out is not None:
        raise ValueError(
            "out: not supported inside torch.compile (the compiled op returns a new tensor; use the return value)"
        )
    group, layout = req.group, req.layout
    # dist.get_world_size / get_rank / group.group_name: Dynamo folds these to constants on torch 2.11..2.13
    checks.check_layout(layout, dist.get_world_size(group))
    if device_counts is None:
        pair = (None, None)
    elif isinstance(device_counts, (tuple, list)) and len(device_counts) == 2:
        pair = tuple(device_counts)  # the op checks them as eager does
    else:
        kind = type(device_counts).__name__
        raise ValueError(f"device_counts: expected a (counts, offsets) pair of tensors, got {kind}")
    name = None if group is None else group.group_name
    return (list(layout.per_rank_actual_token), layout.align, name, dist.get_rank(group), req.compact, req.algo,
            req.backend, validate, *pair, positions)


def call(req: Request, t, out, device_counts, positions, norm_args, validate):
    """A public call while compiling: one ``torch.ops.nsa_cp.*`` node. Returns what ``plan.call`` returns
    (for ``reduce_scatter_fused_add_rmsnorm``: ``(y, h)``, h meaningful only without a residual)."""
    checks.format_of(req.quant)
    op = _OPS.get((req.op, req.quant))
    if op is None:
        raise ValueError(f"quant: {req.quant!r} has no torch.compile op (a wire format added after nsa_cp was imported "
                         f"is served eagerly only)")
    tail = _schema_args(req, out, validate, device_counts, positions)
    if norm_args is None:
        return op(t, *tail)
    residual, weight, eps = norm_args
    return op(t, residual, weight, float(eps), *tail)
