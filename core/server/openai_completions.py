"""POST /v1/completions: the OpenAI text completion API."""

from __future__ import annotations

from typing import Any, AsyncIterator

import attrs

from .endpoint import MAX_TOP_LOGPROBS, Plan, expand
from .group import RequestGroup
from .openai_common import (
    TOKEN_IDS, finish_fields, header, params_for_choice, sampling_fields, text_logprobs, usage,
)
from .outputs import Completion, Output
from .schema import BOOLEAN, INTEGER, STRING, AnyOf, Field, ListOf
from .served_model import ServedModel
from .structured import from_response_format, response_format_field

PROMPT = AnyOf(
    STRING,
    ListOf(STRING, "an array of strings", min_items=1),
    ListOf(INTEGER, "an array of token ids", min_items=1),
    ListOf(TOKEN_IDS, "an array of arrays of token ids", min_items=1),
)


class CompletionsEndpoint:
    path = "/v1/completions"
    summary = "OpenAI text completion (streaming with stream: true)"

    def __init__(self, model: ServedModel):
        self.model = model
        self.fields = [
            Field("prompt", PROMPT, None, "text, texts, token ids, or lists of token ids", required=True),
            *sampling_fields(max_tokens_default=16),
            Field("logprobs", INTEGER, None, "log-probabilities of the chosen and the top-K tokens", minimum=0,
                  maximum=MAX_TOP_LOGPROBS),
            Field("echo", BOOLEAN, False, "not supported", choices=(False,)),
            Field("suffix", STRING, None, "not supported", choices=("",)),
            Field("best_of", INTEGER, None, "not supported beyond 1", choices=(1,)),
            response_format_field(),
        ]

    def plan(self, values: dict[str, Any]) -> Plan:
        model = self.model
        model.check_name(values["model"])
        prompts = self._prompt_ids(values["prompt"])
        max_tokens = values["max_tokens"]
        for ids in prompts:
            model.check_prompt(ids, "prompt")
            model.check_length(len(ids), max_tokens, "max_tokens")
        top = values["logprobs"]
        engine_logprobs = 0 if top is None else max(top, 1)
        requests = expand(prompts, values["n"], lambda j: params_for_choice(values, model, max_tokens, engine_logprobs, j))
        constraint = from_response_format(values["response_format"])
        if constraint is not None:
            model.constraints.check(constraint, "response_format")
            requests = [(ids, attrs.evolve(params, constraint=constraint)) for ids, params in requests]
        return Plan(requests, values["stream"], values["n"], values)

    def _prompt_ids(self, prompt) -> list[list[int]]:
        if isinstance(prompt, str):
            return [self.model.encode(prompt, "prompt")]
        if isinstance(prompt[0], str):
            return [self.model.encode(text, f"prompt[{i}]") for i, text in enumerate(prompt)]
        if isinstance(prompt[0], int):
            return [prompt]
        return prompt

    def _choice(self, plan: Plan, index: int, text: str, token_ids, logprobs, offset: int, finish, stop) -> dict:
        top = plan.options["logprobs"]
        choice = {
            "index": index,
            "text": text,
            "logprobs": None if top is None else text_logprobs(self.model, logprobs, top, offset),
            **finish_fields(finish, stop),
        }
        if plan.options["return_token_ids"]:
            choice["token_ids"] = list(token_ids)
        return choice

    def response(self, plan: Plan, group: RequestGroup, completions: list[Completion]) -> dict:
        choices = [
            self._choice(plan, c.index, c.text, c.token_ids, c.logprobs, 0, c.finish_reason, c.stop_reason) for c in completions
        ]
        return {**header("text_completion", f"cmpl-{group.id}", self.model), "choices": choices,
                "usage": usage(completions, plan.n)}

    async def stream(self, plan: Plan, group: RequestGroup) -> AsyncIterator[dict]:
        base = header("text_completion", f"cmpl-{group.id}", self.model)
        include_usage = (plan.options["stream_options"] or {}).get("include_usage", False)
        completions = [Completion(i) for i in range(group.size)]
        async for output in group.outputs():
            done = completions[output.index]
            offset = len(done.text)
            done.add(output)
            chunk = {**base, "choices": [self._chunk_choice(plan, output, offset)]}
            if include_usage:
                chunk["usage"] = None
            yield chunk
        if include_usage:
            yield {**base, "choices": [], "usage": usage(completions, plan.n)}

    def _chunk_choice(self, plan: Plan, o: Output, offset: int) -> dict:
        return self._choice(plan, o.index, o.text, o.token_ids, o.logprobs, offset, o.finish_reason, o.stop_reason)
