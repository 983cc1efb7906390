"""What /v1/completions and /v1/chat/completions share: sampling fields, usage, logprob formats."""

from __future__ import annotations

import time
from typing import Any

from .endpoint import MAX_SEED, choice_params
from .outputs import Completion
from .schema import BOOLEAN, INTEGER, NUMBER, OBJECT, STRING, AnyOf, Field, ListOf, ObjectOf
from .served_model import ServedModel

MAX_N = 128
STOP = AnyOf(STRING, ListOf(STRING, "an array of strings"))
TOKEN_IDS = ListOf(INTEGER, "an array of token ids")

STREAM_OPTIONS = ObjectOf(
    [
        Field("include_usage", BOOLEAN, False, "send a last chunk with the usage of the whole request"),
        Field("continuous_usage_stats", BOOLEAN, False, "not supported", choices=(False,)),
    ]
)


def sampling_fields(max_tokens_default: int | None) -> list[Field]:
    return [
        Field("model", STRING, None, "the served model name (GET /v1/models); optional"),
        Field("max_tokens", INTEGER, max_tokens_default, "tokens to generate at most", minimum=1),
        Field("temperature", NUMBER, 1.0, "0 is greedy", minimum=0),
        Field("top_p", NUMBER, 1.0, "nucleus sampling mass", minimum=0, exclusive_minimum=True, maximum=1),
        Field("n", INTEGER, 1, "choices to generate for each prompt", minimum=1, maximum=MAX_N),
        Field("stop", STOP, None, "strings that end the generation (not included in the text)"),
        Field("seed", INTEGER, None, "seed of the request's random stream; choice j uses seed + j", minimum=0, maximum=MAX_SEED),
        Field("stream", BOOLEAN, False, "send server-sent events, ending with data: [DONE]"),
        Field("stream_options", STREAM_OPTIONS, None),
        Field("user", STRING, None, "accepted and ignored"),
        Field("frequency_penalty", NUMBER, 0, "not supported", choices=(0,)),
        Field("presence_penalty", NUMBER, 0, "not supported", choices=(0,)),
        Field("logit_bias", OBJECT, None, "not supported", choices=({},)),
        # extensions, named as in vLLM and SGLang
        Field("top_k", INTEGER, -1, "sample among the k most likely tokens; -1 is off"),
        Field("min_p", NUMBER, 0.0, "drop tokens below min_p times the top probability", minimum=0, maximum=1),
        Field("ignore_eos", BOOLEAN, False, "keep generating after the end-of-sequence token"),
        Field("stop_token_ids", TOKEN_IDS, None, "token ids that end the generation"),
        Field("return_token_ids", BOOLEAN, False, "add the generated token ids to each choice (as vLLM)"),
    ]


def params_for_choice(values: dict, model: ServedModel, max_tokens: int, logprobs: int, choice: int):
    model.check_token_ids(values["stop_token_ids"] or (), "stop_token_ids")
    return choice_params(values, max_tokens, values["seed"], logprobs, choice)


def usage(completions: list[Completion], n: int) -> dict:
    prompt = sum(c.num_prompt_tokens for c in completions[::n])  # a prompt counts once, whatever n
    cached = sum(c.cached_tokens for c in completions[::n])
    generated = sum(len(c.token_ids) for c in completions)
    return {
        "prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def header(kind: str, call_id: str, model: ServedModel) -> dict:
    return {"id": call_id, "object": kind, "created": int(time.time()), "model": model.name}


def text_logprobs(model: ServedModel, entries, top: int, offset: int) -> dict:
    """The legacy completions format: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens = [model.token_text(e["token_id"]) for e in entries]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{model.token_text(t): lp for t, lp in e["top_logprobs"][:top]} for e in entries] if top else None,
        "text_offset": offsets,
    }


def _token_logprob(model: ServedModel, token_id: int, logprob: float) -> dict:
    text = model.token_text(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def chat_logprobs(model: ServedModel, entries, top: int) -> dict:
    content = []
    for e in entries:
        entry = _token_logprob(model, e["token_id"], e["logprob"])
        entry["top_logprobs"] = [_token_logprob(model, t, lp) for t, lp in e["top_logprobs"][:top]]
        content.append(entry)
    return {"content": content}


def finish_fields(finish_reason: str | None, stop_reason: Any) -> dict:
    return {"finish_reason": finish_reason, "stop_reason": stop_reason if finish_reason == "stop" else None}
