"""POST /v1/chat/completions: the OpenAI chat API, prompts rendered with the model's chat template."""

from __future__ import annotations

from typing import Any, AsyncIterator

import attrs

from .chat_template import ChatTemplate
from .endpoint import MAX_TOP_LOGPROBS, Plan, expand
from .errors import bad_request
from .group import RequestGroup
from .openai_common import (
    chat_logprobs, finish_fields, header, params_for_choice, sampling_fields, token_namer, truncate, usage,
    usage_chunk_fields, vllm_prompt_logprobs,
)
from .outputs import Completion, Output
from .schema import BOOLEAN, INTEGER, OBJECT, STRING, AnyOf, Field, ListOf, ObjectOf
from .served_model import ServedModel
from .structured import request_constraint, response_format_field
from .reasoning import END, ReasoningParser, ReasoningStream
from .tools.parsers import ToolCallParser
from .tools.request import ToolPlan, tool_call_json, tool_fields
from .tools.stream import ToolStream

ROLES = ("system", "developer", "user", "assistant", "tool")
TEXT_PART = ObjectOf([Field("type", STRING, None, required=True, choices=("text",)), Field("text", STRING, None, required=True)])
MESSAGE = ObjectOf(
    [
        Field("role", STRING, None, required=True, choices=ROLES),
        Field("content", AnyOf(STRING, ListOf(TEXT_PART, "an array of text parts")), None, "text, or text parts"),
        Field("name", STRING, None, "accepted and ignored"),
        Field("tool_calls", ListOf(OBJECT, "an array of tool calls"), None, "an assistant's calls (as answered before)"),
        Field("tool_call_id", STRING, None, "a tool message: the call it answers"),
    ],
    describe="a message object",
)


def _flatten(message: dict) -> dict:
    """A message as chat templates expect it: role and content as one string (and an assistant's tool calls, a
    tool result's call id, where given)."""
    content = message["content"]
    if isinstance(content, list):
        content = "".join(part["text"] for part in content)
    flat = {"role": message["role"], "content": content or ""}
    for key in ("tool_calls", "tool_call_id"):
        if message[key] is not None:
            flat[key] = message[key]
    return flat


