"""The eager entry points: plan, call checks, optional rank agreement, run.

``nsa_cp.collectives`` (the public functions) calls these when not compiling, and the torch.library ops
of ``nsa_cp.ops`` call them when a compiled graph runs: one code path moves the data.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from . import checks, envs, plan as plans, validation
from .layout import ShardLayout
from .transport import nccl

__all__ = ["all_gather", "reduce_scatter", "fused_add_rmsnorm_all_gather", "reduce_scatter_fused_add_rmsnorm",
           "reduce_scatter_buffer"]


_VALIDATE = envs.reader("NSA_CP_VALIDATE")


def _values(t):
    """The collectives are not differentiable: they work on values and return tensors without history."""
    return t.detach() if isinstance(t, torch.Tensor) and t.requires_grad else t


def _comm_device(group, t) -> torch.device:
    if isinstance(t, torch.Tensor):
        return t.device
    backend = dist.get_backend(group)
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def _prepared(call: str, validate: Optional[bool], layout, group, t, positions, prepare):
    """``prepare()`` (plan + call checks; raises ValueError) and, with validation, the rank agreement.

    With validation every rank takes part in one small all-reduce whatever its own checks said, so a rank
    with bad input or another layout makes every rank raise instead of leaving the others in a collective
    (nsa_cp/validation.py). Positions are then also checked to be a permutation.
    """
    if validate is None:
        validate = _VALIDATE()
    if not validate:
        return prepare()
    rank, size = nccl.group_rank_and_size(group)
    try:
        plan, error = prepare(), None
        if positions is not None:
            checks.check_permutation(positions, layout.total_len)
    except ValueError as err:
        plan, error = None, err
    valid_layout = layout if isinstance(layout, ShardLayout) else None
    signature = plan.signature if plan is not None else ""
    validation.agree(call, valid_layout, group, rank, size, _comm_device(group, t), error, signature)
    return plan


def all_gather(x, layout, group=None, *, compact=False, out=None, algo="auto", backend="auto", validate=None,
               device_counts=None, positions=None, quant=None):
    """``nsa_cp.cp_all_gather`` (eager)."""
    def prepare():
        plan = plans.gather_plan("cp_all_gather", "copy" if quant is None else "quant", x, layout, group, compact,
                                 out, algo, backend, device_counts, positions, quant)
        plan.check(x, out, device_counts, positions)
        return plan

    plan = _prepared("cp_all_gather", validate, layout, group, x, positions, prepare)
    return plan.run(_values(x), out, device_counts, positions)


def fused_add_rmsnorm_all_gather(x, residual, weight, eps, layout, group=None, *, compact=False, quant=None, out=None,
                                 algo="auto", backend="auto", validate=None, device_counts=None, positions=None):
    """``nsa_cp.fused_add_rmsnorm_all_gather`` (eager)."""
    def prepare():
        plan = plans.gather_plan("fused_add_rmsnorm_all_gather", "norm" if quant is None else "norm_quant", x, layout,
                                 group, compact, out, algo, backend, device_counts, positions, quant)
        plan.check(x, out, device_counts, positions)
        checks.check_norm_args(x.shape, x.dtype, x.device, residual, weight, eps)
        return plan

    plan = _prepared("fused_add_rmsnorm_all_gather", validate, layout, group, x, positions, prepare)
    gathered = plan.run(_values(x), out, device_counts, positions, (_values(residual), _values(weight), float(eps)))
    return gathered, (x if residual is None else residual)


def reduce_scatter(y, layout, group=None, *, compact=False, out=None, algo="auto", backend="auto", validate=None,
                   device_counts=None, positions=None):
    """``nsa_cp.cp_reduce_scatter`` (eager)."""
    def prepare():
        plan = plans.scatter_plan("cp_reduce_scatter", y, layout, group, compact, out, algo, backend, device_counts,
                                  positions)
        plan.check(y, out, device_counts, positions)
        return plan

    plan = _prepared("cp_reduce_scatter", validate, layout, group, y, positions, prepare)
    return plan.run(_values(y), out, device_counts, positions)


def reduce_scatter_fused_add_rmsnorm(partials, residual, weight, eps, layout, group=None, *, compact=False,
                                     algo="auto", backend="auto", validate=None, device_counts=None, positions=None):
    """``nsa_cp.reduce_scatter_fused_add_rmsnorm`` (eager)."""
    def prepare():
        plan = plans.scatter_plan("reduce_scatter_fused_add_rmsnorm", partials, layout, group, compact, None, algo,
                                  backend, device_counts, positions, norm=residual is not None, name="partials")
        plan.check(partials, None, device_counts, positions, "partials")
        if partials.dim() != 2:
            raise ValueError(f"partials: expected a 2-D tensor [rows, hidden], got shape {checks.shape_str(partials.shape)}")
        checks.check_dtype("partials", partials, checks.NORM_DTYPES)
        checks.check_norm_args(plan.out_shape, partials.dtype, partials.device, residual, weight, eps)
        return plan

    plan = _prepared("reduce_scatter_fused_add_rmsnorm", validate, layout, group, partials, positions, prepare)
    if residual is None:
        reduced = plan.run(_values(partials), None, device_counts, positions)
        return plans.norm_in_place(reduced, None, _values(weight), float(eps))
    y, _ = plan.run_norm(_values(partials), _values(residual), _values(weight), float(eps), device_counts, positions)
    return y, residual


def reduce_scatter_buffer(like, layout, group=None, *, compact=False, backend="auto", positions=None):
    """``nsa_cp.cp_reduce_scatter_buffer`` (eager): the plan of the reduce-scatter that will follow."""
    plan = plans.scatter_plan("cp_reduce_scatter", like, layout, group, compact, None, "auto", backend, None, positions,
                              name="like")
    return plan.buffer()
