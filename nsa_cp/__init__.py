"""nsa_cp: pad-aware context-parallel all-gather / reduce-scatter for uneven shards."""

__version__ = "0.1.0"

from .layout import ShardLayout

__all__ = ["ShardLayout", "__version__"]
