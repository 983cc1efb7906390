"""Chat messages to prompt text, through the model's Jinja chat template (as transformers renders it)."""

from __future__ import annotations

import json
import os

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import bad_request

# Used when the model folder has no template: each message as <|role|>, its content and a newline,
# then <|assistant|> and a newline to prompt the reply (the template `moeplex make-model` writes, without the bos).
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _token_text(value) -> str:
    # tokenizer_config.json writes special tokens as a string or as {"content": ...}
    if isinstance(value, dict):
        return value.get("content", "")
    return value or ""


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str], is_default: bool):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        self.template = env.from_string(source)
        self.special_tokens = special_tokens
        self.is_default = is_default

    @classmethod
    def from_folder(cls, folder: str) -> "ChatTemplate":
        """chat_template.jinja, else tokenizer_config.json's chat_template, else DEFAULT_CHAT_TEMPLATE."""
        config = {}
        config_path = os.path.join(folder, "tokenizer_config.json")
        if os.path.exists(config_path):
            with open(config_path) as f:
                config = json.load(f)
        special = {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
        source = _template_source(folder, config)
        return cls(source or DEFAULT_CHAT_TEMPLATE, special, is_default=source is None)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, continue_final_message: bool = False,
               tools: list[dict] | None = None, **variables) -> str:
        """The prompt text; `tools`: the request's tools, which templates of tool-calling models show the model
        (None: no tools); `variables` (chat_template_kwargs) reach the template beside the messages. With
        continue_final_message the text ends where the last message's content ends (its closing tokens cut)."""
        try:
            text = self.template.render(**{**variables, "messages": messages, "tools": tools,
                                           "add_generation_prompt": add_generation_prompt, **self.special_tokens})
        except jinja2.exceptions.TemplateError as exc:
            raise bad_request(f"the chat template refused the messages: {exc}", "messages") from None
        if continue_final_message:
            final = messages[-1]["content"]
            at = text.rfind(final) if final else -1
            if at < 0:
                raise bad_request("continue_final_message: the chat template does not show the last message's content",
                                  "continue_final_message")
            text = text[: at + len(final)]
        return text


def _template_source(folder: str, config: dict) -> str | None:
    jinja_path = os.path.join(folder, "chat_template.jinja")
    if os.path.exists(jinja_path):
        with open(jinja_path) as f:
            return f.read()
    template = config.get("chat_template")
    if isinstance(template, list):  # several named templates: the one called "default"
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template
