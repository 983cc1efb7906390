"""`moeplex serve` over real HTTP: a uvicorn server on a loopback port, a tiny model, httpx and the openai client."""

from __future__ import annotations

import asyncio
import json
import re
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moeplex.cli import main as cli_main
from moeplex.config import EngineConfig
from moeplex.engine import Engine
from moeplex.sampling import SamplingParams
from moeplex.server import ServerSettings, build_app
from moeplex.server.progress import held_back

from live_server import LiveServer

KEY = "test-key"
PROMPT = "Hello"
CHAT_PROMPT = "<|begin_of_text|><|user|>\nHi\n<|assistant|>\n"  # the template make-model writes, rendered
ENGINE = dict(dtype="fp32", show_progress=False, max_total_tokens=4096, page_size=16, max_running_requests=64)



@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir("deepseek_v3")


@pytest.fixture(scope="module")
def reference(folder):
    return Engine(EngineConfig(model=folder, **ENGINE))


@pytest.fixture(scope="module")
def live(folder):
    engine = Engine(EngineConfig(model=folder, **ENGINE))
    app = build_app(engine, ServerSettings(api_key=KEY, served_model_name="tiny", max_request_bytes=256 << 10))
    with LiveServer(app) as server:
        yield server


@pytest.fixture(scope="module")
def client(live):
    with httpx.Client(base_url=live.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        yield c


def greedy(engine: Engine, ids: list[int], n: int, **kw):
    [request] = engine.generate([ids], SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, **kw))
    return request


def sse(response: httpx.Response) -> list:
    """The events of a server-sent-events body: JSON objects, then the string "[DONE]"."""
    events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def wait_until_idle(client: httpx.Client, timeout: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        info = client.get("/get_server_info").json()
        kv = info["kv_cache"]
        if info["num_running_requests"] == info["num_queued_requests"] == 0 and kv["free_pages"] + kv["cached_pages"] == kv["num_pages"]:
            return info
        assert time.monotonic() < deadline, f"the server did not go idle: {info}"
        time.sleep(0.05)


# --- completions ------------------------------------------------------------------------------------


def test_greedy_completion_equals_engine_and_moeplex_generate(client, reference, folder, capsys):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    expected = greedy(reference, reference.encode(PROMPT), 12)
    assert (choice["token_ids"], choice["text"], choice["finish_reason"]) == (expected.output_ids, expected.text, "length")
    prompt_tokens = len(reference.encode(PROMPT))
    assert r.json()["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 12, "total_tokens": prompt_tokens + 12,
                                 "prompt_tokens_details": {"cached_tokens": 0}}
    cli_main(["generate", "--model", folder, "--prompt", PROMPT, "--max-new-tokens", "12", "--ignore-eos", "--json"])
    assert json.loads(capsys.readouterr().out)["output_ids"] == choice["token_ids"]


def test_streamed_completion_has_the_same_text_and_tokens(client):
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=stream) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse(r)
    assert events[-1] == "[DONE]"
    chunks = [e["choices"][0] for e in events[:-2]]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert [t for c in chunks for t in c["token_ids"]] == whole["token_ids"]
    assert [c["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 24


def test_stop_string_ends_the_text_streamed_or_not(client, reference):
    full = greedy(reference, reference.encode(PROMPT), 24).text
    at = next(k for k in range(2, len(full) - 2) if full.find(full[k : k + 2]) == k)
    stop = full[at : at + 2]
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stop": [stop]}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (full[:at], "stop", stop)
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        events = sse(r)[:-1]
    # the first character of the stop string was held back, never sent and then taken away
    assert "".join(e["choices"][0]["text"] for e in events) == full[:at]


def test_n_choices_with_a_seed_are_reproducible(client, reference):
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0.9, "n": 2, "seed": 5, "ignore_eos": True, "return_token_ids": True}
    first, again = (client.post("/v1/completions", json=body).json() for _ in range(2))
    assert [c["index"] for c in first["choices"]] == [0, 1]
    assert first["choices"] == again["choices"]
    ids = reference.encode(PROMPT)
    for j, choice in enumerate(first["choices"]):  # choice j samples with seed + j
        params = SamplingParams(max_new_tokens=8, temperature=0.9, seed=5 + j, ignore_eos=True)
        assert choice["token_ids"] == reference.generate([ids], params)[0].output_ids
    assert first["usage"]["prompt_tokens"] == len(ids) and first["usage"]["completion_tokens"] == 16


def test_logprobs_match_the_engine(client, reference):
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 3}
    logprobs = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    expected = greedy(reference, reference.encode(PROMPT), 6, logprobs=3).logprobs
    assert logprobs["token_logprobs"] == pytest.approx([e["logprob"] for e in expected], abs=1e-5)
    for top, step in zip(logprobs["top_logprobs"], expected):  # keyed by token text, so equal texts merge
        assert {round(v, 4) for v in top.values()} <= {round(lp, 4) for _, lp in step["top_logprobs"]}
    assert len(logprobs["tokens"]) == len(logprobs["text_offset"]) == 6
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    content = client.post("/v1/chat/completions", json=chat).json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 4 and all(len(entry["top_logprobs"]) == 2 for entry in content)
    native = {"text": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
              "return_logprob": True, "top_logprobs_num": 3}
    meta = client.post("/generate", json=native).json()["meta_info"]
    assert [t for _, t, _ in meta["output_token_logprobs"]] == [e["token_id"] for e in expected]
    assert [lp for lp, _, _ in meta["output_token_logprobs"]] == pytest.approx([e["logprob"] for e in expected], abs=1e-5)
    assert [len(top) for top in meta["output_top_logprobs"]] == [3] * 6


