"""The overlapped boundary's plan: its request checked once, its transport chosen once, then cached.

``lookup(req)`` finds (or builds) the :class:`OverlapPlan` of an ``OverlapRequest`` in the plan cache of
nsa_cp/planning/plan.py. A plan asks the transports in the planner's order (nsa_cp/transport/base.py) for an
overlapped boundary: a transport that has one says whether it serves the request (``serves_overlap``) and
builds the call's ``start(x) -> pipeline`` (``overlap``); the first yes wins, ``backend=`` insists on one.
The torch.distributed transport (point-to-point, SM-driven on NCCL, host-staged on gloo) serves every
request and is asked last; the P2P transport's pipeline pulls rows with the copy engine. ``declined`` keeps
each earlier transport's reason (``nsa_cp.explain``).

``start(req, x, error, validate, timeout_ms)`` runs the rank agreement when asked (one all-reduce naming the argument that
differs) and starts the pipeline; ``finish`` agrees, when asked, on whether the consumer returned ``TopK``
(only known once it ran), then returns the sum.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from . import plan as plans, validation
from .route import choose
from ..errors import LayoutMismatchError
from ..geometry.stage import OVERLAPPED_BOUNDARY
from ..support import Support
from ..transport import groups
from .request import OverlapRequest

__all__ = ["OverlapPlan", "start", "lookup", "CALL"]

logger = logging.getLogger("nsa_cp")

CALL = OVERLAPPED_BOUNDARY.name


class OverlapPlan:
    """One overlapped boundary's choices: ``backend`` (the transport's name), ``mechanism`` (how its bytes
    move, in words), ``declined`` (``(name, reason)`` of the transports asked before it) and the transport's
    ``start(x) -> pipeline``."""

    __slots__ = ("request", "backend", "mechanism", "declined", "_start")

    def __init__(self, req: OverlapRequest, pg):
        def ask(transport):
            if not callable(getattr(transport, "overlap", None)):
                return Support.no("this transport has no overlapped boundary"), None
            verdict = transport.serves_overlap(req)
            return verdict, (transport.overlap(req) if verdict else None)

        self.request = req
        self.backend, _, (self._start, self.mechanism), self.declined = choose(req.call, pg, ask)
        logger.debug("nsa_cp plan: %s on %s (%s)", CALL, self.backend, self.mechanism)

    def explain(self) -> str:
        lines = [f"{CALL}: backend {self.backend!r} ({self.mechanism})"]
        lines += [f"  declined by {name!r}: {reason}" for name, reason in self.declined]
        return "\n".join(lines)


def lookup(req: OverlapRequest) -> OverlapPlan:
    """The cached plan of ``req`` (the planner's cache, keyed as every plan is)."""
    return plans.lookup(req, OverlapPlan)


def start(req: OverlapRequest, x: torch.Tensor, local_error: Optional[ValueError], validate: Optional[bool],
          timeout_ms: int):
    """The call's pipeline, started (its rows posted or pulling), after the rank agreement when asked
    (``validate``; None: NSA_CP_VALIDATE). ``local_error``: this rank's ValueError from its argument checks,
    raised here (with validation every rank raises together, before any byte moves)."""
    if validate is None:
        validate = plans.validate_default()
    plan = None
    if local_error is None:
        try:
            plan = lookup(req)
        except ValueError as err:
            local_error = err
    if validate:
        rank, size = groups.group_rank_and_size(req.group)
        device = x.device if isinstance(x, torch.Tensor) else torch.device("cpu")
        validation.agree_on_fields(CALL, req.fields(), req.group, rank, size, device, local_error)
    elif local_error is not None:
        raise local_error
    return plan, plan._start(x, timeout_ms)


def finish(req: OverlapRequest, pipeline, shared, topk: bool, validate: Optional[bool]) -> torch.Tensor:
    """The pipeline's result. With validation, one all-reduce first on whether the consumer returned TopK; where
    the ranks disagree the pipeline still completes (the transport stays usable), then every rank raises
    LayoutMismatchError naming it."""
    if validate is None:
        validate = plans.validate_default()
    mismatch = None
    if validate:
        rank, size = groups.group_rank_and_size(req.group)
        device = shared.device if shared is not None else pipeline.device
        try:
            validation.agree_on_fields(CALL, {"consumer output (TopK or a tensor)": "TopK" if topk else "tensor"},
                                       req.group, rank, size, device, None)
        except LayoutMismatchError as err:
            mismatch = err
        except BaseException:
            pipeline.abort()
            raise
    result = pipeline.finish(shared)
    if mismatch is not None:
        raise mismatch
    return result
