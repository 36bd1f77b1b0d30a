"""Trace readers: Mooncake JSONL and Applied Compute's Trie JSONL (Dynamo's agentic v2 format is
in ``agentic.py``). Each returns a :class:`TraceWorkload`, whose agents the runner plays like
generated ones, in open loop at the trace's times or in closed loop.

**Mooncake** (kvcache-ai/Mooncake ``FAST25-release/traces``; field semantics as Dynamo's
``docs/dynosim/trace-formats.md`` and ``lib/mocker/src/loadgen/trace.rs`` read them): one JSON
object per request, ``timestamp`` (ms from the trace start), ``input_length``,
``output_length``, ``hash_ids`` (one id per ``block_size``-token block, 512 in Mooncake's
release; equal leading ids mean a shared prefix). Each id expands to fixed tokens
(``tokens.block_tokens``) and the prompt is cut to ``input_length``, so prefix sharing is exact.
Dynamo's extension is read too: rows with the same ``session_id`` are the turns of one agent,
each sent after the previous answer plus ``delay`` ms (or the timestamp gap); rows without a
session are one-request agents. ``input_length`` defaults to (and is capped at) the blocks'
capacity, as in Dynamo.

**Trie** (Applied-Compute/trie ``README.md`` "Workload format" and ``src/trie/client.py``): one
JSON object per agent: ``num_turns``, ``input_prompt_length``, and per turn
``assistant_response_length``, ``tool_call_output_length``, ``tool_call_latency`` (s), then
``final_assistant_response_length``. Turn ``t`` sends the prompt, waits for the response,
appends it, sleeps the tool latency and appends the tool output; a last request follows the
last tool output. Trie has no timestamps (it runs at a concurrency, cycling through the rows),
and its prompts are fresh per trace run; here agent ``i`` plays row ``i mod n`` with tokens
keyed by ``i``. Trie allows zero-length responses; a request needs at least one output token
here, so zero is rejected.

Token content is keyed by ``seed`` (and the play or agent), so two runs with the same seed
send the same tokens. Malformed input raises :class:`~evinfra.errors.ConfigError` naming the
file and line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

import msgspec

from evinfra.core.types import NonNegFloat, NonNegInt, PosInt
from evinfra.errors import ConfigError
from evinfra.workloads.arrivals import Arrival
from evinfra.workloads.program import Agent, Call, Pause, Program, Reset, Spawn
from evinfra.workloads.tokens import (
    DEFAULT_SPACE, EMPTY, TokenSpace, block_tokens, stable_seed, synth,
)

__all__ = ["TraceWorkload", "read_mooncake", "read_trie"]


class TraceWorkload:
    """Agents read from a trace: agent ``i`` is the ``i``-th by start time.

    ``starts`` (seconds from the first start) exist for timestamped traces; :meth:`arrivals`
    gives them to :meth:`Runner.open_loop <evinfra.workloads.runner.Runner.open_loop>`. With
    ``cycle``, ``agent(i)`` exists for every ``i`` (closed-loop replay of a finite trace);
    otherwise it is None past the trace's end.
    """

    def __init__(self, name: str, count: int, make: Callable[[int], Spawn],
                 starts: list[float] | None = None, cycle: bool = False) -> None:
        self.name = name
        self.count = count
        self.starts = starts
        self.cycle = cycle
        self._make = make

    def __len__(self) -> int:
        return self.count

    def agent(self, index: int) -> Agent | None:
        if index >= self.count and not self.cycle:
            return None
        return Agent(self.name, index, self._make(index))

    def arrivals(self) -> list[Arrival]:
        if self.starts is None:
            raise ValueError(f"trace {self.name} has no timestamps; replay it in closed loop")
        return [Arrival(t, self.name) for t in self.starts]


def read_lines(path: str | Path, decoder: msgspec.json.Decoder) -> Iterator[tuple[int, object]]:
    """Decoded non-empty lines with their 1-based numbers; errors name the file and line."""
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield n, decoder.decode(line)
                except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                    raise ConfigError(str(exc), path=str(path), key=f"line {n}") from exc


class MooncakeRow(msgspec.Struct, frozen=True):
    hash_ids: list[NonNegInt]
    output_length: PosInt
    input_length: NonNegInt | None = None
    timestamp: NonNegFloat | None = None
    session_id: str | None = None
    delay: NonNegFloat | None = None


def read_mooncake(
    path: str | Path, *, block_size: int = 512, name: str = "mooncake", seed: int = 0,
    space: TokenSpace = DEFAULT_SPACE,
) -> TraceWorkload:
    """A Mooncake JSONL trace: one agent per session (per row without ``session_id``)."""
    sessions: dict[str, list[MooncakeRow]] = {}
    for n, row in read_lines(path, msgspec.json.Decoder(MooncakeRow)):
        sessions.setdefault(row.session_id or f"line {n}", []).append(row)
    if not sessions:
        raise ConfigError("no requests", path=str(path))
    rows = sorted(sessions.values(), key=lambda s: s[0].timestamp or 0.0)
    first = rows[0][0].timestamp or 0.0
    starts = [((s[0].timestamp or 0.0) - first) / 1000 for s in rows]
    namespace = stable_seed(seed, name)

    def program(session: list[MooncakeRow]) -> Program:
        for k, row in enumerate(session):
            if k:
                gap = row.delay if row.delay is not None else (
                    (row.timestamp or 0.0) - (session[k - 1].timestamp or 0.0))
                if gap > 0:
                    yield Pause(gap / 1000)
            capacity = len(row.hash_ids) * block_size
            length = capacity if row.input_length is None else min(row.input_length, capacity)
            yield Reset(block_tokens(namespace, row.hash_ids, block_size, length, space))
            yield Call(EMPTY, row.output_length, keep=0)

    return TraceWorkload(name, len(rows), lambda i: Spawn(program(rows[i])), starts)


class TrieRow(msgspec.Struct, frozen=True):
    num_turns: NonNegInt
    input_prompt_length: PosInt
    assistant_response_length: list[PosInt]
    tool_call_output_length: list[NonNegInt]
    tool_call_latency: list[NonNegFloat]
    final_assistant_response_length: PosInt

    def __post_init__(self) -> None:
        for field in ("assistant_response_length", "tool_call_output_length",
                      "tool_call_latency"):
            if len(getattr(self, field)) != self.num_turns:
                raise ValueError(f"{field} must have num_turns={self.num_turns} entries")


def read_trie(
    path: str | Path, *, name: str = "trie", seed: int = 0, space: TokenSpace = DEFAULT_SPACE,
) -> TraceWorkload:
    """A Trie workload JSONL: one agent per row, replayed in closed loop (cycling)."""
    rows = [row for _, row in read_lines(path, msgspec.json.Decoder(TrieRow))]
    if not rows:
        raise ConfigError("no traces", path=str(path))

    def program(index: int, row: TrieRow) -> Program:
        append = EMPTY
        for t in range(row.num_turns):
            yield Call(append, row.assistant_response_length[t])
            if row.tool_call_latency[t] > 0:
                yield Pause(row.tool_call_latency[t])
            append = synth((seed, name, index, t, "tool"), row.tool_call_output_length[t], space)
        yield Call(append, row.final_assistant_response_length)

    def make(index: int) -> Spawn:
        row = rows[index % len(rows)]
        prompt = synth((seed, name, index, "prompt"), row.input_prompt_length, space)
        return Spawn(program(index, row), EMPTY, prompt)

    return TraceWorkload(name, len(rows), make, cycle=True)

