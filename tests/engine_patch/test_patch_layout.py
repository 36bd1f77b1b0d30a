"""Host KV addresses against the real tensor layouts SGLang allocates, and transfer chunks
against a slot-by-slot copy."""

import numpy as np
import pytest

from evinfra.engine_patch.layout import address, host_layout, slot_runs, transfer_chunks

L, H, D, P, SLOTS = 3, 2, 4, 4, 32  # layers, heads, head dim, page, slots
ITEM = 2  # bf16
TB = H * D * ITEM


def buffer(name: str) -> np.ndarray:
    """A host buffer shaped as SGLang's ``init_kv_buffer`` makes it."""
    dims = {"layer_first": (2, L, SLOTS, H, D), "page_first": (2, SLOTS, L, H, D),
            "page_first_direct": (2, SLOTS // P, L, P, H, D)}[name]
    return np.zeros(dims, dtype=np.int16)


def element(name: str, kv: int, layer: int, slot: int) -> tuple:
    if name == "layer_first":
        return (kv, layer, slot, 0, 0)
    if name == "page_first":
        return (kv, slot, layer, 0, 0)
    return (kv, slot // P, layer, slot % P, 0, 0)


@pytest.mark.parametrize("name", ["layer_first", "page_first", "page_first_direct"])
def test_addresses_match_the_tensor_layout(name):
    buf = buffer(name)
    lay = host_layout(name, 1000, SLOTS, L, TB, P)
    for kv in (0, 1):
        for layer in range(L):
            for slot in (0, 1, P - 1, P, SLOTS - 1):
                want = 1000 + np.ravel_multi_index(element(name, kv, layer, slot),
                                                   buf.shape) * ITEM
                assert address(lay, kv, layer, slot) == want


def test_unsupported_layouts_and_sizes():
    with pytest.raises(ValueError, match="page_head"):
        host_layout("page_head", 0, SLOTS, L, TB, P)
    with pytest.raises(ValueError, match="multiple"):
        host_layout("layer_first", 0, SLOTS + 1, L, TB, P)


def test_slot_runs_break_where_either_side_jumps():
    assert slot_runs(np.array([4, 5, 6, 9]), np.array([0, 1, 2, 3]), P, False) == \
        [(4, 0, 3), (9, 3, 1)]
    assert slot_runs(np.array([2, 3, 4, 5]), np.array([10, 11, 12, 13]), P, True) == \
        [(2, 10, 2), (4, 12, 2)]
    assert slot_runs(np.array([], dtype=np.int64), np.array([], dtype=np.int64), P, True) == []


@pytest.mark.parametrize("name", ["layer_first", "page_first", "page_first_direct"])
def test_chunks_copy_exactly_the_named_slots(name):
    rng = np.random.default_rng(1)
    remote = rng.integers(0, 1 << 14, size=buffer(name).shape).astype(np.int16)
    local = np.zeros_like(remote)
    rbase, lbase = 1 << 20, 1 << 24
    rl = host_layout(name, rbase, SLOTS, L, TB, P)
    ll = host_layout(name, lbase, SLOTS, L, TB, P)
    # Three pages, the remote ones out of order, as a radix tree hands them out.
    remote_slots = [*range(12, 16), *range(4, 8), *range(28, 32)]
    local_slots = [*range(0, 8), *range(16, 20)]
    la, ra, ln = transfer_chunks(ll, rl, local_slots, remote_slots)
    rb, lb = remote.view(np.uint8).reshape(-1), local.view(np.uint8).reshape(-1)
    for a, b, n in zip(la, ra, ln):
        lb[a - lbase: a - lbase + n] = rb[b - rbase: b - rbase + n]
    want = np.zeros_like(remote)
    for dst, src in zip(local_slots, remote_slots):
        for kv in (0, 1):
            for layer in range(L):
                want[element(name, kv, layer, dst)[:-2]] = remote[element(name, kv, layer, src)[:-2]]
    assert np.array_equal(local, want)
    # Merged, not one chunk per token: contiguous runs of the same page go together.
    assert len(ln) <= 2 * L * 3


def test_geometries_must_match():
    a = host_layout("layer_first", 0, SLOTS, L, TB, P)
    b = host_layout("layer_first", 0, SLOTS * 2, L, TB, P)  # a bigger host tier is fine
    assert transfer_chunks(a, b, [0], [5])[2] == [TB] * 2 * L
    with pytest.raises(ValueError, match="geometry"):
        transfer_chunks(a, host_layout("layer_first", 0, SLOTS, L + 1, TB, P), [0], [0])


def test_an_mla_layout_has_one_plane_and_never_meets_an_mha_one():
    mla = host_layout("layer_first", 0, SLOTS, L, TB, P, planes=1)
    assert mla.planes == 1 and transfer_chunks(mla, mla, [0], [5])[2] == [TB] * L
    mha = host_layout("layer_first", 0, SLOTS, L, TB, P)
    with pytest.raises(ValueError, match="geometry"):
        transfer_chunks(mla, mha, [0], [0])
    with pytest.raises(ValueError, match="planes"):
        host_layout("layer_first", 0, SLOTS, L, TB, P, planes=3)
