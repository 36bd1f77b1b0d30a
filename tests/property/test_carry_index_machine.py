"""Stateful test: CarryIndex against a naive reference that searches token windows.

Branches answer (streamed in random chunks), answer again, are forgotten; prompts are built
from pieces of held and forgotten answers and random tokens. Each lookup must list the held
branches whose answer's first or last window (``M`` tokens in) lies in the prompt past
``start``, in the order of their first such window, and whether each started on the same
page. Tokens are 32-bit random, so two answers share no window by chance.
"""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule, run_state_machine_as_test

from evinfra.control.carryover import M, W, Answer, CarryIndex
from tests.conftest import MIN_STEPS

STEPS = {"n": 0}
BRANCHES = ["a", "b", "c", "d"]


def windows(answer: tuple[int, ...]) -> list[tuple[int, ...]]:
    if len(answer) < W + 2 * M:
        return []
    return [answer[M:M + W], answer[len(answer) - M - W:len(answer) - M]]


class CarryMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index = CarryIndex()
        self.held: dict[str, tuple[tuple[int, ...], int]] = {}  # branch -> answer, first page
        self.seen: list[tuple[int, ...]] = []  # every answer so far, held or not
        self.rng = np.random.default_rng(0)

    def tokens(self, n: int) -> tuple[int, ...]:
        return tuple(self.rng.integers(0, 1 << 32, n, dtype=np.uint64).tolist())

    @rule(branch=st.sampled_from(BRANCHES), size=st.integers(0, 120),
          chunks=st.lists(st.integers(1, 50), min_size=1, max_size=5),
          first_page=st.integers(0, 2))
    def answer(self, branch: str, size: int, chunks: list[int], first_page: int) -> None:
        STEPS["n"] += 1
        out = self.tokens(size)
        a = Answer(first_page)
        arr = np.array(out, np.uint32)
        i = 0
        for c in chunks * (size // sum(chunks) + 1):
            if i >= size:
                break
            a.add(arr[i:i + c])
            i += c
        self.index.answered(branch, a)
        self.held.pop(branch, None)
        if windows(out):
            self.held[branch] = (out, first_page)
        self.seen.append(out)

    @rule(branch=st.sampled_from(BRANCHES))
    def forget(self, branch: str) -> None:
        STEPS["n"] += 1
        self.index.forget(branch)
        self.held.pop(branch, None)

    @precondition(lambda self: self.seen)
    @rule(pieces=st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 120),
                                    st.integers(0, 120), st.integers(0, 40)), max_size=4),
          start=st.integers(0, 200), first_page=st.integers(0, 2),
          skip=st.sets(st.sampled_from(BRANCHES), max_size=2))
    def find(self, pieces: list[tuple[int, int, int, int]], start: int, first_page: int,
             skip: set[str]) -> None:
        STEPS["n"] += 1
        prompt: tuple[int, ...] = ()
        for pick, a, b, noise in pieces:
            answer = self.seen[pick % len(self.seen)]
            prompt += self.tokens(noise) + answer[min(a, b):max(a, b)]
        got = self.index.find(np.array(prompt, np.uint32), start, first_page, skip)
        first: dict[str, int] = {}
        for branch, (answer, _) in self.held.items():
            if branch in skip:
                continue
            at = [i for w in windows(answer) for i in range(start, len(prompt) - W + 1)
                  if prompt[i:i + W] == w]
            if at:
                first[branch] = min(at)
        want = sorted(first, key=first.__getitem__)
        assert got.branches == want
        assert got.same_start == [self.held[b][1] == first_page for b in want]
        assert len(self.index) == len(self.held)


def test_carry_index_agrees_with_reference() -> None:
    STEPS["n"] = 0
    run_state_machine_as_test(CarryMachine)
    profile = settings.get_current_profile_name()
    assert STEPS["n"] >= MIN_STEPS.get(profile, 0) // 4, f"only {STEPS['n']} steps ran"
