"""Each rule of the paper's Figure 4, with the exact counts the figure shows.

Blocks are pages of 4 tokens: A and B are the shared history, C a block one branch appends,
S the summary a compaction writes. Both branches start on prefill node P1.
"""

import pytest

from evinfra.core.types import Phase
from evinfra.directory import Directory

A, B, C, S = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]
NODES = {"P1": Phase.PREFILL, "P2": Phase.PREFILL, "D1": Phase.DECODE}


def R(d: Directory, tokens: list[int], node: str) -> list[int]:
    """Counts of the blocks of ``tokens`` on ``node``, in path order."""
    path = d.branches.hasher.hash(tokens).hashes
    return [d.branches.count(h, d.index(node)) for h in path]


@pytest.fixture
def d() -> Directory:
    d = Directory(NODES, page_size=4)
    d.step("branch1", A + B)
    d.place("branch1", "P1")
    d.step("branch2", A + B, parent="branch1")  # a fork reuses the context
    d.place("branch2", "P1")
    assert R(d, A + B, "P1") == [2, 2]
    return d


def test_a_consecutive_request_counts_only_its_new_block(d: Directory) -> None:
    step = d.step("branch1", A + B + C)
    assert not step.rewritten and step.version == 1
    d.place("branch1", "P1")
    assert R(d, A + B + C, "P1") == [2, 2, 1]


def test_b_compaction_bumps_the_version_and_drops_the_old_blocks(d: Directory) -> None:
    d.step("branch1", A + B + C)
    d.place("branch1", "P1")
    step = d.step("branch1", A + S)
    assert step.rewritten and step.version == 2
    d.place("branch1", "P1")
    # A stays shared; B and C lose branch 1 (C drops to 0); the summary counts 1.
    assert R(d, A + B + C, "P1") == [2, 1, 0]
    assert R(d, A + S, "P1") == [2, 1]


def test_c_a_same_phase_move_counts_the_target_and_releases_the_source(d: Directory) -> None:
    d.place("branch1", "P2")
    assert R(d, A + B, "P2") == [1, 1]
    assert R(d, A + B, "P1") == [2, 2]  # not before P2 holds the current version
    assert d.settle("branch1", "P2") == ["P1"]
    assert R(d, A + B, "P1") == [1, 1]
    assert R(d, A + B, "P2") == [1, 1]


def test_d_cross_phase_transfers_keep_both_copies_and_send_only_new_kv(d: Directory) -> None:
    d.place("branch1", "D1")  # P2D: decode bound when the prefill starts
    assert d.settle("branch1", "D1") == []
    assert R(d, A + B, "P1") == [2, 2]
    assert R(d, A + B, "D1") == [1, 1]
    d.step("branch1", A + B + C)  # D2P: the next step prefills on P1 again
    d.place("branch1", "P1")
    d.settle("branch1", "P1")
    assert R(d, A + B + C, "P1") == [2, 2, 1]
    assert R(d, A + B + C, "D1") == [1, 1, 0]
    d.place("branch1", "D1")  # only C is new on D1
    assert R(d, A + B + C, "D1") == [1, 1, 1]


def test_branch_end_releases_every_count(d: Directory) -> None:
    d.place("branch1", "D1")
    d.end("branch1")
    assert R(d, A + B, "P1") == [1, 1]
    assert R(d, A + B, "D1") == [0, 0]
    assert "branch1" not in d.branches


def test_phase_switches_reset_decode_to_prefill_and_keep_prefill_to_decode(d: Directory) -> None:
    d.place("branch1", "D1")
    d.switch_phase("P1", Phase.DECODE)
    assert R(d, A + B, "P1") == [2, 2]
    d.switch_phase("D1", Phase.PREFILL)
    assert R(d, A + B, "D1") == [0, 0]


def test_a_sub_agent_starts_fresh_and_leaves_the_parent_counts(d: Directory) -> None:
    d.step("sub", S + C, parent="branch1")
    d.place("sub", "P1")
    assert R(d, A + B, "P1") == [2, 2]
    assert R(d, S + C, "P1") == [1, 1]
