"""POST /generate: SGLang's native API (text or input_ids, sampling_params, stream, logprobs).

A single prompt with n = 1 answers one object, anything else a list (prompt-major, then choice).
Streamed chunks are cumulative, as SGLang's: each carries the text and output_ids so far, and an
"index" saying which sequence it belongs to.
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator

import attrs

from .endpoint import MAX_SEED, MAX_TOP_LOGPROBS, Plan, expand, choice_params
from .errors import bad_request
from .group import RequestGroup
from .openai_common import LOGIT_BIAS, MAX_N, NOT_LOADED, STOP, TOKEN_IDS
from ..request import accept_length, accept_rate
from .outputs import Completion
from .schema import BOOLEAN, INTEGER, NUMBER, OBJECT, STRING, AnyOf, Field, ListOf, ObjectOf
from .served_model import ServedModel
from .structured import NATIVE_FIELDS, from_native

SAMPLING = ObjectOf(
    [
        Field("max_new_tokens", INTEGER, 128, "tokens to generate at most", minimum=1),
        Field("temperature", NUMBER, 1.0, "0 is greedy", minimum=0),
        Field("top_p", NUMBER, 1.0, "nucleus sampling mass", minimum=0, exclusive_minimum=True, maximum=1),
        Field("top_k", INTEGER, -1, "sample among the k most likely tokens; -1 is off"),
        Field("min_p", NUMBER, 0.0, "drop tokens below min_p times the top probability", minimum=0, maximum=1),
        Field("stop", STOP, None, "strings that end the generation"),
        Field("stop_token_ids", TOKEN_IDS, None, "token ids that end the generation"),
        Field("ignore_eos", BOOLEAN, False, "keep generating after the end-of-sequence token"),
        Field("n", INTEGER, 1, "sequences to generate for each prompt", minimum=1, maximum=MAX_N),
        Field("sampling_seed", INTEGER, None, "seed of the request's random stream", minimum=0, maximum=MAX_SEED),
        Field("skip_special_tokens", BOOLEAN, True, "leave special tokens out of the text"),
        Field("spaces_between_special_tokens", BOOLEAN, True, "accepted; the text is the tokenizer's own decode"),
        Field("no_stop_trim", BOOLEAN, False, "keep the stop string that ended the output in its text"),
        Field("frequency_penalty", NUMBER, 0.0, "subtract penalty x count of each generated token", minimum=-2, maximum=2),
        Field("presence_penalty", NUMBER, 0.0, "subtract penalty from each token generated at least once", minimum=-2, maximum=2),
        Field("repetition_penalty", NUMBER, 1.0, "divide positive (multiply negative) logits of tokens in the prompt "
              "or output by it; 1 is off", minimum=0, exclusive_minimum=True),
        Field("min_new_tokens", INTEGER, 0, "EOS and stop_token_ids cannot end the output before this many tokens",
              minimum=0),
        Field("logit_bias", LOGIT_BIAS, None, "token id -> bias added to its logit; -100 bans it, +100 forces it"),
        Field("stream_interval", INTEGER, None, "streamed chunks after the first hold at least this many tokens "
              "(default: the server's --stream-interval)", minimum=1),
        Field("custom_params", OBJECT, None, refused="no custom logit processor is loaded"),
        *NATIVE_FIELDS,
    ],
    describe="an object of sampling parameters",
)


class GenerateEndpoint:
    path = "/generate"
    summary = "SGLang-compatible native generation"

    def __init__(self, model: ServedModel):
        self.model = model
        self.fields = [
            Field("text", AnyOf(STRING, ListOf(STRING, "an array of strings", min_items=1)), None, "prompt text(s)"),
            Field("input_ids", AnyOf(ListOf(INTEGER, "an array of token ids", min_items=1),
                                     ListOf(TOKEN_IDS, "an array of arrays of token ids", min_items=1)), None,
                  "prompt token ids (instead of text)"),
            Field("sampling_params", AnyOf(SAMPLING, ListOf(SAMPLING, "an array of sampling parameter objects")), None),
            Field("stream", BOOLEAN, False, "send cumulative server-sent events, ending with data: [DONE]"),
            Field("return_logprob", BOOLEAN, False, "return the log-probability of each generated token"),
            Field("top_logprobs_num", INTEGER, 0, "with return_logprob: the K most likely tokens at each step", minimum=0,
                  maximum=MAX_TOP_LOGPROBS),
            Field("return_text_in_logprobs", BOOLEAN, False, "add each token's text to the logprobs"),
            Field("logprob_start_len", INTEGER, -1, "with return_logprob: the prompt position from which the prompt's "
              "tokens get logprobs too (input_token_logprobs); -1: none", minimum=-1),
            Field("rid", AnyOf(STRING, ListOf(STRING, "an array of strings")), None, "accepted and ignored"),
            Field("lora_path", AnyOf(STRING, ListOf(STRING, "an array of strings")), None, refused=NOT_LOADED),
            Field("custom_logit_processor", AnyOf(STRING, ListOf(STRING, "an array of strings")), None,
                  refused="no custom logit processor is loaded"),
            Field("return_hidden_states", BOOLEAN, False, "only false", choices=(False,)),
        ]

    def plan(self, values: dict[str, Any]) -> Plan:
        prompts = self._prompt_ids(values)
        per_prompt = self._sampling_per_prompt(values["sampling_params"], len(prompts))
        ns = {s["n"] for s in per_prompt}
        if len(ns) > 1:
            raise bad_request("every prompt of a batch must ask for the same n", "sampling_params")
        n = ns.pop()
        logprobs = max(values["top_logprobs_num"], 1) if values["return_logprob"] else 0
        start = values["logprob_start_len"]
        prompt_logprobs = (values["top_logprobs_num"], start) if values["return_logprob"] and start >= 0 else None
        self.model.check_prompt_logprobs(prompt_logprobs is not None, "logprob_start_len")
        requests = []
        for i, (ids, sampling) in enumerate(zip(prompts, per_prompt)):
            param = "text" if values["text"] is not None else "input_ids"
            self.model.check_prompt(ids, param)
            self.model.check_length(len(ids), sampling["max_new_tokens"], "sampling_params.max_new_tokens")
            self.model.check_token_ids(sampling["stop_token_ids"] or (), "sampling_params.stop_token_ids")
            self.model.check_logit_bias(sampling["logit_bias"], "sampling_params.logit_bias")
            if prompt_logprobs is not None and start >= len(ids):
                raise bad_request(f"logprob_start_len {start} is not a position of the {len(ids)}-token prompt",
                                  "logprob_start_len")
            constraint = from_native(sampling)
            self.model.constraints.check(constraint, "sampling_params")
            expanded = expand([ids], n, lambda j: _params(sampling, logprobs, j, prompt_logprobs))
            requests += [(p, attrs.evolve(sp, constraint=constraint)) for p, sp in expanded] if constraint else expanded
        intervals = [s["stream_interval"] for s in per_prompt if s["stream_interval"] is not None]
        return Plan(requests, values["stream"], n, values, min(intervals, default=None))

    def _prompt_ids(self, values: dict[str, Any]) -> list[list[int]]:
        text, ids = values["text"], values["input_ids"]
        if (text is None) == (ids is None):
            raise bad_request("give exactly one of text and input_ids", "text")
        if text is not None:
            texts = [text] if isinstance(text, str) else text
            return [self.model.encode(t, "text") for t in texts]
        return [ids] if isinstance(ids[0], int) else ids

    @staticmethod
    def _sampling_per_prompt(sampling, count: int) -> list[dict]:
        if sampling is None:
            return [SAMPLING.read({}, "sampling_params")] * count
        if isinstance(sampling, dict):
            return [sampling] * count
        if len(sampling) != count:
            raise bad_request(f"{len(sampling)} sampling_params for {count} prompts", "sampling_params")
        return sampling

    def _item(self, plan: Plan, group: RequestGroup, c: Completion) -> dict:
        meta = {
            "id": f"{group.id}-{c.index}",
            "finish_reason": _finish_reason(c),
            "prompt_tokens": c.num_prompt_tokens,
            "completion_tokens": len(c.token_ids),
            "cached_tokens": c.cached_tokens,
            "e2e_latency": time.monotonic() - group.submitted_at,
        }
        if c.spec_counts[0]:  # speculative decoding verified drafts for it (SGLang's names)
            meta.update(spec_verify_ct=c.spec_counts[0], spec_accept_length=accept_length(c.spec_counts),
                        spec_accept_rate=accept_rate(c.spec_counts))
        if plan.options["return_logprob"]:
            meta.update(self._logprobs(plan, c.logprobs))
            if c.prompt_logprobs is not None and plan.options["logprob_start_len"] >= 0:
                meta.update(self._prompt_logprobs(plan, c))
        return {"text": c.text, "output_ids": list(c.token_ids), "meta_info": meta}

    def _logprobs(self, plan: Plan, entries) -> dict:
        with_text = plan.options["return_text_in_logprobs"]
        top = plan.options["top_logprobs_num"]

        def entry(token_id: int, logprob: float) -> list:
            return [logprob, token_id, self.model.token_text(token_id) if with_text else None]

        logprobs = {"output_token_logprobs": [entry(e["token_id"], e["logprob"]) for e in entries]}
        if top:
            logprobs["output_top_logprobs"] = [[entry(t, lp) for t, lp in e["top_logprobs"][:top]] for e in entries]
        return logprobs

    def _prompt_logprobs(self, plan: Plan, c: Completion) -> dict:
        """SGLang's input_token_logprobs (and input_top_logprobs): from logprob_start_len on, the first prompt
        token's logprob null."""
        with_text = plan.options["return_text_in_logprobs"]
        top = plan.options["top_logprobs_num"]
        ids = plan.requests[c.index][0]
        start = plan.options["logprob_start_len"]

        def entry(token_id: int, logprob) -> list:
            return [logprob, token_id, self.model.token_text(token_id) if with_text else None]

        chosen, tops = [], []
        for position in range(start, len(ids)):
            e = c.prompt_logprobs[position]
            chosen.append(entry(ids[position], None if e is None else e["logprob"]))
            tops.append(None if e is None else [entry(t, lp) for t, lp in e["top_logprobs"][:top]])
        out = {"input_token_logprobs": chosen}
        if top:
            out["input_top_logprobs"] = tops
        return out

    def response(self, plan: Plan, group: RequestGroup, completions: list[Completion]) -> Any:
        items = [self._item(plan, group, c) for c in completions]
        prompt = plan.options["text"] if plan.options["text"] is not None else plan.options["input_ids"]
        single_prompt = isinstance(prompt, str) or isinstance(prompt[0], int)
        return items[0] if single_prompt and plan.n == 1 else items

    async def stream(self, plan: Plan, group: RequestGroup) -> AsyncIterator[dict]:
        completions = [Completion(i) for i in range(group.size)]
        async for output in group.outputs():
            completions[output.index].add(output)
            yield {**self._item(plan, group, completions[output.index]), "index": output.index}


