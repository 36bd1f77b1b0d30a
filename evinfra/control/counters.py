"""What the control plane counted since it started (``/v1/evinfra/status``, ``/metrics``,
the simulator's report)."""

from __future__ import annotations

import msgspec

__all__ = ["Counters"]


class Counters(msgspec.Struct, gc=False):
    """``submitted = ok + failed + aborted + rejected`` once nothing is in flight;
    ``refused`` requests were never submitted."""

    submitted: int = 0
    ok: int = 0
    failed: int = 0
    """Ended by the cluster: an engine error, a node lost, a timeout, no node left."""
    aborted: int = 0
    """The client went away."""
    rejected: int = 0
    """The engine refused the request itself (a bad request, not a failure of the cluster)."""
    refused: int = 0
    """No node could take it at submit (HTTP 503)."""
    rerouted: int = 0
    """Routed again after a failure before its prefill started."""
    timeouts: int = 0
    splits: int = 0
    """Splits applied after the warm-up (the planner's or an operator's); the exit from the
    collocated warm-up is not one."""
    switches: int = 0
    """Node phase switches between prefill and decode, counted when the node serves its new
    phase; a node leaving the collocated warm-up does not switch."""
    branches_expired: int = 0
    branches_inferred: int = 0
    requests_chained: int = 0
    branches_joined: int = 0
    compactions_inferred: int = 0
