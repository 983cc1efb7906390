"""`moeplex serve`: the engine behind an OpenAI-compatible and SGLang-native HTTP server.

This process is the HTTP front end; it spawns every rank of the engine, rank 0 leading the others
(moeplex.server.processes). A rank that fails stops the rest, and the error names it.
"""

from __future__ import annotations

import errno
import socket
import sys
import tempfile

from ..server import ServerSettings
from ..server.settings import REASONING_PARSERS, TOOL_CALL_PARSERS
from ..server.processes import EngineStopped, serve
from .flags import add_engine_flags, engine_config

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over HTTP (OpenAI-compatible and SGLang-native APIs)")
    http = p.add_argument_group("HTTP server")
    http.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    http.add_argument("--port", type=int, default=30000, help="port to bind (default: 30000)")
    http.add_argument(
        "--api-key", default=None,
        help="require 'Authorization: Bearer KEY' on every path except /health, /health_generate and /metrics",
    )
    http.add_argument("--served-model-name", default=None, help="the model name clients send and see (default: the model path)")
    http.add_argument(
        "--max-request-bytes", type=int, default=8 << 20, help="larger request bodies are refused with 413 (default: 8 MiB)"
    )
    http.add_argument(
        "--read-timeout", type=float, default=30.0,
        help="seconds a client has to send a request's headers, and again its body, before the connection is "
        "dropped (408 for a body) (default: 30)",
    )
    http.add_argument(
        "--max-connections", type=int, default=2048,
        help="concurrent connections and requests; past this many a new one gets a 503 (default: 2048)",
    )
    http.add_argument(
        "--stall-timeout", type=float, default=30.0,
        help="no engine step for this many seconds while requests wait: /health answers 503, the requests in flight "
        "fail with a 503 naming the rank that stopped answering (default: 30; the collective timeout "
        "--dist-timeout still ends the server)",
    )
    http.add_argument(
        "--shutdown-timeout", type=float, default=30.0,
        help="on SIGTERM, stop accepting and give in-flight requests this many seconds to finish (default: 30)",
    )
    http.add_argument(
        "--gil-switch-interval", type=float, default=1e-4,
        help="Python's thread switch interval in seconds for the HTTP process: how soon the thread receiving the "
        "engine's reports gets the GIL back from the event loop (default: 0.0001; Python's own default is 0.005)",
    )
    http.add_argument(
        "--expert-load-dir", default=tempfile.gettempdir(),
        help="folder where POST /dump_expert_distribution_record writes its files (default: the system temp folder)",
    )
    http.add_argument(
        "--skip-warmup", action="store_true",
        help="on a GPU, serve at once instead of first running one prefill step of each size class up to "
        "--max-batched-tokens (which compiles their kernels before a client waits on them)",
    )
    http.add_argument(
        "--strict-request-fields", action="store_true",
        help="answer 400 to a request that carries a field this server does not know, instead of ignoring it with "
        "a warning in the log and its name in the X-Moeplex-Ignored-Fields response header (vLLM's default)",
    )
    http.add_argument(
        "--tool-call-parser", choices=TOOL_CALL_PARSERS,
        help="how the model writes tool calls, read back into tool_calls for tool_choice auto: deepseek_v3, qwen3 "
        "(also Qwen2.5's <tool_call> blocks) or mistral (see docs/structured_outputs.md; default: none, calls stay text)",
    )
    http.add_argument(
        "--reasoning-parser", choices=REASONING_PARSERS,
        help="split the model's thinking (<think>...</think>) into reasoning_content: deepseek_r1 or qwen3 "
        "(default: none)",
    )
    http.add_argument(
        "--stream-interval", type=int, default=1,
        help="a streamed answer's chunks: the first token at once, then one chunk every this many tokens, and the "
        "end (default: 1, every step's tokens; larger: fewer, larger events, less front-end work a token; a native "
        "request's sampling_params.stream_interval overrides it)",
    )
    http.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="server log level (default: info)")
    add_engine_flags(p)
    p.set_defaults(run=run)


def run(args) -> int:
    settings = ServerSettings(
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        served_model_name=args.served_model_name,
        max_request_bytes=args.max_request_bytes,
        read_timeout=args.read_timeout,
        stall_timeout=args.stall_timeout,
        max_connections=args.max_connections,
        shutdown_timeout=args.shutdown_timeout,
        gil_switch_interval=args.gil_switch_interval,
        stream_interval=args.stream_interval,
        expert_load_dir=args.expert_load_dir,
        warmup=not args.skip_warmup,
        strict_request_fields=args.strict_request_fields,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
    )
    check_port_free(args.host, args.port)  # before the model loads, not after
    config = engine_config(args)  # rank 0 draws the loading bar when stderr is a terminal
    try:
        serve(config, settings, args.log_level)
    except EngineStopped as exc:
        print(f"moeplex serve: error: {exc}", file=sys.stderr)
        return 1
    return 0


def check_port_free(host: str, port: int) -> None:
    """Bind the address as uvicorn will (SO_REUSEADDR) and let go: a taken port is refused in one sentence."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            why = "it is already in use" if exc.errno == errno.EADDRINUSE else exc.strerror
            raise OSError(f"cannot serve on {host}:{port}: {why}; choose another --port") from None
