"""POST /tokenize and /detokenize: vLLM's (and SGLang's) tokenizer endpoints, which benchmark clients call to
check that their tokenizer agrees with the server's (`vllm bench serve` aligns its prompts with them)."""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse
from starlette.routing import Route

from .body import BodyReader
from .chat_template import ChatTemplate
from .errors import bad_request
from .openai_chat import MESSAGE, _flatten
from .schema import BOOLEAN, STRING, Field, ListOf, parse, prune
from .openai_common import TOKEN_IDS
from .served_model import ServedModel

TOKENIZE = [
    Field("model", STRING, None, "the served model name; optional"),
    Field("prompt", STRING, None, "text to tokenize (or messages)"),
    Field("messages", ListOf(MESSAGE, "an array of messages", min_items=1), None, "chat messages, rendered first"),
    Field("add_special_tokens", BOOLEAN, None, "let the tokenizer add its special tokens (default: true for a prompt, "
          "false for messages)"),
    Field("add_generation_prompt", BOOLEAN, True, "with messages: end with the assistant header"),
    Field("return_token_strs", BOOLEAN, False, "also each token's text"),
]
DETOKENIZE = [Field("model", STRING, None, "the served model name; optional"),
              Field("tokens", TOKEN_IDS, None, "token ids", required=True)]


class TokenizerRoutes:
    def __init__(self, model: ServedModel, bodies: BodyReader, template: ChatTemplate):
        self.model = model
        self.bodies = bodies
        self.template = template

    def routes(self) -> list[Route]:
        return [Route("/tokenize", self.tokenize, methods=["POST"]), Route("/detokenize", self.detokenize, methods=["POST"])]

    async def _values(self, http: HttpRequest, fields) -> dict:
        return parse(prune(await self.bodies.json(http), fields)[0], fields)

    async def tokenize(self, http: HttpRequest) -> JSONResponse:
        values = await self._values(http, TOKENIZE)
        self.model.check_name(values["model"])
        if (values["prompt"] is None) == (values["messages"] is None):
            raise bad_request("give exactly one of prompt and messages", "prompt")
        if values["prompt"] is not None:
            text, special = values["prompt"], values["add_special_tokens"] is not False
        else:
            messages = [_flatten(m) for m in values["messages"]]
            text = self.template.render(messages, add_generation_prompt=values["add_generation_prompt"])
            special = bool(values["add_special_tokens"])
        ids = await run_in_threadpool(self.model.encode, text, "prompt", special)
        answer = {"count": len(ids), "max_model_len": self.model.context_length, "tokens": ids}
        if values["return_token_strs"]:
            answer["token_strs"] = [self.model.token_text(t) for t in ids]
        return JSONResponse(answer)

    async def detokenize(self, http: HttpRequest) -> JSONResponse:
        values = await self._values(http, DETOKENIZE)
        self.model.check_name(values["model"])
        self.model.check_token_ids(values["tokens"], "tokens")
        return JSONResponse({"prompt": self.model.decode(values["tokens"])})
