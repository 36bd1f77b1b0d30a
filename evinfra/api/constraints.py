"""Constrained output: JSON answers, forced tool calls, regular expressions, choices and EBNF
grammars, as the engines' grammar backend holds an output to them (SGLang's ``json_schema``,
``regex`` and ``ebnf`` sampling parameters; :class:`Grammar`).

A JSON answer (``response_format`` / ``text.format``) is held to the request's schema, or to
"an object", and comes back as the content. A forced tool choice (``required``, a named
function; Anthropic's ``any`` and ``tool``) is held, as SGLang does it, to a JSON array of
``{"name", "parameters"}`` objects, one per call, which :class:`ForcedCalls` reads back into
tool calls once the output is whole. An engine may let a thinking model reason before its
grammar holds the output (SGLang launched with ``--reasoning-parser``): with the config's
reasoning parser that block comes back apart, as for any answer (``serving.chat_reader``).
Engines that cannot hold an output to a grammar (the fake engines, SGLang launched with
``--grammar-backend none``) are not sent such a request: it is refused.

The other constraints come as SGLang's OpenAI server takes them (``regex``, ``ebnf``; and a
completion's ``json_schema``, as text) or as vLLM's ``structured_outputs`` (``json``,
``json_object``, ``regex``, ``grammar``, and ``choice``: one of its strings, as an EBNF
alternation of string literals, which is how vLLM hands a choice to xgrammar). A request is
held to one constraint; two are a 400, as in SGLang. What such an output says is the answer,
after any reasoning block.
"""

from __future__ import annotations

import json
from typing import Callable

import msgspec

from evinfra.api.schemas import StructuredOutputs
from evinfra.api.tool_calls import ToolCall
from evinfra.core.contracts import Sampling
from evinfra.errors import RequestError

__all__ = ["ANY_OBJECT", "ForcedCalls", "Grammar", "check_served", "engine_grammars",
           "json_schema", "one_grammar", "output_schema", "tools_schema"]

ANY_OBJECT = '{"type": "object"}'
"""The schema of a JSON answer with no schema of its own (``json_object``)."""


def json_schema(schema: object, param: str) -> str:
    """A request's JSON schema as the engines take it: JSON text."""
    if not isinstance(schema, dict):
        raise RequestError("the JSON schema must be an object", param=param)
    return json.dumps(schema, ensure_ascii=False)


def tools_schema(tools: list[dict], name: str | None, parallel: bool, param: str) -> str:
    """The calls of a forced tool choice: at least one (only one, not ``parallel``) of the
    tool ``name`` (None: any of ``tools``, as the chat template got them)."""
    if not tools:
        raise RequestError("a forced tool choice needs tools", param=param)
    chosen = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    if not chosen:
        raise RequestError(f"tool_choice names {name!r}, which is not among the tools",
                           param=param)
    calls = [{"type": "object", "properties": {
        "name": {"type": "string", "enum": [f["name"]]},
        "parameters": f.get("parameters") or {"type": "object"}},
        "required": ["name", "parameters"], "additionalProperties": False} for f in chosen]
    schema: dict = {"type": "array", "minItems": 1,
                    "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return json.dumps(schema, ensure_ascii=False)


def output_schema(tools: list[dict] | None, forced: bool, tool: str | None, parallel: bool,
                  fmt: str | None, schema: object, fmt_param: str, schema_param: str
                  ) -> tuple[str | None, bool]:
    """The JSON schema a request's output is held to (None: free text), and whether it is a
    forced tool choice's: the calls of ``tool`` (None: any of ``tools``) when the choice is
    ``forced``, else the JSON format ``fmt`` (None or ``text``: none; ``json_object``;
    ``json_schema``, with ``schema``). ``fmt_param`` and ``schema_param`` name the format's
    fields in a refusal."""
    json_out = fmt not in (None, "text")
    if tools and forced:
        if json_out:
            raise RequestError(f"a forced tool choice and a JSON {fmt_param} cannot both hold "
                               "the output", param=fmt_param)
        return tools_schema(tools, tool, parallel, "tool_choice"), True
    if not json_out:
        return None, False
    if fmt == "json_object":
        return ANY_OBJECT, False
    if fmt != "json_schema":
        raise RequestError(f"{fmt_param} type {fmt!r} is not one of text, json_object, "
                           "json_schema", param=f"{fmt_param}.type")
    if schema is None:
        raise RequestError(f"a json_schema {fmt_param} needs its schema", param=schema_param)
    return json_schema(schema, schema_param), False


class Grammar(msgspec.Struct, frozen=True):
    """What holds a request's output: one of SGLang's ``json_schema`` (JSON text), ``regex``
    and ``ebnf``. ``what`` and ``param`` name it in a refusal."""

    what: str
    param: str
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    def hold(self, sampling: Sampling) -> Sampling:
        """``sampling`` with this grammar."""
        return msgspec.structs.replace(sampling, json_schema=self.json_schema,
                                       regex=self.regex, ebnf=self.ebnf)


def _text(value: str, what: str, param: str) -> str:
    if not value:
        raise RequestError(f"{what} must not be empty", param=param)
    return value


def _loaded(text: str, param: str) -> object:
    """A schema given as JSON text."""
    try:
        return json.loads(text)
    except ValueError:
        raise RequestError(f"{param} must be a JSON schema's text", param=param) from None


def _choice_grammar(choice: list[str], param: str) -> str:
    """``choice`` as an EBNF grammar: the output is one of the strings, whole. JSON's string
    escapes are the grammar's (quotes, backslashes, control characters)."""
    if not choice:
        raise RequestError("a choice needs at least one string", param=param)
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choice)


