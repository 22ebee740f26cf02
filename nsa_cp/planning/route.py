"""Which transport serves a call: the registered transports asked in the table's order
(nsa_cp/transport/base.py), the first whose verdict is yes; ``backend=`` (or NSA_CP_BACKEND) insists on one.
The plans of nsa_cp/planning/plan.py and nsa_cp/planning/overlap.py choose through ``choose``."""

from __future__ import annotations

import logging

from .. import envs
from ..support import Support
from ..transport import base

__all__ = ["choose", "route"]

logger = logging.getLogger("nsa_cp")


def choose(req, pg, ask, providers=None):
    """``(provider_name, transport, answer, declined)``: the first registered transport (in the table's
    order, or ``providers``) whose ``ask(transport) -> (verdict, answer)`` is yes. ``declined``: ``(name,
    reason)`` of those asked before it. ``backend`` (or NSA_CP_BACKEND under "auto") insists on one: its no
    is the ValueError naming the call's input."""
    backend = envs.NSA_CP_BACKEND if req.backend == "auto" else req.backend
    declined = []
    for provider in base.providers() if providers is None else providers:
        if backend != "auto" and provider.name != backend:
            continue
        transport = provider.open(req, pg)
        verdict, answer = (transport, None) if isinstance(transport, Support) else ask(transport)
        if verdict:
            return provider.name, transport, answer, tuple(declined)
        if backend != "auto":
            raise ValueError(f"backend: {backend!r} cannot serve this call ({req.input_name}): {verdict.reason}")
        declined.append((provider.name, verdict.reason))
        logger.debug("nsa_cp plan: transport %r declined %s: %s", provider.name, req.op, verdict.reason)
    raise ValueError(f"backend: {backend!r} is not a registered transport ({', '.join(base.names())})")


def route(req, pg, stage, gather: bool):
    """``(transport, route)`` of the first transport that serves ``(req, stage)`` (``choose``). Under "auto"
    the even layout keeps torch's collective (the contract). A norm a transport cannot fuse (P2P rows of an
    odd byte size) runs as a kernel of its own before its plain move (``Route.norm`` False)."""
    def ask(transport):
        verdict = transport.serves(req, stage)
        if not verdict and stage.norm and stage.fmt is None:
            return transport.serves(req, stage.unnormed), stage.unnormed
        return verdict, stage

    even = (envs.NSA_CP_BACKEND if req.backend == "auto" else req.backend) == "auto" and req.layout.is_even
    _, transport, serve, _ = choose(req, pg, ask, [base.fallback()] if even else None)
    if not req.layout.total_len:  # nothing moves: the last transport returns the empty results
        transport, serve = base.fallback().open(req, pg), stage
    return transport, (transport.gather(req, serve) if gather else transport.scatter(req, serve))
