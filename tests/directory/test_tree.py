import numpy as np
import pytest

from evinfra.core.contracts import HintDelta
from evinfra.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from evinfra.core.types import Phase, Tier
from evinfra.directory import Directory


def stored(hashes, medium="GPU", parent=None):
    return BlockStored(list(hashes), parent, [0] * 4 * len(hashes), 4, medium=medium)


@pytest.fixture
def d() -> Directory:
    return Directory({"a": Phase.PREFILL, "b": Phase.PREFILL, "c": Phase.DECODE}, page_size=4)


def test_match_reports_own_l1_and_union_prefixes(d: Directory) -> None:
    d.apply("a", stored([1, 2, 3], "CPU_PINNED"))
    d.apply("a", stored([1]))
    d.apply("b", stored([1, 2, 3, 4]))
    m = d.match([1, 2, 3, 4, 5])
    assert m.union == 4
    assert m.own == [3, 4, 0]
    assert m.own_l1 == [1, 4, 0]
    assert d.match([9, 1]).union == 0


def test_a_block_lost_in_every_tier_zeroes_its_counts(d: Directory) -> None:
    path = d.step("x", list(range(12))).path.hashes
    d.place("x", "a")
    d.apply("a", stored(path))
    d.apply("a", stored(path, "CPU_PINNED"))
    d.apply("a", BlockRemoved(path[1:2], "GPU"))  # still in host memory
    assert d.branches.count(path[1], 0) == 1
    d.apply("a", BlockRemoved(path[1:2], "CPU_PINNED"))
    assert d.branches.count(path[1], 0) == 0
    assert path[1] not in d.branches.counted("x", 0)
    d.place("x", "a")  # a later request recounts the block once the node stores it again
    assert d.branches.count(path[1], 0) == 1


def test_bad_events_are_counted_logged_and_harmless(d: Directory, logs) -> None:
    d.apply("a", stored([7, 8], parent=99))  # unknown parent: stored anyway
    d.apply("a", BlockRemoved([123], "GPU"))  # never stored
    d.apply("a", stored([5, 6, 5]))  # duplicate hash in one path
    d.apply("zz", stored([1]))  # unknown node
    d.apply("a", stored([1], medium="DISK"))  # tier not tracked
    d.apply("a", BlockStored([3], None, [], 16, None))  # another page size
    s = d.tree.stats
    assert (s.unknown_parent, s.unknown_removal, s.duplicate_hash, s.unknown_node,
            s.untracked_medium, s.block_size_mismatch) == (1, 1, 1, 1, 1, 1)
    assert {e["problem"] for e in logs} == {"unknown_parent", "unknown_removal", "duplicate_hash",
                                            "unknown_node", "untracked_medium", "block_size_mismatch"}
    d.check_invariants()
    assert d.match([7, 8]).own == [2, 0, 0]


def test_one_removal_event_mixing_every_case(d: Directory, logs) -> None:
    """Blocks kept in the other tier, lost on the node, freed everywhere, never held, and
    listed twice, in one event: each gets its own outcome."""
    d.apply("a", stored([1, 2, 3, 4]))
    d.apply("a", stored([1, 2], "CPU_PINNED"))
    d.apply("b", stored([1, 2, 3]))
    lost = d.tree.apply("a", BlockRemoved([1, 3, 99, 4, 3], "GPU"))
    assert lost == [3, 4]  # 1 stays in host memory; 99 was never there; 3 goes once
    assert d.tree.tiers(1, 0) == {Tier.L2} and not d.tree.holds(3, 0)
    assert 4 not in d.tree and 3 in d.tree  # b still holds 3; nobody holds 4
    assert d.tree.stats.unknown_removal == 2 and d.tree.stats.blocks_removed == 3
    assert sorted(e.get("block") for e in logs if e["problem"] == "unknown_removal") == [3, 99]
    d.check_invariants()
    d.apply("c", stored([4, 5]))  # the freed slot serves a new block
    assert d.match([4, 5]).own == [0, 0, 2]
    d.check_invariants()


