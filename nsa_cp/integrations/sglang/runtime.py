"""SGLang's runtime state, looked up when asked (never at import), for the adapter and the plugin.

Contract: every function answers without raising where SGLang is not installed or not set up yet (the
plugin loads before SGLang's distributed init):

* :func:`attn_cp_group` -> SGLang's attention-CP ``GroupCoordinator``, or None;
* :func:`attn_dp_size` -> ``get_parallel().attn_dp_size``, or 1 (no attention DP);
* :func:`attn_tp_size` -> ``get_parallel().attn_tp_size``, or 1;
* :func:`cp_gathers_over_attn_cp` -> SGLang's own ``_cp_gathers_over_attn_cp()`` (DSA / MLA prefill CP), or
  False;
* :func:`cp_align` -> the row multiple SGLang pads each CP shard to (``2 * cp`` zigzag, ``cp`` interleave);
* :func:`sglang_version` -> the installed SGLang's version string, or None (what nsa_cp serves is decided
  by SGLang's code, not its version: ``contract``).
"""

from __future__ import annotations

import sys
from typing import Any, Optional



def _parallel() -> Any:
    from sglang.srt.runtime_context import get_parallel

    return get_parallel()


def attn_cp_group():
    """SGLang's attention-CP GroupCoordinator, or None where SGLang is not importable or not set up."""
    try:
        return _parallel().attn_cp_group
    except Exception:  # noqa: BLE001  not installed, not initialised: the caller falls back
        return None


def attn_dp_size() -> int:
    """SGLang's attention-DP size; 1 where SGLang is not importable or has not published it."""
    try:
        return int(_parallel().attn_dp_size)
    except Exception:  # noqa: BLE001  not SGLang, or not published: no attention DP
        return 1


def attn_tp_size() -> int:
    """SGLang's attention-TP size; 1 where SGLang is not importable or has not published it."""
    try:
        return int(_parallel().attn_tp_size)
    except Exception:  # noqa: BLE001
        return 1


def cp_gathers_over_attn_cp() -> bool:
    """Whether SGLang's CP extends gather the MoE input over the attention-CP group (its own predicate)."""
    try:
        from sglang.srt.layers.layer_boundary.layout import _cp_gathers_over_attn_cp

        return bool(_cp_gathers_over_attn_cp())
    except Exception:  # noqa: BLE001  not SGLang, or not configured: not this path
        return False


def cp_align(cp_size: int) -> int:
    """The multiple SGLang pads every CP shard to (``cp/padding.get_cp_padding_align_size``)."""
    try:
        from sglang.srt.layers.cp.padding import get_cp_padding_align_size

        return int(get_cp_padding_align_size())
    except Exception:  # noqa: BLE001  the larger of SGLang's two alignments
        return 2 * cp_size


def sglang_version() -> Optional[str]:
    """The installed distribution's version, else the imported module's ``__version__``, else None."""
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:  # noqa: BLE001
        return getattr(sys.modules.get("sglang"), "__version__", None)
