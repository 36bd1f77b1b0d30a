"""A control-plane :class:`~evinfra.control.Service` on fast fake engines in virtual time.

The same object ``evinfra serve`` runs, built as the simulator builds it
(``Service.from_config(config, VirtualClock(), stream="batched")``): every timer the
service arms (branch sweeps, request timeouts, planner ticks) and every engine step is a
callback on one :class:`~evinfra.core.clock.VirtualClock`, so a test moves time to the
instant it wants to look at and sees the same thing on every run, on any machine.

Tests talk to the service through its public methods only (``submit``, ``abort``,
``end_branch``, ``cordon``, ``force_split``, ``status``, ``branch_counts``, ``in_flight``,
``start``, ``stop``), read counters from ``status()["counters"]``, and use the fake engines'
fault injection (``stall``/``resume``) through ``service.fake_cluster``. Imports of the
service live here only, so the ``evinfra/control`` refactor changes one file of these tests.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Sequence

import numpy as np

from evinfra.config import Config, parse_config
from evinfra.core.clock import VirtualClock
from evinfra.core.contracts import Sampling
from evinfra.core.events import RequestDone
from evinfra.errors import EvinfraError, UnknownBranchError
from evinfra.control import Service, Submission

__all__ = ["FAST", "Sink", "VSim", "make_config", "prompt"]

# Fake engines fast enough that a request takes milliseconds of virtual time (the tests of
# tests/api and tests/baselines use the same numbers): a decode iteration ~2 ms, a prefill
# ~1 ms plus 1 us per token, a switch 10 ms, an idle heartbeat every 0.2 s.
FAST = {"c0": 0.001, "c1": 1e-6, "c2": 1e-12, "d0": 0.001, "d1": 0.001, "d2": 1e-5,
        "switch_latency": 0.01, "heartbeat_s": 0.2}

WARMUP = 1.0
"""The planner's collocated warm-up (``planner.t_learn``): short, then the initial 2P2D."""


def _merged(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = (_merged(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict)
                  else v)
    return out


def make_config(**over: Any) -> Config:
    """Four fake nodes n0..n3, initially 2P2D (n0, n1 prefill), a fixed split (the planner
    never decides on its own, only ``force_split`` changes it), no timeouts and no branch
    expiry unless ``over`` sets them (``server={"branch_idle_s": 8.0}``)."""
    raw = {
        "cluster": {"nodes": [{"name": f"n{i}"} for i in range(4)], "initial_prefill": 2},
        "fake": dict(FAST),
        "planner": {"t_learn": WARMUP, "adapt": False},
        "server": {"first_token_timeout_s": None, "token_timeout_s": None,
                   "branch_idle_s": None},
    }
    return parse_config(_merged(raw, over))


def prompt(n: int, seed: int = 0) -> np.ndarray:
    """``n`` token ids, distinct per seed (no shared prefix between seeds)."""
    return np.random.default_rng(seed).integers(0, 50_000, n).astype(np.uint32)


class Sink:
    """A :class:`~evinfra.control.RequestSink` that keeps what it gets, and when."""

    def __init__(self, clock: VirtualClock, on_tokens: Callable[["Sink"], None] | None = None
                 ) -> None:
        self.clock = clock
        self.on_tokens = on_tokens
        self.out: list[int] = []
        self.token_times: list[float] = []
        self.record: RequestDone | None = None
        self.error: EvinfraError | None = None
        self.done_calls = 0
        self.done_at: float | None = None

    def tokens(self, tokens: Sequence[int], logprobs: object) -> None:
        self.out.extend(int(t) for t in tokens)
        self.token_times.append(self.clock.now())
        if self.on_tokens is not None:
            self.on_tokens(self)

    def prompt_logprobs(self, logprobs: object) -> None:
        pass

    def done(self, record: RequestDone, error: EvinfraError | None) -> None:
        self.done_calls += 1
        self.record, self.error = record, error
        self.done_at = self.clock.now()

    @property
    def finished(self) -> bool:
        return self.record is not None

    @property
    def ok(self) -> bool:
        return self.record is not None and self.record.status == "ok" and self.error is None


class VSim:
    """A started service on a virtual clock, past its warm-up unless ``warm=False``."""

    def __init__(self, config: Config | None = None, warm: bool = True, **over: Any) -> None:
        self.clock = VirtualClock()
        self.service = Service.from_config(config or make_config(**over), self.clock,
                                           stream="batched")
        self.engines = self.service.fake_cluster.engines
        # The fake drivers' start only schedules on the clock: nothing to await for real.
        asyncio.run(self.service.start())
        if warm:
            self.run_to(WARMUP + 0.5)
            split = self.service.status()["split"]
            assert (split["prefill"], split["decode"], split["switching"]) == (
                ["n0", "n1"], ["n2", "n3"], {}), split

    # -- time ---------------------------------------------------------------------------

    @property
    def now(self) -> float:
        return self.clock.now()

    def run_to(self, t: float) -> None:
        assert t >= self.clock.now(), (t, self.clock.now())
        self.clock.run(until=t)

    def run_for(self, dt: float) -> None:
        self.clock.run(until=self.clock.now() + dt)

    def step_until(self, check: Callable[[], bool], dt: float = 0.001,
                   limit: float = 30.0) -> float:
        """Advance in steps of ``dt`` until ``check()`` holds; the virtual time it first held
        (an AssertionError after ``limit`` virtual seconds)."""
        end = self.clock.now() + limit
        while not check():
            assert self.clock.now() < end, f"still not true after {limit} virtual s"
            self.run_for(dt)
        return self.clock.now()

    # -- requests -----------------------------------------------------------------------

    def submit(self, rid: str, tokens: np.ndarray, branch: str | None = None,
               max_tokens: int = 16, final: bool = False,
               on_tokens: Callable[[Sink], None] | None = None) -> Sink:
        sink = Sink(self.clock, on_tokens)
        got = self.service.submit(Submission(tokens, Sampling(max_tokens, ignore_eos=True),
                                             branch, None, final, rid), sink)
        assert got == rid
        return sink

    # -- public views -------------------------------------------------------------------

    def counters(self) -> dict[str, int]:
        return self.service.status()["counters"]

    def node(self, name: str) -> dict:
        return self.service.status()["nodes"][name]

    def has_branch(self, branch: str) -> bool:
        try:
            self.service.branch_counts(branch)
        except UnknownBranchError:
            return False
        return True
