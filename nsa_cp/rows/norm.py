"""RMSNorm with the SGLang / vLLM calling convention and the numerics of docs/design.md ("The fused layer boundary").

``norm(x) -> y``; ``norm(x, residual) -> (y, residual)``:

- ``s = x + residual`` in fp32; ``residual`` is overwritten IN PLACE with ``s`` rounded to its dtype and
  returned (the same tensor object);
- ``y = s * rsqrt(mean(s^2) + eps) * weight`` in fp32 (weight read as fp32), rounded once to x's dtype;
- x itself is never modified.

Implementations, chosen per call (the first use of each is logged once on the "nsa_cp" logger):

- flashinfer (``pip install nsa_cp[flashinfer]``): ``flashinfer.norm.rmsnorm`` / ``fused_add_rmsnorm``
  when flashinfer imports and the call suits it: CUDA, bf16/fp16, x and residual contiguous, weight of
  x's dtype (flashinfer reads the weight as x's element type). Its fused kernel follows the same
  convention: it sums in fp32, stores the rounded sum as the residual and computes the statistics and
  y from the fp32 sum (kept in shared memory), weight as fp32. Two differences, both below one ulp of
  the output dtype before its rounding: ``rsqrt`` is the hardware approximation (a few fp32 ulps) and
  the sum of squares is a warp-tree reduction. Its fused kernel writes y into its input, so this module
  hands it a copy of x (x stays unmodified).
- Triton (``nsa_cp.rows.kernels.norm_rows``) on other CUDA tensors (fp32, a weight of another dtype, strided
  rows): the reference's arithmetic with correctly rounded division and square root; it differs from
  the reference only through the order of the sum of squares.
- torch (``nsa_cp.rows.reference.fused_add_rmsnorm``) on CPU, and where neither kernel applies.

``impl=`` ("auto", "flashinfer", "triton", "torch") forces one; a forced one that cannot serve the call
raises ValueError saying why.

Autograd: the norm works on values, as in serving. ``weight`` is an ``nn.Parameter`` that requires grad
(as in any model); every implementation reads it (and x, residual) detached under ``no_grad``, so no
graph is recorded and the in-place residual update is allowed. Do not train through this module.
"""

from __future__ import annotations

import functools
import logging
from typing import Optional, Tuple, Union

import torch
from torch import nn

from . import reference
from ..support import Support

__all__ = ["RMSNorm", "flashinfer_norm_module", "fused_add_rmsnorm_into", "norm_in_place"]

logger = logging.getLogger("nsa_cp")

_IMPLS = ("auto", "flashinfer", "triton", "torch")
_logged: set = set()


@functools.lru_cache(maxsize=None)
def flashinfer_norm_module():
    """``flashinfer.norm`` when flashinfer imports here, else None (the reason is logged once)."""
    try:
        import flashinfer.norm as fi_norm  # noqa: PLC0415 (optional dependency, imported on first use)
    except Exception as exc:  # ImportError, or a broken install (missing CUDA libraries, ABI)
        logger.info("nsa_cp.RMSNorm: flashinfer not usable (%s: %s)", type(exc).__name__, exc)
        return None
    return fi_norm


# Up to this many bytes a copy + flashinfer's norm beats the one Triton kernel (flashinfer's launch costs
# less host time); above it the layer is device-bound and the one kernel wins (docs/performance.md).
_COPY_THEN_NORM_MAX_BYTES = 32 << 20


