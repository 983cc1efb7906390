"""The request fields ordinary clients send, through the official openai SDK and plain HTTP: each one's meaning
checked against the engine (or transformers), unknown fields ignored and named (or refused when strict)."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from moeplex.config import EngineConfig
from moeplex.engine import Engine
from moeplex.sampling import SamplingParams
from moeplex.server import ServerSettings, build_app

from live_server import LiveServer

transformers = pytest.importorskip("transformers")

ENGINE = dict(dtype="fp32", show_progress=False, max_total_tokens=8192, page_size=4)
PROMPT = "The experts of"
PENALTIES = dict(frequency_penalty=0.7, presence_penalty=0.3, logit_bias={"65": 4.0})
VLLM_EXTRAS = dict(repetition_penalty=1.3, min_tokens=3, top_k=40, min_p=0.01, ignore_eos=False, stop_token_ids=[300],
                   skip_special_tokens=True, spaces_between_special_tokens=True, include_stop_str_in_output=False,
                   allowed_token_ids=None, truncate_prompt_tokens=64, return_token_ids=True)


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir("qwen3_moe")


@pytest.fixture(scope="module")
def engine_ref(folder):
    return Engine(EngineConfig(model=folder, **ENGINE))


@pytest.fixture(scope="module")
def server(folder):
    engine = Engine(EngineConfig(model=folder, **ENGINE))
    with LiveServer(build_app(engine, ServerSettings(served_model_name="tiny"))) as live:
        yield live


@pytest.fixture(scope="module")
def api(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


def expected(engine: Engine, text: str, **params) -> list[int]:
    ids = engine.encode(text)
    return engine.generate([ids], SamplingParams(**params))[0].output_ids


def test_completions_with_every_field_streamed_and_not(api, engine_ref):
    want = expected(engine_ref, PROMPT, max_new_tokens=8, temperature=0.0, repetition_penalty=1.3, min_tokens=3,
                    stop_token_ids=[300], **PENALTIES)
    fields = dict(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0.0, seed=1, n=1, user="u", **PENALTIES)
    got = api.completions.create(**fields, extra_body=VLLM_EXTRAS)
    assert got.choices[0].model_extra["token_ids"] == want
    chunks = list(api.completions.create(**fields, stream=True, extra_body=VLLM_EXTRAS,
                                         stream_options={"include_usage": True, "continuous_usage_stats": True}))
    ids = [t for c in chunks if c.choices for t in c.choices[0].model_extra["token_ids"]]
    assert ids == want
    usages = [c.usage.completion_tokens for c in chunks if c.choices]
    assert usages == sorted(usages) and usages[-1] == len(want)  # usage so far, in every chunk
    assert chunks[-1].usage.completion_tokens == len(want) and not chunks[-1].choices


def test_chat_with_every_field_streamed_and_not(api, engine_ref, folder):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name an expert."}]
    fields = dict(model="tiny", messages=messages, max_completion_tokens=6, temperature=0.0, seed=3,
                  logprobs=True, top_logprobs=2, **PENALTIES)
    extras = {**VLLM_EXTRAS, "add_generation_prompt": True, "chat_template_kwargs": {"enable_thinking": False},
              "echo": False}
    full = api.chat.completions.create(**fields, extra_body=extras)
    streamed = list(api.chat.completions.create(**fields, stream=True, extra_body=extras,
                                                stream_options={"include_usage": True, "continuous_usage_stats": True}))
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == full.choices[0].message.content
    assert [e.token for e in full.choices[0].logprobs.content] == [
        e.token for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert all(c.usage is not None for c in streamed)


def test_unknown_fields_are_ignored_and_named(server):
    body = {"prompt": PROMPT, "max_tokens": 2, "max_token": 5, "some_future_option": {"a": 1},
            "stream_options": {"include_usage": True, "new_flag": True}}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["x-moeplex-ignored-fields"] == "max_token, some_future_option, stream_options.new_flag"
    r = httpx.post(f"{server.url}/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 2, "x": 1}},
                   timeout=60)
    assert r.status_code == 200 and r.headers["x-moeplex-ignored-fields"] == "sampling_params.x"


def test_a_strict_server_refuses_unknown_fields(folder):
    engine = Engine(EngineConfig(model=folder, **ENGINE))
    with LiveServer(build_app(engine, ServerSettings(strict_request_fields=True))) as live:
        r = httpx.post(f"{live.url}/v1/completions", json={"prompt": PROMPT, "max_token": 5}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_token"


def hf_prompt_logprobs(folder: str, ids: list[int]) -> list[float]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    return [float(logprobs[q - 1, ids[q]]) for q in range(1, len(ids))]


def test_echo_with_logprobs_and_prompt_logprobs(api, engine_ref, folder):
    ids = engine_ref.encode(PROMPT)
    want = hf_prompt_logprobs(folder, ids)
    got = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0.0, echo=True, logprobs=2,
                                 extra_body={"prompt_logprobs": 1})
    choice = got.choices[0]
    assert choice.text.startswith(PROMPT)
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1 : len(ids)] == pytest.approx(want, abs=1e-4)
    assert len(lp.tokens) == len(ids) + 3
    prompt_lp = choice.model_extra["prompt_logprobs"]
    assert prompt_lp[0] is None
    assert [prompt_lp[q][str(ids[q])]["logprob"] for q in range(1, len(ids))] == pytest.approx(want, abs=1e-4)
    streamed = list(api.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0.0, echo=True,
                                           stream=True))
    assert "".join(c.choices[0].text for c in streamed) == choice.text


def test_generate_takes_sglang_sampling_names_and_logprob_start_len(server, engine_ref, folder):
    ids = engine_ref.encode(PROMPT)
    body = {"text": PROMPT, "return_logprob": True, "logprob_start_len": 2, "top_logprobs_num": 2,
            "sampling_params": {"max_new_tokens": 5, "temperature": 0, "frequency_penalty": 0.5, "presence_penalty": 0.2,
                                "repetition_penalty": 1.1, "min_new_tokens": 2, "logit_bias": {"70": 3},
                                "no_stop_trim": True, "skip_special_tokens": False}}
    r = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()
    want = expected(engine_ref, PROMPT, max_new_tokens=5, temperature=0.0, frequency_penalty=0.5, presence_penalty=0.2,
                    repetition_penalty=1.1, min_tokens=2, logit_bias={"70": 3})
    assert r["output_ids"] == want
    inputs = r["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in inputs] == ids[2:]
    assert [lp for lp, _, _ in inputs] == pytest.approx(hf_prompt_logprobs(folder, ids)[1:], abs=1e-4)
    assert len(r["meta_info"]["input_top_logprobs"]) == len(ids) - 2


def test_include_stop_str_in_output(api, engine_ref):
    plain = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0.0)
    text = plain.choices[0].text
    stop = text[3:5]
    assert stop and text.find(stop) == 3
    cut = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0.0, stop=[stop])
    kept = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0.0, stop=[stop],
                                  extra_body={"include_stop_str_in_output": True})
    assert cut.choices[0].text == text[:3] and kept.choices[0].text == text[:5]


def test_tokenize_and_detokenize(server, engine_ref):
    ids = engine_ref.encode(PROMPT)
    r = httpx.post(f"{server.url}/tokenize", json={"model": "tiny", "prompt": PROMPT, "return_token_strs": True}).json()
    assert r["tokens"] == ids and r["count"] == len(ids) and len(r["token_strs"]) == len(ids)
    bare = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}).json()["tokens"]
    assert bare == engine_ref.tokenizer.encode(PROMPT, add_special_tokens=False).ids
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 1
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": bare}).json()["prompt"] == PROMPT
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": [10**6]}).status_code == 400


def test_sglang_bench_serving_payloads(server):
    """The bodies SGLang's bench_serving sends to /generate and /v1/completions, as it sends them."""
    body = {"text": PROMPT, "image_data": None, "lora_path": None, "return_logprob": False, "logprob_start_len": -1,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True},
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}/generate", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and '"completion_tokens":8' in events[-2]
    body = {"model": "tiny", "prompt": PROMPT, "temperature": 0.0, "best_of": 1, "max_tokens": 8, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}, "lora_path": None}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and sum(1 for line in r.iter_lines() if line.startswith("data: {")) >= 8


