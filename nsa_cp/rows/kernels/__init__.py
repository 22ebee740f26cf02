"""Row kernels, one family per module; each mirrors a function of ``nsa_cp.rows.reference``.

- ``pack`` / ``compact``: row copies (pack into a padded slot, padded <-> compact). Each holds the Triton
  kernel and dispatches to its native twin in ``nsa_cp._C`` (csrc/row_copy.cu) where that is available for
  the tensors' GPU (``_rows.native_module``, NSA_CP_ROW_KERNELS): the same copies for a fraction of the
  host time per launch.
- ``norm_rows``: fused residual add + RMSNorm, optionally quantized to FP8 (groups of 128), into a padded slot
  with a device-side row count, and the quant-only and local in-place forms (Triton only); ``exact_fp32``
  holds its rounding and FP8 division helpers, ``row_checks`` its argument checks.
Triton is imported lazily: a CPU-only install without Triton still imports nsa_cp and uses the
pure-torch path. ``TRITON_INTERPRET=1`` runs the Triton kernels on CPU tensors (the tests do).
"""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
