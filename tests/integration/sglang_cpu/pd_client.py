"""A bare PD client for the engine-patch tests: one request through a prefill engine and a
decode engine over plain HTTP, as the SGLang driver sends it (``drivers/sglang/requests.py``),
so a test controls every field (the fetch plan included) and reads both engines' answers."""

from __future__ import annotations

import json
import secrets
import threading
import time
import urllib.error
import urllib.request
from typing import Any


def http(method: str, url: str, body: Any = None, timeout: float = 120.0) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, method=method, data=data,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, _body(r.read())
    except urllib.error.HTTPError as e:
        return e.code, _body(e.read())


def _body(raw: bytes) -> Any:
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return raw.decode(errors="replace")


def generate(prefill_url: str, decode_url: str, bootstrap_port: int, input_ids: list[int],
             max_new_tokens: int, kv_hints: dict | None = None, rid: str | None = None,
             timeout: float = 120.0, decode_delay_s: float = 0.0,
             logprob_start: int | None = None, bootstrap_host: str = "127.0.0.1") -> dict:
    """Greedy generation of ``input_ids`` through the pair. Returns ``{"output_ids", "rid"
    (the prefill half's), "prefill": meta_info of the prefill engine, "decode": meta_info of
    the decode engine}``. ``decode_delay_s`` sends the decode half later: the prefill engine
    holds the request in its bootstrap queue until then (a queued request). ``logprob_start``
    asks for log-probabilities: ``"input_logprobs"``, the prefill engine's of the prompt tokens
    from that position on (SGLang then reuses at most that many cached tokens), and
    ``"logprobs"``, the decode engine's of the output tokens."""
    rid = rid or secrets.token_hex(6)
    room = secrets.randbits(63)
    body = {"input_ids": [int(t) for t in input_ids],
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0,
                                "ignore_eos": True},
            "bootstrap_host": bootstrap_host, "bootstrap_port": bootstrap_port,
            "bootstrap_room": room}
    if logprob_start is not None:
        body.update(return_logprob=True, logprob_start_len=logprob_start)
    out: dict[str, Any] = {}

    def run(kind: str, url: str, extra: dict) -> None:
        if kind == "decode" and decode_delay_s:
            time.sleep(decode_delay_s)
        try:
            out[kind] = http("POST", url + "/generate", {**body, **extra, "rid": f"{rid}-{kind}"},
                             timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - reported to the caller
            out[kind] = (0, repr(exc))

    pre = {"kv_hints": kv_hints} if kv_hints else {}
    threads = [threading.Thread(target=run, args=("prefill", prefill_url, pre)),
               threading.Thread(target=run, args=("decode", decode_url, {}))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5)
    (ps, pb), (ds, db) = out["prefill"], out["decode"]
    if ps != 200 or ds != 200:
        raise AssertionError(f"generate failed: prefill {ps} {pb!r}, decode {ds} {db!r}")
    out = {"output_ids": db["output_ids"], "rid": f"{rid}-prefill", "prefill": pb["meta_info"],
           "decode": db["meta_info"]}
    if logprob_start is not None:
        out["logprobs"] = [x[0] for x in db["meta_info"]["output_token_logprobs"]]
        out["input_logprobs"] = [x[0] for x in pb["meta_info"]["input_token_logprobs"]]
    return out
