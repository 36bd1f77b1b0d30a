"""The global binding of agents to partitions in simulation (paper D.2: "constraints such as
region and hardware bind each user to one partition, and each partition thus serves its own
subset of agents").

Two policies, each a function from the cluster's load to one load per partition:

* ``hash``: user ``u`` of workload ``w`` (the ``u``-th agent slot of a closed loop, the
  ``u``-th arrival of an open one) goes to partition ``H("w-u") mod P``, ``H`` a stable hash,
  as nginx binds an agent's identity in ``serve``. A user keeps its partition through every
  phase of a schedule, and the partitions see one composition, in shares that differ only by
  the draw;
* ``groups``: constraint groups (a region, a hardware kind), each a number of partitions that
  play the group's own schedule, so partitions can see different compositions and shifts.
"""

from __future__ import annotations

import hashlib
from typing import Annotated

import msgspec

from evinfra.core.types import PosInt
from evinfra.errors import ConfigError
from evinfra.workloads import Arrival, Phase

__all__ = ["Group", "bind_arrivals", "bind_groups", "bind_schedule", "partition_of"]


def partition_of(user: str, partitions: int) -> int:
    """The partition of ``user`` (stable across processes and runs)."""
    digest = hashlib.blake2b(user.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % partitions


def bind_schedule(schedule: list[Phase], partitions: int) -> list[list[Phase]]:
    """One closed-loop schedule per partition: each phase's ``n`` users of a workload spread
    by :func:`partition_of`."""
    out: list[list[Phase]] = [[] for _ in range(partitions)]
    for phase in schedule:
        counts = [{w: 0 for w in phase.agents} for _ in range(partitions)]
        for w, n in phase.agents.items():
            for u in range(n):
                counts[partition_of(f"{w}-{u}", partitions)][w] += 1
        for p in range(partitions):
            out[p].append(Phase(phase.duration, counts[p]))
    return out


def bind_arrivals(arrivals: list[Arrival], partitions: int) -> list[list[Arrival]]:
    """One open-loop arrival stream per partition: the ``u``-th arrival of a workload goes
    to :func:`partition_of` ``("w-u")``."""
    out: list[list[Arrival]] = [[] for _ in range(partitions)]
    seen: dict[str, int] = {}
    for a in arrivals:
        u = seen.get(a.workload, 0)
        seen[a.workload] = u + 1
        out[partition_of(f"{a.workload}-{u}", partitions)].append(a)
    return out


class Group(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Partitions bound by one constraint, each playing ``schedule`` (agents per partition)."""

    name: Annotated[str, msgspec.Meta(min_length=1)]
    partitions: PosInt
    schedule: Annotated[list[Phase], msgspec.Meta(min_length=1)]


def bind_groups(groups: list[Group], partitions: int) -> list[tuple[str, list[Phase]]]:
    """``(group name, schedule)`` per partition, the groups' partitions in order."""
    total = sum(g.partitions for g in groups)
    if total != partitions:
        raise ConfigError(f"the groups hold {total} partitions, not the {partitions} of "
                          "--partitions")
    return [(g.name, list(g.schedule)) for g in groups for _ in range(g.partitions)]
