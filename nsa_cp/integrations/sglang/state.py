"""What the SGLang integration did in this process, for :func:`~.plugin.status` and the logs.

Contract: one :data:`STATE` per process (every scheduler has its own), an ``IntegrationState`` of the
engine-independent core (``integrations.core``). Its fields are written by the plugin (registration), the
scheduler hook (the transport) and the moves (fusions, declined batches), and only read by ``status()``.
``count`` / ``record`` / ``once`` / ``transport_decision`` are the core's.
"""

from __future__ import annotations

from ..core import IntegrationState, count, once, record, reset_logged, transport_decision
from ..firstuse import Checks

__all__ = ["STATE", "CHECKS", "IntegrationState", "count", "once", "record", "transport_decision", "reset"]

STATE = IntegrationState()
CHECKS = Checks("SGLang", "SGLang's own CP moves")  # the first-use checks (``check``)


def reset() -> None:
    """A fresh state, in place (tests)."""
    STATE.reset()
    reset_logged()
    CHECKS.reset()
