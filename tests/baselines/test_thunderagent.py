"""ThunderAgent's program pausing on the prefill choice: programs waiting for tools are paused
once a node's programs exceed 95 % of its GPU-plus-host capacity, never below (paper D.5)."""

from types import SimpleNamespace

from evinfra.baselines.thunderagent import ProgramScheduler, ThunderAgentConfig
from evinfra.router.strategy import Hold

CAP = 10_000  # tokens of KV per node (GPU plus host)


class First:
    """An inner strategy that always takes the first node."""

    def choose(self, view):
        return SimpleNamespace(node=view.nodes[0])

    def routed(self, request, node, view):
        pass

    def prefill_done(self, request, node):
        pass

    def finished(self, request, now):
        pass

    def released(self, now):
        return []


def view(request, branch, need, now, nodes=("a",), final=False):
    return SimpleNamespace(request=request, branch=branch, need=need, now=now, final=final,
                           nodes=list(nodes), capacity=lambda n: CAP,
                           predict=lambda n: SimpleNamespace(node=n))


def serve(s: ProgramScheduler, request, branch, need, now, final=False, nodes=("a",)):
    """Route a request and finish it at once (the program then waits for a tool)."""
    v = view(request, branch, need, now, nodes, final)
    choice = s.choose(v)
    if isinstance(choice, Hold):
        return choice
    s.routed(request, choice.node, v)
    s.finished(request, now)
    return choice.node


def test_no_pause_at_or_below_the_threshold() -> None:
    s = ProgramScheduler(ThunderAgentConfig(), First())
    # Three programs of 3,066 tokens plus a 100-token buffer each: 9,498 <= 9,500.
    for i, b in enumerate("xyz"):
        serve(s, f"r{i}", b, 3066, now=0.0)
    serve(s, "r9", "x", 3066, now=10.0)
    assert s.used("a") == 9498 and s.pauses == 0
    assert not any(p.paused for p in s.programs.values())


def test_programs_waiting_for_tools_pause_above_it_smallest_first() -> None:
    s = ProgramScheduler(ThunderAgentConfig(), First())
    serve(s, "r1", "big", 5000, now=0.0)
    serve(s, "r2", "small", 2000, now=0.0)
    serve(s, "r3", "mid", 3000, now=0.0)  # 10,300 tokens in use > 9,500
    serve(s, "r4", "big", 5000, now=6.0)  # the next check: pause the smallest acting program
    assert s.pauses == 1 and s.programs["small"].paused
    assert s.used("a") <= 0.95 * CAP
    held = serve(s, "r5", "small", 2000, now=7.0)  # its next request is held
    assert isinstance(held, Hold) and s.released(7.0) == []
    s.programs["big"].tokens = 1000  # the big program's context shrank (e.g. compaction)
    assert s.released(12.0) == ["r5"]  # resumed onto the node with room
    assert not s.programs["small"].paused


def test_finished_programs_release_their_tokens_at_once() -> None:
    s = ProgramScheduler(ThunderAgentConfig(), First())
    serve(s, "r1", "done", 9000, now=0.0, final=True)  # the harness marked its last request
    assert "done" not in s.programs and s.used("a") == 0
