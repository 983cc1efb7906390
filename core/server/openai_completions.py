"""POST /v1/completions: the OpenAI text completion API."""

from __future__ import annotations

from typing import Any, AsyncIterator

import attrs

from .endpoint import MAX_TOP_LOGPROBS, Plan, expand
from .group import RequestGroup
from .openai_common import (
    TOKEN_IDS, echoed_entries, finish_fields, header, params_for_choice, sampling_fields, text_logprobs,
    token_namer, truncate, usage, usage_chunk_fields, vllm_prompt_logprobs,
)
from .outputs import Completion, Output
from .schema import BOOLEAN, INTEGER, OBJECT, STRING, AnyOf, Field, ListOf
from .served_model import ServedModel
from .structured import request_constraint, response_format_field

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
            Field("echo", BOOLEAN, False, "the prompt before the completion (with logprobs: the prompt's logprobs too)"),
            Field("add_special_tokens", BOOLEAN, True, "let the tokenizer add its special tokens (a BOS) to text prompts"),
            Field("suffix", STRING, None, "only empty: no insertion mode", choices=("",)),
            Field("best_of", INTEGER, None, "only 1", choices=(1,)),
            response_format_field(),
        ]

    def plan(self, values: dict[str, Any]) -> Plan:
        model = self.model
        model.check_name(values["model"])
        prompts = [truncate(ids, values) for ids in self._prompt_ids(values["prompt"], values["add_special_tokens"])]
        max_tokens = values["max_tokens"]
        for ids in prompts:
            model.check_prompt(ids, "prompt")
            model.check_length(len(ids), max_tokens, "max_tokens")
        top = values["logprobs"]
        engine_logprobs = 0 if top is None else max(top, 1)
        prompt_top = values["prompt_logprobs"]
        if values["echo"] and top is not None:  # echoed prompt tokens carry logprobs too
            prompt_top = max(prompt_top or 0, top)
        requests = expand(prompts, values["n"], lambda j: params_for_choice(
            values, model, max_tokens, engine_logprobs, j, prompt_logprobs=prompt_top))
        constraint, asked_by = request_constraint(values)
        if constraint is not None:
            model.constraints.check(constraint, asked_by)
            requests = [(ids, attrs.evolve(params, constraint=constraint)) for ids, params in requests]
        return Plan(requests, values["stream"], values["n"], values)

    def _prompt_ids(self, prompt, add_special_tokens: bool) -> list[list[int]]:
        if isinstance(prompt, str):
            return [self.model.encode(prompt, "prompt", add_special_tokens)]
        if isinstance(prompt[0], str):
            return [self.model.encode(text, f"prompt[{i}]", add_special_tokens) for i, text in enumerate(prompt)]
        if isinstance(prompt[0], int):
            return [prompt]
        return prompt

    def _echo(self, plan: Plan, index: int) -> str:
        """The text of the prompt of choice `index`: as the client sent it, or the decode of its token ids."""
        prompt = plan.options["prompt"]
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt[0], str):
            return prompt[index // plan.n]
        return self.model.decode(plan.requests[index][0])

    def _choice(self, plan: Plan, index: int, text: str, token_ids, logprobs, offset: int, finish, stop,
                prompt_logprobs=None, echo: bool = False) -> dict:
        options = plan.options
        top = options["logprobs"]
        if echo:
            prompt_text = self._echo(plan, index)
            text = prompt_text + text
            if top is not None and prompt_logprobs is not None:
                logprobs = echoed_entries(plan.requests[index][0], prompt_logprobs) + list(logprobs)
        choice = {
            "index": index,
            "text": text,
            "logprobs": None if top is None else text_logprobs(
                token_namer(self.model, options["return_tokens_as_token_ids"]), logprobs, top, offset),
            **finish_fields(finish, stop),
        }
        if options["prompt_logprobs"] is not None and prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(self.model, prompt_logprobs, options["prompt_logprobs"])
        if options["return_token_ids"]:
            choice["token_ids"] = list(token_ids)
            if echo:
                choice["prompt_token_ids"] = list(plan.requests[index][0])
        return choice

    def response(self, plan: Plan, group: RequestGroup, completions: list[Completion]) -> dict:
        echo = plan.options["echo"]
        choices = [
            self._choice(plan, c.index, c.text, c.token_ids, c.logprobs, 0, c.finish_reason, c.stop_reason,
                         c.prompt_logprobs, echo) for c in completions
        ]
        return {**header("text_completion", f"cmpl-{group.id}", self.model), "choices": choices,
                "usage": usage(completions, plan.n)}

    async def stream(self, plan: Plan, group: RequestGroup) -> AsyncIterator[dict]:
        base = header("text_completion", f"cmpl-{group.id}", self.model)
        completions = [Completion(i) for i in range(group.size)]
        echoed: set[int] = set()  # choices whose prompt went out (in their first chunk)
        async for output in group.outputs():
            done = completions[output.index]
            offset = len(done.text)
            done.add(output)
            echo = plan.options["echo"] and output.index not in echoed
            echoed.add(output.index)
            choice = self._choice(plan, output.index, output.text, output.token_ids, output.logprobs, offset,
                                  output.finish_reason, output.stop_reason, output.prompt_logprobs, echo)
            yield {**base, "choices": [choice], **usage_chunk_fields(plan.options, completions, plan.n)}
        if (plan.options["stream_options"] or {}).get("include_usage"):
            yield {**base, "choices": [], "usage": usage(completions, plan.n)}
