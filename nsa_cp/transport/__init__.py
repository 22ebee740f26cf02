"""How bytes move between ranks, and the transports' lifecycle.

- ``dist/``: NCCL / gloo through torch.distributed's process groups (the path every call can take), with
  nsa_cp's own NCCL communicator for a group's uneven calls (``dist/nccl.py``: ``init_nccl``);
- ``p2p``: the intranode P2P transport (peer memory + the nsa_cp._C kernels; ``init_p2p``).

The planner asks them through one seam (``base``: the ``Transport`` protocol), in the order of the static
table nsa_cp/transports.py: P2P first, then torch.distributed (``dist``), which serves every call;
``register`` / ``unregister`` add a provider at run time. A provider that makes its transport owns that
lifecycle (``base.Lifecycle``); the one creation policy (``policy``) asks the rows in order and names none;
``close_transports(group)`` closes what the lifecycles made for a group.

The lifecycle helpers live here: ``init_p2p`` / ``get_p2p`` / ``destroy_p2p`` /
``p2p_unavailable_reason``, ``init_nccl`` / ``get_nccl`` / ``destroy_nccl`` / ``nccl_unavailable_reason``
and ``workspace_bytes`` (what ``init_p2p`` allocates). ``nsa_cp`` itself keeps ``init_p2p``, ``init_nccl``
and the two ``*_unavailable_reason`` (the use cases); its other lifecycle names are deprecated aliases.
"""

from ..geometry.workspace import workspace_bytes
from .base import Lifecycle, Route, Sizes, Transport, register, unregister
from .policy import close_transports
from .dist.nccl import destroy_nccl, get_nccl, init_nccl, nccl_unavailable_reason
from .p2p import destroy_p2p, get_p2p, init_p2p, p2p_unavailable_reason

__all__ = ["init_p2p", "get_p2p", "destroy_p2p", "p2p_unavailable_reason", "init_nccl", "get_nccl", "destroy_nccl",
           "nccl_unavailable_reason", "workspace_bytes", "Transport", "Route", "Lifecycle", "Sizes", "register", "unregister",
           "close_transports"]
