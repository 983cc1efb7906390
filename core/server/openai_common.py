"""What /v1/completions and /v1/chat/completions share: sampling fields, usage, logprob formats."""

from __future__ import annotations

import time
from typing import Any

from .endpoint import MAX_SEED, choice_params
from .outputs import Completion
from .endpoint import MAX_TOP_LOGPROBS
from .schema import BOOLEAN, INTEGER, NUMBER, OBJECT, STRING, AnyOf, Field, ListOf, MapOf, ObjectOf
from .served_model import ServedModel
from .structured import GUIDED_FIELDS

MAX_N = 128
STOP = AnyOf(STRING, ListOf(STRING, "an array of strings"))
TOKEN_IDS = ListOf(INTEGER, "an array of token ids")

STREAM_OPTIONS = ObjectOf(
    [
        Field("include_usage", BOOLEAN, False, "send a last chunk with the usage of the whole request"),
        Field("continuous_usage_stats", BOOLEAN, False, "with include_usage: the usage so far in every chunk (vLLM)"),
    ]
)
LOGIT_BIAS = MapOf(NUMBER, "an object of token ids to biases in [-100, 100]")
NOT_LOADED = "this server loads no LoRA adapters"


def sampling_fields(max_tokens_default: int | None) -> list[Field]:
    """The sampling fields both OpenAI endpoints take: OpenAI's, then vLLM's and SGLang's extensions under their
    names (docs/serving.md gives each one's source and meaning)."""
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
        Field("frequency_penalty", NUMBER, 0.0, "subtract penalty x count of each generated token", minimum=-2, maximum=2),
        Field("presence_penalty", NUMBER, 0.0, "subtract penalty from each token generated at least once", minimum=-2, maximum=2),
        Field("logit_bias", LOGIT_BIAS, None, "token id -> bias added to its logit; -100 bans it, +100 forces it"),
        # extensions, named as in vLLM and SGLang
        Field("repetition_penalty", NUMBER, 1.0, "divide positive (multiply negative) logits of tokens in the prompt or "
              "output by it; 1 is off", minimum=0, exclusive_minimum=True),
        Field("min_tokens", INTEGER, 0, "EOS and stop_token_ids cannot end the output before this many tokens", minimum=0),
        Field("top_k", INTEGER, -1, "sample among the k most likely tokens; -1 (or 0) is off"),
        Field("min_p", NUMBER, 0.0, "drop tokens below min_p times the top probability", minimum=0, maximum=1),
        Field("ignore_eos", BOOLEAN, False, "keep generating after the end-of-sequence token"),
        Field("stop_token_ids", TOKEN_IDS, None, "token ids that end the generation"),
        Field("include_stop_str_in_output", BOOLEAN, False, "keep the stop string that ended the output in its text"),
        Field("no_stop_trim", BOOLEAN, False, "SGLang's name for include_stop_str_in_output"),
        Field("skip_special_tokens", BOOLEAN, True, "leave special tokens out of the text"),
        Field("spaces_between_special_tokens", BOOLEAN, True, "accepted; like vLLM's fast tokenizers, the text is the "
              "tokenizer's own decode either way"),
        Field("allowed_token_ids", TOKEN_IDS, None, "only these token ids may be generated"),
        Field("prompt_logprobs", INTEGER, None, "the logprob of every prompt token and its top-K (vLLM)", minimum=0,
              maximum=MAX_TOP_LOGPROBS),
        Field("truncate_prompt_tokens", INTEGER, None, "keep only the last k prompt tokens", minimum=1),
        Field("return_token_ids", BOOLEAN, False, "add the generated token ids to each choice (as vLLM)"),
        Field("return_tokens_as_token_ids", BOOLEAN, False, "logprob tokens as 'token_id:N' strings (vLLM)"),
        Field("use_beam_search", BOOLEAN, False, "only false: no beam search", choices=(False,)),
        Field("length_penalty", NUMBER, 1.0, "a beam-search option: only 1", choices=(1, 1.0)),
        Field("priority", INTEGER, 0, "only 0: requests are served in arrival order", choices=(0,)),
        Field("request_id", STRING, None, "accepted and ignored: the server names its own requests"),
        Field("rid", STRING, None, "SGLang's request_id: accepted and ignored"),
        Field("bad_words", ListOf(STRING, "an array of strings"), None, "only empty", choices=([],)),
        Field("logits_processors", ListOf(OBJECT, "an array"), None, refused="custom logits processors are not loaded"),
        Field("lora_path", AnyOf(STRING, ListOf(STRING, "an array of strings")), None, refused=NOT_LOADED),
        Field("lora_request", OBJECT, None, refused=NOT_LOADED),
        Field("cache_salt", STRING, None, refused="the prefix cache is shared by every request of this server"),
        Field("kv_transfer_params", OBJECT, None, refused="disaggregation runs through `moeplex router --pd`"),
        Field("prompt_embeds", AnyOf(STRING, ListOf(STRING, "an array of strings")), None, refused="prompts are tokens or text"),
        Field("vllm_xargs", OBJECT, None, refused="no extension reads them"),
        Field("session_params", OBJECT, None, refused="no sessions are kept"),
        Field("service_tier", STRING, None, "accepted and ignored: one tier"),
        Field("store", BOOLEAN, None, "accepted and ignored: nothing is stored"),
        Field("metadata", OBJECT, None, "accepted and ignored"),
        *GUIDED_FIELDS,
    ]


