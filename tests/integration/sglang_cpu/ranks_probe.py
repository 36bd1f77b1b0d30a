"""Two ranks of one engine deciding a switch's flip together (``engine_patch/ranks.py``), in
two processes joined by a real torch.distributed gloo group, as SGLang's TP ranks are: each
runs the patch's ``SwitchController.tick`` once per "loop iteration" over a scheduler whose
drain ends at a different iteration per rank (``IDLE_AT``). Prints one JSON line per rank.

    python ranks_probe.py RANK PORT agree|alone drain|timeout
"""

from __future__ import annotations

import json
import sys
import time

import torch.distributed as dist

from evinfra.engine_patch import switch

rank, port, mode, case = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
IDLE_AT = {"drain": (2, 5), "timeout": (2, 10**9)}[case][rank]
STEPS = 8

dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=2)
group = dist.new_group([0, 1], backend="gloo")


class Scheduler:
    step = 0
    tp_cpu_group = group if mode == "agree" else None

    def is_fully_idle(self) -> bool:
        return self.step >= IDLE_AT


s = Scheduler()
ctl = switch.SwitchController(s, drain_timeout_s=0.25 if case == "timeout" else 60.0)
ctl.pending = switch._Pending(None, "prefill", "decode", 1, 0)
events = []
ctl._flip = lambda p, t_idle: events.append(("flip", s.step)) or True
ctl._finish = lambda p, ok, **kw: events.append(("gave_up", s.step))
for step in range(STEPS):
    s.step = step
    if ctl.pending is not None and ctl.tick():
        ctl.pending = None
    if events and events[-1][0] == "gave_up":
        ctl.pending = None
    time.sleep(0.1)  # an iteration; the timeout case passes its 0.25 s limit at step 3
    if mode == "agree":
        dist.barrier(group)  # (SGLang's ranks are in step through its input broadcast)
print("PROBE " + json.dumps({"rank": rank, "events": events}), flush=True)
dist.destroy_process_group()