def _params(sampling: dict, logprobs: int, choice: int, prompt_logprobs: tuple[int, int] | None):
    """SGLang's sampling names as SamplingParams fields."""
    values = {
        "temperature": sampling["temperature"], "top_p": sampling["top_p"], "top_k": sampling["top_k"],
        "min_p": sampling["min_p"], "stop": sampling["stop"], "stop_token_ids": sampling["stop_token_ids"] or (),
        "ignore_eos": sampling["ignore_eos"], "frequency_penalty": sampling["frequency_penalty"],
        "presence_penalty": sampling["presence_penalty"], "repetition_penalty": sampling["repetition_penalty"],
        "min_tokens": sampling["min_new_tokens"], "logit_bias": sampling["logit_bias"],
        "include_stop_str_in_output": sampling["no_stop_trim"], "skip_special_tokens": sampling["skip_special_tokens"],
    }
    if prompt_logprobs is not None:
        values["prompt_logprobs"], values["prompt_logprobs_start"] = prompt_logprobs
    return choice_params(values, sampling["max_new_tokens"], sampling["sampling_seed"], logprobs, choice)


def _finish_reason(c: Completion) -> dict | None:
    if c.finish_reason == "length":
        return {"type": "length", "length": len(c.token_ids)}
    if c.finish_reason == "stop":
        return {"type": "stop", "matched": c.stop_reason}
    if c.finish_reason == "abort":
        return {"type": "abort", "message": c.error}
    return None
