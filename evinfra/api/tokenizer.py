"""The front end's tokenizers: it owns tokenization, as Dynamo's front end does.

* :class:`HFTokenizer` reads a Hugging Face model directory: ``tokenizer.json`` (the
  ``tokenizers`` library) and the chat template of ``tokenizer_config.json`` (Jinja, rendered
  in a sandbox the way ``transformers`` does).
* :class:`ByteTokenizer` needs nothing: UTF-8 bytes are the token ids, and a fixed chat
  template frames the messages. It serves the fake engines of the embedded default, whose
  outputs are ids from a large vocabulary: ids past the byte range render as letters, so a
  response reads as text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol, Sequence

import numpy as np

from evinfra.errors import ConfigError, RequestError

__all__ = ["ByteTokenizer", "HFTokenizer", "Tokenizer", "continue_final", "load_tokenizer"]

Message = dict[str, object]


class Tokenizer(Protocol):
    eos_token_ids: list[int]

    def encode(self, text: str, add_special_tokens: bool = False) -> np.ndarray:
        """``add_special_tokens``: what the model's tokenizer adds around a text of its own
        (a BOS), as engines do for a completion's text prompt; a rendered chat template
        has its special tokens already."""

    def decode(self, ids: Sequence[int]) -> str: ...

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        """Each token as the vocabulary spells it (not decoded text)."""

    def apply_chat_template(self, messages: list[Message], tools: list[dict] | None = None,
                            extra: dict[str, object] | None = None,
                            add_generation_prompt: bool = True) -> str: ...


def message_text(message: Message) -> str:
    """A message's content as text: a string, or the text parts of a content list."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RequestError(f"unsupported content part type {kind!r}: only text",
                                   param="messages")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise RequestError("message content must be a string or a list of parts", param="messages")


def continue_final(rendered: str, messages: list[Message]) -> str:
    """A conversation rendered without a generation prompt, cut right after the text of its
    final message, an assistant's: the model goes on writing that message (a prefilled
    answer) instead of closing it. As transformers' and vLLM's ``continue_final_message``:
    what the template writes after the text (its end-of-turn tokens) goes; the text is found
    stripped, as templates often strip it."""
    last = messages[-1]
    if last.get("role") != "assistant":
        raise RequestError("only an assistant's final message can be continued",
                           param="messages")
    text = message_text(last).strip()
    if not text:
        raise RequestError("the final assistant message has no text to continue",
                           param="messages")
    at = rendered.rfind(text)
    if at < 0:
        raise RequestError("the chat template does not render the final assistant message's "
                           "text as it is: it cannot be continued", param="messages")
    return rendered[:at + len(text)]


def _arguments(messages: list[Message]) -> list[Message]:
    """The messages with each tool call's ``arguments`` (a JSON string, as OpenAI sends it) as
    the object chat templates expect (SGLang and vLLM convert them too). Calls are an
    assistant's, but whatever message carries them, a template reads them."""
    out = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if calls:
            param = f"messages[{i}].tool_calls"
            if not isinstance(calls, list) or not all(
                    isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls):
                raise RequestError("tool_calls must be a list of {id, type, function}",
                                   param=param)
            m = {**m, "tool_calls": [{**c, "function": {**c["function"], "arguments":
                                                        call_arguments(c["function"], param)}}
                                     for c in calls]}
        out.append({**m, "content": message_text(m)})
    return out


def call_arguments(function: dict, param: str) -> dict:
    """A call's ``arguments`` as an object: a JSON object, or a string of one."""
    args = function.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args or "{}")
        except ValueError:
            args = None
    if not isinstance(args, dict):
        raise RequestError("a tool call's function.arguments must be a JSON object", param=param)
    return args


_LETTERS = "etaoin shrdlucmfwypvbgkjqxz etaoin shrdlu"


