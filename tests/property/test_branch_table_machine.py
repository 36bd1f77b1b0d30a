"""Stateful test: the native branch table against the Python one it replaced (issue 37).

Random programs of requests (new branch, fork, sub-agent, append, compaction), placements,
settles, branch ends, phase switches, node releases, evictions (batches of counted, uncounted
and repeated blocks) and hint takes run on both; every answer must be equal, and every hint
delta block for block in the same order: the engines evict in that order, so the simulation
reports depend on it. The Python table is ``tests/directory/reference_branches.py``.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import Phase as HPhase
from hypothesis import settings
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from evinfra.core.contracts import HintDelta
from evinfra.core.types import Phase
from evinfra.directory.branches import BranchTable
from evinfra.errors import UnknownBranchError
from tests.conftest import MIN_STEPS
from tests.directory.reference_branches import ReferenceBranchTable

PAGE = 2
PHASES = [Phase.PREFILL, Phase.PREFILL, Phase.DECODE, Phase.DECODE, Phase.COLLOCATED]
NODES = range(len(PHASES))
SYSTEMS = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9, 9], [20, 21]]
tokens = st.lists(st.integers(0, 6), max_size=12)
routed = st.none() | st.sampled_from(NODES)

STEPS = {"n": 0}


class BranchTableMachine(RuleBasedStateMachine):
    table_cls = BranchTable

    def __init__(self) -> None:
        super().__init__()
        self.real = self.table_cls(PAGE, PHASES)
        self.ref = ReferenceBranchTable(PAGE, PHASES)
        self.tokens: dict[str, list[int]] = {}
        self.blocks: set[int] = set()  # every block of every path so far
        self.next_id = 0

    def _step(self, beta: str, toks: list[int], parent: str | None = None,
              to: int | None = None) -> None:
        """A request of ``beta``, routed ``to`` a node (placed there) unless None."""
        got = self.real.step(beta, toks, parent)
        want = self.ref.step(beta, toks, parent)
        assert (got.branch, got.version, got.rewritten, got.old_len) == (
            want.branch, want.version, want.rewritten, want.old_len)
        assert got.path.hashes == want.path.hashes
        self.tokens[beta] = toks
        self.blocks.update(got.path.hashes)
        if to is not None:
            self.real.place(beta, to)
            self.ref.place(beta, to)

    def _branch(self, data: st.DataObject) -> str:
        return data.draw(st.sampled_from(sorted(self.tokens)), label="branch")

    # -- requests -------------------------------------------------------------------------

    @initialize(extra=tokens)
    def two_branches(self, extra: list[int]) -> None:
        self.new_branch(SYSTEMS[0], extra, 0)
        self.new_branch(SYSTEMS[0], extra[::-1], 1)

    @rule(system=st.sampled_from(SYSTEMS), extra=tokens, to=routed)
    def new_branch(self, system: list[int], extra: list[int], to: int | None) -> None:
        self.next_id += 1
        self._step(f"b{self.next_id}", system + extra, None, to)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), extra=tokens, own=st.booleans(), to=routed)
    def fork_or_sub_agent(self, data: st.DataObject, extra: list[int], own: bool,
                          to: int | None) -> None:
        parent = self._branch(data)
        self.next_id += 1
        self._step(f"b{self.next_id}", (self.tokens[parent] if own else []) + extra, parent, to)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), extra=tokens, to=routed)
    def append(self, data: st.DataObject, extra: list[int], to: int | None) -> None:
        beta = self._branch(data)
        self._step(beta, self.tokens[beta] + extra, None, to)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), keep=st.integers(0, 16), summary=tokens, to=routed)
    def compaction(self, data: st.DataObject, keep: int, summary: list[int],
                   to: int | None) -> None:
        beta = self._branch(data)
        self._step(beta, self.tokens[beta][:keep] + summary, None, to)

    # -- counts ---------------------------------------------------------------------------

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), node=st.sampled_from(NODES))
    def place(self, data: st.DataObject, node: int) -> None:
        beta = self._branch(data)
        self.real.place(beta, node)
        self.ref.place(beta, node)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), node=st.sampled_from(NODES))
    def place_and_settle(self, data: st.DataObject, node: int) -> None:
        beta = self._branch(data)
        self.real.place(beta, node)
        self.ref.place(beta, node)
        assert self.real.settle(beta, node) == self.ref.settle(beta, node)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def end(self, data: st.DataObject) -> None:
        beta = self._branch(data)
        self.real.end(beta)
        self.ref.end(beta)
        del self.tokens[beta]
        for table in (self.real, self.ref):
            with pytest.raises(UnknownBranchError):
                table.end(beta)

    @rule(node=st.sampled_from(NODES), phase=st.sampled_from([None, *Phase]))
    def switch_phase_or_release(self, node: int, phase: Phase | None) -> None:
        """A phase switch (E.2 lines 14-15), or with no phase a lost node's release."""
        for table in (self.real, self.ref):
            if phase is None:
                table.release_node(node)
            else:
                table.switch_phase(node, phase)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def evicted_leaf_run(self, data: st.DataObject) -> None:
        """A node the branch counts on loses its path from some point on, leaf first (as
        engines evict)."""
        beta = self._branch(data)
        node = data.draw(st.sampled_from(self.real.nodes_of(beta) or NODES), label="node")
        path = self.real.path(beta).hashes
        blocks = path[data.draw(st.integers(0, len(path)), label="from"):][::-1]
        self.real.evicted(node, blocks)
        self.ref.evicted(node, blocks)

    @precondition(lambda self: self.blocks)
    @rule(data=st.data(), node=st.sampled_from(NODES))
    def evicted_mix(self, data: st.DataObject, node: int) -> None:
        """A node loses any mix of counted, uncounted, unknown and repeated blocks."""
        known = st.sampled_from(sorted(self.blocks))
        blocks = data.draw(st.lists(known | st.integers(-3, 3), max_size=12), label="blocks")
        self.real.evicted(node, blocks)
        self.ref.evicted(node, blocks)

    # -- hints ----------------------------------------------------------------------------

    @rule(node=st.sampled_from([None, *NODES]))
    def take_hints(self, node: int | None) -> None:
        """One node's hint, or (no node) every waiting one as ``Directory.take_all_hints``."""
        nodes = self.real.hinted_nodes()
        assert nodes == self.ref.hinted_nodes()
        for n in nodes if node is None else [node]:
            got = self.real.take_hints(n)
            assert type(got) is HintDelta
            assert got == self.ref.take_hints(n), n

    # -- invariants -----------------------------------------------------------------------

    @invariant()
    def tables_agree(self) -> None:
        STEPS["n"] += 1
        real, ref = self.real, self.ref
        assert real.branches() == ref.branches() == list(self.tokens)
        assert len(real) == len(ref)
        for beta in self.tokens:
            assert beta in real
            assert real.version(beta) == ref.version(beta)
            assert real.path(beta).hashes == ref.path(beta).hashes
            assert real.nodes_of(beta) == ref.nodes_of(beta)
            for n in NODES:
                assert real.counted(beta, n) == ref.counted(beta, n), (beta, n)
        for n in NODES:
            assert real.phase(n) is ref.phase(n)
            assert real.counts(n) == ref.counts(n), n
            assert real.branches_on(n) == ref.branches_on(n), n
            one = ref._slice[n]
            assert real.waiting(n) == (len(one[0]) if one is not None else len(ref._notes[n]))
        for h in sorted(self.blocks)[:8]:
            assert [real.count(h, n) for n in NODES] == [ref.count(h, n) for n in NODES]


