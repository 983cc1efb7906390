"""POST /v1/chat/completions: the OpenAI chat API, prompts rendered with the model's chat template."""

from __future__ import annotations

from typing import Any, AsyncIterator

import attrs

from .endpoint import MAX_TOP_LOGPROBS, Plan, expand
from .errors import bad_request
from .group import RequestGroup
from .openai_common import chat_logprobs, finish_fields, header, params_for_choice, sampling_fields, usage
from .outputs import Completion, Output
from .schema import BOOLEAN, INTEGER, OBJECT, STRING, AnyOf, Field, ListOf, ObjectOf
from .served_model import ServedModel
from .structured import from_response_format, response_format_field

ROLES = ("system", "developer", "user", "assistant")
TEXT_PART = ObjectOf([Field("type", STRING, None, required=True, choices=("text",)), Field("text", STRING, None, required=True)])
MESSAGE = ObjectOf(
    [
        Field("role", STRING, None, required=True, choices=ROLES),
        Field("content", AnyOf(STRING, ListOf(TEXT_PART, "an array of text parts")), None, "text, or text parts"),
        Field("name", STRING, None, "accepted and ignored"),
    ],
    describe="a message object",
)


def _flatten(message: dict) -> dict:
    """A message as chat templates expect it: role and content as one string."""
    content = message["content"]
    if isinstance(content, list):
        content = "".join(part["text"] for part in content)
    return {"role": message["role"], "content": content or ""}


class ChatEndpoint:
    path = "/v1/chat/completions"
    summary = "OpenAI chat completion (streaming with stream: true)"

    def __init__(self, model: ServedModel):
        self.model = model
        self.fields = [
            Field("messages", ListOf(MESSAGE, "an array of messages", min_items=1), None, required=True),
            *sampling_fields(max_tokens_default=None),
            Field("max_completion_tokens", INTEGER, None, "tokens to generate at most (wins over max_tokens)", minimum=1),
            Field("logprobs", BOOLEAN, False, "return the log-probability of each generated token"),
            Field("top_logprobs", INTEGER, 0, "with logprobs: the K most likely tokens at each step", minimum=0,
                  maximum=MAX_TOP_LOGPROBS),
            response_format_field(),
            Field("tools", ListOf(OBJECT, "an array of tools"), None, "not supported", choices=([],)),
            Field("tool_choice", AnyOf(STRING, OBJECT), None, "not supported", choices=("none", "auto")),
            Field("parallel_tool_calls", BOOLEAN, None, "accepted and ignored (no tools)"),
        ]

    def plan(self, values: dict[str, Any]) -> Plan:
        model = self.model
        model.check_name(values["model"])
        if values["top_logprobs"] and not values["logprobs"]:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        text = model.chat_template.render([_flatten(m) for m in values["messages"]])
        ids = model.encode(text, "messages")
        model.check_prompt(ids, "messages")
        max_tokens = values["max_completion_tokens"] or values["max_tokens"] or model.room_after(len(ids))
        model.check_length(len(ids), max_tokens, "max_tokens")
        engine_logprobs = max(values["top_logprobs"], 1) if values["logprobs"] else 0
        requests = expand([ids], values["n"], lambda j: params_for_choice(values, model, max_tokens, engine_logprobs, j))
        constraint = from_response_format(values["response_format"])
        if constraint is not None:
            model.constraints.check(constraint, "response_format")
            requests = [(ids, attrs.evolve(params, constraint=constraint)) for ids, params in requests]
        return Plan(requests, values["stream"], values["n"], values)

    def _logprobs(self, plan: Plan, entries) -> dict | None:
        return chat_logprobs(self.model, entries, plan.options["top_logprobs"]) if plan.options["logprobs"] else None

    def response(self, plan: Plan, group: RequestGroup, completions: list[Completion]) -> dict:
        choices = []
        for c in completions:
            choice = {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": self._logprobs(plan, c.logprobs),
                **finish_fields(c.finish_reason, c.stop_reason),
            }
            if plan.options["return_token_ids"]:
                choice["token_ids"] = c.token_ids
            choices.append(choice)
        return {**header("chat.completion", f"chatcmpl-{group.id}", self.model), "choices": choices,
                "usage": usage(completions, plan.n)}

    async def stream(self, plan: Plan, group: RequestGroup) -> AsyncIterator[dict]:
        base = header("chat.completion.chunk", f"chatcmpl-{group.id}", self.model)
        include_usage = (plan.options["stream_options"] or {}).get("include_usage", False)
        extra = {"usage": None} if include_usage else {}
        for index in range(group.size):  # the role first, as OpenAI does, before any token is ready
            delta = {"role": "assistant", "content": ""}
            yield {**base, "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}], **extra}
        completions = [Completion(i) for i in range(group.size)]
        async for output in group.outputs():
            completions[output.index].add(output)
            yield {**base, "choices": [self._chunk_choice(plan, output)], **extra}
        if include_usage:
            yield {**base, "choices": [], "usage": usage(completions, plan.n)}

    def _chunk_choice(self, plan: Plan, o: Output) -> dict:
        choice = {
            "index": o.index,
            "delta": {"content": o.text} if o.text or not o.finished else {},
            "logprobs": self._logprobs(plan, o.logprobs),
            **finish_fields(o.finish_reason, o.stop_reason),
        }
        if plan.options["return_token_ids"]:
            choice["token_ids"] = list(o.token_ids)
        return choice