class ChatEndpoint:
    path = "/v1/chat/completions"
    summary = "OpenAI chat completion (streaming with stream: true)"

    def __init__(self, model: ServedModel, tool_parser: ToolCallParser | None = None,
                 reasoning: ReasoningParser | None = None):
        self.model = model
        self.reasoning = reasoning  # --reasoning-parser: the thinking goes to reasoning_content
        self.tool_parser = tool_parser  # --tool-call-parser: how this model family writes calls (tool_choice auto)
        self.fields = [
            Field("messages", ListOf(MESSAGE, "an array of messages", min_items=1), None, required=True),
            *sampling_fields(max_tokens_default=None),
            Field("max_completion_tokens", INTEGER, None, "tokens to generate at most (wins over max_tokens)", minimum=1),
            Field("logprobs", BOOLEAN, False, "return the log-probability of each generated token"),
            Field("top_logprobs", INTEGER, 0, "with logprobs: the K most likely tokens at each step", minimum=0,
                  maximum=MAX_TOP_LOGPROBS),
            response_format_field(),
            *tool_fields(),
            # vLLM's and SGLang's chat extensions
            Field("add_generation_prompt", BOOLEAN, True, "end the prompt with the template's assistant header"),
            Field("continue_final_message", BOOLEAN, False, "leave the last (assistant) message open for the model to "
                  "continue; needs add_generation_prompt: false"),
            Field("echo", BOOLEAN, False, "prefix the answer with the last message's content when it is the assistant's"),
            Field("add_special_tokens", BOOLEAN, False, "let the tokenizer add its special tokens to the rendered prompt"),
            Field("chat_template", STRING, None, "a Jinja chat template for this request instead of the model's"),
            Field("chat_template_kwargs", OBJECT, None, "extra variables for the chat template (enable_thinking, ...)"),
            Field("documents", ListOf(OBJECT, "an array of objects"), None, "documents for a RAG chat template"),
            Field("reasoning_effort", STRING, None, "passed to the chat template as reasoning_effort"),
            Field("separate_reasoning", BOOLEAN, True, "accepted (SGLang): reasoning is split only by a reasoning parser"),
            Field("stream_reasoning", BOOLEAN, True, "accepted (SGLang): reasoning is split only by a reasoning parser"),
            Field("modalities", ListOf(STRING, "an array of strings"), None, "only text", choices=(["text"],)),
            Field("prediction", OBJECT, None, "accepted and ignored: a hint that changes no token"),
            Field("audio", OBJECT, None, refused="this server answers in text"),
            Field("web_search_options", OBJECT, None, refused="this server does not search the web"),
            Field("functions", ListOf(OBJECT, "an array"), None, refused="the deprecated functions API; send tools"),
            Field("function_call", AnyOf(STRING, OBJECT), None, refused="the deprecated functions API; send tool_choice"),
        ]
        self._templates: dict[str, ChatTemplate] = {}  # per-request templates, compiled once each

    def _template(self, source: str | None) -> ChatTemplate:
        if source is None:
            return self.model.chat_template
        if source not in self._templates:
            if len(self._templates) > 64:
                self._templates.clear()
            try:
                self._templates[source] = ChatTemplate(source, self.model.chat_template.special_tokens, False)
            except Exception as exc:  # jinja2's TemplateSyntaxError and kin
                raise bad_request(f"chat_template does not compile: {exc}", "chat_template") from None
        return self._templates[source]

    def plan(self, values: dict[str, Any]) -> Plan:
        model = self.model
        model.check_name(values["model"])
        if values["top_logprobs"] and not values["logprobs"]:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        tools = ToolPlan.of(values)
        values["tool_plan"] = tools
        messages = [_flatten(m) for m in values["messages"]]
        if values["continue_final_message"] and (values["add_generation_prompt"] or messages[-1]["role"] != "assistant"):
            raise bad_request("continue_final_message needs add_generation_prompt: false and a last assistant message",
                              "continue_final_message")
        variables = dict(values["chat_template_kwargs"] or {})
        if values["documents"] is not None:
            variables["documents"] = values["documents"]
        if values["reasoning_effort"] is not None:
            variables["reasoning_effort"] = values["reasoning_effort"]
        text = self._template(values["chat_template"]).render(
            messages, add_generation_prompt=values["add_generation_prompt"],
            continue_final_message=values["continue_final_message"], tools=tools.tools, **variables)
        ids = truncate(model.encode(text, "messages", values["add_special_tokens"]), values)
        model.check_prompt(ids, "messages")
        max_tokens = values["max_completion_tokens"] or values["max_tokens"] or model.room_after(len(ids))
        model.check_length(len(ids), max_tokens, "max_tokens")
        engine_logprobs = max(values["top_logprobs"], 1) if values["logprobs"] else 0
        requests = expand([ids], values["n"], lambda j: params_for_choice(values, model, max_tokens, engine_logprobs, j))
        constraint, asked_by = request_constraint(values)
        if constraint is not None and tools.constrained:
            raise bad_request(f"{asked_by} cannot be combined with tool_choice required or a named function", asked_by)
        constraint = constraint or tools.constraint
        if constraint is not None:
            model.constraints.check(constraint, "tools" if tools.constrained else asked_by)
            # with a reasoning parser the constraint is the answer's: it starts after the thinking, unless the
            # template closed the thinking in the prompt (Qwen3 with thinking off)
            after = END if self.reasoning is not None and not text.rstrip().endswith(END) else ""
            requests = [(ids, attrs.evolve(params, constraint=constraint, constraint_after=after)) for ids, params in requests]
        return Plan(requests, values["stream"], values["n"], values)

    def _logprobs(self, plan: Plan, entries) -> dict | None:
        if not plan.options["logprobs"]:
            return None
        return chat_logprobs(token_namer(self.model, plan.options["return_tokens_as_token_ids"]), entries,
                             plan.options["top_logprobs"])

    def _echo(self, plan: Plan) -> str:
        last = plan.options["messages"][-1]
        return _flatten(last)["content"] if plan.options["echo"] and last["role"] == "assistant" else ""

    def response(self, plan: Plan, group: RequestGroup, completions: list[Completion]) -> dict:
        choices = []
        for c in completions:
            reasoning, text = self.reasoning.split(c.text) if self.reasoning is not None else (None, c.text)
            content, calls = plan.options["tool_plan"].split(text, self.tool_parser)
            content = self._echo(plan) + content  # echo: the last assistant message's content first (vLLM)
            message = {"role": "assistant", "content": content or (None if calls else "")}
            if self.reasoning is not None:
                message["reasoning_content"] = reasoning or None
            if calls:
                message["tool_calls"] = [tool_call_json(call) for call in calls]
            choice = {
                "index": c.index,
                "message": message,
                "logprobs": self._logprobs(plan, c.logprobs),
                **_finish(c.finish_reason, c.stop_reason, calls),
            }
            if plan.options["return_token_ids"]:
                choice["token_ids"] = c.token_ids
            choices.append(choice)
        answer = {**header("chat.completion", f"chatcmpl-{group.id}", self.model), "choices": choices,
                  "usage": usage(completions, plan.n)}
        if plan.options["prompt_logprobs"] is not None and completions and completions[0].prompt_logprobs is not None:
            answer["prompt_logprobs"] = vllm_prompt_logprobs(self.model, completions[0].prompt_logprobs,
                                                             plan.options["prompt_logprobs"])
        return answer

    async def stream(self, plan: Plan, group: RequestGroup) -> AsyncIterator[dict]:
        base = header("chat.completion.chunk", f"chatcmpl-{group.id}", self.model)
        completions = [Completion(i) for i in range(group.size)]
        for index in range(group.size):  # the role first, as OpenAI does, before any token is ready
            delta = {"role": "assistant", "content": self._echo(plan)}
            yield {**base, "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}],
                   **usage_chunk_fields(plan.options, completions, plan.n)}
        tools = [ToolStream(plan.options["tool_plan"], self.tool_parser) for _ in range(group.size)]
        thinking = [self.reasoning.stream() if self.reasoning is not None else None for _ in range(group.size)]
        async for output in group.outputs():
            completions[output.index].add(output)
            choice = self._chunk_choice(plan, output, tools[output.index], thinking[output.index])
            yield {**base, "choices": [choice], **usage_chunk_fields(plan.options, completions, plan.n)}
        if (plan.options["stream_options"] or {}).get("include_usage"):
            yield {**base, "choices": [], "usage": usage(completions, plan.n)}

    def _chunk_choice(self, plan: Plan, o: Output, tools: ToolStream, thinking: ReasoningStream | None) -> dict:
        reasoning, text = thinking.push(o.text, final=o.finished) if thinking is not None else ("", o.text)
        content, calls = tools.push(text), []
        if o.finished:
            rest, calls = tools.finish()
            content += rest
        delta = {"content": content} if content or not o.finished else {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if calls:
            delta["tool_calls"] = [tool_call_json(call, i) for i, call in enumerate(calls)]
        choice = {
            "index": o.index,
            "delta": delta,
            "logprobs": self._logprobs(plan, o.logprobs),
            **_finish(o.finish_reason, o.stop_reason, calls),
        }
        if plan.options["return_token_ids"]:
            choice["token_ids"] = list(o.token_ids)
        return choice


def _finish(reason: str | None, stop_reason, calls) -> dict:
    """finish_reason is tool_calls where the output ended in calls (OpenAI's value)."""
    fields = finish_fields(reason, stop_reason)
    if calls and reason == "stop":
        fields["finish_reason"] = "tool_calls"
    return fields
