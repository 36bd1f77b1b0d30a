"""Stateful test: ChainIndex against a naive reference that compares token prefixes.

Random hint-less requests (each a fresh prompt or an earlier one extended, from a small
alphabet so prompts share prefixes often) are inferred and recorded as the service does,
and inferred branches end. Without a tip limit the index must agree with the reference on
every request; with a small limit, a live branch's latest tip must survive and the index
must stay within its bound.
"""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
from hypothesis import settings
from hypothesis.stateful import (RuleBasedStateMachine, invariant, precondition, rule,
                                 run_state_machine_as_test)

from evinfra.control.chains import ChainIndex, Inferred
from tests.conftest import MIN_STEPS

PAGE = 2
STEPS = {"n": 0}


class ChainMachine(RuleBasedStateMachine):
    capacity = 1 << 30

    def __init__(self) -> None:
        super().__init__()
        self.index = ChainIndex(PAGE, self.capacity)
        self.prompts: list[tuple[int, ...]] = []
        self.owner: dict[tuple[int, ...], str | None] = {}  # tip prefix -> last recorded
        self.latest: dict[str, tuple[int, ...]] = {}
        self.live: set[str] = set()
        self.names = 0

    @staticmethod
    def tip_of(prompt: tuple[int, ...]) -> tuple[int, ...] | None:
        n = (len(prompt) - 1) // PAGE * PAGE
        return prompt[:n] if n else None

    def expected(self, prompt: tuple[int, ...]) -> Inferred:
        found = [t for t in self.owner if prompt[:len(t)] == t]
        if not found:
            return Inferred(None, None, False)
        tip = max(found, key=len)
        pages = len(tip) // PAGE
        branch = self.owner[tip]
        if branch is None or branch not in self.live:
            return Inferred(None, None, True, pages)
        if self.latest[branch] == tip:
            return Inferred(branch, None, True, pages)
        return Inferred(None, branch, True, pages)

    @rule(base=st.integers(0, 1 << 16), extra=st.lists(st.integers(0, 3), max_size=7),
          fresh=st.booleans())
    def request(self, base: int, extra: list[int], fresh: bool) -> None:
        STEPS["n"] += 1
        prefix = () if fresh or not self.prompts else self.prompts[base % len(self.prompts)]
        prompt = prefix + tuple(extra)
        if not prompt:
            return
        self.prompts.append(prompt)
        keys = self.index.keys(np.array(prompt, np.uint32))
        tip = self.index.tip(keys, len(prompt))
        assert (tip is None) == (self.tip_of(prompt) is None)
        if tip is None:
            return
        got = self.index.find(keys, self.live)
        if self.capacity > 1 << 20:
            assert got == self.expected(prompt)
        for b in (got.continues, got.fork_of):
            assert b is None or b in self.live
        if got.continues is not None:
            branch = got.continues
        elif got.chained:
            self.names += 1
            branch = f"b{self.names}"
            self.live.add(branch)
        else:
            branch = None
        self.index.record(tip, branch)
        # Over the limit only by live branches' latest tips (an ended branch's go later).
        assert len(self.index._tips) <= self.capacity + len(self.live)
        t = self.tip_of(prompt)
        self.owner.pop(t, None)
        self.owner[t] = branch
        if branch is not None:
            self.latest[branch] = t

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 1 << 16))
    def end(self, pick: int) -> None:
        branch = sorted(self.live)[pick % len(self.live)]
        self.live.remove(branch)
        self.index.forget(branch)

    @invariant()
    def live_branches_keep_their_latest_tip(self) -> None:
        assert len(self.index) == len(self.live)
        for b in self.live:
            tip = self.latest[b]
            if self.owner.get(tip) == b:  # no later request recorded the same prompt
                keys = self.index.keys(np.array(tip + (0,), np.uint32))
                assert self.index.find(keys, self.live) == Inferred(b, None, True,
                                                                    len(tip) // PAGE)


class SmallChainMachine(ChainMachine):
    capacity = 3


def test_chain_index_agrees_with_reference() -> None:
    STEPS["n"] = 0
    run_state_machine_as_test(ChainMachine)
    profile = settings.get_current_profile_name()
    assert STEPS["n"] >= MIN_STEPS.get(profile, 0) // 4, f"only {STEPS['n']} steps ran"


def test_chain_index_keeps_live_tips_within_its_bound() -> None:
    run_state_machine_as_test(SmallChainMachine)
