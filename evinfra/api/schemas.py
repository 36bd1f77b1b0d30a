"""Request bodies of the OpenAI-compatible routes, validated once at the edge.

Unknown fields are ignored, as OpenAI clients send many this server has no use for
(``user``, ``metadata``...), but those that ask for a different answer this server does not
give (an image in a message: the model reads text; the fields of ``refuse_unserved``, say
legacy ``functions`` or a completion's ``suffix``) are refused; wrong types
and out-of-range values are 400s that name the field. ``evinfra`` in a body carries the same
agent hints as the ``X-Evinfra-*`` headers.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from evinfra.errors import RequestError

__all__ = ["AgentHints", "ChatCompletionRequest", "CompletionRequest", "Effort",
           "ResponseFormat", "SplitRequest", "StructuredOutputs", "ToolChoice", "decode_body",
           "refuse_unserved", "template_kwargs"]

Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
Seed = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
"""An int64: SGLang makes a tensor of it, so a larger one would fail in the engine."""
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[float, msgspec.Meta(gt=0.0, le=2.0)]
"""1.0 is no penalty (the ranges are OpenAI's and SGLang's)."""
MinP = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
Choices = Annotated[int, msgspec.Meta(ge=1, le=128)]
"""``n``: OpenAI's range."""
Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]
"""OpenAI's reasoning efforts."""


def template_kwargs(kwargs: dict[str, object] | None, effort: Effort | None
                    ) -> dict[str, object] | None:
    """The chat template's variables: the request's own, and its reasoning effort as
    ``reasoning_effort`` (the variable gpt-oss's template reads, as vLLM and SGLang hand it
    over) unless they name one."""
    if effort is None or kwargs and "reasoning_effort" in kwargs:
        return kwargs
    return {**(kwargs or {}), "reasoning_effort": effort}


class AgentHints(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Agent context management (paper 4.3): the branch of this request, the branch it was
    forked or spawned from, and whether the branch ends with this request."""

    branch_id: str | None = None
    parent_branch_id: str | None = None
    final: bool = False


class StreamOptions(msgspec.Struct, frozen=True):
    include_usage: bool = False
    """A last chunk with the request's ``usage``."""
    continuous_usage_stats: bool = False
    """vLLM's and SGLang's: every chunk carries the usage so far."""


class StructuredOutputs(msgspec.Struct, frozen=True):
    """vLLM's ``structured_outputs``: what holds the output, one of ``json`` (a schema, or
    its JSON text), ``json_object``, ``regex``, ``choice`` (one of these strings) and
    ``grammar`` (EBNF). vLLM's tuning options (``disable_any_whitespace``...) are the
    engines' launch flags here and are ignored; ``structural_tag`` is refused."""

    json: dict[str, object] | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: object | None = None


class _Common(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    max_tokens: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    n: Choices = 1
    """Choices sampled from the prompt; 1 to ``n - 1`` are forks of the request's branch."""
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False
    """vLLM's (SGLang's ``no_stop_trim``): a matched stop string stays in the output."""
    no_stop_trim: bool = False
    min_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    """SGLang's and vLLM's: no EOS, stop token or stop string ends the output before this
    many tokens (at most ``max_tokens``)."""
    seed: Seed | None = None
    frequency_penalty: Penalty = 0.0
    presence_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    """This and ``top_k``, ``min_p``: the extensions SGLang and vLLM accept."""
    top_k: int = -1
    """-1: no limit, else at least 1 (checked by the handler: no Meta says "-1 or >= 1")."""
    min_p: MinP = 0.0
    logit_bias: dict[str, float] | None = None
    """Token id (a decimal string, as OpenAI's) -> bias added to its logit, -100 to 100."""
    ignore_eos: bool = False
    """Generate exactly ``max_tokens`` (SGLang and vLLM accept it; replay uses it)."""
    evinfra: AgentHints | None = None
    return_token_ids: bool = False
    """Add the output token ids to each choice (``token_ids``), as vLLM does: a replay client
    needs them to build the next prompt exactly."""
    regex: str | None = None
    """SGLang's: the output matches this regular expression (``constraints.py``)."""
    ebnf: str | None = None
    """SGLang's: the output is a sentence of this EBNF grammar (xgrammar's dialect)."""
    structured_outputs: StructuredOutputs | None = None
    # Refused (``refuse_unserved``): each asks for an answer this server does not give.
    guided_json: object | None = None
    guided_regex: object | None = None
    guided_choice: object | None = None
    guided_grammar: object | None = None
    stop_regex: object | None = None
    prompt_logprobs: object | None = None
    skip_special_tokens: bool | None = None


class FunctionDef(msgspec.Struct, frozen=True, omit_defaults=True):
    name: str
    description: str | None = None
    parameters: dict[str, object] | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, frozen=True, omit_defaults=True):
    """One of ``tools``: rendered by the chat template as the client sent it."""

    function: FunctionDef
    type: Literal["function"] = "function"


class NamedFunction(msgspec.Struct, frozen=True):
    name: str


class ToolChoice(msgspec.Struct, frozen=True):
    function: NamedFunction
    type: Literal["function"] = "function"


class JsonSchemaFormat(msgspec.Struct, frozen=True):
    name: str = "answer"
    schema: dict[str, object] | None = None
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, frozen=True):
    type: str
    """``text``, ``json_object`` or ``json_schema`` (with ``json_schema``)."""
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(_Common, frozen=True, kw_only=True):
    messages: list[dict[str, object]]
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoice | None = None
    """``required`` and a named function hold the output to calls (``constraints.py``)."""
    parallel_tool_calls: bool = True
    """False: only the first call the model writes is returned."""
    response_format: ResponseFormat | None = None
    """``json_object`` and ``json_schema`` hold the output to JSON (``constraints.py``)."""
    chat_template_kwargs: dict[str, object] | None = None
    """More variables for the model's chat template (``enable_thinking`` for Qwen3, say), as
    SGLang and vLLM accept them."""
    reasoning_effort: Effort | None = None
    """How long a reasoning model thinks: the template's ``reasoning_effort``."""
    add_generation_prompt: bool | None = None
    """vLLM's: open the assistant's turn after the messages (default: yes, unless
    ``continue_final_message``)."""
    continue_final_message: bool = False
    """vLLM's: the final message, an assistant's, is continued rather than answered (a
    prefilled answer): the output is what follows its text."""
    max_completion_tokens: int | None = None
    logprobs: bool = False
    """Each output token's log-probability in ``choices[].logprobs.content``."""
    top_logprobs: int | None = None
    """With ``logprobs``: that many most likely tokens at each position (0-20)."""
    functions: object | None = None
    function_call: object | None = None
    audio: object | None = None
    web_search_options: object | None = None

    def template_tools(self) -> list[dict] | None:
        """The tools the chat template shows the model (none with ``tool_choice: none``, as
        SGLang does)."""
        if not self.tools or self.tool_choice == "none":
            return None
        return msgspec.to_builtins(self.tools)