def test_all_blocks_cleared_and_node_loss(d: Directory) -> None:
    path = d.step("x", list(range(8))).path.hashes
    d.place("x", "b")
    d.apply("b", stored(path))
    d.apply("a", stored(path))
    d.apply("b", AllBlocksCleared())
    assert d.match(path).own == [2, 0, 0]
    assert d.branches.counted("x", 1) == set()
    d.place("x", "a")
    assert d.node_lost("a") == 2
    assert d.match(path).union == 0
    assert d.branches.nodes_of("x") == []
    d.check_invariants()


def test_an_engines_resync_keeps_the_counts_of_what_it_still_holds(d: Directory) -> None:
    """A patched engine's resync is one batch: a clear, then its whole cache stored again
    (``engine_patch.tree_ops.republish``). The blocks it stores again were never let go: their
    counts, and the engine's marks, stay. CI once saw the resync of an engine the service
    started beside zero a live branch's blocks (its engine then kept 100 of 150)."""
    path = d.step("x", list(range(12))).path.hashes
    d.place("x", "a")
    d.apply("a", stored(path))
    d.apply("a", stored([40, 41]))  # zero count
    assert sorted(d.take_hints("a").positive) == sorted(path)
    d.apply_batch("a", KVEventBatch(0.0, [AllBlocksCleared(), stored(path[:2])]))
    assert d.branches.counted("x", 0) == set(path[:2])  # the third page is gone
    assert d.take_hints("a") == HintDelta([], [path[2]])
    assert d.match(path).own == [2, 0, 0] and 40 not in d.tree
    # The control: the same clear alone zeroes every count on the node.
    d.apply_batch("a", KVEventBatch(0.0, [AllBlocksCleared()]))
    assert d.branches.counted("x", 0) == set()
    zeroed = d.take_hints("a")
    assert not zeroed.positive and sorted(zeroed.zero) == sorted(path[:2])
    d.check_invariants()


def test_many_nodes_take_more_words_of_holder_bits() -> None:
    d = Directory({f"n{i}": Phase.PREFILL for i in range(8)}, page_size=4)
    d.apply("n7", stored([1, 2]))
    for i in range(8, 70):
        d.add_node(f"n{i}", Phase.DECODE)
    d.apply("n69", stored([1]))
    m = d.match([1, 2])
    assert m.own[7] == 2 and m.own[69] == 1 and m.union == 2
    d.check_invariants()
    # A block whose holders sit in other words stays until the last one lets it go.
    d.apply("n7", BlockRemoved([1], "GPU"))
    assert d.tree.holders(1) == [69] and len(d.tree) == 2
    d.apply("n69", BlockRemoved([1], "GPU"))
    assert d.tree.holders(1) == [] and len(d.tree) == 1
    d.check_invariants()


