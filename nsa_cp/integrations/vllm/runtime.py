"""vLLM's runtime state, looked up when asked (never at import), for the moves and the plugin.

Contract: :func:`pcp_group` (vLLM's PCP ``GroupCoordinator``), :func:`pcp_device_group` (its torch group),
:func:`pcp_rank` and :func:`pcp_size` assume vLLM's distributed state is set up (the MoE runs); the
others answer without raising where vLLM is not installed or not set up yet:
:func:`forward_context` (None outside a forward), :func:`pcp_group_or_none`, :func:`vllm_version`.
:func:`fp8_scales_ue8m0` and :func:`fp8_max` are vLLM's own answers to how its per-token-group FP8
quantizer rounds scales and where it clamps (the contract checks that its quantizer asks the same helpers).
"""

from __future__ import annotations

import sys
from typing import Any, Optional


def pcp_group() -> Any:
    from vllm.distributed.parallel_state import get_pcp_group

    return get_pcp_group()


def pcp_group_or_none() -> Any:
    try:
        return pcp_group()
    except Exception:  # noqa: BLE001  not installed, not initialised: the caller says so
        return None


def pcp_device_group() -> Any:
    return pcp_group().device_group


def pcp_rank() -> int:
    return pcp_group().rank_in_group


def pcp_size() -> int:
    return pcp_group().world_size


def forward_context() -> Optional[Any]:
    """vLLM's current ForwardContext, or None outside a forward."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    return get_forward_context() if is_forward_context_available() else None


def vllm_version() -> Optional[str]:
    module = sys.modules.get("vllm")
    version = getattr(module, "__version__", None) if module is not None else None
    if version is None:
        try:
            from importlib.metadata import version as dist_version

            version = dist_version("vllm")
        except Exception:  # noqa: BLE001  not installed
            return None
    return version


def fp8_scales_ue8m0() -> bool:
    """Whether vLLM's per-token-group FP8 quantizer rounds its scales to powers of two (DeepGEMM's UE8M0): the
    helper its quantizer asks, looked up where the quantizer looks it up."""
    from vllm.model_executor.layers.quantization.utils import fp8_utils

    return bool(fp8_utils.is_deep_gemm_e8m0_used())


def fp8_max() -> float:
    """The bound vLLM's FP8 quantizer clamps to (448 for float8_e4m3fn; 224 for ROCm's fnuz)."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import get_fp8_min_max

    return float(get_fp8_min_max()[1])
