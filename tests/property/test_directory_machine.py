"""Stateful tests: the real directory against the naive reference of Algorithms E.1 and E.2.

Random programs of agent context management (new branch, fork, sub-agent, append,
compaction, branch end), placements (prefill routing, decode binding, P2P/D2D moves,
P2D/D2P transfers), phase switches, KV events (stored, removed, cleared; one at a time and in
batches, where a GPU store and its write-through to host memory are fused), node loss and host
eviction run on both; after every step the counts, counted sets, held blocks per tier,
versions, paths and prefix lookups must agree, and the invariants of the paper hold.
"""

from __future__ import annotations

import functools

import hypothesis.strategies as st
import msgspec
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from evinfra.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventBatch
from evinfra.core.types import Phase, Tier
from evinfra.directory import Directory
from evinfra.directory.reference import ReferenceDirectory
from tests.conftest import MIN_STEPS

PAGE = 4
NODES = {"p0": Phase.PREFILL, "p1": Phase.PREFILL, "d0": Phase.DECODE, "d1": Phase.DECODE}
SYSTEMS = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [20, 21, 22, 23]]
tokens = st.lists(st.integers(0, 40), min_size=0, max_size=10)
# SGLang's media as the oracle reads them, written out here rather than taken from the code
# under test: no medium is the GPU radix cache (no HiCache), DISK is not tracked at all.
MEDIA = {None: Tier.L1, "GPU": Tier.L1, "CPU_PINNED": Tier.L2, "DISK": None}
GPU_MEDIA = [None, "GPU"]
# What one item of a batch is; a write-through (a GPU store and its host copy, fused by
# ``apply_batch``) and its near misses (not fused) weigh most.
BATCH_ITEMS = ["store", "write_through", "write_through", "near_miss", "remove", "clear"]
NEAR_MISSES = ["fewer_blocks", "other_parent", "gpu_twice", "host_first", "disk", "block_size"]

STEPS = {"n": 0}


def _stored(blocks: list[int], parent: int | None, medium: str | None,
            block_size: int = PAGE) -> BlockStored:
    return BlockStored(list(blocks), parent, [0] * block_size * len(blocks), block_size,
                       medium=medium)


