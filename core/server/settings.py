"""ServerSettings: the HTTP side's options, validated once (built from `moeplex serve` flags)."""

from __future__ import annotations

import tempfile

import attrs


TOOL_CALL_PARSERS = ("deepseek_v3", "qwen3", "mistral")  # core/server/tools/parsers.py
REASONING_PARSERS = ("deepseek_r1", "qwen3")  # core/server/reasoning.py


def _positive(instance, attribute, value):
    if value <= 0:
        raise ValueError(f"{attribute.name} must be positive, got {value}")


@attrs.frozen
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = attrs.field(default=30000, validator=attrs.validators.and_(attrs.validators.ge(0), attrs.validators.le(65535)))
    api_key: str | None = None  # when set, every path but /health, /health_generate and /metrics needs it
    served_model_name: str | None = None  # default: the model path
    max_request_bytes: int = attrs.field(default=8 << 20, validator=_positive)  # larger bodies are a 413
    read_timeout: float = attrs.field(default=30.0, validator=_positive)  # a request's headers, then its body (408)
    max_connections: int = attrs.field(default=2048, validator=_positive)  # uvicorn answers 503 past this many
    stall_timeout: float = attrs.field(default=30.0, validator=_positive)  # no step this long with work waiting: 503s
    shutdown_timeout: float = attrs.field(default=30.0, validator=_positive)  # drain in-flight requests on SIGTERM
    expert_load_dir: str = attrs.field(factory=tempfile.gettempdir)  # where expert-load dumps are written
    warmup: bool = True  # on a GPU, rank 0 runs a prefill step of each size class before serving (ranks/warmup.py)
    strict_request_fields: bool = False  # a request field no endpoint declares is a 400 rather than ignored
    health_timeout: float = attrs.field(default=20.0, validator=_positive)  # /health_generate's one-token request
    # applied by `moeplex serve` to its front-end process (sys.setswitchinterval), never by build_app: the thread
    # that receives the engine's round reports gets the GIL back from the event loop within this interval rather
    # than Python's 5 ms default (the forward steps themselves run in the rank processes)
    gil_switch_interval: float = attrs.field(default=1e-4, validator=_positive)
    # a streamed request's chunks: its first token at once, then one every this many tokens, and its end
    # (SGLang's --stream-interval; a native request's sampling_params.stream_interval overrides it)
    stream_interval: int = attrs.field(default=1, validator=_positive)
    # how the model writes tool calls (tool_choice auto) and its thinking: parsers by model family, none by default
    tool_call_parser: str | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.in_(TOOL_CALL_PARSERS)))
    reasoning_parser: str | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.in_(REASONING_PARSERS)))
