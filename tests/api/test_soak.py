"""A bounded-memory soak: rounds of agents, each a branch of growing prompts over HTTP, half
ending their branch (``X-Evinfra-Branch-Final``), half just going quiet until
``server.branch_idle_s`` ends it; after each round the process's RSS, the directory's
entries and the live branches. They must level off: every branch gone once expired, the
directory's entries bounded by what the engines hold, RSS flat after the first rounds.

Where memory is kept, and why it is bounded: the directory's ``(block, node)`` entries mirror
the engines' KV caches (``[fake] l1_tokens``/``l2_tokens`` here, the GPU and host memory of a
real engine), so they stop growing once the caches are full and evict; a branch's counts and
last context live until it ends or idles out; stored responses and request bodies are bounded
by ``[limits]``. Python keeps its freed memory in its own pools, so RSS levels off at a
plateau rather than coming back down.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tests.api.conftest import body, eventually

ROUNDS = 8
AGENTS = 24
TURNS = 3
PAGE = 64
SOAK = {"server": {"branch_idle_s": 0.5, "inferred_branch_idle_s": 0.5},
        # Small KV caches, so that they fill within the soak: 48 pages of GPU, 192 of host.
        "fake": {"l1_tokens": 48 * PAGE, "l2_tokens": 192 * PAGE}}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


async def agent(client, rng: np.random.Generator, name: str, final: bool) -> None:
    context = rng.integers(1000, 30000, size=int(rng.integers(3, 8)) * PAGE).tolist()
    for turn in range(TURNS):
        last = turn == TURNS - 1
        # (the session's own post: TestClient.post keeps every response until the end)
        async with client.session.post(client.make_url("/v1/completions"), data=body(
                model="evinfra-fake", prompt=context, max_tokens=8, ignore_eos=True,
                return_token_ids=True), headers={
                "X-Evinfra-Branch-Id": name,
                "X-Evinfra-Branch-Final": "true" if final and last else "false"}) as r:
            assert r.status == 200, await r.text()
            out = (await r.json())["choices"][0]["token_ids"]
        context = context + out + rng.integers(1000, 30000, size=PAGE).tolist()


@pytest.mark.parametrize("config_overrides", [SOAK])
async def test_rss_and_directory_entries_level_off(client, service, config_overrides):
    rng = np.random.default_rng(0)
    curve = []
    for round_ in range(ROUNDS):
        await asyncio.gather(*(agent(client, rng, f"r{round_}-a{i}", final=i % 2 == 0)
                               for i in range(AGENTS)))
        # Every branch of the round ends: half said so, the rest idle out.
        assert await eventually(lambda: len(service.directory.branches) == 0, 10.0), \
            len(service.directory.branches)
        summary = service.directory.summary()
        curve.append((rss_bytes() / 2**20, summary["entries"], summary["blocks"]))
    print("\nround  RSS MiB  entries  blocks")
    for i, (rss, entries, blocks) in enumerate(curve):
        print(f"{i:>5} {rss:>8.1f} {entries:>8} {blocks:>7}")
    nodes = len(service.nodes)
    entries = [e for _, e, _ in curve]
    # Bounded by the caches: at most every node's GPU and host pages.
    assert max(entries) <= nodes * (48 + 192)
    # Level: the second half holds no more than the first half's peak (the caches filled),
    # and RSS grows by under 8 MiB over the second half.
    half = ROUNDS // 2
    assert max(entries[half:]) <= max(entries[:half]) * 1.05 + nodes
    rss = [r for r, _, _ in curve]
    assert rss[-1] - rss[half - 1] < 8.0, rss
    # Control: the caches did fill (so the bound is what held the entries, not idleness),
    # and 8 x 24 agents x 3 turns went through.
    assert max(entries) >= nodes * 48
    assert service.counters.ok == ROUNDS * AGENTS * TURNS
