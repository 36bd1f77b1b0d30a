"""The branch table's boundary: errors for unknown branches and nodes, and a native core that
answers bad input with exceptions (never a crash) whatever it is given."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given

from evinfra.core.types import Phase
from evinfra.directory.branches import BranchTable
from evinfra.errors import UnknownBranchError
from evinfra.native import _native


@pytest.fixture
def table() -> BranchTable:
    return BranchTable(2, [Phase.PREFILL, Phase.DECODE])


@pytest.mark.parametrize("call", [
    lambda t: t.version("x"), lambda t: t.path("x"), lambda t: t.nodes_of("x"),
    lambda t: t.counted("x", 0), lambda t: t.place("x", 0), lambda t: t.settle("x", 0),
    lambda t: t.end("x"),
])
def test_an_unknown_branch_raises(table: BranchTable, call) -> None:
    table.step("y", [1, 2, 3, 4])
    table.step("x", [1, 2])
    table.end("x")  # known once, then forgotten
    with pytest.raises(UnknownBranchError):
        call(table)


@pytest.mark.parametrize("node", [2, -1])
@pytest.mark.parametrize("call", [
    lambda t, n: t.place("y", n), lambda t, n: t.settle("y", n), lambda t, n: t.counted("y", n),
    lambda t, n: t.evicted(n, [1]), lambda t, n: t.take_hints(n), lambda t, n: t.phase(n),
    lambda t, n: t.release_node(n), lambda t, n: t.count(1, n), lambda t, n: t.counts(n),
    lambda t, n: t.switch_phase(n, Phase.PREFILL), lambda t, n: t.branches_on(n),
])
def test_an_unknown_node_raises_index_error(table: BranchTable, call, node: int) -> None:
    table.step("y", [1, 2, 3, 4])
    with pytest.raises(IndexError):
        call(table, node)


def test_a_new_branch_stays_unknown_when_its_tokens_are_refused(table: BranchTable) -> None:
    with pytest.raises(ValueError):
        table.step("x", [1, -2])
    assert "x" not in table and len(table) == 0


def test_handles_are_reused_and_ids_follow_them(table: BranchTable) -> None:
    table.step("a", [1, 2])
    table.place("a", 0)
    table.end("a")
    table.step("b", [3, 4])
    table.place("b", 0)
    assert table.branches_on(0) == {"b"} and table.branches() == ["b"]


# The raw core: any sequence of calls, handles, nodes, keeps and blocks (repeated ones, which
# real paths never have, and things that are no int64) ends in results or Python exceptions.

_calls = st.lists(st.tuples(
    st.sampled_from(["add_branch", "step", "place", "settle", "end", "release_node", "evicted",
                     "take_hints", "counted", "nodes_of", "set_phase", "version", "waiting"]),
    st.integers(-1, 4), st.integers(-1, 4), st.integers(-2, 8),
    st.lists(st.integers(0, 5) | st.sampled_from([2**63, "x", 1.5]), max_size=8)), max_size=60)


@given(calls=_calls)
def test_the_native_table_never_crashes(calls) -> None:
    t = _native.BranchTable()
    for phase in (0, 1, 0):
        t.add_node(phase)
    for name, handle, node, keep, blocks in calls:
        args = {"add_branch": (blocks,), "step": (handle, keep, blocks),
                "evicted": (node, blocks), "release_node": (node,), "take_hints": (node,),
                "set_phase": (node, keep), "version": (handle,), "nodes_of": (handle,),
                "end": (handle,), "waiting": (node,)}.get(name, (handle, node))
        try:
            getattr(t, name)(*args)
        except (KeyError, IndexError, ValueError, TypeError, OverflowError):
            pass
        for n in range(3):
            assert all(r > 0 for r in t.counts(n).values())
