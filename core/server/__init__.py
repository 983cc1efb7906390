"""`moeplex serve`: OpenAI-compatible and SGLang-native HTTP serving.

    processes.py      the processes: this one the HTTP front end, every rank spawned (rank 0 leads, the others
                      follow: moeplex.ranks)
    app.py            the starlette app: routes, middleware, the leader's lifetime (in-process engines: a leader thread)
    engine_loop.py    the front end of the engine: commands out to the leader (core/messages.py), its round reports
                      into the HTTP calls
    body.py           reading a request body within its size and time limits
    watchdog.py       the ranks' heartbeats, and when no step has come back for too long
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
