"""RouterSettings: every option of `moeplex router`, validated once (built from its flags)."""

from __future__ import annotations

import attrs
from attrs.validators import ge, gt, le

from .access import WorkerUrlRule

POLICIES = ("cache_aware", "round_robin", "random", "shortest_queue")


def _worker_url(instance, attribute, urls):
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"a worker URL starts with http:// or https://, got {url!r}")


@attrs.frozen
class RouterSettings:
    worker_urls: tuple[str, ...] = attrs.field(default=(), converter=tuple, validator=_worker_url)
    policy: str = attrs.field(default="cache_aware", validator=attrs.validators.in_(POLICIES))
    host: str = "127.0.0.1"
    port: int = attrs.field(default=30000, validator=[ge(0), le(65535)])
    # cache_aware: above this matched fraction of the request text, the worker with the longest match
    cache_threshold: float = attrs.field(default=0.5, validator=[ge(0.0), le(1.0)])
    # cache_aware: load is imbalanced when max - min > abs AND max > rel * min; then the shortest queue wins
    balance_abs_threshold: int = attrs.field(default=32, validator=ge(0))
    balance_rel_threshold: float = attrs.field(default=1.1, validator=ge(1.0))
    max_tree_size: int = attrs.field(default=1 << 22, validator=gt(0))  # characters per worker, at all times
    health_check_interval_secs: float = attrs.field(default=10.0, validator=gt(0))
    health_check_timeout_secs: float = attrs.field(default=5.0, validator=gt(0))
    health_failure_threshold: int = attrs.field(default=3, validator=ge(1))  # consecutive failures take a worker out
    health_success_threshold: int = attrs.field(default=2, validator=ge(1))  # consecutive passed checks put it back
    # a worker not yet seen healthy is 'starting' (probed with backoff, never taken out) for this long
    worker_startup_timeout_secs: float = attrs.field(default=600.0, validator=gt(0))
    max_retries: int = attrs.field(default=3, validator=ge(0))  # further workers tried after a failed forward
    retry_backoff_ms: float = attrs.field(default=50.0, validator=ge(0))
    retry_max_backoff_ms: float = attrs.field(default=1000.0, validator=ge(0))
    retry_jitter: float = attrs.field(default=0.2, validator=[ge(0.0), le(1.0)])
    request_timeout_secs: float = attrs.field(default=600.0, validator=gt(0))
    connect_timeout_secs: float = attrs.field(default=5.0, validator=gt(0))
    max_connections: int = attrs.field(default=512, validator=ge(1))
    max_request_bytes: int = attrs.field(default=32 << 20, validator=gt(0))
    body_timeout_secs: float = attrs.field(default=30.0, validator=gt(0))  # a body not all there by then: 408
    seed: int | None = None  # of the random policy and the retry jitter; None draws from the OS
    # access: keys are never shown in a repr or a log
    api_key: str | None = attrs.field(default=None, repr=False)  # clients' bearer key; None: open
    admin_api_key: str | None = attrs.field(default=None, repr=False)  # management; None: loopback binding only
    worker_api_key: str | None = attrs.field(default=None, repr=False)  # the bearer key the router sends workers
    worker_url_allow: tuple[str, ...] = attrs.field(default=(), converter=tuple)  # URL patterns; empty: any
    # prefill/decode disaggregation: pairs of a prefill server (URL[,BOOTSTRAP_PORT]) and a decode server per request
    pd: bool = False
    prefill: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    decode: tuple[str, ...] = attrs.field(default=(), converter=tuple)

    def __attrs_post_init__(self):
        if self.pd and (not self.prefill or not self.decode or self.worker_urls):
            raise ValueError("--pd takes --prefill URL[,BOOTSTRAP_PORT] ... and --decode URL ... (and no --worker-urls)")
        if not self.pd and (self.prefill or self.decode):
            raise ValueError("--prefill and --decode need --pd")
        _worker_url(self, None, [spec.partition(",")[0] for spec in self.prefill] + list(self.decode))
        rule = WorkerUrlRule(self.worker_url_allow)
        for url in self.worker_urls + tuple(spec.partition(",")[0] for spec in self.prefill) + self.decode:
            refusal = rule.refusal(url)
            if refusal:
                raise ValueError(refusal)
