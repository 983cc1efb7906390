"""Prefill/decode disaggregation end to end: P, D and `moeplex router --pd` as separate processes (zmq on loopback)
answer token for token as a co-located server does, through the official openai client, and both pools end empty."""

from __future__ import annotations

import httpx
import openai
import pytest

from moeplex.interfaces import PluginError
from moeplex.plugins.kv_transfer.nixl import load_nixl

from pd_cluster import PDRouter, RoleServer, running, wait_idle

FLAGS = ("--chunked-prefill-size", "16", "--page-size", "16")
PROMPTS = {
    "one page": [256, 11, 12, 13, 14],
    "page boundary": list(range(300, 316)),  # exactly one full page
    "chunked": list(range(400, 441)),  # three prompt chunks of at most 16
}


def cluster(folder: str, backend: str):
    co = RoleServer(folder, "none", *FLAGS)
    pd = (*FLAGS, "--disaggregation-transfer-backend", backend)
    return co, RoleServer(folder, "prefill", *pd), RoleServer(folder, "decode", *pd)


@pytest.fixture(scope="module", params=[("deepseek_v3", "zmq"), ("qwen3_moe", "zmq"), ("deepseek_v3", "nixl")],
                ids=lambda p: "-".join(p))
def servers(request, tiny_model_dir):
    arch, backend = request.param
    if backend == "nixl":
        try:
            load_nixl()
        except PluginError as exc:
            pytest.skip(str(exc))
    co, prefill, decode = cluster(tiny_model_dir(arch), backend)
    with running(co, prefill, decode), PDRouter([prefill], [decode]) as router:
        yield co, prefill, decode, router


def api(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


def complete(server, prompt, **kw):
    extra = {"ignore_eos": True, "return_token_ids": True, **kw.pop("extra_body", {})}
    answer = api(server).completions.create(model=None, prompt=prompt, temperature=0, extra_body=extra, **kw)
    choice = answer.choices[0]
    return choice.text, choice.token_ids, choice.finish_reason, choice.logprobs, answer.usage.completion_tokens


def stream(server, prompt, **kw):
    extra = {"ignore_eos": True, "return_token_ids": True, **kw.pop("extra_body", {})}
    text, ids, finish = "", [], None
    for chunk in api(server).completions.create(model=None, prompt=prompt, temperature=0, stream=True, extra_body=extra, **kw):
        for choice in chunk.choices:
            text += choice.text
            ids += choice.token_ids or []
            finish = choice.finish_reason or finish
    return text, ids, finish


@pytest.mark.parametrize("shape", PROMPTS)
def test_pd_answers_token_for_token_as_colocated(servers, shape):
    co, prefill, decode, router = servers
    prompt = PROMPTS[shape]
    expected = complete(co, prompt, max_tokens=8, logprobs=2)
    assert complete(router, prompt, max_tokens=8, logprobs=2) == expected
    assert stream(router, prompt, max_tokens=8) == stream(co, prompt, max_tokens=8)
    assert stream(router, prompt, max_tokens=8)[1] == expected[1]
    wait_idle(prefill, decode)


def test_a_first_token_that_stops_is_the_only_completion_token(servers):
    co, prefill, decode, router = servers
    prompt = PROMPTS["one page"]
    first = complete(co, prompt, max_tokens=1)[1][0]
    for server in (co, router):
        text, ids, finish, _, used = complete(server, prompt, max_tokens=8, extra_body={"stop_token_ids": [first]})
        assert (ids, finish, used) == ([first], "stop", 1)
    assert complete(router, prompt, max_tokens=1)[1:3] == ([first], "length")
    wait_idle(prefill, decode)


def test_transfers_show_in_metrics_and_server_info(servers):
    co, prefill, decode, router = servers
    complete(router, PROMPTS["chunked"], max_tokens=2)
    wait_idle(prefill, decode)
    for server, role in ((prefill, "prefill"), (decode, "decode")):
        info = server.info()["disaggregation"]
        assert info["role"] == role and info["backend"] in ("zmq", "nixl") and info["transfers"].get("done", 0) >= 1
        assert info["bytes"] > 0 and set(info["states"]) == {"bootstrapping", "waiting", "transferring"}
        metrics = server.client.get("/metrics").text
        assert f'moeplex_kv_transfers_total{{outcome="done",role="{role}"}}' in metrics
        assert "moeplex_kv_transfer_gb_per_second" in metrics
    assert list(decode.info()["disaggregation"]["peers"]) == [f"127.0.0.1:{prefill.bootstrap_port}"]
    assert co.info()["disaggregation"] == {"role": "none"}


def test_requests_without_a_room_are_refused_by_either_role(servers):
    co, prefill, decode, router = servers
    for server in (prefill, decode):
        answer = server.client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
        assert answer.status_code == 400 and "bootstrap_room" in answer.json()["error"]["message"]
    answer = co.client.post("/v1/completions", json={"prompt": [1, 2], "bootstrap_room": 5})
    assert answer.status_code == 400 and "bootstrap_room" in answer.json()["error"]["message"]