def test_freed_slots_and_a_block_of_hash_zero_are_told_apart(d: Directory) -> None:
    """Blocks stored together sit in consecutive slots; a slot freed (its hash zeroed) or
    taken by another block since (a block of hash 0 included) must not be mistaken for the
    block's."""
    d.apply("a", stored([1, 2, 3, 4]))
    d.apply("a", BlockRemoved([3, 4], "GPU"))  # freed: the slots after 2's
    d.apply("b", stored([0, 9]))  # a hash of 0 takes a freed slot, 9 the next
    d.apply("c", stored([1, 2, 3, 0]))  # 3 and 0 are not where 2's neighbour was
    d.apply("a", BlockRemoved([2, 9, 0], "GPU"))  # 9 and 0 were never a's
    d.check_invariants()
    assert d.tree.stats.unknown_removal == 2
    assert [d.tree.holders(h) for h in (1, 2, 3, 4, 0, 9)] == [[0, 2], [2], [2], [], [1, 2], [1]]
    assert d.tree.blocks_on(2) == {1, 2, 3, 0}
    d.apply("c", BlockRemoved([3], "GPU"))  # frees the slot after 9's
    d.apply("c", stored([9, 0], "CPU_PINNED"))  # 0 is not that free slot's, hash 0 or not
    d.check_invariants()
    assert d.tree.tiers(0, 2) == {Tier.L1, Tier.L2} and d.tree.tiers(9, 2) == {Tier.L2}
    assert d.match([1, 2, 3]).own == [1, 0, 2]
    assert d.tree.blocks_on(2) == {1, 2, 0, 9}
    assert (d.tree.held(2), d.tree.held(2, Tier.L1), d.tree.held(2, Tier.L2)) == (4, 3, 2)
    assert d.summary()["nodes"]["c"] | {"phase": None} == {
        "phase": None, "blocks": 4, "host_blocks": 2, "positive_count_blocks": 0, "branches": 0}


def test_a_batch_in_one_native_call_is_its_events_one_by_one(logs) -> None:
    """A node's batch is applied in one native call: the tree, the counts it zeroes and the
    tolerated-event counters come out as if each event were applied alone, write-throughs
    (a GPU store and the same blocks' host store) and corrupt pairs included."""
    def batch(*events):
        return KVEventBatch(0.0, list(events))

    runs = [
        [stored([1, 2, 3]), stored([1, 2, 3], "CPU_PINNED")],
        [stored([4, 5], parent=3), stored([4, 5], "CPU_PINNED", parent=3),  # a pair
         stored([6], parent=5), stored([7], "CPU_PINNED", parent=5),  # other blocks
         stored([8]), stored([8], "DISK"),  # an untracked second tier
         stored([9], "CPU_PINNED"), stored([9])],  # host first: not a write-through
        [stored([10, 11, 10], parent=99), stored([10, 11, 10], "CPU_PINNED", parent=99),
         stored([21, 22], parent=21), stored([21, 22], "CPU_PINNED", parent=21),
         BlockStored([30], None, [0] * 16, 16, medium="GPU"),
         BlockStored([30], None, [0] * 16, 16, medium="CPU_PINNED")],
        [BlockRemoved([2, 3, 5], "GPU"), BlockRemoved([1, 4], "CPU_PINNED")],
    ]
    one, paired = Directory({"a": Phase.PREFILL}, 4), Directory({"a": Phase.PREFILL}, 4)
    for d in (one, paired):
        d.step("x", list(range(12)))
        d.place("x", "a")
    for events in runs:
        for e in events:
            one.apply("a", e)
        paired.apply_batch("a", batch(*events))
        paired.check_invariants()
        assert paired.tree.stats == one.tree.stats
        for h in range(32):
            assert paired.tree.tiers(h, 0) == one.tree.tiers(h, 0), h
    assert one.tree.stats.blocks_stored == 27
    s = paired.tree.stats
    assert (s.duplicate_hash, s.unknown_parent, s.block_size_mismatch, s.untracked_medium) \
        == (2, 3, 2, 1)  # parent 21: unknown to the GPU event only
    assert paired.branches.counts(0) == one.branches.counts(0)
    assert paired.take_hints("a") == one.take_hints("a")
    paired.apply_batch("zz", batch(stored([1]), stored([1], "CPU_PINNED")))  # unknown node
    assert paired.tree.stats.unknown_node == 2


