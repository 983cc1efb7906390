"""Structured outputs over HTTP: OpenAI's response_format on chat and completions (the official openai client's
`chat.completions.parse` with a pydantic model included), SGLang's json_schema / regex / ebnf on /generate, and a
400 naming the problem for a schema, regex or grammar that does not compile."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pydantic
import pytest

from moeplex.config import EngineConfig
from moeplex.engine import Engine
from moeplex.server import ServerSettings, build_app

from live_server import LiveServer

KEY = "test-key"
ENGINE = dict(dtype="fp32", show_progress=False, max_total_tokens=4096, page_size=16, max_running_requests=16)
SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["paris", "rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"],
    "additionalProperties": False,
}


class Trip(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    city: str = pydantic.Field(pattern="^(paris|rome)$")
    days: int = pydantic.Field(ge=1, le=9)


@pytest.fixture(scope="module")
def live(tiny_model_dir):
    engine = Engine(EngineConfig(model=tiny_model_dir("deepseek_v3"), **ENGINE))
    app = build_app(engine, ServerSettings(api_key=KEY, served_model_name="tiny"))
    with LiveServer(app) as server:
        yield server


@pytest.fixture(scope="module")
def client(live):
    with httpx.Client(base_url=live.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:
        yield c


def post(client: httpx.Client, path: str, body: dict) -> dict:
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "trip", "schema": schema, "strict": True}}


def test_chat_json_schema_follows_the_schema_for_every_choice(client):
    body = {"messages": [{"role": "user", "content": "Plan a trip"}], "response_format": json_schema_format(SCHEMA),
            "max_tokens": 64, "n": 3, "temperature": 1.0, "seed": 5}
    for choice in post(client, "/v1/chat/completions", body)["choices"]:
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)


def test_chat_json_object_streamed(client):
    body = {"messages": [{"role": "user", "content": "JSON please"}], "response_format": {"type": "json_object"},
            "max_tokens": 48, "temperature": 0, "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    finish = [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1]
    if finish == "stop":
        assert isinstance(json.loads(text), dict)
    assert text.startswith("{")


def test_completions_response_format(client):
    body = {"prompt": "Trip:", "response_format": json_schema_format(SCHEMA), "max_tokens": 64, "temperature": 0}
    [choice] = post(client, "/v1/completions", body)["choices"]
    jsonschema.validate(json.loads(choice["text"]), SCHEMA)


@pytest.mark.parametrize(
    "field, value, check",
    [
        ("json_schema", json.dumps(SCHEMA), lambda text: jsonschema.validate(json.loads(text), SCHEMA)),
        ("regex", r"[a-f]{3}-[0-9]{3}", lambda text: re.fullmatch(r"[a-f]{3}-[0-9]{3}", text)),
        ("ebnf", 'root ::= "left" | "right"', lambda text: text in ("left", "right")),
    ],
)
def test_generate_native_constraints(client, field, value, check):
    out = post(client, "/generate", {"text": "Go", "sampling_params": {field: value, "max_new_tokens": 48, "temperature": 0}})
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    assert check(out["text"]) is not False


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                  "response_format": json_schema_format({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}})},
         "response_format"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}},
         "response_format.json_schema"),
        ("/generate", {"text": "x", "sampling_params": {"regex": "(unclosed"}}, "sampling_params"),
        ("/generate", {"text": "x", "sampling_params": {"ebnf": "root ::= missing"}}, "sampling_params"),
        ("/generate", {"text": "x", "sampling_params": {"json_schema": "{not json"}}, "sampling_params"),
        ("/generate", {"text": "x", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}}, "sampling_params"),
    ],
)
def test_a_constraint_that_cannot_compile_is_a_400_naming_it(client, path, body, param):
    response = client.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"]


def test_openai_client_parses_into_a_pydantic_model(live):
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key=KEY)
    completion = client.chat.completions.parse(
        model="tiny", messages=[{"role": "user", "content": "Plan a trip"}], response_format=Trip, max_tokens=64,
        temperature=0,
    )
    trip = completion.choices[0].message.parsed
    assert isinstance(trip, Trip) and trip.city in ("paris", "rome") and 1 <= trip.days <= 9


def test_metrics_count_mask_waits(client):
    body = client.get("/metrics").text
    assert "moeplex_grammar_mask_waits_total" in body and "moeplex_grammar_mask_wait_seconds_total" in body
