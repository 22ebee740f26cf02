"""The intranode P2P transport (design record: docs/design.md, "The P2P transport"), by job:

* ``transport``: ``P2PTransport``, its support verdicts and the runners the plan calls;
* ``buffers``: rendezvous, peer-mapped allocation, pointer tables, the error record, the native state;
* ``memory``: can this group use P2P (``p2p_unavailable_reason``), and how buffers are mapped;
* ``errors``: ``P2PError``, ``P2PTimeoutError``, ``LayoutMismatchError`` and the text of a device-side
  error record;
* ``routes``: the planner's side of ``P2PTransport`` (its verdict and routes: the transport seam);
* ``registry``: one transport per group (``init_p2p``, ``get_p2p``, ``destroy_p2p``; ``generation`` is
  ``nsa_cp.transport.groups.latest_generation``, the plan-cache key) and ``PROVIDER``, the P2P row's
  provider in nsa_cp/transports.py.

This package re-exports their public names (``nsa_cp`` and the communicator import them from here).
"""

from __future__ import annotations

from .errors import LayoutMismatchError, P2PError, P2PTimeoutError, describe_error
from .memory import p2p_unavailable_reason
from .registry import any_registered, destroy_p2p, generation, get_p2p, init_p2p
from .transport import P2PTransport

__all__ = [
    "P2PTransport", "P2PError", "P2PTimeoutError", "LayoutMismatchError", "describe_error", "p2p_unavailable_reason", "init_p2p",
    "get_p2p", "destroy_p2p", "any_registered", "generation",
]