def sampling_values(values: dict) -> dict:
    """The SamplingParams fields an OpenAI body sets (besides max_new_tokens, seed and logprobs)."""
    return {
        "temperature": values["temperature"], "top_p": values["top_p"],
        "top_k": values["top_k"] if values["top_k"] != 0 else -1,
        "min_p": values["min_p"], "stop": values["stop"], "stop_token_ids": values["stop_token_ids"] or (),
        "ignore_eos": values["ignore_eos"], "frequency_penalty": values["frequency_penalty"],
        "presence_penalty": values["presence_penalty"], "repetition_penalty": values["repetition_penalty"],
        "logit_bias": values["logit_bias"], "allowed_token_ids": values["allowed_token_ids"] or (),
        "min_tokens": values["min_tokens"],
        "include_stop_str_in_output": values["include_stop_str_in_output"] or values["no_stop_trim"],
        "skip_special_tokens": values["skip_special_tokens"], "prompt_logprobs": values["prompt_logprobs"],
    }


def truncate(ids: list[int], values: dict) -> list[int]:
    keep = values["truncate_prompt_tokens"]
    return ids[-keep:] if keep is not None else ids


def params_for_choice(values: dict, model: ServedModel, max_tokens: int, logprobs: int, choice: int, **overrides):
    model.check_token_ids(values["stop_token_ids"] or (), "stop_token_ids")
    model.check_token_ids(values["allowed_token_ids"] or (), "allowed_token_ids")
    model.check_logit_bias(values["logit_bias"])
    sampling = {**sampling_values(values), **overrides}
    model.check_prompt_logprobs(sampling["prompt_logprobs"] is not None, "prompt_logprobs")
    return choice_params(sampling, max_tokens, values["seed"], logprobs, choice)


def usage_chunk_fields(options: dict, completions: list[Completion], n: int) -> dict:
    """What a streamed chunk carries of the usage: nothing, null (include_usage: the last chunk has it) or, with
    continuous_usage_stats, the usage so far."""
    stream_options = options["stream_options"] or {}
    if not stream_options.get("include_usage"):
        return {}
    return {"usage": usage(completions, n) if stream_options.get("continuous_usage_stats") else None}


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


def token_namer(model: ServedModel, as_ids: bool):
    """How logprobs name a token: its text, or 'token_id:N' (vLLM's return_tokens_as_token_ids)."""
    return (lambda t: f"token_id:{t}") if as_ids else model.token_text


def echoed_entries(prompt_ids, prompt_logprobs) -> list[dict]:
    """A prompt's logprob entries in the generated tokens' shape; the first token has no logprob (null)."""
    return [e if e is not None else {"token_id": t, "logprob": None, "top_logprobs": None}
            for t, e in zip(prompt_ids, prompt_logprobs)]


def text_logprobs(name, entries, top: int, offset: int) -> dict:
    """The legacy completions format: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens = [name(e["token_id"]) for e in entries]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [None if e["top_logprobs"] is None else {name(t): lp for t, lp in e["top_logprobs"][:top]}
                         for e in entries] if top else None,
        "text_offset": offsets,
    }


def vllm_prompt_logprobs(model: ServedModel, entries, top: int) -> list:
    """vLLM's prompt_logprobs: per prompt position null or {token id: {logprob, rank, decoded_token}}, the prompt's
    own token and the top-K."""
    out = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        position = {str(t): {"logprob": lp, "rank": k + 1, "decoded_token": model.token_text(t)}
                    for k, (t, lp) in enumerate(e["top_logprobs"][:top])}
        position[str(e["token_id"])] = {"logprob": e["logprob"], "rank": e["rank"],
                                        "decoded_token": model.token_text(e["token_id"])}
        out.append(position)
    return out


def _token_logprob(name, token_id: int, logprob: float) -> dict:
    text = name(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def chat_logprobs(name, entries, top: int) -> dict:
    content = []
    for e in entries:
        entry = _token_logprob(name, e["token_id"], e["logprob"])
        entry["top_logprobs"] = [_token_logprob(name, t, lp) for t, lp in e["top_logprobs"][:top]]
        content.append(entry)
    return {"content": content}


def finish_fields(finish_reason: str | None, stop_reason: Any) -> dict:
    return {"finish_reason": finish_reason, "stop_reason": stop_reason if finish_reason == "stop" else None}
