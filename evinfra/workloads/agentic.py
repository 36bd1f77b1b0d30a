"""Dynamo's agentic Mooncake v2 traces, lowered to branch programs.

The format, as ai-dynamo/dynamo defines it (``lib/data-gen/src/mooncake.rs``:
``AgenticMooncakeHeader``, ``AgenticMooncakeRow``, ``AgenticDependency``): a JSONL file whose
first record is a header ``{"schema": "dynamo.agentic_mooncake", "version": 2, "block_size",
"hash_id_scope": "local", "source": {"format", "digest"}}``, then one row per LLM request:
``request_id``, ``play_id`` (one agent run), ``session_id`` (one conversation, i.e. a branch),
``model``, ``input_length``, ``output_length``, ``hash_ids`` (one id per ``block_size``
tokens), ``not_before_ms``, optional ``output_token_ids`` / ``priority`` / ... and
``dependencies``: ``{request_id, trigger: dispatch|completion, delay_ms, relation:
sequence|spawn|join|replay_barrier}``. Dynamo's replay (the v2 versions of
``lib/mocker/src/loadgen/driver.rs``) dispatches a row once every dependency has fired (its
source dispatched or completed, per ``trigger``) and ``delay_ms`` has passed since. ``hash_id_scope: local`` gives each play its
own id namespace (Dynamo's tests reuse ids across plays and expect no sharing), so tokens are
synthesized per (play, id).

Lowering, one branch per session:

- a session's first row either has no dependency (a root: one agent, arriving at its
  ``not_before_ms``, made relative to the trace's first root) or exactly one, on a row of
  another session: the parent spawns it (before that row's call if the trigger is
  ``dispatch``, after it if ``completion``), and the child starts with a pause of the delay;
- a later row may depend on the previous row of its session (trigger ``completion``: a pause
  of the delay after that call; a row without that dependency still follows the call) and on the *last* rows of sessions it spawned (trigger
  ``completion``: a :class:`~evinfra.workloads.program.Join`; the join delay is a pause at the
  end of the child, so the row waits for the later of the two, as Dynamo's ``max`` does);
- each row is a :class:`Reset` to its prompt and a call of ``output_length`` tokens that keeps
  no output (the next prompt comes from the trace), tagged with its ``request_id``.

Differences from Dynamo's replay, all forced by the agent model: a row always waits for the
previous row of its session (a branch is sequential); a failed request does not skip the rest
of its play (the runner goes on without its output); ``not_before_ms`` of non-root rows is not
a lower bound (rows run on their dependencies and delays, as the paper's open-loop replay D.3
does); ``output_token_ids`` are ignored (the backend decides outputs). Dependency shapes outside
this (``replay_barrier``, a join of a child's non-last row or of another session's child, a
first row with several dependencies) raise :class:`~evinfra.errors.ConfigError`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import msgspec

from evinfra.core.types import NonNegFloat, NonNegInt, PosInt
from evinfra.errors import ConfigError
from evinfra.workloads.program import Call, Join, Pause, Program, Reset, Spawn
from evinfra.workloads.tokens import DEFAULT_SPACE, EMPTY, TokenSpace, block_tokens, stable_seed
from evinfra.workloads.traces import TraceWorkload, read_lines

__all__ = ["read_agentic"]

SCHEMA = "dynamo.agentic_mooncake"
VERSION = 2


class AgenticSource(msgspec.Struct, frozen=True):
    format: str
    digest: str


class AgenticHeader(msgspec.Struct, frozen=True):
    schema: str
    version: int
    block_size: PosInt
    hash_id_scope: str
    source: AgenticSource


class Dependency(msgspec.Struct, frozen=True):
    request_id: str
    trigger: Literal["dispatch", "completion"]
    delay_ms: NonNegFloat
    relation: Literal["sequence", "spawn", "join", "replay_barrier"]


class AgenticRow(msgspec.Struct, frozen=True):
    request_id: str
    play_id: str
    session_id: str
    not_before_ms: float
    model: str = ""
    input_length: NonNegInt | None = None
    output_length: PosInt | None = None
    hash_ids: list[NonNegInt] | None = None
    dependencies: list[Dependency] = []


class _Session:
    """One conversation of a play, with the edges the lowering keeps."""

    __slots__ = ("play", "rows", "parent", "spawned_at", "start_delay", "end_delay", "index",
                 "spawns", "joins", "seq_delay")

    def __init__(self, play: str) -> None:
        self.play = play
        self.rows: list[AgenticRow] = []
        self.parent: _Session | None = None
        self.spawned_at = -1  # position of the parent's row that spawns this session
        self.start_delay = 0.0  # seconds after the spawn trigger
        self.end_delay = 0.0  # seconds between this session's end and its parent's join
        self.index = -1  # child number in the parent's program
        # Per row id: children spawned at dispatch / at completion, children joined before it.
        self.spawns: dict[str, tuple[list[_Session], list[_Session]]] = {}
        self.joins: dict[str, list[_Session]] = {}
        self.seq_delay: dict[str, float] = {}


def _read(path: str | Path) -> tuple[AgenticHeader, list[tuple[int, AgenticRow]]]:
    lines = iter(read_lines(path, msgspec.json.Decoder(msgspec.Raw)))
    first = next(lines, None)
    if first is None:
        raise ConfigError("empty trace", path=str(path))
    try:
        header = msgspec.json.decode(first[1], type=AgenticHeader)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"expected a {SCHEMA} v{VERSION} header: {exc}", path=str(path),
                          key=f"line {first[0]}") from exc
    if (header.schema, header.version, header.hash_id_scope) != (SCHEMA, VERSION, "local"):
        raise ConfigError(
            f"expected schema {SCHEMA!r} version {VERSION} with hash_id_scope 'local', got "
            f"{header.schema!r} {header.version} {header.hash_id_scope!r}", path=str(path),
            key=f"line {first[0]}")
    decoder = msgspec.json.Decoder(AgenticRow)
    rows = []
    for n, raw in lines:
        try:
            rows.append((n, decoder.decode(raw)))
        except msgspec.ValidationError as exc:
            raise ConfigError(str(exc), path=str(path), key=f"line {n}") from exc
    return header, rows


def read_agentic(
    path: str | Path, *, name: str = "agentic", seed: int = 0, space: TokenSpace = DEFAULT_SPACE,
) -> TraceWorkload:
    """A Dynamo agentic Mooncake v2 trace: one agent per root session (see the module doc)."""
    header, rows = _read(path)
    block = header.block_size

    def fail(message: str, row: AgenticRow) -> ConfigError:
        return ConfigError(message, path=str(path), key=f"request {row.request_id!r}")

    sessions: dict[tuple[str, str], _Session] = {}
    where: dict[str, tuple[_Session, int]] = {}
    for _, row in rows:
        if row.request_id in where:
            raise fail("duplicate request_id", row)
        if row.hash_ids is None or row.output_length is None:
            raise fail("hash_ids and output_length are required", row)
        if (row.input_length or 0) > len(row.hash_ids) * block:
            raise fail(f"input_length exceeds {len(row.hash_ids)} blocks of {block}", row)
        session = sessions.setdefault((row.play_id, row.session_id), _Session(row.play_id))
        where[row.request_id] = (session, len(session.rows))
        session.rows.append(row)

    # Spawn edges first: a join names a child, which must be known by then.
    for session in sessions.values():
        _link_spawn(session, where, fail)
    for session in sessions.values():
        _number_children(session)
        for pos in range(1, len(session.rows)):
            _link_later(session, pos, where, fail)
    roots = [session for session in sessions.values() if session.parent is None]
    for session in sessions.values():
        seen = set()
        node = session
        while node.parent is not None:
            if id(node) in seen:
                raise fail("spawn edges form a cycle", session.rows[0])
            seen.add(id(node))
            node = node.parent

    def program(session: _Session) -> Program:
        namespace = stable_seed(seed, name, session.play)
        if session.start_delay > 0:
            yield Pause(session.start_delay)
        for row in session.rows:
            rid = row.request_id
            if rid in session.seq_delay and session.seq_delay[rid] > 0:
                yield Pause(session.seq_delay[rid])
            if rid in session.joins:
                yield Join(tuple(child.index for child in session.joins[rid]))
            at_dispatch, at_completion = session.spawns.get(rid, ((), ()))
            for child in at_dispatch:
                yield Spawn(program(child))
            length = len(row.hash_ids) * block if row.input_length is None else row.input_length
            yield Reset(block_tokens(namespace, row.hash_ids, block, length, space))
            yield Call(EMPTY, row.output_length, keep=0, tag=rid)
            for child in at_completion:
                yield Spawn(program(child))
        if session.end_delay > 0:
            yield Pause(session.end_delay)

    if not roots:
        raise ConfigError("no root request (every session depends on another)", path=str(path))
    roots.sort(key=lambda s: s.rows[0].not_before_ms)
    first = roots[0].rows[0].not_before_ms
    starts = [(s.rows[0].not_before_ms - first) / 1000 for s in roots]
    return TraceWorkload(name, len(roots), lambda i: Spawn(program(roots[i])), starts)


def _deps(session: _Session, row: AgenticRow, where: dict[str, tuple[_Session, int]],
          fail) -> list[tuple[Dependency, _Session, int]]:
    """``row``'s dependencies with their source session and position, checked for scope."""
    deps = []
    for dep in row.dependencies:
        if dep.request_id not in where:
            raise fail(f"depends on unknown request {dep.request_id!r}", row)
        if dep.relation == "replay_barrier":
            raise fail("replay_barrier dependencies are not supported", row)
        source, source_pos = where[dep.request_id]
        if source.play != session.play:
            raise fail("depends on a request of another play", row)
        deps.append((dep, source, source_pos))
    return deps