# --- chat and native ---------------------------------------------------------------------------------


def test_chat_renders_the_model_template_and_streams_the_same_reply(client, reference):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    r = client.post("/v1/chat/completions", json=body).json()
    expected = greedy(reference, reference.encode(CHAT_PROMPT), 10)
    assert r["object"] == "chat.completion" and r["choices"][0]["message"] == {"role": "assistant", "content": expected.text}
    assert r["usage"]["prompt_tokens"] == len(reference.encode(CHAT_PROMPT))
    # an SDK's earlier answer sent back as is (null fields included), and content as text parts
    turns = [{"role": "user", "content": [{"type": "text", "text": "H"}, {"type": "text", "text": "i"}]},
             {"role": "assistant", "content": "Yo", "refusal": None, "tool_calls": None}, {"role": "user", "content": "?"}]
    again = client.post("/v1/chat/completions", json={**body, "messages": turns, "return_token_ids": True}).json()
    rendered = "<|begin_of_text|><|user|>\nHi\n<|assistant|>\nYo\n<|user|>\n?\n<|assistant|>\n"
    assert again["choices"][0]["token_ids"] == greedy(reference, reference.encode(rendered), 10).output_ids
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
        events = sse(s)[:-1]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == expected.text
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_generate_takes_text_or_input_ids_and_streams_cumulatively(client, reference):
    ids = reference.encode(PROMPT)
    expected = greedy(reference, ids, 8)
    sampling = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    by_text = client.post("/generate", json={"text": PROMPT, "sampling_params": sampling}).json()
    assert (by_text["output_ids"], by_text["text"]) == (expected.output_ids, expected.text)
    assert by_text["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    batch = client.post("/generate", json={"input_ids": [ids, [256, 65]], "sampling_params": sampling}).json()
    assert batch[0]["output_ids"] == expected.output_ids and len(batch[1]["output_ids"]) == 8
    with client.stream("POST", "/generate", json={"input_ids": ids, "sampling_params": sampling, "stream": True}) as r:
        events = sse(r)
    assert events[-1] == "[DONE]" and events[-2]["output_ids"] == expected.output_ids
    # cumulative: each event the whole output so far (a busy front end may fold several steps into one event)
    lengths = [len(e["output_ids"]) for e in events[:-1]]
    assert lengths == sorted(set(lengths)) and lengths[-1] == 8
    assert all(e["output_ids"] == expected.output_ids[: len(e["output_ids"])] for e in events[:-1])


def test_openai_client_completions_chat_and_streaming(live):
    openai = pytest.importorskip("openai")
    api = openai.OpenAI(base_url=f"{live.url}/v1", api_key=KEY, max_retries=0, timeout=60)
    done = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == 5
    streamed = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, stream=True,
                                      extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == done.choices[0].text
    chat = api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3, n=2, seed=1)
    assert len(chat.choices) == 2 and chat.usage.completion_tokens <= 6
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        api.completions.create(model="tiny", prompt=PROMPT, max_tokens=-1)
    assert [m.id for m in api.models.list().data] == ["tiny"]


