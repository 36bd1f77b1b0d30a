"""One decision for every rank of an engine (tensor parallelism; engine process only).

With TP each GPU of an engine runs its own scheduler process; SGLang keeps them in lockstep
by giving every rank the same inputs each loop iteration, so a switch request reaches every
rank in the same iteration. What each rank then sees of its drain is its own (a rank's KV
transfer may finish an iteration later than another's), so the flip is decided jointly: each
loop iteration while a switch is pending, every rank contributes "idle" and "still within the
drain limit", the flags are reduced with MIN over the engine's own TP CPU (gloo) group, and
every rank acts on the same result: all flip in the same iteration, or all give up.
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["all_ranks"]


def all_ranks(flags: Sequence[bool], group: Any) -> list[bool]:
    """Each flag true on every rank of ``group`` (a torch.distributed process group; None or a
    group of one: this rank's flags). A collective: every rank must call it in step."""
    import torch
    import torch.distributed as dist

    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [bool(f) for f in flags]
    t = torch.tensor([int(bool(f)) for f in flags], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return [bool(x) for x in t.tolist()]
