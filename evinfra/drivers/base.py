"""The EngineDriver protocol: the only door between the control plane and an engine.

Commands go in as plain method calls that return at once (``submit_prefill``,
``submit_decode``, ``withdraw``, ``abort``, ``switch_phase``, ``push_hints``); everything an
engine has to say comes back as events on the bus (``core/events.py``): KV events, iteration
reports, node state at each iteration launch, prefill started / done, output tokens,
failures, withdrawals, phase switches, node loss. A driver for a remote engine does its I/O
in its own tasks; the fake driver runs a simulated engine on the clock. Nothing else in the
control plane knows what an engine is.

The data plane (KV moving between engines: peer fetches, prefill-to-decode transfers) is the
engines' business: orders name the peer, and the engines move the bytes.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import msgspec

from evinfra.core.types import BlockHash, NodeId, Phase, RequestId
from evinfra.directory.branches import HintDelta

__all__ = ["DecodeOrder", "EngineDriver", "FetchRun", "PrefillOrder", "Sampling"]


class FetchRun(msgspec.Struct, frozen=True, gc=False):
    """Consecutive blocks of the request's path to pull from ``peer``'s host memory."""

    peer: NodeId
    start: int
    """Index of the first block in the request's path."""
    blocks: list[BlockHash]


class Sampling(msgspec.Struct, frozen=True, gc=False):
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    ignore_eos: bool = False
    stop_token_ids: list[int] = []
    seed: int | None = None
    top_k: int = -1
    """-1: no limit."""
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    """None: no log-probabilities; k >= 0: each output token's, and the ``k`` most likely
    tokens at its position (``TokensOut.logprobs``)."""
    logit_bias: dict[int, float] | None = None
    """Token id -> bias added to its logit."""
    json_schema: str | None = None
    """The output is JSON that this schema (JSON text) holds: the engine's grammar keeps
    it so (only sent to engines whose ``constrains_output``; so are ``regex``, ``ebnf``). At
    most one of the three is set."""
    regex: str | None = None
    """The output matches this regular expression."""
    ebnf: str | None = None
    """The output is a sentence of this EBNF grammar (xgrammar's dialect, as SGLang's)."""
    min_tokens: int = 0
    """No stop token (EOS included) ends the output before this many tokens."""
    prompt_logprobs: bool = False
    """With ``logprobs``: the same for each prompt token but the first
    (``PrefillDone.prompt_logprobs``). The engine computes the whole prompt for them (it
    reuses no cached KV; nothing is fetched); the fake engines make them up as they do an
    output's."""


class PrefillOrder(msgspec.Struct, frozen=True, gc=False):
    """Prefill ``tokens`` on the receiving node; pull ``fetch`` from peers while queued.

    ``tokens`` is a uint32 numpy array (the front end tokenizes); ``path`` the hashes of its
    full pages. ``cached_tokens`` is what the router expects to reuse; the engine reports what
    it actually reused in ``PrefillDone``.
    """

    request: RequestId
    tokens: Any
    path: list[BlockHash]
    fetch: list[FetchRun]
    sampling: Sampling
    cached_tokens: int = 0
    branch: str | None = None
    final: bool = False
    """The branch ends with this request: nothing will reuse its KV through this branch."""


class DecodeOrder(msgspec.Struct, frozen=True, gc=False):
    """Decode ``request`` on the receiving node with the KV ``source`` is prefilling."""

    request: RequestId
    source: NodeId
    tokens: Any
    path: list[BlockHash]
    sampling: Sampling
    branch: str | None = None
    final: bool = False


@runtime_checkable
class EngineDriver(Protocol):
    """One node's engine, as the control plane sees it."""

    node: NodeId
    stats: dict[str, int]
    """Counters of what the driver did with its engine (status and ``/metrics``)."""

    @property
    def constrains_output(self) -> bool:
        """The engine holds an output to a grammar (``Sampling.json_schema``, ``regex``,
        ``ebnf``)."""

    async def start(self) -> None:
        """Connect (or launch) and begin publishing the engine's events on the bus."""

    async def stop(self) -> None:
        """Stop publishing and release connections; in-flight requests fail."""

    def submit_prefill(self, order: PrefillOrder) -> None: ...

    def submit_decode(self, order: DecodeOrder) -> None: ...

    def withdraw(self, request: RequestId) -> None:
        """Take back a queued request. The engine answers ``Withdrawn`` if it had not started
        the prefill yet; otherwise the request runs on (``PrefillStarted`` tells)."""

    def abort(self, request: RequestId) -> None:
        """Stop a request wherever it is (the client went away); no event follows."""

    def switch_phase(self, phase: Phase) -> None:
        """Serve ``phase`` from now on; ``PhaseSwitched`` follows. Called once the router has
        drained the node's old-phase work."""

    def push_hints(self, delta: HintDelta) -> None:
        """Blocks whose branch count crossed zero (count-aware host eviction)."""

    def healthy(self) -> bool: ...