def fused_add_rmsnorm_into(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float,
                           out: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The add + RMSNorm of local rows ``x [n, H]`` into ``out [n, H]`` (which may be ``x`` itself when the
    caller gives x up): ``(out, residual)``, residual updated in place. For the library's own norms
    (a slot of the NCCL gather buffer, the rows a reduce-scatter returned).

    flashinfer where it imports and suits (CUDA bf16/fp16 contiguous rows, weight of x's dtype, n > 0):
    its launch costs a fraction of a Triton launch's host time; within one ulp of the Triton kernel.
    Its fused kernel works in place, so writing into another ``out`` costs a copy first: past
    ``_COPY_THEN_NORM_MAX_BYTES`` of rows that extra pass outweighs the launch, and the Triton kernel (one
    pass) serves. Otherwise the Triton kernel on CUDA, the reference on CPU.
    """
    if (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype and x.shape[0]
            and x.is_contiguous() and out.is_contiguous()
            and (residual is None or residual.is_contiguous())
            and (out is x or residual is None or x.numel() * x.element_size() < _COPY_THEN_NORM_MAX_BYTES)
            and flashinfer_norm_module() is not None):
        fi = flashinfer_norm_module()
        if residual is None:
            fi.rmsnorm(x, weight, eps, out=out)
        else:
            if out is not x:
                out.copy_(x)
            fi.fused_add_rmsnorm(out, residual, weight, eps)  # out <- y, residual <- x + residual
        return out, residual
    if x.is_cuda:
        from .kernels import norm_rows as norm_kernels

        norm_kernels.fused_add_rmsnorm(x, residual, weight, eps, out=None if out is x else out)
        return out, residual
    y, _ = reference.fused_add_rmsnorm(x, residual, weight, eps)
    out.copy_(y)
    return out, residual


def norm_in_place(h: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                  eps: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """The add + RMSNorm after a reduce-scatter that did not fuse it, on this rank's reduced rows
    ``h [n_r, H]`` (private to the call, so overwritten): ``(y, residual)``, residual updated in place;
    with ``residual=None``, ``y = rmsnorm(h)`` and ``h`` is the residual (kept)."""
    if not h.is_cuda:
        return reference.fused_add_rmsnorm(h, residual, weight, eps)
    if residual is None:
        y, _ = fused_add_rmsnorm_into(h, None, weight, eps, out=torch.empty_like(h))
        return y, h
    return fused_add_rmsnorm_into(h, residual, weight, eps, out=h)  # y overwrites h


def norm_before(move):
    """A plain gather's ``run(x, outs, dc, pos, norm_args)`` after the add + RMSNorm kernel (for a transport
    that cannot fuse the norm): the normed rows ``y [n_r, H]`` move, the residual is updated in place."""
    def run(x, outs, dc, pos, norm_args):
        y, _ = fused_add_rmsnorm_into(x, *norm_args, out=torch.empty_like(x))
        return move(y, outs, dc, pos, None)
    return run


def norm_after(move):
    """A reduce-scatter's ``run(y, out, dc, pos)`` followed by ``norm_in_place`` of its result (for a
    transport that did not fuse the norm): ``run(y, out, dc, pos, norm_args) -> (normed, residual)``."""
    return lambda y, out, dc, pos, norm_args: norm_in_place(move(y, None, dc, pos), *norm_args)


def _log_choice(impl: str, why: str) -> None:
    if impl not in _logged:
        _logged.add(impl)
        logger.info("nsa_cp.RMSNorm: using %s (%s)", impl, why)


def _kernel_rows(t: torch.Tensor) -> Optional[torch.Tensor]:
    """``t [..., H]`` as a ``[rows, H]`` view with unit inner stride, or None when no such view exists."""
    if t.dim() == 2 and (t.shape[1] <= 1 or t.stride(1) == 1):
        return t
    if not t.is_contiguous():
        return None
    return t.view(-1, t.shape[-1])


class RMSNorm(nn.Module):
    """``y = x / sqrt(mean(x^2) + eps) * weight`` over the last dim (size ``hidden_size``).

    Args:
        hidden_size: H.
        eps: epsilon; also exposed as ``variance_epsilon`` (SGLang / vLLM's name).
        dtype, device: of ``weight`` (``nn.Parameter [H]``, initialised to ones).
        impl: "auto" (flashinfer, then Triton, then torch, as the call allows), or one of them forced.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        dtype: Optional[torch.dtype] = None,
        device=None,
        impl: str = "auto",
    ):
        super().__init__()
        if hidden_size < 1:
            raise ValueError(f"hidden_size: expected an int >= 1, got {hidden_size}")
        if impl not in _IMPLS:
            raise ValueError(f"impl: expected one of {_IMPLS}, got {impl!r}")
        self.hidden_size = hidden_size
        self.eps = eps
        self.impl = impl
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))

    @property
    def variance_epsilon(self) -> float:
        return self.eps

    @variance_epsilon.setter
    def variance_epsilon(self, value: float) -> None:
        self.eps = value

    # ---- the choice

    def _flashinfer_support(self, x: torch.Tensor, residual: Optional[torch.Tensor]) -> Support:
        """Whether flashinfer can take this call, and why not."""
        if not x.is_cuda:
            return Support.no("x is not on a CUDA device")
        if x.dtype not in (torch.bfloat16, torch.float16):
            return Support.no(f"flashinfer's norm takes bf16/fp16, x is {x.dtype}")
        if self.weight.dtype != x.dtype:
            return Support.no(f"flashinfer reads the weight as x's dtype; weight is {self.weight.dtype}, x {x.dtype}")
        if not x.is_contiguous() or (residual is not None and not residual.is_contiguous()):
            return Support.no("x or residual is not contiguous")
        if x.numel() == 0:
            return Support.no("x has no rows (flashinfer would launch an empty grid)")
        if flashinfer_norm_module() is None:
            return Support.no("flashinfer does not import (see the log)")
        return Support.yes()

    def _triton_support(self, x: torch.Tensor, residual: Optional[torch.Tensor]) -> Support:
        if not x.is_cuda:
            return Support.no("x is not on a CUDA device")
        from .kernels import triton_available

        if not triton_available():
            return Support.no("Triton is not installed")
        if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return Support.no(f"the Triton kernel takes bf16/fp16/fp32, x is {x.dtype}")
        if self.hidden_size > 65536:
            return Support.no(f"rows of {self.hidden_size} elements exceed the Triton kernel's 65536")
        if _kernel_rows(x) is None or (residual is not None and _kernel_rows(residual) is None):
            return Support.no("x or residual has no [rows, H] view")
        return Support.yes()

    def _choose(self, x: torch.Tensor, residual: Optional[torch.Tensor]) -> str:
        if self.impl == "torch":
            return "torch"
        verdict = None
        for name, support, why in (("flashinfer", self._flashinfer_support, "CUDA bf16/fp16 contiguous rows"),
                                   ("triton", self._triton_support, "CUDA tensors flashinfer does not take")):
            if self.impl not in ("auto", name):
                continue
            verdict = support(x, residual)
            if verdict:
                _log_choice(name, why)
                return name
            if self.impl == name:
                raise ValueError(f"impl: {name!r} cannot serve this call: {verdict.reason}")
        _log_choice("torch", verdict.reason)
        return "torch"

    # ---- the call

    def forward(
        self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        if x.dim() < 1 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x: expected last dim {self.hidden_size}, got shape {list(x.shape)}")
        if residual is not None:
            if residual.shape != x.shape:
                raise ValueError(f"residual: expected shape {list(x.shape)} (x's), got {list(residual.shape)}")
            if residual.dtype != x.dtype or residual.device != x.device:
                raise ValueError(
                    f"residual: expected {x.dtype} on {x.device} (x's), got {residual.dtype} on {residual.device}"
                    f" (shape {list(residual.shape)})"
                )
        if self.weight.device != x.device:
            raise ValueError(f"x: expected device {self.weight.device} (weight's), got {x.device} (shape {list(x.shape)})")
        impl = self._choose(x, residual)
        with torch.no_grad():
            weight = self.weight.detach()
            xd = x.detach()
            rd = residual.detach() if residual is not None else None
            if impl == "flashinfer":
                y = self._flashinfer(xd, rd, weight)
            elif impl == "triton":
                y = self._triton(xd, rd, weight)
            else:
                y, _ = reference.fused_add_rmsnorm(xd, rd, weight, self.eps)
        return y if residual is None else (y, residual)

    def _flashinfer(self, x, residual, weight):
        fi = flashinfer_norm_module()
        x2 = x.view(-1, self.hidden_size)
        if residual is None:
            return fi.rmsnorm(x2, weight, self.eps).view(x.shape)
        y = x2.clone()  # flashinfer's fused kernel writes y over its input
        fi.fused_add_rmsnorm(y, residual.view(-1, self.hidden_size), weight, self.eps)
        return y.view(x.shape)

    def _triton(self, x, residual, weight):
        from .kernels import norm_rows as norm_kernels

        x2 = _kernel_rows(x)
        out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
        norm_kernels.fused_add_rmsnorm(
            x2, None if residual is None else _kernel_rows(residual), weight, self.eps, out=out
        )
        return out.view(x.shape)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}" + ("" if self.impl == "auto" else f", impl={self.impl!r}")
