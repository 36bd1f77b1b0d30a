"""``putnam``: a decode-heavy math agent (mini-SWE-agent on PutnamBench, paper 6.1).

Sources: paper 6.1 and Figure 2(a) (Putnam is decode-heavy, "a single agent branch per problem
without context management", each request "generates a long reasoning trace"); issue 6 (long
reasoning outputs of several thousand tokens, small checker outputs, short pauses). Shape:

- system prompt: mini-SWE-agent's default system and instance templates, ~1K tokens, one
  variant shared by every agent (one harness config serves the whole benchmark);
- task: a PutnamBench problem with its Lean 4 statement, 150-1,200 tokens;
- steps: 3-24, uniform (each step: the model reasons and issues one command; the run ends when
  the proof checks or the agent gives up; we know of no published step distribution, so this
  range is an assumption), and the agent stops early once its context passes 128K tokens;
- output per step: log-normal, 90 % in 1.5K-9K tokens (median ~3.7K), clipped to 500-16K; the
  whole output stays in the context (no context management);
- checker output (Lean / shell observation): 90 % in 40-800 tokens, clipped to 10-4,000;
- pause (running the checker): 90 % in 0.5-10 s, clipped to 0.1-60 s.

None of these numbers was tuned against any system.
"""

from __future__ import annotations

import numpy as np

from evinfra.workloads.program import Agent, Call, Pause, Program, Spawn
from evinfra.workloads.sampling import LogNormal, rng_for, uniform_int
from evinfra.workloads.tokens import DEFAULT_SPACE, EMPTY, TokenSpace, synth

__all__ = ["Putnam"]

SYSTEM_TOKENS = 1_000
TASK = LogNormal(150, 1_200, 100, 2_000)
STEPS = (3, 24)
MAX_CONTEXT = 128_000
OUTPUT = LogNormal(1_500, 9_000, 500, 16_000)
OBSERVATION = LogNormal(40, 800, 10, 4_000)
PAUSE = LogNormal(0.5, 10.0, 0.1, 60.0)


class Putnam:
    """Putnam agents for one seed: ``agent(i)`` is the same agent on every call."""

    name = "putnam"

    def __init__(self, seed: int = 0, space: TokenSpace = DEFAULT_SPACE) -> None:
        self.seed = seed
        self.space = space
        self.system = synth((seed, self.name, "system"), SYSTEM_TOKENS, space)

    def agent(self, index: int) -> Agent:
        key = (self.seed, self.name, index)
        rng = rng_for(*key)
        task = synth(key + ("task",), TASK.tokens(rng), self.space)
        context = self.system.size + task.size
        return Agent(self.name, index, Spawn(self._program(key, rng, context), self.system, task))

    def _program(self, key: tuple, rng: np.random.Generator, context: int) -> Program:
        steps = uniform_int(rng, *STEPS)
        observation = EMPTY
        for step in range(steps):
            output = OUTPUT.tokens(rng)
            yield Call(observation, output, tag="reason")
            context += observation.size + output
            if step == steps - 1 or context >= MAX_CONTEXT:
                return
            yield Pause(PAUSE.draw(rng))
            observation = synth(key + (step, "check"), OBSERVATION.tokens(rng), self.space)
