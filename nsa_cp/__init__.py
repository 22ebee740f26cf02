"""nsa_cp: pad-aware context-parallel all-gather / reduce-scatter for uneven shards.

Public API (see README.md and ../shared/DESIGN.md for the contract):

* ``ShardLayout``: per-rank token counts and the padded / compact layouts they define.
* ``cp_all_gather`` / ``cp_reduce_scatter``: the collectives over any torch.distributed group.
* ``in_seq_split`` / ``in_seq_positions`` / ``in_seq_restore_index``: the page-aligned zigzag split.
* ``NSACPLayerCommunicator`` and ``RMSNorm``: the per-layer glue for a FULL-mode MoE.
* ``init_p2p``: the intranode P2P transport (symmetric memory + nsa_cp._C) for a group.
"""

__version__ = "0.1.0"

import logging as _logging

from . import ops as _ops  # noqa: F401  registers torch.ops.nsa_cp.* (for graphs loaded by torch.export and friends)
from .collectives import cp_all_gather, cp_reduce_scatter
from .communicator import NSACPLayerCommunicator
from .layout import ShardLayout
from .norm import RMSNorm
from .split import in_seq_positions, in_seq_restore_index, in_seq_split
from .transport.p2p import P2PError, P2PTimeoutError, destroy_p2p, get_p2p, init_p2p
from .validation import LayoutMismatchError
from .workspace import workspace_bytes

_logging.getLogger(__name__).addHandler(_logging.NullHandler())

__all__ = [
    "ShardLayout",
    "cp_all_gather",
    "cp_reduce_scatter",
    "in_seq_split",
    "in_seq_positions",
    "in_seq_restore_index",
    "NSACPLayerCommunicator",
    "RMSNorm",
    "init_p2p",
    "get_p2p",
    "destroy_p2p",
    "P2PError",
    "P2PTimeoutError",
    "LayoutMismatchError",
    "workspace_bytes",
    "__version__",
]
