"""Input checks of the public functions: each raises ``ValueError`` naming the argument, the expected and
the actual value, before anything is written.

Two kinds, kept apart on purpose (nsa_cp/planning/plan.py):

* plan checks: everything a cached plan is keyed on (layout against the group, dtype, row shape,
  compact, algorithm, backend, quantization). They run once, when a plan is built.
* call checks: what changes from call to call with the same plan (the row count of ``x``, the ``out``
  tensor, ``device_counts``, ``positions``, the norm's ``residual`` and ``weight``). They are a handful
  of attribute reads and run on every call.
"""

from __future__ import annotations

import functools
import weakref
from typing import Optional, Sequence

import torch

from ..geometry.layout import ShardLayout
from ..geometry.wire import FP8_DTYPES, QUANTS, format_of  # noqa: F401  (QUANTS: what quant= accepts; FP8_DTYPES re-exported)

__all__ = [
    "shape_str", "check_plan", "check_flag", "check_layer_args", "check_norm_partials", "check_layout", "check_tensor", "check_rows", "check_dtype", "check_out", "check_choice",
    "check_device_counts", "check_positions", "check_call_tensors", "check_outs", "check_row_stage", "check_permutation", "ordered_rows", "check_norm_args", "SUM_DTYPES", "FP8_DTYPES", "GATHER_DTYPES",
    "NORM_DTYPES", "QUANTS",
]

# A reduce-scatter sums: floating dtypes that NCCL and gloo both add. A gather only moves bytes: fp8 is
# carried as uint8 (same bits), so every dtype either transport carries is accepted.
SUM_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
GATHER_DTYPES = SUM_DTYPES + FP8_DTYPES + (torch.uint8, torch.int8, torch.int32, torch.int64)
NORM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def shape_str(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


def check_layout(layout, group_size: int) -> None:
    if not isinstance(layout, ShardLayout):
        raise ValueError(f"layout: expected an nsa_cp.ShardLayout, got {type(layout).__name__}")
    if layout.cp_size != group_size:
        raise ValueError(
            f"layout: expected cp_size == group size {group_size}, got cp_size {layout.cp_size} ({layout!r})"
        )


def check_tensor(name: str, t, what: str) -> None:
    """``t`` is a tensor of 2 or more dims (dim 0: tokens)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() < 2:
        raise ValueError(f"{name}: expected a tensor of 2 or more dims [{what}, ...], got shape {shape_str(t.shape)}")


def check_rows(name: str, t: torch.Tensor, expected_rows: int, what: str) -> None:
    if t.shape[0] != expected_rows:
        raise ValueError(
            f"{name}: expected shape {shape_str((expected_rows, *t.shape[1:]))} ({what}), got {shape_str(t.shape)}"
        )


def check_dtype(name: str, t: torch.Tensor, allowed) -> None:
    if t.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise ValueError(f"{name}: expected dtype one of [{names}], got {t.dtype}")


def check_out(name: str, out, expected_shape, dtype: torch.dtype, device: torch.device) -> None:
    """``out`` (never None here): contiguous, of exactly that shape, dtype and device, no autograd history."""
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor or None, got {type(out).__name__}")
    if tuple(out.shape) != tuple(expected_shape):
        raise ValueError(f"{name}: expected shape {shape_str(expected_shape)}, got {shape_str(out.shape)}")
    if out.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype}, got {out.dtype}")
    if out.device != device:
        raise ValueError(f"{name}: expected device {device} (the input's), got {out.device}")
    if not out.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor of shape {shape_str(expected_shape)}, got strides {tuple(out.stride())}")
    if out.requires_grad:
        raise ValueError(f"{name}: expected a tensor without autograd history (the collectives are not "
                         f"differentiable), got one with requires_grad=True")


def check_plan(req, group_size: int, dtypes, algos, backends) -> None:
    """The plan checks every call shares (``req``: an nsa_cp.planning.request.Request): its layout against the
    group, ``algo``, ``backend``, the input's dtype, and device counts only with the padded layout."""
    check_layout(req.layout, group_size)
    check_flag("compact", req.compact)
    check_choice("algo", req.algo, algos)
    check_choice("backend", req.backend, backends)
    check_dtype(req.input_name, req, dtypes)
    if req.has_device_counts and (req.compact or req.ordered):
        raise ValueError("device_counts: supported for the padded layout only (compact and ordered shapes depend "
                         f"on the counts), got compact={req.compact}, positions={'given' if req.ordered else None}")


def check_norm_partials(req) -> None:
    """Plan check of ``reduce_scatter_fused_add_rmsnorm``: 2-D partials of a norm dtype."""
    if len(req.row_shape) != 1:
        raise ValueError(f"partials: expected a 2-D tensor [rows, hidden], got shape "
                         f"{shape_str((req.result_rows, *req.row_shape))}")
    check_dtype("partials", req, NORM_DTYPES)


def check_flag(name: str, value) -> None:
    """``value`` is True or False: a string such as "no" would otherwise count as true."""
    if not isinstance(value, bool):
        raise ValueError(f"{name}: expected True or False, got {type(value).__name__} {value!r}")


def check_layer_args(method: str, hidden_states, residual, layout, hidden: str = "a torch.Tensor [rows, H]") -> None:
    """The communicator's ``method(hidden_states, residual, layout)``: a tensor (``hidden`` says which), a
    tensor or None, a ShardLayout or None (arguments in another order are named here, not failed on
    inside a norm)."""
    for name, value, expected, ok in (
        ("hidden_states", hidden_states, hidden, isinstance(hidden_states, torch.Tensor)),
        ("residual", residual, "a torch.Tensor [n_r, H] or None", residual is None or isinstance(residual, torch.Tensor)),
        ("layout", layout, "an nsa_cp.ShardLayout or None", layout is None or isinstance(layout, ShardLayout)),
    ):
        if not ok:
            got = f"shape {shape_str(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"{method}(hidden_states, residual, layout): {name}: expected {expected}, got {got}")


def check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name}: expected one of {choices}, got {value!r}")