def test_vllm_guided_fields_constrain_the_output(api):
    """vLLM's guided_choice, guided_regex, guided_json and structured_outputs mean what they mean there."""
    import json
    import re

    choice = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0.0,
                                    extra_body={"guided_choice": ["yes", "no", "maybe so"]})
    assert choice.choices[0].text in ("yes", "no", "maybe so") and choice.choices[0].finish_reason == "stop"
    digits = api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a number"}], max_tokens=8,
                                         temperature=0.0, extra_body={"structured_outputs": {"regex": "[0-9]{3}"}})
    assert re.fullmatch("[0-9]{3}", digits.choices[0].message.content)
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"], "additionalProperties": False}
    obj = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=64, temperature=0.0,
                                 extra_body={"guided_json": schema})
    if obj.choices[0].finish_reason == "stop":
        assert json.loads(obj.choices[0].text)["a"] in ("x", "y")
    else:  # cut by max_tokens: a prefix of a valid answer
        assert obj.choices[0].text.lstrip().startswith("{")


def test_ignored_field_names_of_any_text_fit_in_a_header(server):
    body = {"prompt": PROMPT, "max_tokens": 1, "Ā\n": 1, **{f"x{i}": i for i in range(40)}}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    named = r.headers["x-moeplex-ignored-fields"]
    assert named.startswith("\\u0100\\n, x0, x1") and named.endswith("and 9 more")
