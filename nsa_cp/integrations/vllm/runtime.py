"""vLLM's runtime state, looked up when asked (never at import), for the moves and the plugin.

Contract: :func:`pcp_group` (vLLM's PCP ``GroupCoordinator``), :func:`pcp_device_group` (its torch group),
:func:`pcp_rank` and :func:`pcp_size` assume vLLM's distributed state is set up (the MoE runs); the
others answer without raising where vLLM is not installed or not set up yet:
:func:`forward_context` (None outside a forward), :func:`pcp_group_or_none`, :func:`vllm_version`;
:func:`warn_if_untested` logs a warning when the installed vLLM is not :data:`TESTED_VLLM`.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Optional

logger = logging.getLogger("nsa_cp")

TESTED_VLLM = "0.33.0"


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


def warn_if_untested(version: Optional[str]) -> None:
    if version is not None and version != TESTED_VLLM:
        logger.warning("nsa_cp: vLLM %s is installed; the vLLM plugin was tested against %s", version, TESTED_VLLM)