def check_device_counts(device_counts, layout: ShardLayout, device: torch.device) -> None:
    """``device_counts``: a ``(counts, offsets)`` pair of int32 ``[cp_size]`` tensors on ``device``."""
    if not isinstance(device_counts, (tuple, list)) or len(device_counts) != 2:
        raise ValueError(f"device_counts: expected a (counts, offsets) pair of tensors, got {type(device_counts).__name__}")
    for name, t in zip(("device_counts[0]", "device_counts[1]"), device_counts):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or tuple(t.shape) != (layout.cp_size,) or t.device != device:
            got = f"{t.dtype} {shape_str(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}: expected int32 [{layout.cp_size}] on {device}, got {got}")


def check_call_tensors(device_counts, positions, layout: ShardLayout, device: torch.device) -> None:
    """The optional tensors of a call (call checks): ``device_counts`` and ``positions``, where given."""
    if device_counts is not None:
        check_device_counts(device_counts, layout, device)
    if positions is not None:
        check_positions(positions, layout, device)


def check_outs(out, shapes, dtypes, device: torch.device) -> None:
    """A gather's ``out``: one tensor, or a ``(q, scale)`` pair for the FP8 wire (``shapes``: one or two)."""
    if len(shapes) == 1:
        check_out("out", out, shapes[0], dtypes[0], device)
        return
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise ValueError(f"out: expected a (q, scale) pair of tensors, got {type(out).__name__}")
    for name, t, shape, dtype in zip(("out[0]", "out[1]"), out, shapes, dtypes):
        check_out(name, t, shape, dtype, device)


def check_row_stage(req) -> None:
    """Plan check of a gather with a row stage (norm, a wire format): rows ``[n_r, H]`` that the format
    takes (``req``: an nsa_cp.planning.request.Request)."""
    shape = shape_str(req.row_shape)
    if len(req.row_shape) != 1:
        raise ValueError(f"x: expected a 2-D tensor [n_r, hidden], got a tensor of {len(req.row_shape) + 1} dims, "
                         f"rows of shape {shape}")
    fmt = format_of(req.quant)
    verdict = fmt.support(req.row_shape[0]) if fmt is not None else None
    if verdict is not None and not verdict:
        raise ValueError(f"x: {verdict.reason}, got rows of shape {shape}")


def check_positions(positions, layout: ShardLayout, device: torch.device) -> None:
    """``positions``: int64 ``[total_len]`` on the tensors' device (the batch row of each compact row)."""
    if not isinstance(positions, torch.Tensor):
        raise ValueError(f"positions: expected an int64 tensor [{layout.total_len}], got {type(positions).__name__}")
    if positions.dtype != torch.int64 or tuple(positions.shape) != (layout.total_len,) or positions.device != device:
        raise ValueError(
            f"positions: expected int64 [{layout.total_len}] (total_len of {layout!r}) on {device}, got "
            f"{positions.dtype} {shape_str(positions.shape)} on {positions.device}"
        )


def check_permutation(positions: torch.Tensor, total: int) -> None:
    """``validate=True`` only: positions is a permutation of ``range(total)`` (syncs with the device)."""
    if total == 0:
        return
    seen = torch.zeros(total, dtype=torch.int32, device=positions.device)
    in_range = (positions >= 0) & (positions < total)
    seen.index_add_(0, positions.clamp(0, total - 1), in_range.to(torch.int32))
    if not bool(in_range.all()) or not bool((seen == 1).all()):
        bad = positions[~in_range][:4].tolist()
        raise ValueError(
            f"positions: expected a permutation of range({total}), got "
            + (f"values out of range, e.g. {bad}" if bad else "repeated values")
        )


