"""`moeplex router`: a cache-aware router in front of several `moeplex serve` workers."""

from __future__ import annotations

import gc
import logging

import uvicorn

from ..router import POLICIES, RouterSettings

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def add_parser(sub) -> None:
    p = sub.add_parser("router", help="route requests over several `moeplex serve` workers (cache-aware by default)")
    p.add_argument("--worker-urls", nargs="+", metavar="URL", default=[],
                   help="workers to route to, e.g. http://127.0.0.1:30001 (more can be added with POST /add_worker)")
    p.add_argument("--policy", choices=POLICIES, default="cache_aware",
                   help="how a worker is chosen: cache_aware (prefix affinity with load balancing), round_robin, "
                   "random, shortest_queue (fewest requests in flight) (default: cache_aware)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=30000, help="port to bind (default: 30000)")
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="log level (default: info)")
    p.add_argument("--access-log", action="store_true", help="log every request (costs CPU under load; default: off)")
    pd = p.add_argument_group("prefill/decode disaggregation (docs/pd.md)")
    pd.add_argument("--pd", "--pd-disaggregation", dest="pd", action="store_true",
                    help="pair a prefill and a decode server per request (`serve --disaggregation-mode prefill|decode`): "
                    "the --policy chooses among the prefill servers, the least loaded decode server decodes "
                    "(--pd-disaggregation: sglang-router's spelling)")
    pd.add_argument("--prefill", nargs="+", action="append", metavar="URL[,BOOTSTRAP_PORT]", default=[],
                    help="prefill servers, each with the port of its bootstrap endpoint (default port: 8998): "
                    "'--prefill URL,PORT URL,PORT', or sglang-router's '--prefill URL PORT' once per server")
    pd.add_argument("--decode", nargs="+", action="append", metavar="URL", default=[],
                    help="decode servers: '--decode URL URL' or '--decode URL' once per server")
    _add_cache_aware_flags(p)
    _add_health_flags(p)
    _add_forwarding_flags(p)
    _add_access_flags(p)
    p.set_defaults(run=run)


def _add_access_flags(p) -> None:
    g = p.add_argument_group("access")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' from clients on every path except /health and /metrics "
                   "(401 otherwise; default: no key)")
    g.add_argument("--admin-api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /add_worker, /remove_worker and /list_workers; without "
                   "it they need the --api-key when one is set, and with no key at all they answer only on a router "
                   "bound to a loopback --host (403 otherwise; default: no key)")
    g.add_argument("--worker-api-key", default=None,
                   help="the key the router sends workers as 'Authorization: Bearer KEY' (their `serve --api-key`); "
                   "a worker sees only an allow-list of the client's headers (Content-Type, Accept, User-Agent, "
                   "X-Request-Id, tracing), never its credentials (default: none sent)")
    g.add_argument("--worker-url-allow", nargs="+", metavar="PATTERN", default=[],
                   help="patterns a worker URL must match, shell-style and part by part (scheme, host label by label, "
                   "port), e.g. 'http://10.0.0.*:*' or 'https://*.internal.example:30001'; applies to --worker-urls and "
                   "/add_worker, which refuses others with 400; a URL must first be valid: a real host and a port that "
                   "is a number in 1..65535 (default: any valid URL)")


def _add_cache_aware_flags(p) -> None:
    g = p.add_argument_group("cache-aware policy")
    g.add_argument("--cache-threshold", type=float, default=0.5,
                   help="when the longest prefix some worker has seen covers more than this fraction of the request "
                   "text, that worker gets it; otherwise the least loaded worker, and among workers within one request of it "
                   "the one owning the least text (default: 0.5)")
    g.add_argument("--balance-abs-threshold", type=int, default=32,
                   help="load is imbalanced, and the shortest queue wins over prefix affinity, when the most and least "
                   "loaded workers differ by more than this many requests AND by the relative threshold (default: 32)")
    g.add_argument("--balance-rel-threshold", type=float, default=1.1,
                   help="... and the most loaded worker has more than this times the least loaded one's requests "
                   "(default: 1.1)")
    g.add_argument("--max-tree-size", type=int, default=1 << 22,
                   help="characters of the tree each worker owns at most: an insert past it evicts that worker's least "
                   "recently used text down to 7/8 of it (default: 4194304)")


