"""Adapters to serving frameworks. None imports its framework at load: ``nsa_cp.integrations.sglang``
works on duck-typed objects with SGLang's field names and touches SGLang only when its plugin registers,
in ``install()``, and in runtime lookups when the moves run."""

from . import sglang

__all__ = ["sglang"]