class DirectoryMachine(RuleBasedStateMachine):
    directory_cls = Directory

    def __init__(self) -> None:
        super().__init__()
        self.real = self.directory_cls(NODES, PAGE)
        self.ref = ReferenceDirectory(NODES, PAGE)
        self.tokens: dict[str, list[int]] = {}
        self.ended: set[str] = set()
        # (branch, phase) pairs whose last move into that phase has settled (E.2 line 11):
        # the branch must count on at most one node of the phase.
        self.settled: set[tuple[str, Phase]] = set()
        self.next_id = 0
        # What each node's engine believes positive, from the hints it was pushed.
        self.engine_positive: dict[str, set[int]] = {n: set() for n in NODES}

    # -- helpers ------------------------------------------------------------------------

    def _new_id(self) -> str:
        self.next_id += 1
        return f"b{self.next_id}"

    def _step(self, beta: str, toks: list[int], parent: str | None = None) -> None:
        got = self.real.step(beta, toks, parent)
        v, pi_old, pi_new = self.ref.step(beta, toks, parent)
        assert got.version == v
        assert got.path.hashes == pi_new
        assert got.old_len == len(pi_old)
        assert got.rewritten == (pi_new[: len(pi_old)] != pi_old)
        self.tokens[beta] = list(toks)

    def _active(self, data: st.DataObject) -> str:
        return data.draw(st.sampled_from(sorted(self.tokens)), label="branch")

    def _node(self, data: st.DataObject) -> str:
        return data.draw(st.sampled_from(sorted(NODES)), label="node")

    def _blocks(self, beta: str) -> list[int]:
        return self.real.branches.path(beta).hashes

    def _ref_apply(self, n: str, event: KVEvent, batch: set[int] | None = None) -> None:
        """One KV event on the reference (``batch``: see :meth:`ReferenceDirectory.remove`)."""
        if isinstance(event, BlockStored):
            tier = MEDIA[event.medium]
            if tier is not None:
                self.ref.store(n, event.block_hashes, tier)
        elif isinstance(event, BlockRemoved):
            tier = MEDIA[event.medium]
            if tier is not None:
                self.ref.remove(n, event.block_hashes, tier, batch)
        else:
            self.ref.clear(n, batch)

    # -- context management ---------------------------------------------------------------

    @rule(system=st.sampled_from(SYSTEMS), extra=tokens)
    def new_branch(self, system: list[int], extra: list[int]) -> None:
        self._step(self._new_id(), system + extra)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), extra=tokens)
    def fork(self, data: st.DataObject, extra: list[int]) -> None:
        parent = self._active(data)
        self._step(self._new_id(), self.tokens[parent] + extra, parent)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), system=st.sampled_from(SYSTEMS), task=tokens)
    def sub_agent(self, data: st.DataObject, system: list[int], task: list[int]) -> None:
        parent = self._active(data)
        self._step(self._new_id(), system + task, parent)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), extra=tokens)
    def append(self, data: st.DataObject, extra: list[int]) -> None:
        beta = self._active(data)
        self._step(beta, self.tokens[beta] + extra)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), keep=st.integers(0, 12), summary=tokens)
    def compaction(self, data: st.DataObject, keep: int, summary: list[int]) -> None:
        beta = self._active(data)
        self._step(beta, self.tokens[beta][:keep] + summary)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def branch_end(self, data: st.DataObject) -> None:
        beta = self._active(data)
        self.real.end(beta)
        self.ref.end(beta)
        del self.tokens[beta]
        self.ended.add(beta)

    # -- placements and transfers ---------------------------------------------------------

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), settle=st.booleans())
    def place(self, data: st.DataObject, settle: bool) -> None:
        """Prefill routing or decode binding; with ``settle`` also the point where the node
        holds the current version (so a same-phase move releases the old node)."""
        beta, n = self._active(data), self._node(data)
        self.real.place(beta, n)
        self.ref.place(beta, n)
        key = (beta, self.real.phase(n))
        if settle:
            released = self.real.settle(beta, n)
            before = set(self.ref.N(beta))
            self.ref.settle(beta, n)
            assert set(released) == before - set(self.ref.N(beta))
            self.settled.add(key)
        else:
            self.settled.discard(key)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def move_same_phase(self, data: st.DataObject) -> None:
        """P2P or D2D: place on another node of the phase of one of the branch's nodes."""
        beta = self._active(data)
        nodes = self.real.branches.nodes_of(beta)
        if not nodes:
            return
        src = self.real.nodes[data.draw(st.sampled_from(nodes))]
        phase = self.real.phase(src)
        targets = sorted(n for n in NODES if n != src and self.real.phase(n) is phase)
        if not targets:
            return
        dst = data.draw(st.sampled_from(targets))
        for d in (self.real, self.ref):
            d.place(beta, dst)
            d.settle(beta, dst)
        assert src not in [self.real.nodes[i] for i in self.real.branches.nodes_of(beta)]
        self.settled.add((beta, phase))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def transfer_cross_phase(self, data: st.DataObject) -> None:
        """P2D or D2P: both copies keep their counts."""
        beta = self._active(data)
        nodes = [self.real.nodes[i] for i in self.real.branches.nodes_of(beta)]
        if not nodes:
            return
        src = data.draw(st.sampled_from(nodes))
        targets = sorted(n for n in NODES if self.real.phase(n) is not self.real.phase(src))
        if not targets:
            return
        dst = data.draw(st.sampled_from(targets))
        for d in (self.real, self.ref):
            d.place(beta, dst)
            d.settle(beta, dst)
        assert src in [self.real.nodes[i] for i in self.real.branches.nodes_of(beta)]
        self.settled.add((beta, self.real.phase(dst)))

    # -- phase switches -------------------------------------------------------------------

    @rule(data=st.data())
    def phase_switch(self, data: st.DataObject) -> None:
        n = self._node(data)
        new = Phase.PREFILL if self.real.phase(n) is Phase.DECODE else Phase.DECODE
        self.real.switch_phase(n, new)
        self.ref.switch_phase(n, new)
        self.settled.clear()  # a switch changes which nodes share a phase

    # -- KV events ------------------------------------------------------------------------

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), tier=st.sampled_from(list(Tier)), upto=st.integers(0, 8))
    def kv_stored(self, data: st.DataObject, tier: Tier, upto: int) -> None:
        beta, n = self._active(data), self._node(data)
        blocks = self._blocks(beta)[:upto]
        if not blocks:
            return
        self.real.apply(n, BlockStored(blocks, None, [0] * PAGE * len(blocks), PAGE,
                                       medium=tier.medium))
        self.ref.store(n, blocks, tier)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), tier=st.sampled_from(list(Tier)), picks=st.lists(st.integers(0, 8), max_size=4))
    def kv_removed(self, data: st.DataObject, tier: Tier, picks: list[int]) -> None:
        beta, n = self._active(data), self._node(data)
        path = self._blocks(beta)
        blocks = sorted({path[i] for i in picks if i < len(path)})
        self.real.apply(n, BlockRemoved(blocks, medium=tier.medium))
        self.ref.remove(n, blocks, tier)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), items=st.lists(st.sampled_from(BATCH_ITEMS), min_size=2, max_size=6))
    def kv_batch(self, data: st.DataObject, items: list[str]) -> None:
        """A node's engine publishes its events in batches, and production applies a batch at
        once (``apply_batch``), fusing a GPU store with its write-through to host memory into
        one tree pass; the reference applies the same events one by one. Near misses (another
        slice, parent, order, medium or block size) must not be fused, and removals and
        clears between stores must see the stores before them. A block is lost (its counts
        zeroed) only if the node holds it nowhere at the batch's end: an engine's resync is
        one batch, a clear and then the whole cache stored again."""
        n = self._node(data)
        events: list[KVEvent] = []
        for item in items:
            if item == "clear":
                events.append(AllBlocksCleared())
                continue
            path = self._blocks(self._active(data))
            if item == "remove":
                picks = data.draw(st.lists(st.integers(0, 8), max_size=4), label="picks")
                medium = data.draw(st.sampled_from(sorted(MEDIA, key=str)), label="medium")
                events.append(BlockRemoved(sorted({path[i] for i in picks if i < len(path)}),
                                           medium=medium))
                continue
            lo = data.draw(st.integers(0, 6), label="lo")
            blocks = path[lo: lo + data.draw(st.integers(1, 8), label="len")]
            if not blocks:
                continue
            parent = path[lo - 1] if lo else None
            stored = functools.partial(_stored, blocks, parent)
            if item == "store":
                events.append(stored(data.draw(st.sampled_from(sorted(MEDIA, key=str)),
                                               label="medium")))
                continue
            gpu = stored(data.draw(st.sampled_from(GPU_MEDIA), label="gpu medium"))
            if item == "write_through":
                events += [gpu, stored("CPU_PINNED")]
                continue
            miss = data.draw(st.sampled_from(NEAR_MISSES), label="near miss")
            if miss == "fewer_blocks":
                second = _stored(blocks[:-1] or path[lo + 1: lo + 2], parent, "CPU_PINNED")
            elif miss == "other_parent":
                second = _stored(blocks, None if lo else -1, "CPU_PINNED")
            elif miss == "gpu_twice":
                second = stored("GPU")
            elif miss == "host_first":
                gpu, second = stored("CPU_PINNED"), gpu
            elif miss == "disk":
                second = stored("DISK")
            else:
                second = stored("CPU_PINNED", 2 * PAGE)
            events += [gpu, second]
        before = self.real.summary()["events"]
        self.real.apply_batch(n, KVEventBatch(0.0, events))
        # A fused pair is still two events, each counted as it would be alone (the metrics
        # read these): a store's parent is unknown if no node holds it when the store comes.
        want = dict.fromkeys(("blocks_stored", "block_size_mismatch", "unknown_parent",
                              "untracked_medium"), 0)
        left: set[int] = set()
        for event in events:
            if not isinstance(event, AllBlocksCleared) and MEDIA[event.medium] is None:
                want["untracked_medium"] += 1
            elif isinstance(event, BlockStored):
                want["blocks_stored"] += len(event.block_hashes)
                want["block_size_mismatch"] += event.block_size != PAGE
                want["unknown_parent"] += event.parent_block_hash is not None and not any(
                    event.parent_block_hash in held for held in self.ref.held.values())
            self._ref_apply(n, event, left)
        self.ref.batch_over(n, left)
        after = self.real.summary()["events"]
        assert {k: after[k] - before[k] for k in want} == want

    @rule(data=st.data())
    def all_blocks_cleared(self, data: st.DataObject) -> None:
        n = self._node(data)
        self.real.apply(n, AllBlocksCleared())
        self.ref.clear(n)

    @rule(data=st.data())
    def view_lost(self, data: st.DataObject) -> None:
        n = self._node(data)
        self.real.view_lost(n)
        self.ref.forget(n)

    @rule(data=st.data())
    def node_lost(self, data: st.DataObject) -> None:
        n = self._node(data)
        self.real.node_lost(n)
        self.ref.clear(n)
        for beta in list(self.ref.S):
            if n in self.ref.N(beta):
                self.ref.release(beta, n)

    @rule(data=st.data(), stale=st.sets(st.integers(0, 2**20), max_size=3))
    def engine_resync(self, data: st.DataObject, stale: set[int]) -> None:
        """An engine comes back with stale marks and gets the full set (hints waiting for it
        included): from then on the deltas track it again (``hints_track_the_counts``)."""
        n = self._node(data)
        self.engine_positive[n] |= stale
        full = self.real.full_hints(n)
        assert full.replace and not full.zero
        self.engine_positive[n] = set(full.positive)

    # -- invariants -----------------------------------------------------------------------

    @invariant()
    def counts_agree(self) -> None:
        STEPS["n"] += 1
        want = {k: v for k, v in self.ref.counts_from_sets().items() if v}
        literal = {k: v for k, v in self.ref.R.items() if v}
        assert literal == want, "reference E.2 arithmetic disagrees with its own sets"
        assert all(v >= 0 for v in self.ref.R.values()), "negative count"
        got = {}
        for n in NODES:
            idx = self.real.index(n)
            for b, r in self.real.branches.counts(idx).items():
                assert r > 0, "non-positive count stored"
                got[b, n] = r
        assert got == want

    @invariant()
    def hints_track_the_counts(self) -> None:
        """Pushing every waiting hint leaves each engine knowing exactly the positive-count
        blocks, and a hint never repeats what the engine knows."""
        for n, delta in self.real.take_all_hints():
            seen = self.engine_positive[n]
            assert not seen & set(delta.positive), "a block hinted positive twice"
            assert set(delta.zero) <= seen, "a block hinted zero that was not positive"
            seen |= set(delta.positive)
            seen -= set(delta.zero)
        for n in NODES:
            assert self.engine_positive[n] == set(self.real.positive_blocks(n)), n

    @invariant()
    def holdings_agree(self) -> None:
        """Every node holds the reference's blocks, as many in each tier (a host copy that
        lookups cannot see while the GPU copy is there shows here)."""
        for n in NODES:
            idx = self.real.index(n)
            want = {t: self.ref.held[n, t] for t in Tier}
            assert self.real.tree.blocks_on(idx) == want[Tier.L1] | want[Tier.L2], n
            for t in Tier:
                assert self.real.tree.held(idx, t) == len(want[t]), (n, t)

    @invariant()
    def branches_agree(self) -> None:
        assert set(self.real.branches.branches()) == set(self.ref.S) == set(self.tokens)
        for beta in self.tokens:
            assert self.real.branches.version(beta) == self.ref.S[beta].v
            for n in NODES:
                real_c = self.real.branches.counted(beta, self.real.index(n))
                assert real_c == self.ref.S[beta].C.get(n, set()), (beta, n)
        for beta in self.ended:
            assert beta not in self.real.branches

    @invariant()
    def one_node_per_phase_once_settled(self) -> None:
        for beta, phase in self.settled:
            if beta not in self.tokens:
                continue
            on = [i for i in self.real.branches.nodes_of(beta)
                  if self.real.branches.phase(i) is phase]
            assert len(on) <= 1, (beta, phase, on)

    @invariant()
    def lookups_agree(self) -> None:
        self.real.check_invariants()
        for beta in self.tokens:
            path = self._blocks(beta)
            m = self.real.match(path)
            assert m.union == self.ref.union_prefix(path)
            for n in NODES:
                idx = self.real.index(n)
                assert m.own[idx] == self.ref.own_prefix(n, path)
                assert m.own_l1[idx] == self.ref.own_prefix(n, path, Tier.L1)
            # The branch's path itself, through the slots it remembers from its last lookup
            # (or its base path's), whatever was stored, lost or reused since.
            assert self.real.match(self.real.branches.path(beta)) == m