def _add_health_flags(p) -> None:
    g = p.add_argument_group("health checks")
    g.add_argument("--health-check-interval-secs", type=float, default=10.0,
                   help="seconds between GET /health checks of every worker (default: 10)")
    g.add_argument("--health-check-timeout-secs", type=float, default=5.0,
                   help="a health check not answered within this many seconds fails (default: 5)")
    g.add_argument("--health-failure-threshold", type=int, default=3,
                   help="failures in a row (forwards or health checks) that take a worker out of routing (default: 3)")
    g.add_argument("--health-success-threshold", type=int, default=2,
                   help="passed health checks in a row that put a worker back into routing (default: 2)")
    g.add_argument("--worker-startup-timeout-secs", type=float, default=600.0,
                   help="a worker not yet seen healthy is 'starting' (loading its model): checked after 0.25 s, 0.5 s, "
                   "1 s, then every 2 s, never taken out, and in routing from its first passed check; "
                   "after this many seconds without one it is out like a failed worker (default: 600)")


def _add_forwarding_flags(p) -> None:
    g = p.add_argument_group("forwarding and retries")
    g.add_argument("--max-retries", type=int, default=3,
                   help="other workers tried when a forward fails before the first byte (default: 3)")
    g.add_argument("--retry-backoff-ms", type=float, default=50.0,
                   help="wait before the first retry, doubled for each further one (default: 50)")
    g.add_argument("--retry-max-backoff-ms", type=float, default=1000.0, help="longest wait before a retry (default: 1000)")
    g.add_argument("--retry-jitter", type=float, default=0.2,
                   help="each wait is scaled by a random factor in 1 +- this (default: 0.2)")
    g.add_argument("--request-timeout-secs", type=float, default=600.0,
                   help="a worker silent for this many seconds fails the forward (default: 600)")
    g.add_argument("--connect-timeout-secs", type=float, default=5.0,
                   help="a worker not accepting a connection within this many seconds fails the forward (default: 5)")
    g.add_argument("--max-connections", type=int, default=512,
                   help="pooled connections to each worker at most (default: 512)")
    g.add_argument("--max-request-bytes", type=int, default=32 << 20,
                   help="larger request bodies are refused with 413 by the router itself, by their Content-Length "
                   "or as they stream past it, before they are buffered (default: 32 MiB)")
    g.add_argument("--body-timeout-secs", type=float, default=30.0,
                   help="a request body not all received within this many seconds is refused with 408 and its "
                   "connection closed (default: 30)")
    g.add_argument("--seed", type=int, default=None,
                   help="seed of the random policy and of the retry jitter (default: fresh randomness)")


def settings_from(args) -> RouterSettings:
    names = [f.name for f in RouterSettings.__attrs_attrs__]
    values = {name: getattr(args, name) for name in names}
    values.update(prefill=prefill_specs(args.prefill), decode=[url for group in args.decode for url in group])
    return RouterSettings(**values)


def prefill_specs(groups: list[list[str]]) -> list[str]:
    """Every --prefill as 'URL[,PORT]', from our spelling ('URL,PORT', several per flag) or sglang-router's
    ('URL PORT' per flag, the port a number or 'none' for the default)."""
    specs: list[str] = []
    for group in groups:
        bare = False  # the last token of this flag was a URL without a port
        for token in group:
            if token.isdigit() or token.lower() == "none":
                if not bare:
                    raise ValueError(f"--prefill: the bootstrap port {token!r} follows no prefill server URL")
                if token.isdigit():
                    specs[-1] = f"{specs[-1]},{token}"
                bare = False
            else:
                specs.append(token)
                bare = "," not in token
    return specs


def run(args) -> int:
    settings = settings_from(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from ..router.app import build_router_app  # here: every other command runs without the router's HTTP client
    from ..router.pd import build_pd_router_app

    from ..router.access import management_access

    app = build_pd_router_app(settings) if settings.pd else build_router_app(settings)
    access = management_access(settings.api_key, settings.admin_api_key, settings.host)
    logging.getLogger("moeplex.router").log(logging.WARNING if "open" in access else logging.INFO, access)
    # the process carries every module the CLI imported (torch among them); frozen, the collector never walks them
    # again, and a larger first generation collects less often on the per-request garbage (a tenth of the router's
    # CPU went to collections before; the tree's nodes still are collected, being cyclic)
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=args.log_level, access_log=args.access_log)
    return 0
