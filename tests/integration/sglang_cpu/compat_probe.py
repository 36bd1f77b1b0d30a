"""Run SGLang's own plugin loader, as an engine's server process does, with the evinfra patch
enabled on a real or a deliberately broken SGLang; print what happened as one JSON line
(run by ``test_engine_patch_compat.py`` with the SGLang venv's interpreter).

    python compat_probe.py ok|version|target
"""

from __future__ import annotations

import json
import sys

mode = sys.argv[1]
if mode == "version":
    import sglang.version

    sglang.version.__version__ = "0.6.0"  # a newer SGLang than the patch knows
elif mode == "target":
    from sglang.srt.managers.scheduler import Scheduler

    del Scheduler.process_batch_result  # a hook target that moved
from sglang.srt.plugins import load_plugins  # noqa: E402
from sglang.srt.plugins.hook_registry import HookRegistry  # noqa: E402

out = {"exit": None}
try:
    load_plugins()
except SystemExit as exc:
    out["exit"] = str(exc)
out["hooks"] = sorted(
    t for t, hooks in HookRegistry._hooks.items()
    if any(getattr(h, "__module__", "").startswith("evinfra.engine_patch")
           for _, h, _ in hooks))
out["patched"] = sorted(t for t in HookRegistry._patched if t in out["hooks"])
print("PROBE " + json.dumps(out), flush=True)
