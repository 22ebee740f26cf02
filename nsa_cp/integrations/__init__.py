"""Adapters to serving frameworks. None imports its framework at load: ``nsa_cp.integrations.sglang``
works on duck-typed objects with SGLang's field names and touches SGLang only when its plugin registers,
in ``install()``, and in runtime lookups when the moves run; ``nsa_cp.integrations.vllm`` likewise for
vLLM. What both share (the state they report, the transport they create, the moves on a rank's padded
rows): ``nsa_cp.integrations.core``."""

from . import core, sglang, vllm

__all__ = ["core", "sglang", "vllm"]
