"""The transports nsa_cp has, as data: one row each, in the order the planner asks them.

A row names the transport (what ``backend=`` and ``NSA_CP_BACKEND`` insist on) and where its provider lives
(a module and an attribute, imported the first time the planner asks it: nothing here imports a transport).
The planner (nsa_cp/planning/plan.py) asks the rows in order, after any provider registered at run time
(``nsa_cp.transport.register``), and takes the first whose verdict on a call is yes; the row that
``serves_every_call`` is asked last, serves even layouts under ``backend="auto"`` (the contract: the old
even-shard path) and empty calls. ``envs.NSA_CP_BACKEND`` accepts ``"auto"`` and these names.

Adding a transport is one module (a provider: ``name`` and ``open(req, group)`` returning the group's
``Transport`` or a ``Support.no``; the protocol is nsa_cp/transport/base.py) and one row here. A transport
that has to be made (buffers, a communicator) also owns that lifecycle on its provider (``base.Lifecycle``);
the communicator and the engine plugins then create it through the one creation policy
(nsa_cp/transport/policy.py), which asks these rows in order and names none.
"""

from __future__ import annotations

from typing import NamedTuple, Tuple

__all__ = ["TransportRow", "TRANSPORTS", "names"]


class TransportRow(NamedTuple):
    name: str  # what backend= / NSA_CP_BACKEND insist on
    module: str  # the module holding its provider
    provider: str  # the provider object's name in that module
    serves_every_call: bool = False  # the fallback: asked last, takes even layouts under "auto" and empty calls


TRANSPORTS: Tuple[TransportRow, ...] = (
    TransportRow("p2p", "nsa_cp.transport.p2p.registry", "PROVIDER"),  # one node: peer memory, nsa_cp._C's kernels
    TransportRow("nccl", "nsa_cp.transport.dist.provider", "PROVIDER", serves_every_call=True),  # torch.distributed
)


def names() -> Tuple[str, ...]:
    """The table's transport names, in order."""
    return tuple(row.name for row in TRANSPORTS)
