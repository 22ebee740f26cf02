"""What the SGLang integration did in this process, for :func:`~.plugin.status` and the logs.

Contract: one :data:`STATE` per process (every scheduler has its own), the plugin record's one
``IntegrationState`` (``integrations.state``). Its fields are written by the install path (registration),
the scheduler hook (the transport) and the moves (fusions, declined batches), and only read by ``status()``.
``count`` / ``record`` / ``once`` / ``declined`` / ``transport_decision`` are ``integrations.state``'s.
"""

from __future__ import annotations

from ..state import IntegrationState, count, declined, once, record, reset_logged, transport_decision
from ..firstuse import Checks

__all__ = ["STATE", "CHECKS", "IntegrationState", "count", "once", "record", "declined", "transport_decision",
           "reset"]

STATE = IntegrationState()
CHECKS = Checks("SGLang", "SGLang's own CP moves")  # the first-use checks (``check``)


def reset() -> None:
    """A fresh state, in place (tests)."""
    STATE.reset()
    reset_logged()
    CHECKS.reset()
