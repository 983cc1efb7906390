"""`moeplex serve`: OpenAI-compatible and SGLang-native HTTP serving.

    app.py            the starlette app: routes, middleware, the engine thread's lifetime
    engine_loop.py    the engine on its own thread; requests in through a queue, Outputs back per step
    progress.py       what each running request has sent its client (stop-string hold-back)
    group.py          the engine requests of one HTTP call, read back through one asyncio queue
    handlers.py       body -> fields -> Plan -> engine -> JSON or server-sent events
    openai_*.py       /v1/completions and /v1/chat/completions;  native.py  SGLang's /generate
    info.py           health, models, model and server info, metrics, the OpenAPI document
    schema.py         request fields: validation (400 naming the field) and JSON Schema from one declaration
"""

from .app import build_app
from .settings import ServerSettings

__all__ = ["build_app", "ServerSettings"]
