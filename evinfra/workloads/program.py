"""The agent model: an agent is a tree of branches, a branch runs a program of ops.

A branch (paper 1, E.1) is one context and its sequence of requests. Its *program* is a lazy,
deterministic iterator of the ops below; the runner (``runner.py``) interprets it against a
backend. The program never sees a response: every choice it makes (lengths, pauses, when to
spawn) is drawn from its own seeded generator when the op is pulled, so a workload is the same
stream of ops whatever the backend's timing. What the backend decides, the output token ids,
only enters the context through the runner, which follows these rules (paper 2.1):

- a request's input is the branch context plus the ``append`` of its :class:`Call`;
- after the call, the context is that input plus the call's *visible* output: the last
  ``keep`` output tokens (reasoning comes first in an output and harnesses drop it from the
  next context, as Claude Code does with earlier turns' thinking; ``keep=None`` keeps all);
- :class:`Fork` starts a new branch on the same context; :class:`Spawn` starts a sub-agent on a
  fresh context (its own system prompt and task); both run in parallel with their parent;
- :class:`Join` waits for children and appends each one's *result*: the visible output of its
  last call (a Claude Code sub-agent's final message is what its Task tool returns);
- :class:`Compact` rewrites the context as the system prompt, the visible output of the
  branch's last call (the summary a compaction request just produced), and ``append`` (what the
  harness re-attaches: recently read files, a continuation prompt);
- :class:`Reset` sets the context to given tokens (trace replay, where each row is a prompt);
- the branch ends when its program is exhausted; its last request carries ``final=True``.

A failed call counts as a call with no output: the branch goes on as its program says, so a
run keeps its shape (and its branch-end reports) through errors.

Ops hold token arrays (uint32, treated as immutable) and child programs; they are built by the
generators (``putnam.py``, ``osworld.py``, ``cc.py``) and the trace readers (``traces.py``,
``agentic.py``). A forked branch keeps its parent's system prompt for :class:`Compact`.
"""

from __future__ import annotations

from typing import Iterator, Protocol, Union

import msgspec
import numpy as np

from evinfra.workloads.tokens import EMPTY

__all__ = [
    "Agent", "Call", "Compact", "Fork", "Join", "Op", "Pause", "Program", "Reset", "Spawn",
    "Workload",
]


class Call(msgspec.Struct, frozen=True, gc=False):
    """Send one request: input = context + ``append``; ``output`` tokens are forced
    (``max_tokens`` with ``ignore_eos``); the last ``keep`` of them (all if None) stay in the
    context. ``tag`` labels the request in the records (e.g. ``"compact"``)."""

    append: np.ndarray
    output: int
    keep: int | None = None
    tag: str = ""

    def __post_init__(self) -> None:
        if self.output < 1 or (self.keep is not None and not 0 <= self.keep <= self.output):
            raise ValueError(f"bad call lengths output={self.output} keep={self.keep}")


class Pause(msgspec.Struct, frozen=True, gc=False):
    """Wait ``seconds`` (a tool, the user, a recorded delay) before the next op."""

    seconds: float


class Fork(msgspec.Struct, frozen=True):
    """Start ``program`` as a new branch on this branch's current context."""

    program: "Program"


class Spawn(msgspec.Struct, frozen=True):
    """Start ``program`` as a sub-agent branch whose context is ``system + task``."""

    program: "Program"
    system: np.ndarray = EMPTY
    task: np.ndarray = EMPTY


class Join(msgspec.Struct, frozen=True):
    """Wait until the listed children have ended, then append their results in that order.

    Children are numbered by start order within the branch (0 = first Fork or Spawn); an empty
    tuple means every child not joined yet.
    """

    children: tuple[int, ...] = ()


class Compact(msgspec.Struct, frozen=True, gc=False):
    """Context := system prompt + visible output of the last call + ``append``."""

    append: np.ndarray = EMPTY


class Reset(msgspec.Struct, frozen=True, gc=False):
    """Context := ``tokens``."""

    tokens: np.ndarray


Op = Union[Call, Pause, Fork, Spawn, Join, Compact, Reset]
Program = Iterator[Op]


class Agent(msgspec.Struct, frozen=True):
    """One agent: its root branch, started like a sub-agent on ``system + task``.

    ``workload`` and ``index`` name it (``agent_id`` is ``"{workload}-{index}"``); ``system``
    is also what :class:`Compact` keeps of the root branch's context.
    """

    workload: str
    index: int
    root: Spawn

    @property
    def agent_id(self) -> str:
        return f"{self.workload}-{self.index}"


class Workload(Protocol):
    """A source of agents: agent ``index`` is always the same agent (None: no more agents)."""

    name: str

    def agent(self, index: int) -> Agent | None: ...
