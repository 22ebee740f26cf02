"""Triton kernels, one family per module; each mirrors a function of ``nsa_cp.reference``.

Triton is imported lazily: a CPU-only install without Triton still imports nsa_cp and uses the
pure-torch path. ``TRITON_INTERPRET=1`` runs these kernels on CPU tensors (the tests do).
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