@pytest.mark.parametrize("nodes", [3, 64, 65, 130])
def test_match_is_each_nodes_leading_run_across_bitmap_words(nodes: int) -> None:
    """Every node's prefix, in any tier and in L1, equals its leading run of held blocks,
    counted naively, while blocks leave every node and their slots go to other blocks; with
    more than 64 nodes a block's holders span several bitmap words."""
    import numpy as np

    rng = np.random.default_rng(nodes)
    names = [f"n{i}" for i in range(nodes)]
    d = Directory({n: Phase.PREFILL for n in names}, page_size=4)
    path = d.step("x", rng.integers(0, 1000, size=400).tolist()).path.hashes
    held: dict[tuple[int, str], set[int]] = {}

    def put(i: int, blocks: list[int], medium: str) -> None:
        d.apply(names[i], stored(blocks, medium))
        held.setdefault((i, medium), set()).update(blocks)

    def drop(i: int, blocks: list[int], medium: str) -> None:
        d.apply(names[i], BlockRemoved(blocks, medium=medium))
        held[i, medium].difference_update(blocks)

    def run(blocks: set[int]) -> int:
        return next((k for k, h in enumerate(path) if h not in blocks), len(path))

    def agree() -> None:
        m = d.match(path)
        union = set().union(*held.values()) if held else set()
        assert m.union == run(union)
        for i in range(nodes):
            gpu, cpu = held.get((i, "GPU"), set()), held.get((i, "CPU_PINNED"), set())
            assert m.own[i] == min(run(gpu | cpu), m.union), i
            assert m.own_l1[i] == min(run(gpu), m.union), i
        d.check_invariants()

    for i in range(nodes):
        put(i, path[:int(rng.integers(0, 80))], "CPU_PINNED")
        put(i, path[:int(rng.integers(0, 40))], "GPU")
    agree()
    last = nodes - 1
    drop(last, sorted(held[last, "CPU_PINNED"] - held[last, "GPU"]), "CPU_PINNED")
    for i in range(nodes):
        drop(i, sorted(held[i, "GPU"] & set(path[20:])), "GPU")
    put(0, list(range(10_000, 10_090)), "GPU")  # takes freed slots
    put(last, path[:70], "GPU")
    agree()
    # Control: the walk reads holders, so a node that drops its first block holds nothing.
    drop(last, [path[0]], "GPU")
    if path[0] in held.get((last, "CPU_PINNED"), set()):
        drop(last, [path[0]], "CPU_PINNED")
    agree()
    assert d.match(path).own[last] == 0


def test_clear_reports_blocks_in_slot_order_and_slots_are_reused_lowest_first() -> None:
    """The order a cleared node's blocks are reported in is the order their counts are
    zeroed and hinted: part of the simulator's output, so it is pinned here."""
    d = Directory({"a": Phase.PREFILL, "b": Phase.PREFILL}, page_size=4)
    d.apply("a", stored([10, 11, 12, 13, 14]))
    d.apply("a", BlockRemoved([11, 13], medium="GPU"))  # slots 2 and 4 free
    d.apply("a", stored([20, 21, 22]))  # take slots 2, 4, then 6
    assert d.tree.apply("a", AllBlocksCleared()) == [10, 20, 12, 21, 14, 22]
    d.check_invariants()
    # Control: a block another node holds keeps its slot; the freed ones are reused.
    d.apply("a", stored([30, 31]))
    d.apply("b", stored([30]))
    assert d.tree.apply("a", AllBlocksCleared()) == [30, 31]
    assert d.tree.apply("b", AllBlocksCleared()) == [30]
    assert len(d.tree) == 0 and d.tree.entries() == 0


def test_hint_notes_stay_bounded_when_nobody_takes_them(d: Directory) -> None:
    kept = d.step("y", list(range(100, 120))).path.hashes
    d.place("y", "a")  # a hint waiting to be taken: it must survive the cut
    path = d.step("x", list(range(40))).path.hashes
    for _ in range(2000):  # the same ten blocks cross zero up and down, never hinted
        d.place("x", "a")
        d.end("x")
        d.step("x", list(range(40)))
    assert len(path) == 10 and d.branches.waiting(0) == len(kept)  # x's cancelled
    assert sorted(d.take_hints("a").positive) == sorted(kept)


