"""Simulator cost in CPU instructions, this checkout beside another, measured in one run.

    python -m bench.instructions [--seconds 600] [--nodes 9|64] [--against REV]

Wall time on a shared machine varies by 15-40 % between identical runs of ``bench.sim``,
more than most changes to the simulator's cost. The instructions a run executes do not
(the same code in two checkouts: 0.05 % apart over 600 simulated seconds, 0.2 % over 60,
with a fixed ``PYTHONHASHSEED``): this counts them with valgrind (cachegrind without its
cache model) for one of ``bench.sim``'s ``cc`` runs (9 nodes and 126 agents, or with
``--nodes 64`` 64 nodes and 640 agents) of ``--seconds`` simulated seconds, less those of a
process that only imports and loads the config. With ``--against``
the same is counted in a temporary worktree of REV, all processes at once, and the ratio
printed. Counts compare when both runs played the same requests (a change that keeps the
simulation byte-equal); otherwise compare the instructions per request. Under valgrind a run
takes about 40 times its native time: 600 simulated seconds, about two minutes.

Two caveats:

* the host tiers fill after about 1,000 simulated seconds: the 600-second run evicts no
  host block, the 1,800-second one asks to evict about 640,000. A change to host
  eviction needs ``--seconds 1800`` (about twelve minutes);
* valgrind's CPU has no SHA extensions, so SHA-256 runs in software there: about 13 % of
  the instructions of a 300-second run (callgrind), where ``chain_digests`` takes about
  3 % of a native run (py-spy). A change to hashing reads larger in counts than in wall
  time.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

from bench.sim import RUNS

_REFS = re.compile(r"I\s+refs:\s+([\d,]+)")


class Count(NamedTuple):
    """One checkout's run: requests played and instructions net of start-up."""

    label: str
    requests: int
    instructions: int


# What valgrind runs, in the checkout measured (which need not have this file): bench.sim's
# run, or with 0 seconds only its imports and the config.
_CHILD = """
import logging, sys
# The checkout on PYTHONPATH is measured, not the one an editable install's finder maps.
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__]
import structlog
from bench.sim import run
from evinfra.config import load_config
structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
seconds, nodes, agents = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
if seconds > 0:
    print("requests", run(nodes, agents, seconds)[0])
else:
    load_config("etc/cluster.toml")
    print("requests 0")
"""


AGENTS = dict(RUNS)  # nodes -> agents


def _start(root: Path, seconds: float, nodes: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONHASHSEED="0", PYTHONPATH=str(root))
    cmd = ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
           sys.executable, "-c", _CHILD, str(seconds), str(nodes), str(AGENTS[nodes])]
    return subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _read(proc: subprocess.Popen) -> tuple[int, int]:
    """Requests and instructions of a finished child."""
    out, err = proc.communicate()
    refs, requests = _REFS.search(err), re.search(r"requests (\d+)", out)
    if proc.returncode != 0 or refs is None or requests is None:
        said = [line for line in err.splitlines() if line and not line.startswith("==")]
        raise SystemExit(f"bench.instructions: a run failed (exit {proc.returncode}): "
                         f"{said[-1] if said else 'no output'}")
    return int(requests.group(1)), int(refs.group(1).replace(",", ""))


def build_native(root: Path, build: Path) -> None:
    """Build a checkout's native core (a ``CMakeLists.txt`` at its root) into its package, as
    an editable install would, out of ``build``; a checkout from before it needs nothing."""
    if not (root / "CMakeLists.txt").exists() or list((root / "evinfra/native").glob("_native*")):
        return
    import nanobind

    for cmd in (["cmake", "-S", str(root), "-B", str(build), "-G", "Ninja",
                 "-DCMAKE_BUILD_TYPE=Release", f"-DPython_EXECUTABLE={sys.executable}",
                 f"-Dnanobind_DIR={nanobind.cmake_dir()}"],
                ["cmake", "--build", str(build)]):
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"bench.instructions: cannot build {root}'s native core: "
                             f"{(done.stdout + done.stderr).strip().splitlines()[-1:]}")
    for so in build.glob("_native*"):
        shutil.copy(so, root / "evinfra/native")


def measure(roots: dict[str, Path], seconds: float, nodes: int = 9) -> list[Count]:
    """Each checkout's run and start-up, all under valgrind at once. Byte code is compiled
    first: a fresh worktree's first run would count compiling the modules it imports."""
    for root in roots.values():
        subprocess.run([sys.executable, "-m", "compileall", "-q", "evinfra", "bench"], cwd=root,
                       check=True, capture_output=True)
    procs = {label: (_start(root, seconds, nodes), _start(root, 0, nodes))
             for label, root in roots.items()}
    try:
        counts = []
        for label, (run, startup) in procs.items():
            requests, total = _read(run)
            counts.append(Count(label, requests, total - _read(startup)[1]))
        return counts
    finally:  # one failed: the others stop too
        for proc in (p for pair in procs.values() for p in pair):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=600.0,
                    help="simulated seconds of the cc run (default 600)")
    ap.add_argument("--nodes", type=int, choices=sorted(AGENTS), default=9,
                    help="bench.sim's 9-node run (126 agents, default) or 64-node one (640)")
    ap.add_argument("--against", metavar="REV", help="also count this git revision")
    args = ap.parse_args(argv)
    if args.seconds <= 0:
        raise SystemExit("bench.instructions: --seconds must be positive")
    if shutil.which("valgrind") is None:
        raise SystemExit("bench.instructions: needs valgrind (apt-get install valgrind)")
    here = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory(prefix="evinfra-bench-") as tmp:
        roots = {"this checkout": here}
        if args.against is not None:
            other = Path(tmp) / "against"
            add = subprocess.run(["git", "-C", str(here), "worktree", "add", "--detach",
                                  str(other), args.against], capture_output=True, text=True)
            if add.returncode != 0:
                why = add.stderr.strip().splitlines() or [f"git exit {add.returncode}"]
                raise SystemExit(f"bench.instructions: cannot check out {args.against}: "
                                 f"{why[-1]}")
            roots[args.against] = other
        try:
            if args.against is not None:
                build_native(roots[args.against], Path(tmp) / "build")
            counts = measure(roots, args.seconds, args.nodes)
        finally:
            if args.against is not None:
                subprocess.run(["git", "-C", str(here), "worktree", "remove", "--force",
                                str(roots[args.against])], capture_output=True)
    print("\n".join(report(args.seconds, counts, args.nodes)))


def report(seconds: float, counts: list[Count], nodes: int = 9) -> list[str]:
    """The printed table, and with two counts their ratio (per request too when both runs
    played some)."""
    lines = [f"cc, {AGENTS[nodes]} agents, {nodes} nodes, {seconds:g} simulated seconds; "
             "instructions net of start-up",
             f"{'checkout':<16}{'requests':>10}{'instructions':>18}{'per request':>14}"]
    for c in counts:
        lines.append(f"{c.label:<16}{c.requests:>10}{c.instructions:>18,}"
                     f"{c.instructions / max(c.requests, 1):>14,.0f}")
    if len(counts) == 2:
        mine, theirs = counts
        ratio = f"ratio {mine.instructions / theirs.instructions:.4f}"
        if mine.requests and theirs.requests:
            same = "same requests" if mine.requests == theirs.requests else "different requests"
            per = mine.instructions * theirs.requests / (theirs.instructions * mine.requests)
            ratio += f" ({same}; per request {per:.4f})"
        else:
            ratio += " (a run played no request: no ratio per request)"
        lines.append(ratio)
    return lines


if __name__ == "__main__":
    main()