# --- information endpoints ---------------------------------------------------------------------------


def test_models_health_info_and_openapi(client, live):
    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"
    assert httpx.get(f"{live.url}/health").status_code == 200  # probes need no key
    assert client.get("/health_generate").status_code == 200
    info = client.get("/get_model_info").json()
    assert (info["vocab_size"], info["context_length"], info["chat_template"]) == (512, 4096, "model")
    doc = client.get("/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/generate", "/metrics"} <= set(doc["paths"])
    completions = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert completions["properties"]["max_tokens"]["minimum"] == 1 and completions["required"] == ["prompt"]


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_kv_pages_the_prefix_cache_keeps_are_not_counted_as_used(client, live):
    """With nothing running, pages the prefix cache keeps are reuse (evictable), not pressure (used)."""
    client.post("/v1/completions", json={"prompt": list(range(300, 340)), "max_tokens": 3, "ignore_eos": True})
    deadline = time.monotonic() + 10
    while (info := client.get("/get_server_info").json())["num_running_requests"] and time.monotonic() < deadline:
        time.sleep(0.05)
    text = httpx.get(f"{live.url}/metrics").text
    kv = info["kv_cache"]
    assert kv["cached_pages"] > 0 and kv["used_pages"] == 0 and kv["evictable_pages"] == kv["cached_pages"], kv
    assert metric(text, "moeplex_kv_pages_used ") == 0 and metric(text, "moeplex_kv_cache_usage_ratio ") == 0
    assert metric(text, "moeplex_kv_pages_cached_evictable ") == metric(text, "moeplex_prefix_cache_pages ") > 0


def test_metrics_count_requests_tokens_and_latencies(client, live):
    client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "ignore_eos": True})
    text = httpx.get(f"{live.url}/metrics").text
    assert metric(text, 'moeplex_http_requests_total{endpoint="/v1/completions",status="200"}') >= 1
    assert metric(text, 'moeplex_requests_finished_total{reason="length"}') >= 1
    for name in ("moeplex_prompt_tokens_total", "moeplex_generation_tokens_total",
                 "moeplex_time_to_first_token_seconds_count", "moeplex_inter_token_latency_seconds_count",
                 "moeplex_kv_pages_total"):
        assert metric(text, name) > 0, name
    for name in ("moeplex_num_running_requests", "moeplex_num_queued_requests", "moeplex_kv_cache_usage_ratio"):
        assert name in text


