"""A stand-in transport that owns its lifecycle, as a new transport of nsa_cp's would: this module plus one
row of nsa_cp/transports.py (``TransportRow("standin", "lifecycle_transport", "PROVIDER")``), nothing else.

Its provider answers the planner (``open``: the group's transport once its lifecycle made one, else a
``Support.no``) and the creation policy (nsa_cp/transport/base.py's ``Lifecycle``: it can serve any group,
is made for given sizes, kept while they fit, closed). The transport moves CPU rows over gloo as the
loopback transport does (tests/support/loopback_transport.py) and refuses batches larger than it was made
for. ``EVENTS`` records every lifecycle step (``("create", max_tokens_per_rank)``, ``("close",)``), and the
loopback's ``CALLS`` every call that reached it.
"""

from __future__ import annotations

import torch.distributed as dist

from loopback_transport import Loopback
from nsa_cp.support import Support
from nsa_cp.transport.groups import GroupRegistry

EVENTS = []
_MADE = GroupRegistry()  # one per group; put / pop give the planner a new generation (no stale plan)


class StandIn(Loopback):
    def __init__(self, group, sizes):
        super().__init__(group if group is not None else dist.group.WORLD)
        self.sizes, self.closed = sizes, False

    def serves(self, req, stage):
        if self.closed:
            return Support.no("the stand-in transport is closed")
        if req.layout.max_rank_len > self.sizes.max_tokens_per_rank:
            return Support.no(f"the stand-in was made for {self.sizes.max_tokens_per_rank} rows per rank")
        return super().serves(req, stage)


class StandInProvider:
    name = "standin"

    def open(self, req, group):
        transport = _MADE.get(req.group)
        return transport if transport is not None else Support.no("no stand-in transport made for this group")

    # ---- the lifecycle
    def unavailable_reason(self, group, device=None):
        return None

    def current(self, group):
        return _MADE.get(group)

    def fits(self, transport, sizes):
        return transport.sizes.max_tokens_per_rank >= sizes.max_tokens_per_rank \
            and transport.sizes.hidden_size == sizes.hidden_size and transport.sizes.dtype == sizes.dtype

    def create(self, group, sizes):
        transport = StandIn(group, sizes)
        old = _MADE.put(group, transport)
        if old is not None:
            old.closed = True
        EVENTS.append(("create", sizes.max_tokens_per_rank))
        return transport

    def close(self, group):
        transport = _MADE.pop(group)
        if transport is not None:
            transport.closed = True
            EVENTS.append(("close",))

    def describe(self, transport, reason=None):
        if transport is None:
            return {}
        return {"bytes": 0, "max_tokens_per_rank": transport.sizes.max_tokens_per_rank}


PROVIDER = StandInProvider()  # what its row of nsa_cp/transports.py names
