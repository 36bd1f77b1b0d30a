"""``cc``: a Claude-Code-like coding agent, the workload that exercises context management most.

Sources: paper 2.1, 6.1 and Figure 2(c) (the CC traces "interleave sub-agents, compactions, and
long pauses between requests"; 98 % of the prompt after a 359 s sub-agent call matches earlier
KV, 14 % after a 12 s compaction; the median gap between turns in GitHub Copilot is 172 s);
issue 6 (8-20K system prompt and tools, tool pauses mostly 2-30 s, user pauses of minutes,
parallel sub-agents with fresh contexts, compaction near the context limit, thinking not
carried into the next context); Anthropic's docs on sub-agents and compaction (paper refs
[6, 7]). Shape of one agent (a session):

- system prompt and tool definitions: one of 4 variants shared by all agents (as deployments
  share a harness version), each 8K-20K tokens; then a per-agent project context (CLAUDE.md,
  environment: 500-3,000 tokens) and the user's prompt (90 % in 30-600 tokens);
- turns: 1-6 user turns; between turns the user pauses, 90 % in 30-990 s (median 172 s, the
  Copilot median), clipped to 5 s-1 h, and writes 10-400 tokens (90 %);
- each turn: 1-20 tool steps, then a text reply. A step's output is thinking (90 % in 50-2,000
  tokens) followed by a tool call (90 % in 40-600); a reply's visible part is 90 % in
  80-1,500 tokens. Only the visible part stays in the context (``keep < output``);
- tools: the pause is 90 % in 2-30 s (clipped to 0.2-600 s), the result 90 % in 60-8,000 tokens,
  clipped to 25K (Claude Code caps a file read at 25K tokens);
- sub-agents: at each step, with probability 0.06, the agent starts 1-3 sub-agents in parallel
  (Task tool) and waits for all of them; each has a fresh context (one of 2 shared sub-agent
  system variants of 3K-8K tokens, and a task of 90 % 100-800 tokens), runs 3-25 tool steps as
  above and ends with a report of 90 % 300-2,500 tokens, which the parent appends;
- compaction: when the context would pass 167K tokens (a 200K window less 20K reserved for
  output and a 13K buffer, the auto-compact constants reported for Claude Code), the agent
  sends a compaction request (the history, the pending tool result and a fixed 600-token
  instruction; output 90 % in 2K-12K tokens, all summary), then continues on the system prompt,
  that summary, 0-5 re-read files of 500-5,000 tokens each (Claude Code restores at most 5
  files of 5K tokens) and a 100-300-token continuation prompt.

The sub-agent rate, step counts and size ranges are assumptions where no source gives them;
none was tuned against any system. What the shape implies for Fig. 2(c): after a join, the
new tokens are the reports (a few K on a context of tens of K), so reuse stays high; after a
compaction, only the system prompt precedes content no earlier request computed at that
position (the summary was produced after the old history), so reuse drops to the system
prompt's share.
"""

from __future__ import annotations

import numpy as np

from evinfra.workloads.program import Agent, Call, Compact, Join, Pause, Program, Spawn
from evinfra.workloads.sampling import LogNormal, rng_for, uniform_int
from evinfra.workloads.tokens import DEFAULT_SPACE, EMPTY, TokenSpace, synth

__all__ = ["CC"]

SYSTEM_VARIANTS = 4
SYSTEM = (8_000, 20_000)
PROJECT = (500, 3_000)
USER_PROMPT = LogNormal(30, 600, 5, 4_000)
TURNS = (1, 6)
USER_PAUSE = LogNormal(30.0, 990.0, 5.0, 3_600.0)
USER_MESSAGE = LogNormal(10, 400, 2, 4_000)
STEPS = (1, 20)
THINKING = LogNormal(50, 2_000, 0, 8_000)
TOOL_CALL = LogNormal(40, 600, 20, 4_000)
REPLY = LogNormal(80, 1_500, 20, 6_000)
TOOL_PAUSE = LogNormal(2.0, 30.0, 0.2, 600.0)
TOOL_RESULT = LogNormal(60, 8_000, 10, 25_000)
SUB_AGENT_P = 0.06
SUB_AGENTS = (1, 3)
SUB_SYSTEM_VARIANTS = 2
SUB_SYSTEM = (3_000, 8_000)
SUB_TASK = LogNormal(100, 800, 30, 3_000)
SUB_STEPS = (3, 25)
SUB_REPORT = LogNormal(300, 2_500, 100, 6_000)
COMPACT_AT = 167_000
COMPACT_PROMPT = 600
SUMMARY = LogNormal(2_000, 12_000, 1_000, 20_000)
RESTORED_FILES = (0, 5)
RESTORED_FILE = (500, 5_000)
CONTINUATION = (100, 300)


