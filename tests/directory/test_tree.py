import pytest

from evinfra.core.events import AllBlocksCleared, BlockRemoved, BlockStored
from evinfra.core.types import Phase, Tier
from evinfra.directory import Directory


def stored(hashes, medium="GPU", parent=None):
    return BlockStored(list(hashes), parent, [0] * 4 * len(hashes), 4, medium=medium)


@pytest.fixture
def d() -> Directory:
    return Directory({"a": Phase.PREFILL, "b": Phase.PREFILL, "c": Phase.DECODE}, page_size=4)


def test_match_reports_own_l1_and_union_prefixes(d: Directory) -> None:
    d.apply("a", stored([1, 2, 3], "CPU_PINNED"), 0.0)
    d.apply("a", stored([1]), 0.0)
    d.apply("b", stored([1, 2, 3, 4]), 0.0)
    m = d.match([1, 2, 3, 4, 5])
    assert m.union == 4
    assert m.own == [3, 4, 0]
    assert m.own_l1 == [1, 4, 0]
    assert d.match([9, 1]).union == 0


def test_a_block_lost_in_every_tier_zeroes_its_counts(d: Directory) -> None:
    path = d.step("x", list(range(12))).path.hashes
    d.place("x", "a")
    d.apply("a", stored(path), 1.0)
    d.apply("a", stored(path, "CPU_PINNED"), 1.0)
    d.apply("a", BlockRemoved(path[1:2], "GPU"), 2.0)  # still in host memory
    assert d.branches.count(path[1], 0) == 1
    d.apply("a", BlockRemoved(path[1:2], "CPU_PINNED"), 2.0)
    assert d.branches.count(path[1], 0) == 0
    assert path[1] not in d.branches.counted("x", 0)
    d.place("x", "a")  # a later request recounts the block once the node stores it again
    assert d.branches.count(path[1], 0) == 1


def test_bad_events_are_counted_logged_and_harmless(d: Directory, logs) -> None:
    d.apply("a", stored([7, 8], parent=99), 0.0)  # unknown parent: stored anyway
    d.apply("a", BlockRemoved([123], "GPU"), 0.0)  # never stored
    d.apply("a", stored([5, 6, 5]), 0.0)  # duplicate hash in one path
    d.apply("zz", stored([1]), 0.0)  # unknown node
    d.apply("a", stored([1], medium="DISK"), 0.0)  # tier not tracked
    d.apply("a", BlockStored([3], None, [], 16, None), 0.0)  # another page size
    s = d.tree.stats
    assert (s.unknown_parent, s.unknown_removal, s.duplicate_hash, s.unknown_node,
            s.untracked_medium, s.block_size_mismatch) == (1, 1, 1, 1, 1, 1)
    assert {e["problem"] for e in logs} == {"unknown_parent", "unknown_removal", "duplicate_hash",
                                            "unknown_node", "untracked_medium", "block_size_mismatch"}
    d.check_invariants()
    assert d.match([7, 8]).own == [2, 0, 0]


def test_all_blocks_cleared_and_node_loss(d: Directory) -> None:
    path = d.step("x", list(range(8))).path.hashes
    d.place("x", "b")
    d.apply("b", stored(path), 0.0)
    d.apply("a", stored(path), 0.0)
    d.apply("b", AllBlocksCleared(), 1.0)
    assert d.match(path).own == [2, 0, 0]
    assert d.branches.counted("x", 1) == set()
    d.place("x", "a")
    assert d.node_lost("a") == 2
    assert d.match(path).union == 0
    assert d.branches.nodes_of("x") == []
    d.check_invariants()


def test_evict_host_prefers_zero_counts_then_lru_and_never_pinned(d: Directory) -> None:
    counted = d.step("x", list(range(8))).path.hashes
    d.place("x", "a")
    d.apply("a", stored(counted, "CPU_PINNED"), 1.0)
    d.apply("a", stored([101], "CPU_PINNED"), 3.0)
    d.apply("a", stored([100], "CPU_PINNED"), 2.0)
    d.apply("a", stored([102], "CPU_PINNED"), 4.0)
    d.apply("a", stored([102], "GPU"), 4.0)  # in GPU memory too: not a host candidate
    assert d.evict_host("a", 3, pinned=[101]) == [100, counted[0], counted[1]]
    assert d.tree.tiers(102, 0) == {Tier.L1, Tier.L2}
    assert d.branches.counted("x", 0) == set()


def test_many_nodes_repack_the_masks() -> None:
    d = Directory({f"n{i}": Phase.PREFILL for i in range(8)}, page_size=4)
    d.apply("n7", stored([1, 2]), 0.0)
    for i in range(8, 70):
        d.add_node(f"n{i}", Phase.DECODE)
    d.apply("n69", stored([1]), 0.0)
    m = d.match([1, 2])
    assert m.own[7] == 2 and m.own[69] == 1 and m.union == 2
    d.check_invariants()
