"""``putnam``: a decode-heavy math agent (mini-SWE-agent on PutnamBench, paper 6.1).

Sources: paper 6.1 and Figure 2(a) (Putnam is decode-heavy, "a single agent branch per problem
without context management", each request "generates a long reasoning trace"); issue 6 (long
reasoning outputs, small checker outputs, short pauses). Shape:

- system prompt: mini-SWE-agent's default system and instance templates, ~1K tokens, one
  variant shared by every agent (one harness config serves the whole benchmark);
- task: a PutnamBench problem with its Lean 4 statement, 150-1,200 tokens;
- steps: 15-90, uniform (each step: the model reasons and issues one command; the run ends when
  the proof checks or the agent gives up), and the agent stops early once its context passes
  128K tokens;
- output per step: log-normal, 90 % in 400-2,500 tokens (median ~1K), clipped to 200-8K; the
  whole output stays in the context (no context management);
- checker output (Lean / shell observation): 90 % in 40-800 tokens, clipped to 10-4,000;
- pause (running the checker): 90 % in 0.5-10 s, clipped to 0.1-60 s.

The steps and the output per step are fitted to two measurements of the paper's baselines
(issue 39); no published statistic gives them. *Table C.1*: Dynamo loses 2.47-2.63 % of the
ideal reuse on Putnam at a 96.4-96.6 % hit rate. A PD-disaggregated baseline keeps a step's
output KV on its decode node, so the next step's prefill recomputes it: the loss is about the
previous output's share of the reusable prefix, 2.5 % here (10.8 % with the earlier 3-24 steps
of 1.5K-9K tokens, which Dynamo lost in full-scale runs: 10.5-11.0 %). *Table D.1*: evinfra's
8.81 req/s at Putnam 224 is 0.98x SGLang PD's best static split (the ratio the paper gives for
the workload whose split the symmetric engines do not move), about 9.0 req/s; this generator
gives 8.6-8.8 req/s at 2P7D and 3P6D (3.4x the earlier shape's 2.7). Nothing here was tuned
against evinfra.
"""

from __future__ import annotations

import numpy as np

from evinfra.workloads.program import Agent, Call, Pause, Program, Spawn
from evinfra.workloads.sampling import LogNormal, rng_for, uniform_int
from evinfra.workloads.tokens import DEFAULT_SPACE, EMPTY, TokenSpace, synth

__all__ = ["Putnam"]

SYSTEM_TOKENS = 1_000
TASK = LogNormal(150, 1_200, 100, 2_000)
STEPS = (15, 90)
MAX_CONTEXT = 128_000
OUTPUT = LogNormal(400, 2_500, 200, 8_000)
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
