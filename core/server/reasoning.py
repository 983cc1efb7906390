"""Reasoning parsers (--reasoning-parser): the thinking a reasoning model writes between <think> and </think>
goes to message.reasoning_content / delta.reasoning_content, the rest is the answer (content).

deepseek_r1: DeepSeek-R1's template opens <think> in the prompt, so the output starts inside the thinking (an
output with no </think> is all thinking); a <think> the model writes itself is dropped. qwen3: the model opens
<think> itself; an output that does not start with it has no thinking (Qwen3 with enable_thinking off).
"""

from __future__ import annotations

START, END = "<think>", "</think>"


def _held_tail(text: str, marker: str) -> int:
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class ReasoningParser:
    def __init__(self, name: str, starts_thinking: bool):
        self.name = name
        self.starts_thinking = starts_thinking

    def split(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of a whole output."""
        stripped = text.lstrip()
        if stripped.startswith(START):
            text = stripped[len(START):]
        elif not self.starts_thinking:
            return "", text
        reasoning, found, content = text.partition(END)
        return (reasoning, content) if found else (text, "")

    def stream(self) -> "ReasoningStream":
        return ReasoningStream(self)


class ReasoningStream:
    """Splits a stream of text deltas; holds back what may be the start of a marker until it is known."""

    def __init__(self, parser: ReasoningParser):
        self.parser = parser
        self.text = ""
        self.reasoning_sent = 0
        self.content_sent = 0

    def push(self, delta: str, final: bool = False) -> tuple[str, str]:
        """(reasoning delta, content delta) to send now."""
        self.text += delta
        if not final and not self.parser.starts_thinking and START.startswith(self.text.lstrip()):
            return "", ""  # qwen3: this may still become <think>
        reasoning, content = self.parser.split(self.text)
        if not final and not content and END not in self.text:
            reasoning = reasoning[: len(reasoning) - max(_held_tail(reasoning, END), _held_tail(reasoning, START))]
        out = reasoning[self.reasoning_sent:], content[self.content_sent:]
        self.reasoning_sent, self.content_sent = max(self.reasoning_sent, len(reasoning)), max(self.content_sent, len(content))
        return out


def reasoning_parser(name: str | None) -> ReasoningParser | None:
    if name is None:
        return None
    return {"deepseek_r1": ReasoningParser("deepseek_r1", True), "qwen3": ReasoningParser("qwen3", False)}[name]