class CC:
    """Claude-Code-like agents for one seed: ``agent(i)`` is the same agent on every call."""

    name = "cc"

    def __init__(self, seed: int = 0, space: TokenSpace = DEFAULT_SPACE) -> None:
        self.seed = seed
        self.space = space
        self.systems = [self._variant("system", v, SYSTEM) for v in range(SYSTEM_VARIANTS)]
        self.sub_systems = [
            self._variant("sub-system", v, SUB_SYSTEM) for v in range(SUB_SYSTEM_VARIANTS)
        ]
        self.compact_prompt = synth((seed, self.name, "compact-prompt"), COMPACT_PROMPT, space)

    def _variant(self, kind: str, v: int, size: tuple[int, int]) -> np.ndarray:
        key = (self.seed, self.name, kind, v)
        return synth(key, uniform_int(rng_for(*key), *size), self.space)

    def agent(self, index: int) -> Agent:
        key = (self.seed, self.name, index)
        rng = rng_for(*key)
        system = self.systems[int(rng.integers(SYSTEM_VARIANTS))]
        task = synth(key + ("task",), uniform_int(rng, *PROJECT) + USER_PROMPT.tokens(rng),
                     self.space)
        program = self._main(key, rng, system, system.size + task.size)
        return Agent(self.name, index, Spawn(program, system, task))

    def _tokens(self, key: tuple, n: int) -> np.ndarray:
        return synth(key, n, self.space)

    def _main(self, key: tuple, rng: np.random.Generator, system: np.ndarray,
              context: int) -> Program:
        pending, tag = EMPTY, "user"
        for turn in range(uniform_int(rng, *TURNS)):
            if turn:
                yield Pause(USER_PAUSE.draw(rng))
                pending, tag = self._tokens(key + (turn, "user"), USER_MESSAGE.tokens(rng)), "user"
            steps = uniform_int(rng, *STEPS)
            for step in range(steps + 1):
                at = key + (turn, step)
                if context + pending.size > COMPACT_AT:
                    summary = SUMMARY.tokens(rng)
                    yield Call(np.concatenate([pending, self.compact_prompt]), summary,
                               tag="compact")
                    restored = self._tokens(at + ("restore",), sum(
                        uniform_int(rng, *RESTORED_FILE)
                        for _ in range(uniform_int(rng, *RESTORED_FILES))))
                    yield Compact(restored)
                    context = system.size + summary + restored.size
                    pending = self._tokens(at + ("continue",), uniform_int(rng, *CONTINUATION))
                    tag = "resume"
                reply = step == steps
                visible = REPLY.tokens(rng) if reply else TOOL_CALL.tokens(rng)
                yield Call(pending, THINKING.tokens(rng) + visible, keep=visible, tag=tag)
                context += pending.size + visible
                if reply:
                    break
                if rng.random() < SUB_AGENT_P:
                    reports = [SUB_REPORT.tokens(rng) for _ in range(uniform_int(rng, *SUB_AGENTS))]
                    for j, report in enumerate(reports):
                        yield self._spawn(at + (j, "sub"), report)
                    yield Join()
                    context += sum(reports)
                    pending, tag = EMPTY, "subagent"
                else:
                    yield Pause(TOOL_PAUSE.draw(rng))
                    pending, tag = self._tokens(at + ("tool",), TOOL_RESULT.tokens(rng)), "tool"

    def _spawn(self, key: tuple, report: int) -> Spawn:
        """A sub-agent whose last output is a ``report``-token result for its parent."""
        rng = rng_for(*key)
        system = self.sub_systems[int(rng.integers(SUB_SYSTEM_VARIANTS))]
        task = self._tokens(key + ("task",), SUB_TASK.tokens(rng))
        return Spawn(self._sub(key, rng, report), system, task)

    def _sub(self, key: tuple, rng: np.random.Generator, report: int) -> Program:
        pending, tag = EMPTY, "task"
        steps = uniform_int(rng, *SUB_STEPS)
        for step in range(steps):
            visible = TOOL_CALL.tokens(rng)
            yield Call(pending, THINKING.tokens(rng) + visible, keep=visible, tag=tag)
            yield Pause(TOOL_PAUSE.draw(rng))
            pending, tag = self._tokens(key + (step, "tool"), TOOL_RESULT.tokens(rng)), "tool"
        yield Call(pending, THINKING.tokens(rng) + report, keep=report, tag="report")
