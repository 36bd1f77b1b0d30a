from evinfra.core.contracts import HintDelta
from evinfra.directory import HostEvictionOrder, eviction_order


def test_eviction_order_zero_counts_first_lru_within_groups() -> None:
    host = {1: 5.0, 2: 1.0, 3: 3.0, 4: 2.0}
    counts = {2: 1, 4: 2}
    assert list(eviction_order(host, counts)) == [3, 1, 2, 4]
    assert list(eviction_order(host, counts, pinned={3})) == [1, 2, 4]


def test_engine_order_follows_hints() -> None:
    o = HostEvictionOrder()
    o.apply_hints(HintDelta(positive=[2, 9], zero=[]))  # 9 is not stored yet
    for h in (1, 2, 3):
        o.touch_all((h,))
    assert list(o.victims()) == [1, 3, 2]
    o.touch_all((9,))
    o.touch_all((1,))
    assert list(o.victims()) == [3, 1, 2, 9]
    o.apply_hints(HintDelta(positive=[3], zero=[2]))
    assert list(o.victims()) == [1, 2, 9, 3]
    assert list(o.victims(pinned=lambda h: h == 1)) == [2, 9, 3]
    o.remove_all((2,))
    assert 2 not in o and len(o) == 3
    o.reset_hints([1])
    assert list(o.victims()) == [9, 3, 1]
    o.apply_hints(HintDelta(positive=[9], zero=[], replace=True))  # a resync through the hints
    assert list(o.victims()) == [3, 1, 9] and o.positive == {9}


def test_plain_lru_for_baselines_ignores_hints() -> None:
    o = HostEvictionOrder(count_aware=False)
    o.apply_hints(HintDelta(positive=[1], zero=[]))
    for h in (1, 2):
        o.touch_all((h,))
    assert list(o.victims()) == [1, 2]


def test_whole_segment_operations_match_one_block_at_a_time() -> None:
    import random

    rnd = random.Random(7)
    for aware in (True, False):
        one, many = HostEvictionOrder(aware), HostEvictionOrder(aware)
        for _ in range(200):
            blocks = rnd.sample(range(40), rnd.randint(1, 8))
            if rnd.random() < 0.3:
                delta = HintDelta(sorted(set(blocks[:3])), sorted(set(blocks[3:5])))
                one.apply_hints(delta)
                many.apply_hints(delta)
            elif rnd.random() < 0.2:
                for h in blocks:  # blocks of both groups, held or not
                    one.remove_all((h,))
                many.remove_all(blocks)
            else:
                if rnd.random() < 0.2:  # a repeated block is touched again, in place
                    blocks += blocks[:2]
                for h in blocks:
                    one.touch_all((h,))
                many.touch_all(blocks)
            assert list(one.victims()) == list(many.victims())
            one.check_invariants()
            many.check_invariants()
