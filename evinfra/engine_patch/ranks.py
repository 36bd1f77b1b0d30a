"""One decision for every rank of an engine (tensor parallelism; engine process only).

With TP each GPU of an engine runs its own scheduler process; SGLang keeps them in lockstep
by giving every rank the same inputs each loop iteration, so a switch request, a request's
arrival or a peer's lease reaches every rank in the same iteration. What each rank then sees
of its own I/O is its own (a rank's KV transfer, its read of a peer's shard, its load into
device memory may finish an iteration later than another's, or fail on one rank only), so
what would change the ranks' radix trees or queues is decided jointly: each loop iteration,
every rank contributes its numbers, they are reduced with MIN over the engine's own TP CPU
(gloo) group, and every rank acts on the same result:

* the switch's flip (``switch``): "idle" and "still within the drain limit";
* a fetch (``fetch``): per job, "read done", "pages read", "loaded", "still within the
  fetch limit": the pages every rank read are the ones every rank uses, none if one rank's
  read failed.
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["all_ranks", "gather", "min_over_ranks", "rank_in"]


def _multi(group: Any) -> bool:
    import torch.distributed as dist

    return group is not None and dist.is_initialized() and dist.get_world_size(group) > 1


def min_over_ranks(values: Sequence[int], group: Any) -> list[int]:
    """Each value's minimum over the ranks of ``group`` (a torch.distributed process group;
    None or a group of one: this rank's values). A collective: every rank must call it in
    step, with as many values."""
    if not _multi(group):
        return [int(v) for v in values]
    import torch
    import torch.distributed as dist

    t = torch.tensor([int(v) for v in values], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return [int(x) for x in t.tolist()]


def all_ranks(flags: Sequence[bool], group: Any) -> list[bool]:
    """Each flag true on every rank of ``group`` (see :func:`min_over_ranks`)."""
    return [bool(x) for x in min_over_ranks([bool(f) for f in flags], group)]


def rank_in(group: Any) -> int:
    """This process's rank in ``group`` (0 without one)."""
    if not _multi(group):
        return 0
    import torch.distributed as dist

    return dist.get_rank(group)


def gather(obj: Any, group: Any) -> list:
    """Every rank's ``obj``, in rank order, over ``group`` (a collective; once, at start)."""
    if not _multi(group):
        return [obj]
    import torch.distributed as dist

    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