def test_native_branch_table_agrees_with_the_python_one() -> None:
    STEPS["n"] = 0
    run_state_machine_as_test(BranchTableMachine)
    profile = settings.get_current_profile_name()
    assert STEPS["n"] >= MIN_STEPS.get(profile, 0), f"only {STEPS['n']} steps ran"


# Mutants the machine must catch: order in a hint matters, and so do evictions.

class _ReversedHints(BranchTable):
    """Hands each hint's blocks on in reverse: the same sets, another eviction order."""

    def take_hints(self, node):  # type: ignore[override]
        delta = super().take_hints(node)
        return HintDelta(delta.positive[::-1], delta.zero[::-1])


class _IgnoresEvictions(BranchTable):
    """Never takes lost blocks out of the counts (E.2 line 20)."""

    def evicted(self, node, blocks):  # type: ignore[override]
        pass


@pytest.mark.parametrize("mutant", [_ReversedHints, _IgnoresEvictions])
def test_the_machine_catches_a_mutant(mutant: type[BranchTable]) -> None:
    machine = type(f"{mutant.__name__}Machine", (BranchTableMachine,), {"table_cls": mutant})
    with pytest.raises(AssertionError):
        run_state_machine_as_test(
            machine, settings=settings(max_examples=2000, stateful_step_count=60,
                                       phases=[HPhase.generate], print_blob=False,
                                       report_multiple_bugs=False))
