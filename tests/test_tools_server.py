"""Tool calling through the official openai client against `moeplex serve`: tool_choice required and a named
function always give arguments valid under the function's schema, streamed and not; finish_reason is tool_calls;
the tool's answer goes back as a role tool message through the chat template and the model answers; reasoning
content is split off with --reasoning-parser."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from moeplex.config import EngineConfig
from moeplex.engine import Engine
from moeplex.server import ServerSettings, build_app

from live_server import LiveServer

KEY = "test-key"
ENGINE = dict(dtype="fp32", show_progress=False, max_total_tokens=4096, page_size=16, max_running_requests=16)
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["paris", "rome", "oslo"]}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"tz": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "required": ["tz"],
        "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Time in a zone", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(tiny_model_dir):
    engine = Engine(EngineConfig(model=tiny_model_dir("qwen3_moe"), **ENGINE))
    app = build_app(engine, ServerSettings(api_key=KEY, served_model_name="tiny", tool_call_parser="qwen3"))
    with LiveServer(app) as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


def check_calls(calls, parallel: bool = True) -> None:
    assert calls and (parallel or len(calls) == 1)
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("seed", range(3))
def test_required_always_yields_valid_arguments(client, seed):
    reply = client.chat.completions.create(model="tiny", messages=QUESTION, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=96, temperature=1.0, seed=seed)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    check_calls(choice.message.tool_calls, parallel=False)


def test_named_function_streamed_through_the_sdk(client):
    with client.chat.completions.stream(
        model="tiny", messages=QUESTION, tools=TOOLS, max_tokens=64, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    ) as stream:
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_time"
    check_calls([call])


def test_round_trip_with_the_tool_result(client):
    # one call: a random-weight model given the choice would add calls until max_tokens cuts the array
    first = client.chat.completions.create(model="tiny", messages=QUESTION, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=96, temperature=0)
    message = first.choices[0].message
    check_calls(message.tool_calls)
    history = QUESTION + [message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})} for call in message.tool_calls
    ]
    answer = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=8, temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.choices[0].message.tool_calls is None
    chunks = list(client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=8, temperature=0,
                                                 stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == answer.choices[0].message.content  # the same prompt, rendered with the tool's answer


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nowhere"}}),
        dict(tool_choice="required"),
        dict(tools=TOOLS, tool_choice="sometimes"),
        dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
    ],
)
def test_bad_tool_requests_are_400s(client, kwargs):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=4, **kwargs)


def test_reasoning_parser_splits_the_thinking(tiny_model_dir):
    """deepseek_r1: the output starts inside the thinking; a random model never closes it, so all of it is
    reasoning_content (a response_format waits for the answer, which never comes), streamed and not alike."""
    engine = Engine(EngineConfig(model=tiny_model_dir("deepseek_v3"), **ENGINE))
    app = build_app(engine, ServerSettings(api_key=KEY, served_model_name="tiny", reasoning_parser="deepseek_r1"))
    with LiveServer(app) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
        kwargs = dict(model="tiny", messages=QUESTION, max_tokens=12, temperature=0, response_format={"type": "json_object"})
        message = client.chat.completions.create(**kwargs).choices[0].message
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
    streamed = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    assert message.reasoning_content and not message.content
    assert streamed == message.reasoning_content


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_calls_cut_by_max_tokens_return_the_complete_ones(client, stream):
    """tool_choice required with parallel calls: a random-weight model adds calls until max_tokens cuts one. The
    calls it finished come back whole (valid under their schemas), the cut one not at all; finish_reason is
    length (OpenAI's; vLLM says tool_calls there, or fails the request under required)."""
    kwargs = dict(model="tiny", messages=QUESTION, tools=TOOLS, tool_choice="required", max_tokens=60, temperature=0)
    if stream:  # (the SDK's stream helper refuses a length finish: read the chunks)
        chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
        finish, content = chunks[-1].finish_reason, "".join(c.delta.content or "" for c in chunks)
        calls = [call for c in chunks for call in c.delta.tool_calls or ()]
        assert [call.index for call in calls] == list(range(len(calls)))
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        finish, content, calls = choice.finish_reason, choice.message.content, choice.message.tool_calls
    assert finish == "length" and not content
    check_calls(calls)
    found = [(call.function.name, json.loads(call.function.arguments)) for call in calls]
    assert found == CUT_CALLS.setdefault("calls", found)  # streamed and not alike


CUT_CALLS: dict = {}
