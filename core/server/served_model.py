"""What the HTTP side knows about the served model: its name, limits, tokenizer and chat template.

Everything here is read-only after start-up, so handlers on the event loop use it freely; the
tokenizer is the HTTP process's own copy.
"""

from __future__ import annotations

from typing import Sequence

from tokenizers import Tokenizer

from ..context_limit import context_length, context_problem
from ..ranks.leader import EngineFacts
from .chat_template import ChatTemplate
from .errors import bad_request
from .structured import ConstraintChecker


class ServedModel:
    def __init__(self, facts: EngineFacts, name: str, tokenizer: Tokenizer | None):
        hf_config = facts.hf_config
        self.name = name
        self.path = facts.config.model
        self.vocab_size = facts.vocab_size
        self.architectures = hf_config.get("architectures", [hf_config.get("model_type")])
        # one sequence can never outgrow the KV pool, however long the model's positions reach
        self.context_length = context_length(hf_config, facts.capacity_tokens)
        self.tokenizer = tokenizer
        # no token spells more characters than the longest in the vocabulary: a bound on a text's token count
        self._longest_token = max(map(len, tokenizer.get_vocab())) if tokenizer is not None else 0
        self.chat_template = ChatTemplate.from_folder(self.path)
        self.bos_token_id = hf_config.get("bos_token_id")
        self._token_texts: dict[int, str] = {}  # bounded by the vocabulary
        eos = hf_config.get("eos_token_id")  # only for compiling: whether a constraint compiles does not depend on it
        eos_ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
        self.constraints = ConstraintChecker.for_engine(facts.config, tokenizer, self.vocab_size, eos_ids)
        config = facts.config
        self._no_prompt_logprobs = (  # why prompt logprobs cannot be computed here, if they cannot
            "not computed with speculative decoding" if config.speculative else
            "not computed on a disaggregated server" if config.disaggregation_mode != "none" else None)

    def check_prompt_logprobs(self, asked: bool, param: str) -> None:
        if asked and self._no_prompt_logprobs:
            raise bad_request(f"prompt logprobs are {self._no_prompt_logprobs} (as in vLLM)", param)

    def check_name(self, requested: str | None) -> None:
        if requested is not None and requested != self.name:
            raise bad_request(f"the model {requested!r} is not served here; this server serves {self.name!r}", "model", "model_not_found")

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False) if self.tokenizer is not None else ""

    def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise bad_request(f"{self.path} has no tokenizer.json, so {param} must be token ids", param)
        if len(text) > self.context_length * self._longest_token:
            raise bad_request(
                f"{param} has {len(text)} characters, more than this model's context of {self.context_length} tokens can "
                f"hold at {self._longest_token} characters per token",
                param,
                "context_length_exceeded",
            )
        # encode_batch lets go of the GIL while it works (encode holds it): the event loop keeps serving
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def check_prompt(self, ids: Sequence[int], param: str) -> None:
        if not ids:
            raise bad_request(f"{param} is empty (it encodes to no tokens)", param)
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise bad_request(f"token id {bad} in {param} is outside the vocabulary (0..{self.vocab_size - 1})", param)

    def check_token_ids(self, ids: Sequence[int], param: str) -> None:
        if ids:
            self.check_prompt(ids, param)

    def check_logit_bias(self, bias: dict | None, param: str = "logit_bias") -> None:
        """Keys must be token ids of the vocabulary, values in [-100, 100] (OpenAI's range)."""
        for key, value in (bias or {}).items():
            if not (key.isdigit() and int(key) < self.vocab_size):
                raise bad_request(f"{param} key {key!r} is not a token id of the vocabulary (0..{self.vocab_size - 1})", param)
            if not -100 <= value <= 100:
                raise bad_request(f"{param}[{key}] must be in [-100, 100], got {value}", param)

    def check_length(self, num_prompt_tokens: int, max_new_tokens: int, param: str) -> None:
        problem = context_problem(num_prompt_tokens, max_new_tokens, self.context_length, param)
        if problem:
            raise bad_request(problem, param, "context_length_exceeded")

    def room_after(self, num_prompt_tokens: int) -> int:
        """The most tokens a prompt of this length can still be followed by (when max_tokens is not given)."""
        if num_prompt_tokens >= self.context_length:
            raise bad_request(
                f"the prompt has {num_prompt_tokens} tokens; this model's context is {self.context_length}",
                "messages",
                "context_length_exceeded",
            )
        return self.context_length - num_prompt_tokens

    def token_text(self, token_id: int) -> str:
        """One token's text (for logprobs); a piece of a multi-byte character shows as U+FFFD."""
        text = self._token_texts.get(token_id)
        if text is None:
            decoded = self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer else None
            text = self._token_texts[token_id] = decoded if decoded is not None else f"<{token_id}>"
        return text