class CompletionRequest(_Common, frozen=True, kw_only=True):
    prompt: str | list[int | str | list[int]]
    """Text, token ids, or a batch: a list of either (msgspec takes one array type per
    union, so the list's items are checked by the handler)."""
    max_tokens: int | None = 16
    logprobs: int | None = None
    """Each output token's log-probability, with that many most likely tokens at each
    position (0-20), in ``choices[].logprobs``."""
    echo: bool = False
    """Each choice's text starts with the prompt's; with ``logprobs``, its log-probabilities
    start with the prompt's tokens' (the first's null), which the prefill engine reports."""
    json_schema: str | None = None
    """SGLang's: the output is JSON this schema (JSON text) holds."""
    suffix: object | None = None
    best_of: Choices | None = None
    """Candidates sampled (at least ``n``; ``n`` when not given), of which the ``n`` with the
    highest log-probability per token are returned; more than ``n`` cannot be streamed."""


class TokenizeRequest(msgspec.Struct, frozen=True, kw_only=True):
    """``POST /tokenize`` (as vLLM and SGLang serve it): a ``prompt``, read as a completion
    reads it, or ``messages`` (and ``tools``) rendered as a chat completion renders them.
    vLLM's options: ``add_special_tokens`` (default: as this server reads that input, so
    a prompt's BOS yes, a chat's no), ``add_generation_prompt`` and
    ``continue_final_message`` (as a chat completion takes them) and ``return_token_strs``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, object]] | None = None
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, object] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, frozen=True, kw_only=True):
    """``POST /detokenize``: token ids back to text."""

    model: str | None = None
    tokens: list[int]


class SplitRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``POST /v1/evinfra/split``: the nodes that prefill; the others decode."""

    prefill: list[str]


_UNSERVED = (  # field, the value that asks for nothing different, what to do instead
    ("guided_json", None, "vLLM's older name: use structured_outputs.json"),
    ("guided_regex", None, "vLLM's older name: use structured_outputs.regex (or regex)"),
    ("guided_choice", None, "vLLM's older name: use structured_outputs.choice"),
    ("guided_grammar", None, "vLLM's older name: use structured_outputs.grammar (or ebnf)"),
    ("stop_regex", None, "stop regexes are not served: use stop strings"),
    ("prompt_logprobs", None, "not served: a completion's echo with logprobs gives the "
                              "prompt's log-probabilities"),
    ("skip_special_tokens", True, "special tokens are always left out of the text: "
                                  "return_token_ids gives every id"),
    ("functions", None, "the legacy functions are not served: use tools"),
    ("function_call", None, "the legacy function_call is not served: use tool_choice"),
    ("audio", None, "audio output is not served: the model writes text"),
    ("web_search_options", None, "web search is not served"),
    ("suffix", None, "fill-in-the-middle (suffix) is not served"),
)


def refuse_unserved(body: msgspec.Struct) -> None:
    """Raise a 400 for a field other servers take that would ask this one for an answer it
    does not give: ignoring it would answer something else without saying so."""
    for name, served, instead in _UNSERVED:
        value = getattr(body, name, None)
        if value is not None and value != served:
            raise RequestError(f"{name}: {instead}", param=name)


def decode_body(body: bytes, schema: type) -> object:
    """Decode and validate; raises ``msgspec.ValidationError``/``DecodeError`` for the caller
    to turn into a 400 naming the field."""
    return msgspec.json.decode(body, type=schema)