def test_directory_agrees_with_reference() -> None:
    STEPS["n"] = 0
    run_state_machine_as_test(DirectoryMachine)
    profile = settings.get_current_profile_name()
    assert STEPS["n"] >= MIN_STEPS.get(profile, 0), f"only {STEPS['n']} steps ran"


def _assert_caught(machine: type[DirectoryMachine]) -> None:
    """The machine fails on a mutant (``machine`` runs it). No shrinking: the point is that
    the machine finds a failure, not the smallest one."""
    import pytest

    from hypothesis import Phase as HPhase

    with pytest.raises(AssertionError):
        run_state_machine_as_test(
            machine, settings=settings(max_examples=2000, stateful_step_count=60,
                                       phases=[HPhase.generate], print_blob=False,
                                       report_multiple_bugs=False))


class _IgnoresEvictions(Directory):
    """A mutant that never zeroes counts of lost blocks (Dynamo's selftest idea)."""

    def apply(self, node, event):  # type: ignore[override]
        self.tree.apply(node, event)


class _MutantMachine(DirectoryMachine):
    directory_cls = _IgnoresEvictions


def test_the_machine_catches_a_directory_that_ignores_evictions() -> None:
    _assert_caught(_MutantMachine)


class _HostCopyStaysOnGPU(Directory):
    """A mutant whose batches file a write-through's host copy under GPU memory, as a fused
    pass that sets only the GPU bits would: every counter is right, the host tier is not."""

    def apply_batch(self, node, batch):  # type: ignore[override]
        prev = None
        for event in batch.events:
            if (isinstance(prev, BlockStored) and isinstance(event, BlockStored)
                    and MEDIA[prev.medium] is Tier.L1 and MEDIA[event.medium] is Tier.L2
                    and (event.block_hashes, event.parent_block_hash, event.block_size)
                    == (prev.block_hashes, prev.parent_block_hash, prev.block_size)):
                event = msgspec.structs.replace(event, medium=prev.medium)
            self.apply(node, event)
            prev = event


