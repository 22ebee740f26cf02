"""RMSNorm with the SGLang / vLLM calling convention.

``norm(x)`` returns ``y``; ``norm(x, residual)`` returns ``(y, x + residual)`` where y normalises the sum.
Statistics are computed in fp32 and the result is cast back to the input dtype.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import nn

__all__ = ["RMSNorm"]


class RMSNorm(nn.Module):
    """``y = x / sqrt(mean(x^2) + eps) * weight`` over the last dim (size ``hidden_size``)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: Optional[torch.dtype] = None, device=None):
        super().__init__()
        if hidden_size < 1:
            raise ValueError(f"hidden_size: expected an int >= 1, got {hidden_size}")
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        variance = x32.pow(2).mean(dim=-1, keepdim=True)
        return (x32 * torch.rsqrt(variance + self.eps) * self.weight.float()).to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        if x.shape[-1] != self.hidden_size:
            raise ValueError(
                f"x: expected last dim {self.hidden_size}, got shape {list(x.shape)}"
            )
        if residual is None:
            return self._normalize(x)
        if residual.shape != x.shape:
            raise ValueError(f"residual: expected shape {list(x.shape)} (x's), got {list(residual.shape)}")
        summed = x + residual
        return self._normalize(summed), summed

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"
