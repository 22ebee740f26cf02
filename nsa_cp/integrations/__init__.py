"""Adapters to serving frameworks. None imports its framework at load: ``nsa_cp.integrations.sglang``
works on duck-typed objects with SGLang's field names and touches SGLang only in ``install()``."""

from . import sglang

__all__ = ["sglang"]