class _BatchMutantMachine(DirectoryMachine):
    directory_cls = _HostCopyStaysOnGPU


def test_the_machine_catches_a_batch_that_loses_the_host_copy() -> None:
    _assert_caught(_BatchMutantMachine)


class _NativeTreeDroppingRemovals:
    """The native tree behind a wrapper that drops one event kind, BlockRemoved, from every
    batch it is given (every KV event reaches the tree in a batch)."""

    def __init__(self, tree) -> None:
        self._tree = tree

    def apply_batch(self, node, events, counts=None):
        return self._tree.apply_batch(node, [e for e in events if type(e) is not BlockRemoved],
                                      counts)

    def __getattr__(self, name):
        return getattr(self._tree, name)

    def __len__(self) -> int:
        return len(self._tree)

    def __contains__(self, block: int) -> bool:
        return block in self._tree


class _DropsRemovals(Directory):
    def __init__(self, nodes, page_size):
        super().__init__(nodes, page_size)
        self.tree._tree = _NativeTreeDroppingRemovals(self.tree._tree)


class _NativeMutantMachine(DirectoryMachine):
    directory_cls = _DropsRemovals


def test_the_machine_catches_a_native_tree_that_drops_removals() -> None:
    _assert_caught(_NativeMutantMachine)


class _NativeTreeKeepingLostBlocks(_NativeTreeDroppingRemovals):
    """The native tree applying every event but handing the blocks a node lost to no branch
    table (the directory's native KV path, tree then counts, cut in two)."""

    def apply_batch(self, node, events, counts=None):
        return self._tree.apply_batch(node, events)