def test_full_hints_replace_the_notes_waiting_for_the_node(d: Directory) -> None:
    kept = d.step("y", list(range(100, 120))).path.hashes
    d.place("y", "a")
    d.take_hints("a")
    gone = d.step("x", list(range(40))).path.hashes
    d.place("x", "a")
    d.take_hints("a")
    d.end("x")  # x's blocks wait to be hinted zero, ...
    more = d.step("z", list(range(200, 212))).path.hashes
    d.place("z", "a")  # ... z's to be hinted positive
    full = d.full_hints("a")
    assert full.replace and full.zero == [] and full.positive == sorted({*kept, *more})
    assert not set(gone) & set(full.positive)
    assert d.take_all_hints() == []  # the full set said it all


def test_a_batch_hands_the_lost_blocks_to_the_branch_table_in_the_same_call(
        d: Directory) -> None:
    """Given the directory's native branch table, the tree's batch zeroes the counts of the
    blocks the node lost itself (E.2 line 20) and returns none; without it, the blocks come
    back and the counts stay (the control)."""
    path = d.step("x", list(range(16))).path.hashes
    d.place("x", "a")
    d.apply_batch("a", KVEventBatch(0.0, [stored(path), stored(path, "CPU_PINNED")]))
    d.take_hints("a")
    gone = [BlockRemoved(path[2:], "GPU"), BlockRemoved(path[3:], "CPU_PINNED")]
    assert d.tree.apply_batch("a", gone, d.branches.native) == []
    assert [d.branches.count(h, 0) for h in path] == [1, 1, 1, 0]
    assert d.take_hints("a").zero == [path[3]]

    control = Directory({"a": Phase.PREFILL}, page_size=4)
    path = control.step("x", list(range(16))).path.hashes
    control.place("x", "a")
    control.apply("a", stored(path))
    assert control.tree.apply_batch("a", [BlockRemoved(path[2:], "GPU")]) == path[2:]
    assert [control.branches.count(h, 0) for h in path] == [1, 1, 1, 1]

    with pytest.raises(TypeError, match="BranchTable"):
        d.tree.apply_batch("a", [BlockRemoved(path[:1], "GPU")], object())
    assert d.tree.holders(path[0]) == [0]  # refused before any event was applied


HASH_EDGES = [0, 1, -1, 2**30 - 1, 2**30, -(2**30), 2**60 - 1, 2**60, -(2**60) - 7,
              2**62 + 12345, 2**63 - 1, -(2**63) + 1, -(2**63)]


def test_block_hashes_are_read_exactly_at_every_digit_boundary(d: Directory) -> None:
    """Hashes are read from CPython's 30-bit digits directly: every signed 64-bit value
    round-trips, one differing only in a high digit is another block (the control), a numpy
    integer is read through ``__index__``, and a value past 64 bits is refused."""
    d.apply_batch("a", KVEventBatch(0.0, [stored(HASH_EDGES)]))
    assert d.tree.blocks_on(0) == set(HASH_EDGES)
    assert all(h in d.tree for h in HASH_EDGES)
    assert (2**60 + 1) not in d.tree and (2**30 + 1) not in d.tree
    d.apply("b", stored([5, 2**30 + 5, 2**60 + 5, -5]))
    assert len(d.tree.blocks_on(1)) == 4
    d.apply("c", BlockStored([np.int64(2**62 + 12345), np.int64(-(2**63))], None, [], 4,
                             medium="GPU"))
    assert d.tree.holders(2**62 + 12345) == [0, 2] and d.tree.holders(-(2**63)) == [0, 2]
    assert d.match(HASH_EDGES).own == [len(HASH_EDGES), 0, 0]
    for bad in (2**63, -(2**63) - 1, 2**64 + 3):
        with pytest.raises(TypeError, match="64-bit"):
            d.apply("a", stored([bad]))
    with pytest.raises(TypeError):
        d.apply("a", stored(["7"]))
    d.check_invariants()