def _structured(so: StructuredOutputs) -> list[Grammar]:
    """vLLM's ``structured_outputs``, each constraint it gives."""
    p = "structured_outputs"
    if so.structural_tag is not None:
        raise RequestError("structured_outputs.structural_tag is not supported: use json, "
                           "regex, choice or grammar", param=f"{p}.structural_tag")
    out = []
    if so.json is not None:
        schema = so.json
        out.append(Grammar("a JSON schema", f"{p}.json", json_schema=json_schema(
            _loaded(schema, f"{p}.json") if isinstance(schema, str) else schema, f"{p}.json")))
    if so.json_object:
        out.append(Grammar("a JSON object", f"{p}.json_object", json_schema=ANY_OBJECT))
    if so.regex is not None:
        out.append(Grammar("a regex", f"{p}.regex",
                           regex=_text(so.regex, "a regex", f"{p}.regex")))
    if so.choice is not None:
        out.append(Grammar("a choice", f"{p}.choice",
                           ebnf=_choice_grammar(so.choice, f"{p}.choice")))
    if so.grammar is not None:
        out.append(Grammar("a grammar", f"{p}.grammar",
                           ebnf=_text(so.grammar, "a grammar", f"{p}.grammar")))
    return out


def engine_grammars(schema: str | None, regex: str | None, ebnf: str | None,
                    structured: StructuredOutputs | None) -> list[Grammar]:
    """The constraints a request gives as SGLang's fields (a completion's ``json_schema``
    text, ``regex``, ``ebnf``) and vLLM's ``structured_outputs``."""
    out = []
    if schema is not None:
        out.append(Grammar("a JSON schema", "json_schema",
                           json_schema=json_schema(_loaded(schema, "json_schema"),
                                                   "json_schema")))
    if regex is not None:
        out.append(Grammar("a regex", "regex", regex=_text(regex, "a regex", "regex")))
    if ebnf is not None:
        out.append(Grammar("an EBNF grammar", "ebnf",
                           ebnf=_text(ebnf, "an EBNF grammar", "ebnf")))
    if structured is not None:
        out += _structured(structured)
    return out


def one_grammar(given: list[Grammar]) -> Grammar | None:
    """The one constraint of a request (None: free text); two cannot both hold it."""
    if len(given) > 1:
        a, b = given[:2]
        raise RequestError(f"{a.what} ({a.param}) and {b.what} ({b.param}) cannot both "
                           "hold the output", param=b.param)
    return given[0] if given else None


def check_served(constrains: bool, what: str, param: str) -> None:
    """Refuse a constrained output the engines cannot hold to its grammar."""
    if not constrains:
        raise RequestError(f"{what} needs constrained decoding, which these engines do not "
                           "serve (an SGLang engine with a grammar backend does)", param=param)


class ForcedCalls:
    """The output of a forced tool choice, read as :class:`~evinfra.api.tool_calls.TaggedCalls`
    is (``feed``, ``end``, ``calls``): held until it is whole, then read as the array of
    calls. An output that is not one (cut at ``max_tokens``) is left as content."""

    def __init__(self, new_id: Callable[[], str]) -> None:
        self._new_id = new_id
        self._parts: list[str] = []
        self.calls: list[ToolCall] = []

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self._parts.append(delta)
        return "", []

    def end(self) -> str:
        text, self._parts = "".join(self._parts), []
        try:
            items = json.loads(text)
        except ValueError:
            return text
        if not (isinstance(items, list) and items and all(
                isinstance(it, dict) and isinstance(it.get("name"), str)
                and isinstance(it.get("parameters"), dict) for it in items)):
            return text
        self.calls = [ToolCall(self._new_id(), it["name"],
                               json.dumps(it["parameters"], ensure_ascii=False))
                      for it in items]
        return ""
