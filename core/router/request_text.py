"""The text a request is routed by: its prompt as the worker will see it, approximately.

The router never tokenizes. A prompt given as token ids becomes its ids spelled as text, which keeps
the one property the tree needs: prompts sharing leading tokens share leading characters. A body
the router cannot read routes by the empty text (the load alone decides) and the worker answers it
with its own 400.
"""

from __future__ import annotations

import json


def routing_text(path: str, body: bytes) -> str:
    if not body:
        return ""
    try:
        values = json.loads(body)
    except (ValueError, RecursionError):
        return ""
    if not isinstance(values, dict):
        return ""
    text_of = TEXT_OF.get(path)
    return text_of(values) if text_of is not None else ""


def _prompt_text(prompt) -> str:
    """A string, token ids, or a batch of either: a batch routes by its first prompt."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        if all(isinstance(x, int) for x in prompt):
            return _ids_text(prompt)
        return _prompt_text(prompt[0])
    return ""


def _ids_text(ids: list[int]) -> str:
    return "".join(f"{i}," for i in ids)


def _messages_text(messages) -> str:
    if not isinstance(messages, list):
        return ""
    parts = []
    for message in messages:
        if isinstance(message, dict):
            parts.append(f"<{message.get('role')}>{_content_text(message.get('content'))}")
    return "".join(parts)


def _content_text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: only the text parts matter
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


# forwarded path -> the routing text of its (JSON object) body
TEXT_OF = {
    "/generate": lambda values: _prompt_text(values["text"] if values.get("text") is not None else values.get("input_ids")),
    "/v1/completions": lambda values: _prompt_text(values.get("prompt")),
    "/v1/chat/completions": lambda values: _messages_text(values.get("messages")),
}
