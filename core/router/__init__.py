"""`moeplex router`: a cache-aware router in front of several `moeplex serve` workers.

    settings.py       RouterSettings: every option, validated once
    radix_tree.py     the approximate radix tree over request text, each node stamped with the workers that saw it
    policies.py       cache_aware, round_robin, random, shortest_queue: which healthy worker gets a request
    request_text.py   the text a request is routed by (prompt, messages, or token ids spelled out)
    access.py         client and admin bearer keys (ASGI middleware), the worker URL allow-list
    bodies.py         request bodies read under a cap (refused by Content-Length before a byte is read)
    workers.py        the worker registry: load from the moment of the decision, failure streaks, starting / healthy / out
    health.py         GET /health on every worker, each on its own schedule and timeout; the only judge of health
    upstream.py       one exchange with one worker up to the client's first byte; the pass-through response
                      (a stream the worker cuts ends with an error event)
    proxy.py          choose, send, retry on another worker with backoff and jitter
    metrics.py        Prometheus metrics in the router's own registry
    app.py            the starlette app: forwarded routes, /health, worker management, /metrics
    fake_worker.py    a stand-in for `moeplex serve` with a fixed service time, for tests and benchmarks
"""

from .settings import POLICIES, RouterSettings

__all__ = ["POLICIES", "RouterSettings"]  # the app (and its HTTP client) from .app, where a router runs
