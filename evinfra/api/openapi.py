"""``GET /openapi.json``: an OpenAPI 3.1 description of the routes the app serves.

The paths are read off the app's router, so a route added anywhere is described; a request
body's schema is its msgspec struct's (the one its handler decodes, :data:`BODIES`), so the
document cannot drift from what the server accepts. Answers are described by their shape
where it is one (an error's, always), and as JSON or an event stream otherwise.
"""

from __future__ import annotations

import re

import msgspec
from aiohttp import web

from evinfra.api.anthropic import CountTokensRequest, MessagesRequest
from evinfra.api.responses import ResponsesRequest
from evinfra.api.schemas import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                 SplitRequest, TokenizeRequest)

__all__ = ["BODIES", "document", "serve_document"]

BODIES: dict[tuple[str, str], type] = {
    ("POST", "/v1/chat/completions"): ChatCompletionRequest,
    ("POST", "/v1/completions"): CompletionRequest,
    ("POST", "/tokenize"): TokenizeRequest,
    ("POST", "/detokenize"): DetokenizeRequest,
    ("POST", "/v1/messages"): MessagesRequest,
    ("POST", "/v1/messages/count_tokens"): CountTokensRequest,
    ("POST", "/v1/responses"): ResponsesRequest,
    ("POST", "/v1/evinfra/split"): SplitRequest,
}
"""The request body each route decodes."""

_STREAMS = {"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"}
_GROUP = re.compile(r"\(\?P<(\w+)>((?:[^()]|\([^()]*\))*)\)")
_ERROR = {"type": "object", "properties": {"error": {"type": "object"}}, "required": ["error"],
          "description": "OpenAI's error shape; Anthropic's routes add \"type\": \"error\""}
_OPEN = {"/health", "/ready", "/metrics", "/openapi.json"}


def _any(t: object) -> dict | None:
    return {"description": "any JSON value"} if t is object else None


def _path_params(info: dict) -> tuple[str, list[dict]]:
    """The route's path in OpenAPI's terms and its parameters; a parameter matched by a
    regex of alternatives (``{action:cordon|uncordon}``) is an enum of them."""
    if "formatter" not in info:
        return info.get("path", ""), []
    params = []
    for name, regex in _GROUP.findall(info["pattern"].pattern):
        schema: dict = {"type": "string", "minLength": 1, "pattern": "^[^/]+$"}
        if re.fullmatch(r"[\w\-]+(\|[\w\-]+)+", regex):
            schema = {"type": "string", "enum": regex.split("|")}
        params.append({"name": name, "in": "path", "required": True, "schema": schema})
    return info["formatter"], params


def document(app: web.Application, title: str = "evinfra") -> dict:
    types = sorted(set(BODIES.values()), key=lambda t: t.__name__)
    refs, components = msgspec.json.schema_components(
        types, schema_hook=_any, ref_template="#/components/schemas/{name}")
    ref = dict(zip(types, refs))
    paths: dict[str, dict] = {}
    for route in app.router.routes():
        if route.method == "HEAD":  # (aiohttp's twin of each GET)
            continue
        path, params = _path_params(route.resource.get_info())
        op: dict = {"operationId": f"{route.method.lower()}_{path}",
                    "responses": {"default": {"description": "an error", "content": {
                        "application/json": {"schema": {"$ref": "#/components/schemas/Error"}}
                    }}}}
        doc = (getattr(route.handler, "__doc__", None) or "").strip()
        if doc:
            op["summary"] = " ".join(doc.split("\n\n")[0].split())
        if params:
            op["parameters"] = params
        body = BODIES.get((route.method, path))
        if body is not None:
            op["requestBody"] = {"required": True,
                                 "content": {"application/json": {"schema": ref[body]}}}
        ok = {"application/json": {}}
        if path in _STREAMS:
            ok["text/event-stream"] = {}
        if path == "/metrics":
            ok = {"text/plain": {}}
        elif not path.startswith(("/v1", "/tokenize", "/detokenize", "/health", "/ready",
                                  "/openapi")):
            ok = {"*/*": {}}  # pages and their assets
        op["responses"]["200"] = {"description": "the answer", "content": ok}
        if path not in _OPEN:
            op["security"] = [{"bearer": []}, {"x-api-key": []}, {}]
        paths.setdefault(path, {})[route.method.lower()] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": "1",
                 "description": "OpenAI-, Anthropic- and Responses-compatible inference, agent "
                                "branch hints (X-Evinfra-* headers) and the control plane's "
                                "admin routes."},
        "paths": dict(sorted(paths.items())),
        "components": {"schemas": {**components, "Error": _ERROR},
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"},
                                           "x-api-key": {"type": "apiKey", "in": "header",
                                                         "name": "x-api-key"}}},
    }


async def serve_document(request: web.Request) -> web.Response:
    """This API's OpenAPI 3.1 description."""
    return web.Response(body=msgspec.json.encode(document(request.app)),
                        content_type="application/json")
