"""Streaming a chat choice that may call tools: content goes out as it is generated, except text that is, or may
become, the start of the calls (held back); the calls go out as whole delta.tool_calls entries once the output
ends, in the shape the OpenAI SDK assembles (index, id, type, function.name, function.arguments)."""

from __future__ import annotations

from .parsers import ToolCall, ToolCallParser
from .request import ToolPlan


def _held_tail(text: str, marker: str) -> int:
    """How many characters at the end of `text` could begin `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class ToolStream:
    def __init__(self, plan: ToolPlan, parser: ToolCallParser | None):
        self.plan = plan
        self.parser = parser if plan.mode == "auto" else None
        self.text = ""
        self.sent = 0  # characters of content already sent
        self.in_calls = False

    def push(self, delta: str) -> str:
        """The content to send now for `delta` of generated text."""
        self.text += delta
        if self.plan.constrained:
            return ""  # the whole output is the calls
        if self.parser is None:
            self.sent = len(self.text)
            return delta
        if self.in_calls:
            return ""
        at = self.text.find(self.parser.start, max(0, self.sent - len(self.parser.start)))
        end = at if at >= 0 else len(self.text) - _held_tail(self.text, self.parser.start)
        self.in_calls = at >= 0
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the end: the content not sent yet, and the calls."""
        content, calls = self.plan.split(self.text, self.parser)
        rest = content[self.sent:] if not self.plan.constrained or not calls else ""
        self.sent = max(self.sent, len(content))
        return rest, calls
