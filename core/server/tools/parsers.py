"""Tool-call parsers: the exact text each model family's chat template teaches it to write for a call, read back
into (name, JSON arguments). `--tool-call-parser NAME` picks one; docs/structured_outputs.md shows each format.

    deepseek_v3  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
                 ```json
                 {ARGUMENTS}
                 ```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
    qwen3        <tool_call>
                 {"name": NAME, "arguments": {ARGUMENTS}}
                 </tool_call>          (one block per call)
    mistral      [TOOL_CALLS][{"name": NAME, "arguments": {ARGUMENTS}}, ...]

Only complete calls are read: an output cut by max_tokens inside its second call gives the first one (its
finish_reason stays "length"), never a call whose arguments are cut JSON.
"""

from __future__ import annotations

import json
import re

import attrs


@attrs.frozen
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (what OpenAI's function.arguments carries)


_SPACE = re.compile(r"\s*")


def _arguments(value) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def complete_items(text: str) -> list:
    """The values of the JSON array `text` that are complete, in order: all of them, or those before the point
    where the text was cut (a cut value, and anything after it, is left out)."""
    decoder = json.JSONDecoder()
    at = _SPACE.match(text).end()
    if not text.startswith("[", at):
        return []
    items, at = [], at + 1
    while True:
        try:
            value, at = decoder.raw_decode(text, _SPACE.match(text, at).end())
        except ValueError:
            return items
        items.append(value)
        at = _SPACE.match(text, at).end()
        if not text.startswith(",", at):
            return items
        at += 1


def named_calls(values: list) -> list[ToolCall]:
    """[{"name", "arguments"}, ...] as calls (entries of another shape are left out)."""
    return [ToolCall(v["name"], _arguments(v.get("arguments", {}))) for v in values
            if isinstance(v, dict) and isinstance(v.get("name"), str)]


class ToolCallParser:
    name = ""
    start = ""  # the text that opens the calls: content before it is the message's text

    def split(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content before the calls, the calls); text without the start marker is all content."""
        at = text.find(self.start)
        if at < 0:
            return text, []
        return text[:at], self.calls(text[at:])

    def calls(self, text: str) -> list[ToolCall]:
        raise NotImplementedError


class DeepSeekV3Parser(ToolCallParser):
    name = "deepseek_v3"
    start = "<｜tool▁calls▁begin｜>"
    CALL = re.compile(
        r"<｜tool▁call▁begin｜>(?P<type>.*?)<｜tool▁sep｜>(?P<name>.*?)\n```json\n(?P<args>.*?)\n```\s*<｜tool▁call▁end｜>",
        re.DOTALL,
    )

    def calls(self, text: str) -> list[ToolCall]:
        return [ToolCall(m["name"].strip(), m["args"].strip()) for m in self.CALL.finditer(text)]


class Qwen3Parser(ToolCallParser):
    name = "qwen3"
    start = "<tool_call>"
    CALL = re.compile(r"<tool_call>\s*(?P<body>\{.*?\})\s*</tool_call>", re.DOTALL)

    def calls(self, text: str) -> list[ToolCall]:
        found = []
        for m in self.CALL.finditer(text):
            try:
                body = json.loads(m["body"])
            except ValueError:
                continue  # a malformed block stays out of tool_calls
            if isinstance(body, dict) and isinstance(body.get("name"), str):
                found.append(ToolCall(body["name"], _arguments(body.get("arguments", {}))))
        return found


class MistralParser(ToolCallParser):
    name = "mistral"
    start = "[TOOL_CALLS]"

    def calls(self, text: str) -> list[ToolCall]:
        body = text[len(self.start):].strip()
        if body.startswith("["):
            return named_calls(complete_items(body))
        try:  # one call without the array
            value, _ = json.JSONDecoder().raw_decode(body)
        except ValueError:
            return []
        return named_calls([value])


PARSERS = {p.name: p for p in (DeepSeekV3Parser(), Qwen3Parser(), MistralParser())}
