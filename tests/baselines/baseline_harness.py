"""A service on fast fake engines in virtual time, for the baselines' mechanism tests: the
same :class:`~evinfra.control.Service` ``serve`` and ``simulate`` run, with ``[policy]``."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from evinfra.config import Config, parse_config
from evinfra.core.bus import Bus
from evinfra.core.clock import VirtualClock
from evinfra.core.contracts import Sampling
from evinfra.core.events import RequestDone
from evinfra.control import Service, Submission

FAST = {"c0": 0.001, "c1": 1e-6, "c2": 1e-12, "d0": 0.001, "d1": 0.001, "d2": 1e-5,
        "switch_latency": 0.01, "heartbeat_s": 0.2}


def merged(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = merged(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return out


def raw_config(policy: str = "evinfra", nodes: int = 4, prefill: int = 2) -> dict:
    return {"cluster": {"nodes": [{"name": f"n{i}"} for i in range(nodes)],
                        "initial_prefill": prefill},
            "fake": dict(FAST), "planner": {"t_learn": 30.0, "t_win": 60.0, "m": 4,
                                            "hold_off": 10.0},
            "policy": {"name": policy},
            "server": {"first_token_timeout_s": None, "token_timeout_s": None}}


def config(policy: str = "evinfra", nodes: int = 4, prefill: int = 2, **over: Any) -> Config:
    return parse_config(merged(raw_config(policy, nodes, prefill), over))


class Sink:
    """A :class:`~evinfra.control.RequestSink` that keeps what it gets."""

    def __init__(self) -> None:
        self.out: list[int] = []
        self.record: RequestDone | None = None
        self.error = None

    def tokens(self, toks, logprobs) -> None:
        self.out.extend(int(t) for t in toks)

    def done(self, record: RequestDone, error) -> None:
        self.record, self.error = record, error


class Sim:
    def __init__(self, cfg: Config) -> None:
        self.clock = VirtualClock()
        self.bus = Bus()
        self.service = Service.from_config(cfg, self.clock, self.bus, stream="batched")
        self.engines = self.service.fake_cluster.engines
        asyncio.run(self.service.start())

    def submit(self, rid: str, toks: np.ndarray, branch: str | None = None,
               max_tokens: int = 16, final: bool = False, parent: str | None = None) -> Sink:
        sink = Sink()
        self.service.submit(Submission(toks, Sampling(max_tokens, ignore_eos=True), branch,
                                       parent, final, rid), sink)
        return sink

    def run(self, until: float) -> None:
        self.clock.run(until=until)


def tokens(n: int, seed: int = 0, base: np.ndarray | None = None) -> np.ndarray:
    t = np.random.default_rng(seed).integers(0, 50_000, n).astype(np.uint32)
    if base is not None:
        t[: base.size] = base[:n]
    return t
