"""Adapters to serving frameworks. None imports its framework at load: ``nsa_cp.integrations.sglang``
works on duck-typed objects with SGLang's field names and touches SGLang only when its plugin registers,
in ``install()``, and in runtime lookups when the moves run; ``nsa_cp.integrations.vllm`` likewise for
vLLM. What both share: ``core`` (the plugin record, its install path and undo handle), ``state`` (the
per-process state, the ``status()`` schema, the transport a worker creates) and ``moves`` (the moves on a
rank's padded rows)."""

from . import core, moves, sglang, state, vllm

__all__ = ["core", "moves", "state", "sglang", "vllm"]