def _link_spawn(session: _Session, where: dict[str, tuple[_Session, int]], fail) -> None:
    """The first row: no dependency (a root) or one on its spawner in another session."""
    row = session.rows[0]
    deps = _deps(session, row, where, fail)
    if not deps:
        return
    if len(deps) > 1 or deps[0][1] is session:
        raise fail("a session's first request must depend on one request of another "
                   "session (its spawner)", row)
    dep, parent, parent_pos = deps[0]
    session.parent = parent
    session.spawned_at = parent_pos
    session.start_delay = dep.delay_ms / 1000
    spawned = parent.spawns.setdefault(dep.request_id, ([], []))
    spawned[0 if dep.trigger == "dispatch" else 1].append(session)


def _link_later(session: _Session, pos: int, where: dict[str, tuple[_Session, int]],
                fail) -> None:
    """A later row: a sequence edge from the previous row, joins of its own children."""
    row = session.rows[pos]
    previous = session.rows[pos - 1].request_id
    for dep, source, source_pos in _deps(session, row, where, fail):
        if dep.trigger != "completion":
            raise fail(f"only the first request of a session may have a dispatch trigger "
                       f"(on {dep.request_id!r})", row)
        if dep.request_id == previous:
            session.seq_delay[row.request_id] = dep.delay_ms / 1000
        elif source is session:
            raise fail(f"depends on {dep.request_id!r}, not the previous request of its "
                       "session", row)
        elif source.parent is not session or source_pos != len(source.rows) - 1:
            raise fail(f"waits for {dep.request_id!r}, which is not the last request of a "
                       "session this session spawned", row)
        elif any(source in joined for joined in session.joins.values()):
            raise fail(f"the session of {dep.request_id!r} is joined twice", row)
        elif source.spawned_at >= pos:
            raise fail(f"joins {dep.request_id!r} before spawning it", row)
        else:
            source.end_delay = dep.delay_ms / 1000
            session.joins.setdefault(row.request_id, []).append(source)


def _number_children(parent: _Session) -> None:
    """Children are numbered in the order the parent's program starts them."""
    k = 0
    for row in parent.rows:
        for group in parent.spawns.get(row.request_id, ((), ())):
            for child in group:
                child.index = k
                k += 1