# ordered_rows' results, per positions tensor: id -> (weakref, version, total, rows). A tensor's version
# counter moves with every in-place write through torch (views share it), so an entry is only reused for
# the unchanged tensor it was computed from. Small: a batch has one positions tensor, used by every layer.
_ORDERED_ROWS: dict = {}
_ORDERED_ROWS_LIMIT = 8


def _version(t: torch.Tensor) -> Optional[int]:
    try:
        return t._version
    except RuntimeError:  # an inference-mode tensor tracks no version: never cached
        return None


def ordered_rows(positions: torch.Tensor, total: int) -> torch.Tensor:
    """The rows an ordered call uses for ``positions``: a permutation of ``range(total)``, on positions'
    device, computed there (no host sync, no collective).

    A permutation maps to itself. Otherwise the result is still a permutation, the same on every rank
    and backend: the first entry holding a value in ``[0, total)`` keeps it; every other entry (a repeat,
    or a value out of range) takes, in entry order, one of the rows no entry holds, in increasing order.
    So an ordered gather writes every result row exactly once (never returns memory it did not write),
    and the ordered reduce-scatter stays its inverse. ``validate=True`` raises on such input instead.

    Cached per positions tensor while it is unchanged (by its version counter); inference-mode tensors,
    which have none, and calls during CUDA-graph capture compute it every time (a few small kernels).
    """
    if total == 0:
        return positions
    # a captured graph must recompute from positions on every replay (a caller refills a static positions
    # buffer in place between replays, which no version counter sees then): no cache inside a capture
    if positions.is_cuda and torch.cuda.is_current_stream_capturing():
        return _permutation_of(positions, total)
    version = _version(positions)
    key = id(positions)
    entry = _ORDERED_ROWS.get(key)
    if entry is not None and version is not None and entry[0]() is positions and entry[1] == version \
            and entry[2] == total:
        return entry[3]
    rows = _permutation_of(positions, total)
    if version is not None:
        if len(_ORDERED_ROWS) >= _ORDERED_ROWS_LIMIT:
            del _ORDERED_ROWS[next(iter(_ORDERED_ROWS))]
        _ORDERED_ROWS[key] = (weakref.ref(positions, functools.partial(_forget, key)), version, total, rows)
    return rows


def _forget(key: int, ref) -> None:
    entry = _ORDERED_ROWS.get(key)
    if entry is not None and entry[0] is ref:
        del _ORDERED_ROWS[key]


def _permutation_of(positions: torch.Tensor, total: int) -> torch.Tensor:
    """``ordered_rows`` computed: int64 ``[total]``, elementwise ops, one scatter-min, one cumsum, one sort."""
    with torch.no_grad():
        index = torch.arange(total, device=positions.device)
        valid = (positions >= 0) & (positions < total)
        target = torch.where(valid, positions, total)  # out-of-range entries aim at a spare slot
        first = torch.full((total + 1,), total, dtype=torch.int64, device=positions.device)
        first.scatter_reduce_(0, target, index, "amin")  # the first entry holding each value
        keeps = valid & (first.gather(0, target) == index)
        # the rows no entry holds, in increasing order (a stable sort puts them first)
        free_rows = torch.argsort((first[:total] < total).to(torch.int8), stable=True)
        moved = torch.cumsum(~keeps, 0) - 1  # the k-th entry that does not keep its value takes free row k
        return torch.where(keeps, positions, free_rows[moved.clamp_min(0)])


def check_norm_args(shape, dtype: torch.dtype, device: torch.device, residual, weight, eps) -> None:
    """The norm's tensors against the rows they apply to, ``[n, H]`` of ``dtype`` on ``device`` (call checks)."""
    hidden = shape[-1]
    if residual is not None:
        if not isinstance(residual, torch.Tensor) or tuple(residual.shape) != tuple(shape):
            got = shape_str(residual.shape) if isinstance(residual, torch.Tensor) else type(residual).__name__
            raise ValueError(f"residual: expected shape {shape_str(shape)}, got {got}")
        if residual.dtype != dtype or residual.device != device:
            raise ValueError(f"residual: expected {dtype} on {device}, got {residual.dtype} on {residual.device}")
        if residual.shape[0] and residual.stride(-1) != 1:
            raise ValueError(f"residual: expected unit stride along hidden (it is updated in place), got strides {tuple(residual.stride())}")
    if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (hidden,):
        got = shape_str(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"weight: expected shape [{hidden}] (the hidden size), got {got}")
    if weight.dtype not in NORM_DTYPES or weight.device != device:
        raise ValueError(f"weight: expected a bf16, fp16 or fp32 tensor on {device}, got {weight.dtype} on {weight.device}")
    if isinstance(eps, bool) or not isinstance(eps, (float, int)) or not eps >= 0:
        raise ValueError(f"eps: expected a float >= 0, got {eps!r}")