class ByteTokenizer:
    """UTF-8 bytes as token ids 0-255; a built-in chat template."""

    eos_token_ids: list[int] = []

    def encode(self, text: str, add_special_tokens: bool = False) -> np.ndarray:
        """(No special tokens to add.)"""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint32)

    def decode(self, ids: Sequence[int]) -> str:
        out = bytearray()
        for i in ids:
            out += bytes((i,)) if i < 256 else _LETTERS[i % len(_LETTERS)].encode()
        return out.decode("utf-8", errors="replace")

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        """A byte as its Latin-1 character (a lone UTF-8 byte has no text of its own)."""
        return [chr(i) if i < 256 else _LETTERS[i % len(_LETTERS)] for i in ids]

    def apply_chat_template(self, messages: list[Message], tools: list[dict] | None = None,
                            extra: dict[str, object] | None = None,
                            add_generation_prompt: bool = True) -> str:
        """Roles in tags; tools and tool calls as the ``hermes`` format writes them. No
        template variables (``extra`` is not read)."""
        out = [f"<|tools|>\n{json.dumps(tools)}\n"] if tools else []
        for m in _arguments(messages):
            calls = "".join(f"<tool_call>\n{json.dumps(c['function'])}\n</tool_call>\n"
                            for c in m.get("tool_calls") or ())
            out.append(f"<|{m.get('role', 'user')}|>\n{m['content']}\n{calls}")
        return "".join(out) + ("<|assistant|>\n" if add_generation_prompt else "")


class HFTokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from tokenizers import Tokenizer as _Tok

        d = Path(model_dir)
        try:
            self._tok = _Tok.from_file(str(d / "tokenizer.json"))
        except Exception as exc:  # noqa: BLE001 - the library raises plain Exception
            raise ConfigError(f"cannot load tokenizer.json: {exc}", path=str(d), key="model.dir") from exc
        try:
            cfg = json.loads((d / "tokenizer_config.json").read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read tokenizer_config.json: {exc}", path=str(d),
                              key="model.dir") from exc

        def token(name: str) -> str:
            v = cfg.get(name)
            return v.get("content", "") if isinstance(v, dict) else (v or "")

        self.bos_token, self.eos_token = token("bos_token"), token("eos_token")
        eos = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.eos_token_ids = [eos] if eos is not None else []
        self._template_error = TemplateError
        template = cfg.get("chat_template")
        self._template = None
        if template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.filters["tojson"] = lambda v, indent=None: json.dumps(v, indent=indent)

            def raise_exception(message: str) -> None:
                raise TemplateError(message)

            env.globals["raise_exception"] = raise_exception
            self._template = env.from_string(template)

    def encode(self, text: str, add_special_tokens: bool = False) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=add_special_tokens).ids,
                          dtype=np.uint32)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        return [self._tok.id_to_token(i) or "" for i in ids]

    def apply_chat_template(self, messages: list[Message], tools: list[dict] | None = None,
                            extra: dict[str, object] | None = None,
                            add_generation_prompt: bool = True) -> str:
        """``extra``: the request's ``chat_template_kwargs``; they cannot replace what the
        server renders (the messages, the tools, the special tokens)."""
        if self._template is None:
            raise RequestError("the model has no chat template: use /v1/completions",
                               param="messages")
        msgs = _arguments(messages)
        try:
            return self._template.render({**(extra or {}), "messages": msgs, "tools": tools,
                                          "add_generation_prompt": add_generation_prompt,
                                          "bos_token": self.bos_token,
                                          "eos_token": self.eos_token})
        except (self._template_error, TypeError, ValueError, LookupError,
                AttributeError) as exc:
            # The template is the model's and the values are the request's: whatever the
            # render trips on (a string added to a number, a missing key), a 400.
            raise RequestError(f"chat template: {exc}", param="messages") from exc


def load_tokenizer(model_dir: str) -> Tokenizer:
    return HFTokenizer(model_dir) if model_dir else ByteTokenizer()
