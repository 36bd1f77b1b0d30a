"""The contracts between components: what the control plane, the drivers, the planner and the
API hand each other.

Each type here crosses a component boundary, so it lives in ``core`` and no component imports
another's internals for it: the orders a driver carries to an engine (:class:`PrefillOrder`,
:class:`DecodeOrder`, with :class:`Sampling` and the peer fetches, :class:`FetchRun`), the count
marks the directory pushes to engines (:class:`HintDelta`), and a node's load as the router
books it, read by planners (:class:`NodeLoad`).
"""

from __future__ import annotations

from typing import Any

import msgspec

from evinfra.core.types import BlockHash, NodeId, RequestId

__all__ = ["DecodeOrder", "FetchRun", "HintDelta", "NodeLoad", "PrefillOrder", "Sampling"]


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


class FetchRun(msgspec.Struct, frozen=True, gc=False):
    """Consecutive blocks of the request's path to pull from ``peer``'s host memory."""

    peer: NodeId
    start: int
    """Index of the first block in the request's path."""
    blocks: list[BlockHash]


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


class HintDelta(msgspec.Struct, frozen=True):
    """Blocks whose count on a node became positive / zero since the last delta, in the
    order they were noted. With ``replace``, ``positive`` is every block with a positive count
    on the node and ``zero`` is empty: the engine forgets every other mark (a resync, say of
    an engine that came back)."""

    positive: list[BlockHash]
    zero: list[BlockHash]
    replace: bool = False


class NodeLoad(msgspec.Struct, frozen=True, gc=False):
    """A node's load in the router's books, for planners that size the split by load
    (the baselines' queue-depth, KV-utilisation and TTFT signals)."""

    node: NodeId
    phase: str
    queued_tokens: int
    """Uncached input tokens of requests sent to the node and not launched yet (``U`` of
    ``Q_n``)."""
    wait_s: float
    """Predicted wait before a new request starts on the node (``Ŵ_n`` of E.3 line 8)."""
    decode_tokens: int
    """KV tokens (input plus ``max_tokens``) of the requests bound to the node for decode."""
    kv_capacity: int | None
    """GPU KV capacity from the node's last report (None before any)."""
    serving: bool = True
    """Healthy and not cordoned: it takes new work (once a switch it is in is over)."""
