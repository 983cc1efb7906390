"""`moeplex serve`: OpenAI-compatible and SGLang-native HTTP serving.

    ranks.py          what each rank runs: rank 0 uvicorn around an EngineGroup, the others a Follower
    app.py            the starlette app: routes, middleware, the engine thread's lifetime
    engine_loop.py    the engine on its own thread; requests in through a queue, one EngineGroup round per step,
                      Outputs back per step (moeplex.engine_group / rank_worker: the ranks' side)
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
