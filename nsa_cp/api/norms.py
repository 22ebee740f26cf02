"""Which norms the communicator accepts, and how it reads them: ``norm_parameters`` (an RMSNorm's weight and
epsilon, for the fused kernels), ``check_norm`` (refused at construction when neither fusable nor callable
with a residual), ``weight_or_ones``."""

from __future__ import annotations

import inspect
from typing import Optional, Tuple

import torch

__all__ = ["norm_parameters", "check_norm", "weight_or_ones"]

_EPS_NAMES = ("variance_epsilon", "eps", "epsilon")


def norm_parameters(norm) -> Optional[Tuple[Optional[torch.Tensor], float]]:
    """``(weight, eps)`` of an RMSNorm the fused kernels can apply in its place, or None.

    Accepted: classes named ``RMSNorm`` or deriving from one (nsa_cp's, SGLang's, vLLM's, ``torch.nn.RMSNorm``:
    ``y = x * rsqrt(mean(x^2) + eps) * weight``) normalising over one dim, with a ``[H]`` tensor ``weight``
    (None for ``torch.nn.RMSNorm(elementwise_affine=False)``: a weight of ones) and a float epsilon named
    ``variance_epsilon``, ``eps`` or ``epsilon``, without a bias or partial variance
    (``variance_size_override``). ``torch.nn.RMSNorm``'s ``eps=None`` is the epsilon torch then uses:
    ``torch.finfo`` of its computation type, float32 for bf16 / fp16 / fp32 inputs. Other classes (e.g.
    Gemma's ``1 + weight``, LayerNorm) are not fused.
    """
    if not any(cls.__name__ == "RMSNorm" for cls in type(norm).__mro__):
        return None
    if getattr(norm, "variance_size_override", None) is not None or getattr(norm, "bias", None) is not None:
        return None
    weight = getattr(norm, "weight", None)
    is_torch_norm = isinstance(norm, getattr(torch.nn, "RMSNorm", ()))
    if is_torch_norm and len(norm.normalized_shape) != 1:
        return None  # normalises over several dims: not a row norm
    if weight is None and not is_torch_norm:
        return None
    if weight is not None and (not isinstance(weight, torch.Tensor) or weight.dim() != 1):
        return None
    eps = next((getattr(norm, n) for n in _EPS_NAMES if hasattr(norm, n)), None)
    if eps is None and is_torch_norm:
        eps = torch.finfo(torch.float32).eps  # what torch.rms_norm adds for eps=None (its fp32 opmath)
    if isinstance(eps, bool) or not isinstance(eps, (float, int)):
        return None
    return weight, float(eps)


def _takes_residual(norm) -> bool:
    """Whether ``norm(x, residual)`` binds (the SGLang convention); True when the signature cannot be read."""
    fn = norm.forward if isinstance(norm, torch.nn.Module) else norm
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return True
    try:
        signature.bind(None, None)
    except TypeError:
        return False
    return True


def check_norm(name: str, norm) -> Tuple[Optional[Tuple[Optional[torch.Tensor], float]], bool]:
    """``(norm_parameters(norm), takes_residual)``; a norm the communicator can neither fuse nor call with
    a residual is refused here, at construction, instead of failing at the first layer."""
    params = norm_parameters(norm)
    takes_residual = callable(norm) and _takes_residual(norm)
    if params is None and not takes_residual:
        why = "not callable" if not callable(norm) else "its call takes no residual"
        raise ValueError(
            f"{name}: expected an RMSNorm exposing `weight` and an epsilon (`eps` or `variance_epsilon`: "
            "nsa_cp.RMSNorm, torch.nn.RMSNorm, SGLang's or vLLM's RMSNorm), or a callable with the convention "
            f"norm(x) -> y, norm(x, residual) -> (y, residual); got {type(norm).__name__} ({why})")
    return params, takes_residual


def weight_or_ones(weight: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """The norm's weight, or ones ``[H]`` (fp32, on like's device) for a norm without one."""
    return weight if weight is not None else torch.ones(like.shape[-1], dtype=torch.float32, device=like.device)
