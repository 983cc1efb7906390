"""Tool-call and reasoning parsers on the exact text each model family writes, whole and streamed in pieces of
every size (a marker split across deltas is held back, never sent as content)."""

from __future__ import annotations

import json

import pytest

from moeplex.server.reasoning import reasoning_parser
from moeplex.server.tools.parsers import PARSERS, ToolCall
from moeplex.server.tools.request import ToolPlan
from moeplex.server.tools.stream import ToolStream

ARGS = {"city": "Paris", "days": 3}
OUTPUTS = {
    "deepseek_v3": (
        "Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        + json.dumps(ARGS) + "\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n"
        '{"tz": "CET"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    ),
    "qwen3": (
        "Let me check.<tool_call>\n" + json.dumps({"name": "get_weather", "arguments": ARGS})
        + "\n</tool_call>\n<tool_call>\n" + json.dumps({"name": "get_time", "arguments": {"tz": "CET"}}) + "\n</tool_call>"
    ),
    "mistral": "Let me check.[TOOL_CALLS]" + json.dumps([{"name": "get_weather", "arguments": ARGS},
                                                          {"name": "get_time", "arguments": {"tz": "CET"}}]),
}
TOOLS = [{"type": "function", "function": {"name": n, "description": None, "parameters": None, "strict": None}}
         for n in ("get_weather", "get_time")]


def auto_plan() -> ToolPlan:
    return ToolPlan.of({"tools": TOOLS, "tool_choice": "auto", "parallel_tool_calls": True})


@pytest.mark.parametrize("family", sorted(OUTPUTS))
def test_parser_reads_content_and_calls(family):
    content, calls = PARSERS[family].split(OUTPUTS[family])
    assert content == "Let me check."
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == ARGS and json.loads(calls[1].arguments) == {"tz": "CET"}


@pytest.mark.parametrize("family", sorted(OUTPUTS))
@pytest.mark.parametrize("piece", [1, 2, 3, 7, 1000])
def test_streamed_in_pieces_the_calls_and_content_are_the_same(family, piece):
    text = OUTPUTS[family]
    stream = ToolStream(auto_plan(), PARSERS[family])
    sent = "".join(stream.push(text[i:i + piece]) for i in range(0, len(text), piece))
    rest, calls = stream.finish()
    assert sent + rest == "Let me check." and PARSERS[family].start not in sent
    assert calls == PARSERS[family].split(text)[1]


def test_text_without_calls_is_all_content_and_a_partial_marker_is_released_at_the_end():
    stream = ToolStream(auto_plan(), PARSERS["qwen3"])
    sent = stream.push("a < b and <tool")
    rest, calls = stream.finish()
    assert sent + rest == "a < b and <tool" and calls == [] and sent == "a < b and "


def test_required_reads_the_json_array_and_named_the_arguments():
    required = ToolPlan.of({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False})
    assert json.loads(required.constraint.text)["maxItems"] == 1
    assert required.split('[{"name": "get_time", "arguments": {"tz": "UTC"}}]', None)[1] == [ToolCall("get_time", '{"tz": "UTC"}')]
    named = ToolPlan.of({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}},
                         "parallel_tool_calls": True})
    assert named.split('{"tz": "UTC"}', None) == ("", [ToolCall("get_time", '{"tz": "UTC"}')])


@pytest.mark.parametrize(
    "name, text, expected",
    [
        ("deepseek_r1", "weighing it</think>The answer.", ("weighing it", "The answer.")),
        ("deepseek_r1", "<think>weighing it</think>The answer.", ("weighing it", "The answer.")),
        ("deepseek_r1", "still thinking", ("still thinking", "")),
        ("qwen3", "<think>\nhmm\n</think>\n\nYes.", ("\nhmm\n", "\n\nYes.")),
        ("qwen3", "Yes, no thinking.", ("", "Yes, no thinking.")),
    ],
)
def test_reasoning_parser_whole_and_streamed(name, text, expected):
    parser = reasoning_parser(name)
    assert parser.split(text) == expected
    for piece in (1, 2, 5):
        stream = parser.stream()
        parts = [stream.push(text[i:i + piece]) for i in range(0, len(text), piece)]
        parts.append(stream.push("", final=True))
        assert ("".join(p[0] for p in parts), "".join(p[1] for p in parts)) == expected
        assert not any("<think>" in p[0] or "</think>" in p[0] or "</think>" in p[1] for p in parts)


CALL_ENDS = {"deepseek_v3": "<｜tool▁call▁end｜>", "qwen3": "</tool_call>", "mistral": "}"}  # a call is whole after it


def second_call_cuts(family: str) -> list[str]:
    """Every prefix of the family's output that ends after its first call and before its second one is whole."""
    text, end = OUTPUTS[family], CALL_ENDS[family]
    first = text.index(end, text.index(json.dumps(ARGS)) + len(json.dumps(ARGS))) + len(end)
    second = text.rindex(end) + len(end)
    return [text[:cut] for cut in range(first, second)]


@pytest.mark.parametrize("family", sorted(OUTPUTS))
def test_a_cut_second_call_leaves_the_first_whole_and_no_broken_one(family):
    """max_tokens cut inside the second of two parallel calls: the first call comes back whole, the cut one not
    at all (nor as content), streamed in pieces and not."""
    parser, first = PARSERS[family], PARSERS[family].split(OUTPUTS[family])[1][0]
    for text in second_call_cuts(family):
        content, calls = parser.split(text)
        assert (content, calls) == ("Let me check.", [first]), text
        stream = ToolStream(auto_plan(), parser)
        sent = "".join(stream.push(text[i:i + 5]) for i in range(0, len(text), 5))
        rest, streamed = stream.finish()
        assert (sent + rest, streamed) == ("Let me check.", [first]), text


def test_required_and_named_cut_by_max_tokens_give_only_complete_calls():
    required = ToolPlan.of({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": True})
    whole = json.dumps([{"name": "get_weather", "arguments": ARGS}, {"name": "get_time", "arguments": {"tz": "CET"}}])
    first = ToolCall("get_weather", json.dumps(ARGS))
    cut_at = whole.index("}, {") + 1
    for cut in range(cut_at, len(whole) - 1):
        assert required.split(whole[:cut], None) == ("", [first]), whole[:cut]
        stream = ToolStream(required, None)
        sent = "".join(stream.push(whole[:cut][i:i + 3]) for i in range(0, cut, 3))
        assert sent == "" and stream.finish() == ("", [first])
    assert required.split(whole[:cut_at - 1], None) == ("", [])  # cut inside the first: nothing complete
    named = ToolPlan.of({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}},
                         "parallel_tool_calls": True})
    assert named.split('{"tz": "UT', None) == ("", [])
