"""``codex``: an OpenAI-Codex-CLI-like coding agent, the second trace family of paper D.2
("we replay the Claude Code and Codex traces").

Sources: the Codex CLI (openai/codex, ``codex-rs``): every tool result the model sees is cut
to 10 KiB or 256 lines (``MODEL_FORMAT_MAX_BYTES``, ``MODEL_FORMAT_MAX_LINES``; about 2,500
tokens at 4 bytes per token), the effective window of its GPT-5 Codex models is 272K tokens
(400K less 128K of output; openai/codex#9429) and auto-compaction fires at 90 % of it
(``auto_compact_token_limit``), keeping the summary and the most recent user messages up to
20K tokens (``COMPACT_USER_MESSAGE_MAX_TOKENS``); a headless session runs long chains of shell
commands (openai/codex#16033: 86 commands, about 242K tokens of output, 2.8K each). Shape of
one agent (a session), where it differs from ``cc``:

- instructions and tool definitions (shell, apply_patch, update_plan): one of 3 variants
  shared by all agents, 3K-10K tokens; then the repository's AGENTS.md and the environment
  context (300-2,500 tokens) and the user's prompt (90 % in 20-400 tokens);
- turns: 1-4 user turns; the user pauses 90 % in 20-900 s between them (clipped to 5 s-1 h)
  and writes 10-300 tokens (90 %);
- each turn: 5-60 tool steps (Codex works through a task without asking), then a reply.
  A step is reasoning (90 % in 30-1,500 tokens, not kept in the context) and a call: a shell
  command (90 % in 20-200 tokens) or, one step in four, a patch (90 % in 100-2,000); the
  reply's visible part is 90 % in 50-800 tokens;
- tools: shell commands are fast, 90 % in 0.3-15 s (clipped to 0.1-600 s: test suites and
  builds take minutes), their result 90 % in 80-4,000 tokens before the cut at 2,560 (the
  10 KiB cap; about a quarter are cut, as #16033's 2.8K-token mean output suggests);
- no sub-agents (the CLI runs one agent per session);
- compaction past 244,800 tokens (90 % of 272K): the history and a 400-token instruction
  go out, the summary comes back (90 % in 1K-6K tokens), and the agent goes on from its
  instructions, the summary and its user messages so far (at most 20K tokens).

Step counts, pauses and size ranges are assumptions where no source gives them; none was
tuned against any system. Compared with ``cc``: shorter system prompts, many more and smaller
steps, shorter tool pauses: more, shorter prefills on longer shared prefixes, a decode-heavier
mix than ``cc`` (what D.2's partitions shifting between the two traces feel).
"""

from __future__ import annotations

import numpy as np

from evinfra.workloads.program import Agent, Call, Compact, Pause, Program, Spawn
from evinfra.workloads.sampling import LogNormal, rng_for, uniform_int
from evinfra.workloads.tokens import DEFAULT_SPACE, EMPTY, TokenSpace, synth

__all__ = ["Codex"]

SYSTEM_VARIANTS = 3
SYSTEM = (3_000, 10_000)
PROJECT = (300, 2_500)
USER_PROMPT = LogNormal(20, 400, 5, 3_000)
TURNS = (1, 4)
USER_PAUSE = LogNormal(20.0, 900.0, 5.0, 3_600.0)
USER_MESSAGE = LogNormal(10, 300, 2, 3_000)
STEPS = (5, 60)
REASONING = LogNormal(30, 1_500, 0, 6_000)
SHELL_CALL = LogNormal(20, 200, 10, 1_000)
PATCH_P = 0.25
PATCH = LogNormal(100, 2_000, 30, 8_000)
REPLY = LogNormal(50, 800, 10, 4_000)
TOOL_PAUSE = LogNormal(0.3, 15.0, 0.1, 600.0)
TOOL_RESULT = LogNormal(80, 4_000, 5, 60_000)
RESULT_CAP = 2_560
COMPACT_AT = 244_800
COMPACT_PROMPT = 400
SUMMARY = LogNormal(1_000, 6_000, 500, 12_000)
KEPT_USER = 20_000


class Codex:
    """Codex-like agents for one seed: ``agent(i)`` is the same agent on every call."""

    name = "codex"

    def __init__(self, seed: int = 0, space: TokenSpace = DEFAULT_SPACE) -> None:
        self.seed = seed
        self.space = space
        self.systems = [self._variant(v) for v in range(SYSTEM_VARIANTS)]
        self.compact_prompt = synth((seed, self.name, "compact-prompt"), COMPACT_PROMPT, space)

    def _variant(self, v: int) -> np.ndarray:
        key = (self.seed, self.name, "system", v)
        return synth(key, uniform_int(rng_for(*key), *SYSTEM), self.space)

    def agent(self, index: int) -> Agent:
        key = (self.seed, self.name, index)
        rng = rng_for(*key)
        system = self.systems[int(rng.integers(SYSTEM_VARIANTS))]
        prompt = USER_PROMPT.tokens(rng)
        task = synth(key + ("task",), uniform_int(rng, *PROJECT) + prompt, self.space)
        program = self._main(key, rng, system, system.size + task.size, prompt)
        return Agent(self.name, index, Spawn(program, system, task))

    def _main(self, key: tuple, rng: np.random.Generator, system: np.ndarray, context: int,
              user: int) -> Program:
        pending, tag = EMPTY, "user"
        for turn in range(uniform_int(rng, *TURNS)):
            if turn:
                yield Pause(USER_PAUSE.draw(rng))
                message = USER_MESSAGE.tokens(rng)
                user += message
                pending, tag = synth(key + (turn, "user"), message, self.space), "user"
            steps = uniform_int(rng, *STEPS)
            for step in range(steps + 1):
                at = key + (turn, step)
                if context + pending.size > COMPACT_AT:
                    summary = SUMMARY.tokens(rng)
                    yield Call(np.concatenate([pending, self.compact_prompt]), summary,
                               tag="compact")
                    kept = synth(at + ("users",), min(user, KEPT_USER), self.space)
                    yield Compact(kept)
                    context = system.size + summary + kept.size
                    pending, tag = EMPTY, "resume"
                reply = step == steps
                visible = (REPLY if reply else PATCH if rng.random() < PATCH_P
                           else SHELL_CALL).tokens(rng)
                yield Call(pending, REASONING.tokens(rng) + visible, keep=visible, tag=tag)
                context += pending.size + visible
                if reply:
                    break
                yield Pause(TOOL_PAUSE.draw(rng))
                result = min(TOOL_RESULT.tokens(rng), RESULT_CAP)
                pending, tag = synth(at + ("tool",), result, self.space), "tool"