# --- bad input, auth ---------------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
BAD = [
    ("/v1/completions", b'{"prompt": "x",', None),
    ("/v1/completions", b"[1, 2]", None),
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', None),
    ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, None),
    ("/v1/completions", {"max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -3}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -0.5}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "seed": -1}, "seed"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, "model"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": [1] * 5000}, "max_tokens"),
    ("/v1/completions", {"prompt": [1, 2, 100_000]}, "prompt"),
    ("/v1/completions", {"prompt": [-1]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [9999]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "top_k": -2}, "top_k"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": 2.5}, "frequency_penalty"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": [99999]}, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "x", "min_tokens": -1}, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "lora_path": "/adapters/a"}, "lora_path"),
    ("/v1/completions", {"prompt": "x", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ("/v1/completions", {"prompt": "x", "guided_regex": "a+", "response_format": {"type": "json_object"}}, "guided_regex"),
    ("/v1/completions", {"prompt": "x", "guided_regex": "(unclosed"}, "guided_regex"),
    ("/v1/completions", {"prompt": "x", "use_beam_search": True}, "use_beam_search"),
    ("/v1/completions", {"prompt": "x", "priority": 5}, "priority"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True}, "continue_final_message"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "chat_template": "{% if %}"}, "chat_template"),
    ("/generate", {"text": "x", "return_logprob": True, "logprob_start_len": 50}, "logprob_start_len"),
    ("/generate", {"text": "x", "sampling_params": {"repetition_penalty": -1}}, "sampling_params.repetition_penalty"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    (CHAT, {"messages": [{"role": "user", "content": "x" * 5000}]}, "messages"),
    ("/generate", {"text": "x", "input_ids": [1]}, "text"),
    ("/generate", {"sampling_params": {}}, "text"),
    ("/generate", {"text": "x", "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    # a lone UTF-16 surrogate is valid JSON but not text: a 400 naming the field, not a 500 from the tokenizer
    ("/v1/completions", {"prompt": "a\ud800b"}, "prompt"),
    ("/v1/completions", {"prompt": ["ok", "\udfff"]}, "prompt[1]"),
    ("/v1/completions", {"prompt": "x", "stop": ["\ud800"]}, "stop[0]"),
    (CHAT, {"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages[0].content"),
    ("/generate", {"text": "a\ud800b"}, "text"),
    # stop strings are bounded in number and length (each step matches them against the new text)
    ("/v1/completions", {"prompt": "x", "stop": ["ab"] * 33}, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": ["a" * 513]}, "stop"),
    # a text no context can hold is refused before it is tokenized
    ("/v1/completions", {"prompt": "x" * (200 << 10)}, "prompt"),
]


@pytest.mark.parametrize("path, body, param", BAD, ids=[f"{i}-{p}" for i, (_, _, p) in enumerate(BAD)])
def test_bad_input_is_a_400_naming_the_problem(client, path, body, param):
    # json.dumps escapes a lone surrogate as JSON allows (httpx's json= refuses to encode one)
    r = client.post(path, content=body if isinstance(body, bytes) else json.dumps(body).encode())
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param


def test_oversized_body_is_a_413_and_the_server_keeps_serving(client):
    r = client.post("/v1/completions", json={"prompt": "x" * (300 << 10)})
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
    assert client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200
    wait_until_idle(client)


@pytest.mark.parametrize("path", ["/v1/completions", "/start_expert_distribution_record", "/rebalance_experts"])
def test_a_declared_oversized_body_is_a_413_before_it_is_read(live, path):
    port = int(live.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                     "Content-Length: 200000000\r\n\r\n{".encode())  # 200 MB announced, one byte sent
        assert sock.recv(4096).startswith(b"HTTP/1.1 413")


def test_missing_or_wrong_api_key_is_a_401(live):
    body = {"prompt": PROMPT, "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(f"{live.url}/v1/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{live.url}/get_server_info").status_code == 401
    assert httpx.get(f"{live.url}/metrics").status_code == 200


# --- disconnects, concurrency, engine failures ------------------------------------------------------


def aborted(client) -> float:
    return metric(client.get("/metrics").text, 'moeplex_requests_finished_total{reason="abort"}')


def test_client_leaving_mid_stream_aborts_and_frees_the_kv_cache(client, live):
    before = aborted(client)
    body = {"prompt": PROMPT, "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=live.url, headers=client.headers, timeout=30) as own:
        with own.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert sum(1 for _, line in zip(range(6), lines) if line.startswith("data: ")) == 3
    info = wait_until_idle(client)
    assert info["kv_cache"]["free_pages"] + info["kv_cache"]["cached_pages"] == info["kv_cache"]["num_pages"]
    assert aborted(client) == before + 1


def test_client_leaving_while_waiting_for_a_whole_answer_aborts_it(client, live):
    before = aborted(client)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{live.url}/v1/completions", headers=client.headers, timeout=0.5,
                   json={"prompt": PROMPT, "max_tokens": 3000, "ignore_eos": True})
    wait_until_idle(client)
    assert aborted(client) == before + 1


def test_200_concurrent_streams_all_complete(live):
    async def one(http: httpx.AsyncClient, i: int) -> int:
        body = {"prompt": [256, 65 + i % 26], "max_tokens": 4, "ignore_eos": True, "stream": True, "return_token_ids": True}
        async with http.stream("POST", "/v1/completions", json=body) as r:
            lines = [line async for line in r.aiter_lines() if line.startswith("data: {")]
        return sum(len(json.loads(line[6:])["choices"][0]["token_ids"]) for line in lines)

    async def run() -> list[int]:
        limits = httpx.Limits(max_connections=200)
        headers = {"Authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(base_url=live.url, headers=headers, limits=limits, timeout=60) as http:
            return await asyncio.wait_for(asyncio.gather(*(one(http, i) for i in range(200))), 80)

    assert asyncio.run(run()) == [4] * 200


def test_a_failed_engine_step_is_a_500_and_the_server_stays_up(client, live):
    runner = live.app.state.engine_loop.engine.runner
    forward = runner.forward

    def broken(batch):
        runner.forward = forward  # fail once
        raise RuntimeError("injected failure")

    runner.forward = broken
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
    assert r.status_code == 500 and "injected failure" in r.json()["error"]["message"]
    assert client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4}).status_code == 200
    assert wait_until_idle(client)["failed_steps"] == 1


def test_fuzzed_bodies_never_give_a_5xx(client):
    doc = client.get("/openapi.json").json()
    fields = {p: list(op["post"]["requestBody"]["content"]["application/json"]["schema"]["properties"])
              for p, op in doc["paths"].items() if "post" in op}
    # chat's default length is the rest of the context: two length fields keep fuzzed requests short
    valid = {"/v1/completions": {"prompt": "hi", "max_tokens": 2}, CHAT: {"messages": [{"role": "user", "content": "hi"}],
             "max_tokens": 2, "max_completion_tokens": 2}, "/generate": {"text": "hi", "sampling_params": {"max_new_tokens": 2}}}
    ints = st.integers(-3, 4) | st.sampled_from([2**31, 2**63, -(2**63), 10**30])
    scalars = st.none() | st.booleans() | ints | st.floats(-1e6, 1e6) | st.text(max_size=6)
    values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                          max_size=3), max_leaves=5)

    @settings(max_examples=80, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(path=st.sampled_from(sorted(fields)), data=st.data())
    def fuzz(path, data):
        body = dict(valid[path])
        for name in data.draw(st.lists(st.sampled_from(fields[path] + ["bogus"]), min_size=1, max_size=3)):
            body[name] = data.draw(values)
        r = client.post(path, json=body)
        assert r.status_code < 500 and "internal_server_error" not in r.text, (body, r.text)

    fuzz()
    wait_until_idle(client)


# --- the command line, and SIGTERM --------------------------------------------------------------------


def test_moeplex_serve_drains_in_flight_requests_on_sigterm(folder):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # a shutdown timeout of 3 s: the 20-token stream drains in well under 1 s, the 16000-token one is still running
    command = [sys.executable, "-c", "import sys; from moeplex.cli import main; sys.exit(main())", "serve", "--model", folder, "--port", str(port), "--max-total-tokens",
               "16384", "--shutdown-timeout", "3", "--log-level", "warning"]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not _answers(f"{url}/health"):
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "moeplex serve did not come up"
            time.sleep(0.2)
        results: dict[int, list] = {}
        started = threading.Barrier(3, timeout=30)
        streams = [threading.Thread(target=_stream, args=(url, n, started, results)) for n in (20, 16000)]
        whole = threading.Thread(target=_whole, args=(url, 16000, results))
        whole.start()  # in the server before the streams start (a request sent after SIGTERM would be refused)
        deadline = time.monotonic() + 30
        while _in_server(url) < 1:
            assert time.monotonic() < deadline, "the whole request never reached the server"
            time.sleep(0.05)
        for t in streams:
            t.start()
        started.wait()
        proc.send_signal(signal.SIGTERM)
        for t in streams + [whole]:
            t.join(30)
        # uvicorn re-raises the SIGTERM once it has shut down, so the exit status says what stopped it
        assert proc.wait(timeout=45) in (0, -signal.SIGTERM), proc.stderr.read().decode()[-3000:]
    finally:
        proc.kill()
    short, long = results[20], results[16000]
    assert short[-1] == "[DONE]" and _tokens(short) == 20  # drained to the end
    # cut when the shutdown timeout ran out: with an error event, never as a short complete answer
    error = json.loads(long[-2])["error"]
    assert long[-1] == "[DONE]" and "shutdown-timeout" in error["message"] and error["type"] == "service_unavailable"
    assert 0 < _tokens(long[:-2]) < 16000
    status, body = results["whole"]
    assert status == 503 and "shutdown-timeout" in body["error"]["message"], (status, body)


def _tokens(events: list[str]) -> int:
    return sum(len(json.loads(e)["choices"][0]["token_ids"]) for e in events if e != "[DONE]")


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def _in_server(url: str) -> float:
    """Requests the server runs or queues, from its /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(("moeplex_num_running_requests", "moeplex_num_queued_requests")))


def _whole(url: str, tokens: int, results: dict) -> None:
    body = {"prompt": PROMPT, "max_tokens": tokens, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    results["whole"] = (r.status_code, r.json() if r.headers.get("content-type") == "application/json" else r.text)


def _stream(url: str, tokens: int, started: threading.Barrier, results: dict) -> None:
    body = {"prompt": PROMPT, "max_tokens": tokens, "ignore_eos": True, "stream": True, "return_token_ids": True}
    events = []
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 1:
                        started.wait()
    except httpx.TransportError:
        pass  # the long stream is cut by the shutdown
    results[tokens] = events


# --- pieces ------------------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.text("ab", max_size=12), st.lists(st.text("abc", min_size=1, max_size=6), max_size=4))
def test_held_back_equals_trying_every_length(text, stops):
    def reference(text, stops):
        return max([n for stop in stops for n in range(min(len(stop) - 1, len(text)) + 1) if text.endswith(stop[:n])] + [0])

    assert held_back(text, stops) == reference(text, stops)


def test_tokenizing_lets_other_threads_run(folder):
    """The front end tokenizes in a worker thread; that helps only if the tokenizer lets go of the GIL."""
    import types

    from moeplex.server.served_model import ServedModel
    from moeplex.tokenizer import load_tokenizer

    model = types.SimpleNamespace(tokenizer=load_tokenizer(folder), context_length=1 << 30, _longest_token=1, path=folder)
    gaps, done = [], threading.Event()

    def tick():
        while not done.is_set():
            start = time.perf_counter()
            time.sleep(0.001)
            gaps.append(time.perf_counter() - start)

    ticker = threading.Thread(target=tick)
    ticker.start()
    start = time.perf_counter()
    ids = ServedModel.encode(model, "experts route tokens " * 40_000, "prompt")
    took = time.perf_counter() - start
    done.set()
    ticker.join()
    assert len(ids) > 100_000 and max(gaps) < took / 2, (max(gaps), took)


@pytest.mark.parametrize("text, stops, held", [("abc", ["cd"], 1), ("abc", ["bcx", "c"], 2), ("abc", ["x"], 0),
                                                ("ab", ["abab"], 2), ("", ["ab"], 0)])
def test_held_back_is_the_longest_end_that_starts_a_stop_string(text, stops, held):
    assert held_back(text, stops) == held


def test_stream_events_survive_any_line_splitting():
    from moeplex.server.sse import event

    text = "a\u2028b\x85c\u2029d\x1ce"  # characters str.splitlines() breaks on
    line = event({"text": text}).decode()
    assert len(line.strip().splitlines()) == 1 and json.loads(line[6:])["text"] == text


def test_a_repeated_prompt_reports_its_cached_tokens_and_the_cache_can_be_flushed(client):
    wait_until_idle(client)
    body = {"prompt": "The experts of a mixture " * 8, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    first = client.post("/v1/completions", json=body).json()["usage"]
    again = client.post("/v1/completions", json=body).json()["usage"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert 0 < again["prompt_tokens_details"]["cached_tokens"] < again["prompt_tokens"]
    native = client.post("/generate", json={"text": body["prompt"], "sampling_params": {"max_new_tokens": 2}}).json()
    assert native["meta_info"]["cached_tokens"] == again["prompt_tokens_details"]["cached_tokens"]
    info = client.get("/get_server_info").json()
    assert info["prefix_cache"]["enabled"] and info["prefix_cache"]["hit_tokens"] > 0 and info["kv_cache"]["cached_pages"] > 0
    text = client.get("/metrics").text
    assert metric(text, "moeplex_prefix_cache_hit_tokens_total") > 0
    wait_until_idle(client)
    assert client.post("/flush_cache").json() == {"flushed": True}
    assert client.get("/get_server_info").json()["kv_cache"]["cached_pages"] == 0


def test_small_bodies_are_planned_on_the_event_loop_and_large_ones_in_a_thread(client, reference, monkeypatch):
    """A body up to INLINE_BODY_BYTES is parsed and planned without a trip to a thread (each trip waits for a pass of
    the event loop); a larger one still goes to a thread. Both answer as the engine does."""
    from moeplex.server import handlers

    trips, original = [], handlers.run_in_threadpool

    async def counted(func, *args):
        trips.append(func)
        return await original(func, *args)

    monkeypatch.setattr(handlers, "run_in_threadpool", counted)
    for ids in ([5, 6, 7], [5, 6, 7] * 400):  # a few bytes, then ~4.8 KB of token ids
        body = {"model": "tiny", "prompt": ids, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        inline = len(json.dumps(body)) <= handlers.INLINE_BODY_BYTES
        trips.clear()
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == greedy(reference, ids, 4).output_ids
        assert len(trips) == (0 if inline else 2), (len(ids), trips)


def test_a_grammar_not_compiled_yet_is_planned_in_a_thread(client, monkeypatch):
    """A small body whose constraint has not been compiled is planned in a thread (a compile, or the grammar
    backend's first load, would stall every stream on the event loop); once compiled, the same constraint is
    planned on the event loop."""
    from moeplex.server import handlers

    trips, original = [], handlers.run_in_threadpool

    async def counted(func, *args):
        trips.append(func)
        return await original(func, *args)

    monkeypatch.setattr(handlers, "run_in_threadpool", counted)
    body = {"model": "tiny", "prompt": "Pick:", "max_tokens": 4, "temperature": 0, "guided_regex": "(yes|no)[a-z]{0,3}"}
    for planned_in_threads in (1, 0):
        trips.clear()
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert re.fullmatch("(yes|no)[a-z]{0,3}", r.json()["choices"][0]["text"]), r.text
        assert len(trips) == planned_in_threads
