"""The sampling options of a request reach the engines' orders, and SGLang's body."""

import pytest

from evinfra.drivers.sglang.requests import sampling_params
from tests.api.conftest import body, spy_prefill_orders

ASKED = {"temperature": 0.7, "top_p": 0.9, "seed": 3, "top_k": 20, "min_p": 0.05,
         "frequency_penalty": 0.5, "presence_penalty": -0.5, "repetition_penalty": 1.1}


async def test_sampling_options_reach_both_orders_and_the_sglang_body(client, service):
    orders = []
    for d in service.drivers.values():
        for name in ("submit_prefill", "submit_decode"):
            def spy(order, _f=getattr(d, name)):
                orders.append(order)
                return _f(order)
            setattr(d, name, spy)
    r = await client.post("/v1/chat/completions", data=body(
        model="evinfra-fake", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        **ASKED))
    assert r.status == 200, await r.text()
    assert len(orders) == 2  # a prefill and a decode, the same sampling
    for o in orders:
        s = o.sampling
        assert (s.max_tokens, s.temperature, s.top_p, s.seed, s.top_k, s.min_p) == \
            (3, 0.7, 0.9, 3, 20, 0.05)
        assert (s.frequency_penalty, s.presence_penalty, s.repetition_penalty) == \
            (0.5, -0.5, 1.1)
    p = sampling_params(orders[0].sampling)
    assert {k: p[k] for k in ("top_k", "min_p", "frequency_penalty", "presence_penalty",
                              "repetition_penalty", "temperature", "top_p")} == \
        {k: v for k, v in ASKED.items() if k != "seed"}
    assert p["sampling_seed"] == 3 and p["max_new_tokens"] == 3


async def test_options_left_out_are_left_out_of_the_sglang_body(client, service):
    orders = spy_prefill_orders(service)
    r = await client.post("/v1/completions", data=body(model="evinfra-fake", prompt="hi",
                                                       max_tokens=2, top_k=-1))
    assert r.status == 200, await r.text()
    assert set(sampling_params(orders[0].sampling)) == {"max_new_tokens", "temperature",
                                                        "top_p", "ignore_eos"}


async def test_logit_bias_reaches_the_sglang_body(client, service):
    orders = spy_prefill_orders(service)
    r = await client.post("/v1/completions", data=body(model="evinfra-fake", prompt="hi",
                                                       max_tokens=2,
                                                       logit_bias={"65": 100, "7": -2.5}))
    assert r.status == 200, await r.text()
    assert orders[0].sampling.logit_bias == {65: 100, 7: -2.5}
    assert sampling_params(orders[0].sampling)["logit_bias"] == {"65": 100, "7": -2.5}


@pytest.mark.parametrize("bias", [{"a": 1}, {"-1": 1}, {"5": 101}, {"5": -100.5},
                                  {str(2**32): 1}])
async def test_bad_logit_bias_is_a_400(client, bias):
    r = await client.post("/v1/chat/completions", data=body(
        model="evinfra-fake", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        logit_bias=bias))
    assert r.status == 400 and (await r.json())["error"]["param"] == "logit_bias"


async def test_min_tokens_reaches_the_sglang_body_and_the_fake_engines_keep_it(client,
                                                                               service):
    """The fake engines draw an output of at least ``min_tokens``, a stop token ending it
    no earlier, as SGLang's ``min_new_tokens`` does."""
    from evinfra.core.contracts import Sampling
    from evinfra.drivers.fake.outputs import OutputPlanner

    orders = spy_prefill_orders(service)
    r = await client.post("/v1/completions", data=body(model="evinfra-fake", prompt="hi",
                                                       max_tokens=40, min_tokens=30))
    assert r.status == 200, await r.text()
    assert 30 <= (await r.json())["usage"]["completion_tokens"] <= 40
    assert sampling_params(orders[0].sampling)["min_new_tokens"] == 30
    planner = OutputPlanner(0, (0, 4))  # four ids: stop tokens come early
    for least in (0, 1, 7, 12):
        lengths = {len(planner.plan(f"r{i}", Sampling(12, stop_token_ids=[1],
                                                      min_tokens=least))[0])
                   for i in range(50)}
        assert min(lengths) == max(1, least)
    for least in (0, 7):
        lengths = {len(planner.plan(f"r{i}", Sampling(12, min_tokens=least))[0])
                   for i in range(200)}
        assert lengths == set(range(max(1, least), 13))


@pytest.mark.parametrize("fields", [{"min_tokens": 9, "max_tokens": 8}, {"min_tokens": -1}])
async def test_bad_min_tokens_is_a_400(client, fields):
    r = await client.post("/v1/completions", data=body(model="evinfra-fake", prompt="hi",
                                                       **{"max_tokens": 8, **fields}))
    assert r.status == 400 and (await r.json())["error"]["param"] == "min_tokens"
