"""nsa_cp: pad-aware context-parallel all-gather / reduce-scatter for uneven shards (NSA prefill CP).

Public API (README.md; docs/design.md for how it works):

* ``ShardLayout``: per-rank token counts and the padded / compact layouts they define.
* ``cp_all_gather`` / ``cp_reduce_scatter``: the collectives over any torch.distributed group, with the
  ordered gather (``positions=``) and the FP8 wire (``quant=``); ``cp_reduce_scatter_buffer``: where a MoE
  writes its partials.
* ``fused_add_rmsnorm_all_gather`` / ``reduce_scatter_fused_add_rmsnorm``: the fused layer boundary.
* ``quantize(x, quant)`` / ``quant_fp8_g128`` / ``dequant_fp8_g128``: the FP8 wire formats' quantizer (SGLang's
  ``fp8_e4m3_g128``; vLLM's power-of-two ``fp8_e4m3_g128_ue8m0``).
* ``in_seq_split`` / ``in_seq_positions`` / ``in_seq_restore_index``: the page-aligned zigzag split.
* ``NSACPLayerCommunicator`` and ``RMSNorm``: the per-layer glue for a FULL-mode MoE;
  ``mask_padding_topk_ids`` for MoEs that route padding rows; ``nsa_cp.integrations.sglang``: SGLang.
* ``init_p2p``: the intranode P2P transport (symmetric memory + nsa_cp._C) for a group.
* ``init_nccl``: an NCCL communicator owned by nsa_cp._C, for the NCCL path's uneven calls (less host
  time per call than torch's c10d op).
* ``nsa_cp.transport``: the transports' other lifecycle helpers (``get_p2p``, ``destroy_p2p``,
  ``get_nccl``, ``destroy_nccl``, ``workspace_bytes``).
"""

__version__ = "0.2.0"  # the source version: setup.py reads this line and adds +cuXX when it builds nsa_cp._C


def _installed_version(source: str) -> str:
    """The installed distribution's version (``0.2.0+cu13``) when this very package is what it installed,
    else ``source``: a checkout on PYTHONPATH next to some other install keeps its own version."""
    import json
    from importlib import metadata
    from pathlib import Path
    from urllib.parse import unquote, urlparse

    try:
        dist = metadata.distribution("nsa_cp")
    except Exception:  # not installed (a checkout on PYTHONPATH), or unreadable metadata
        return source
    version = dist.version or ""
    if version.split("+")[0] != source:
        return source
    here = Path(__file__).resolve().parent
    try:
        direct = json.loads(dist.read_text("direct_url.json") or "{}")
        if direct.get("dir_info", {}).get("editable"):  # pip install -e: the checkout it points at
            url = urlparse(direct.get("url", ""))
            return version if url.scheme == "file" and Path(unquote(url.path)).resolve() == here.parent else source
        return version if Path(dist.locate_file("nsa_cp/__init__.py")).resolve().parent == here else source
    except Exception:
        return source


__version__ = _installed_version(__version__)

import logging as _logging

from .api import ops as _ops  # noqa: F401  registers torch.ops.nsa_cp.* (for graphs loaded by torch.export and friends)
from .api.collectives import (
    cp_all_gather,
    cp_reduce_scatter,
    cp_reduce_scatter_buffer,
    fused_add_rmsnorm_all_gather,
    reduce_scatter_fused_add_rmsnorm,
)
from .api.boundary import Chunk, TopK, cp_overlapped_boundary, explain
from .api.communicator import NSACPLayerCommunicator
from .geometry.layout import ShardLayout
from .api.moe import mask_padding_topk_ids
from .rows.norm import RMSNorm
from .rows.quant import dequant_fp8_g128, quant_fp8_g128, quantize
from .geometry.split import in_seq_positions, in_seq_restore_index, in_seq_split
from .transport import init_nccl, init_p2p, nccl_unavailable_reason, p2p_unavailable_reason
from .transport.p2p import P2PError, P2PTimeoutError
from .errors import LayoutMismatchError

_logging.getLogger(__name__).addHandler(_logging.NullHandler())

__all__ = [
    "ShardLayout",
    "cp_all_gather",
    "cp_reduce_scatter",
    "cp_reduce_scatter_buffer",
    "cp_overlapped_boundary",
    "explain",
    "Chunk",
    "TopK",
    "fused_add_rmsnorm_all_gather",
    "reduce_scatter_fused_add_rmsnorm",
    "quant_fp8_g128",
    "quantize",
    "dequant_fp8_g128",
    "mask_padding_topk_ids",
    "in_seq_split",
    "in_seq_positions",
    "in_seq_restore_index",
    "NSACPLayerCommunicator",
    "RMSNorm",
    "init_p2p",
    "p2p_unavailable_reason",
    "init_nccl",
    "nccl_unavailable_reason",
    "P2PError",
    "P2PTimeoutError",
    "LayoutMismatchError",
    "__version__",
]

# Names that left the top level (0.2.x: still here, with a DeprecationWarning; gone in 0.3): the
# transports' lifecycle helpers live in nsa_cp.transport, the availability verdict type in nsa_cp.support.
_MOVED = {"get_p2p": "nsa_cp.transport", "destroy_p2p": "nsa_cp.transport", "get_nccl": "nsa_cp.transport",
          "destroy_nccl": "nsa_cp.transport", "workspace_bytes": "nsa_cp.transport", "Support": "nsa_cp.support"}


def __getattr__(name: str):
    home = _MOVED.get(name)
    if home is None:
        raise AttributeError(f"module 'nsa_cp' has no attribute {name!r}")
    import importlib

    import warnings

    warnings.warn(f"nsa_cp.{name} is deprecated: use {home}.{name} (removed from the top level in 0.3)",
                   DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(home), name)
