"""The SGLang Model Gateway's sticky sessions (its ``manual`` policy keyed by agent): an
agent and the branches it forks or spawns stay on one prefill node while it is eligible."""

from types import SimpleNamespace

from baseline_harness import Sim, config, tokens

from evinfra.baselines import PolicyConfig, resolve
from evinfra.baselines.sticky import Sticky, StickyConfig


def view(branch, nodes, parent=None, now=0.0):
    return SimpleNamespace(branch=branch, parent=parent, nodes=nodes, now=now)


NODES = ["n0", "n1", "n2", "n3"]


def test_an_agent_and_its_branches_share_a_node_and_agents_spread() -> None:
    s = Sticky(StickyConfig())
    first = s.select(view("a:0", NODES))
    assert s.last_rule == "vacant"
    assert s.select(view("a:0", NODES)) == first and s.last_rule == "hit"
    # A sub-agent of a sub-agent: the root's key, the root's node.
    assert s.select(view("a:0.0", NODES, parent="a:0")) == first
    assert s.select(view("a:0.0.1", NODES, parent="a:0.0")) == first
    assert s.key("a:0.0.1", None) == "a:0"
    # Control: the same branch without its parent hint is a session of its own.
    assert s.key("b:0.0", None) == "b:0.0"
    # New sessions are drawn uniformly, not all on one node.
    picked = {s.select(view(f"agent{i}:0", NODES)) for i in range(40)}
    assert picked == set(NODES)


def test_failover_keeps_two_candidates_and_comes_back() -> None:
    s = Sticky(StickyConfig())
    home = s.select(view("a:0", NODES))
    rest = [n for n in NODES if n != home]
    other = s.select(view("a:0", rest))  # home drained or switching: fail over
    assert other != home and s.last_rule == "miss"
    assert s.select(view("a:0", NODES)) == home  # home is back, and first in the entry
    assert s.select(view("a:0", rest)) == other and s.last_rule == "hit"
    third = s.select(view("a:0", [n for n in rest if n != other]))
    assert third not in (home, other)
    assert s.entries["a:0"].candidates == [other, third]  # at most two: home dropped


def test_idle_sessions_are_evicted_on_the_gateways_interval() -> None:
    s = Sticky(StickyConfig(max_idle_s=100.0, eviction_interval_s=60.0))
    s.select(view("a:0", NODES, now=0.0))
    s.select(view("a:0.1", NODES, parent="a:0", now=0.0))
    s.select(view("b:0", NODES, now=50.0))
    assert s.key("a:0.1", None) == "a:0"  # remembered while the session lives
    s.select(view("c:0", NODES, now=120.0))  # the first check, at 60 s: a idle 120 s
    assert set(s.entries) == {"b:0", "c:0"}
    assert s.key("a:0.1", None) == "a:0.1"  # its branches' keys went with it
    s.select(view("c:0", NODES, now=170.0))  # before the next check (180 s)
    assert "b:0" in s.entries
    s.select(view("c:0", NODES, now=200.0))
    assert set(s.entries) == {"c:0"}


def test_the_sticky_preset_routes_a_sessions_requests_to_one_prefill_node() -> None:
    assert resolve(PolicyConfig(name="sticky-sglang")).router == "sticky"
    assert resolve(PolicyConfig(name="sticky-sglang")).peer_fetch == "none"
    nodes = {}
    for policy in ("sticky-sglang", "static-sglang"):
        sim = Sim(config(policy, nodes=5, prefill=3))
        sim.run(1.0)
        sinks = {}
        # Agent x: its root, then two sub-agents with unrelated prompts; agent y likewise.
        for agent, seed in (("x", 10), ("y", 20)):
            sinks[f"{agent}0"] = sim.submit(f"{agent}0", tokens(2000, seed), f"{agent}:0")
            sim.run(sim.clock.now() + 5.0)
            for k in range(2):
                sinks[f"{agent}{k + 1}"] = sim.submit(
                    f"{agent}{k + 1}", tokens(2000, seed + k + 1), f"{agent}:0.{k}",
                    parent=f"{agent}:0")
                sim.run(sim.clock.now() + 5.0)
        sim.run(sim.clock.now() + 30.0)
        assert all(s.record is not None and s.record.status == "ok" for s in sinks.values())
        nodes[policy] = {k: s.record.prefill_node for k, s in sinks.items()}
    sticky = nodes["sticky-sglang"]
    assert len({sticky[f"x{i}"] for i in range(3)}) == 1
    assert len({sticky[f"y{i}"] for i in range(3)}) == 1
    # Control: cache-aware routing sends the sub-agents' unrelated prompts to the smallest
    # tree, away from their agent's node.
    ca = nodes["static-sglang"]
    assert len({ca[f"x{i}"] for i in range(3)}) > 1