class _KeepsLostBlocks(Directory):
    def __init__(self, nodes, page_size):
        super().__init__(nodes, page_size)
        self.tree._tree = _NativeTreeKeepingLostBlocks(self.tree._tree)


class _LostBlocksMutantMachine(DirectoryMachine):
    directory_cls = _KeepsLostBlocks


def test_the_machine_catches_a_native_batch_that_keeps_lost_blocks_counted() -> None:
    _assert_caught(_LostBlocksMutantMachine)


class _EventByEvent(Directory):
    """A mutant that applies a batch one event at a time, as the directory did before
    resyncs kept their counts: a block cleared and stored again in one batch loses its
    counts (and its engine's marks) though the node never let it go."""

    def apply_batch(self, node, batch):  # type: ignore[override]
        for event in batch.events:
            self.apply(node, event)


class _EventByEventMachine(DirectoryMachine):
    directory_cls = _EventByEvent


def test_the_machine_catches_a_batch_that_loses_what_it_stores_again() -> None:
    _assert_caught(_EventByEventMachine)


class _ViewLostZeroes(Directory):
    """A mutant that takes a lost view of a node's KV for an eviction of everything there
    (as the SGLang driver's ``AllBlocksCleared`` did): the branches' counts go with it."""

    def view_lost(self, node):  # type: ignore[override]
        self.apply(node, AllBlocksCleared())


class _ViewLostMachine(DirectoryMachine):
    directory_cls = _ViewLostZeroes


def test_the_machine_catches_a_lost_view_that_zeroes_counts() -> None:
    _assert_caught(_ViewLostMachine)


class _WideDirectory(Directory):
    """With 130 nodes a block's holder bits span three words (64 nodes each), so ``match``
    walks several; the 126 extra nodes come first (so the machine's nodes sit in the last
    word) and stay idle."""

    def __init__(self, nodes, page_size):
        super().__init__({**{f"idle{i}": Phase.DECODE for i in range(126)}, **nodes}, page_size)


class _WideMachine(DirectoryMachine):
    directory_cls = _WideDirectory


def test_the_general_prefix_walk_agrees_too() -> None:
    run_state_machine_as_test(_WideMachine, settings=settings(max_examples=40,
                                                              stateful_step_count=60))
