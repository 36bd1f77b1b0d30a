"""The agent's identity (``evinfra/partitions/identity.py``): which header wins, keys hidden,
the book bounded; and through the HTTP API, ``/v1/evinfra/status`` lists the agents served."""

from __future__ import annotations

from evinfra.partitions.identity import IDENTITY_HEADERS, AgentBook, agent_of


def test_the_first_header_present_is_the_identity():
    every = {h: f"v-{i}" for i, h in enumerate(IDENTITY_HEADERS)}
    # Dropping the headers one by one from the front hands the identity down the list.
    for i, h in enumerate(IDENTITY_HEADERS):
        rest = {k: every[k] for k in IDENTITY_HEADERS[i:]}
        want = f"v-{i}" if h not in ("Authorization", "x-api-key") else None
        got = agent_of(rest)
        assert got == want if want else got.startswith("key:")
    assert agent_of({}) is None
    assert agent_of({"X-Evinfra-Agent": "  "}) is None  # blank is absent


def test_a_sub_agent_is_its_parents_and_a_root_its_own():
    root = {"X-Dynamo-Session-ID": "run-42"}
    sub = {"X-Dynamo-Session-ID": "run-42:researcher", "X-Dynamo-Parent-Session-ID": "run-42"}
    assert agent_of(root) == agent_of(sub) == "run-42"
    ours = {"X-Evinfra-Branch-Id": "b2", "X-Evinfra-Parent-Branch-Id": "b1"}
    assert agent_of(ours) == "b1" and agent_of({"X-Evinfra-Branch-Id": "b1"}) == "b1"


def test_an_api_key_names_its_user_without_showing_the_key():
    a = agent_of({"Authorization": "Bearer sk-secret"})
    assert a.startswith("key:") and "secret" not in a
    assert a == agent_of({"Authorization": "Bearer sk-secret"})
    assert a != agent_of({"Authorization": "Bearer sk-other"})
    assert agent_of({"x-api-key": "sk-secret"}).startswith("key:")


def test_the_book_keeps_the_most_recent_agents():
    book = AgentBook(capacity=2)
    book.saw("a", 1.0)
    book.saw("b", 2.0)
    book.saw("a", 3.0)
    book.saw("c", 4.0)  # b is the least recent: it goes
    s = book.status()
    assert s["count"] == 2 and set(s["agents"]) == {"a", "c"}
    assert s["agents"]["a"] == {"requests": 2, "last_seen": 3.0}
