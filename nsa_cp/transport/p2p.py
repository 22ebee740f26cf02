"""The intranode P2P transport, by job:

* ``p2p_transport``: ``P2PTransport`` (buffers, native state, runners; its docstring is the design record);
* ``p2p_memory``: can this group use P2P (``p2p_unavailable_reason``), and how buffers are mapped;
* ``p2p_errors``: ``P2PError``, ``P2PTimeoutError``, ``LayoutMismatchError`` and the text of a device-side
  error record;
* ``p2p_registry``: one transport per group (``init_p2p``, ``get_p2p``, ``destroy_p2p``, ``generation``).

This module re-exports their public names (``nsa_cp`` and the communicator import them from here).
"""

from __future__ import annotations

from .p2p_errors import LayoutMismatchError, P2PError, P2PTimeoutError, describe_error
from .p2p_memory import p2p_unavailable_reason
from .p2p_registry import any_registered, destroy_p2p, generation, get_p2p, init_p2p
from .p2p_transport import QUANT_FP8, P2PTransport

__all__ = [
    "P2PTransport", "P2PError", "P2PTimeoutError", "LayoutMismatchError", "describe_error", "p2p_unavailable_reason", "init_p2p",
    "get_p2p", "destroy_p2p", "any_registered", "generation", "QUANT_FP8",
]
