"""Prometheus metrics of one server, in a registry of its own (no process-wide default registry)."""

from __future__ import annotations

from typing import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..request import accept_length, accept_rate

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
ACCEPT_LENGTH_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 2.75, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0)
ACCEPT_RATE_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class ServerMetrics:
    """Counters the HTTP side and the engine thread update (prometheus-client is thread-safe).

    Gauges of engine state (running and queued requests, KV pages) are read when scraped, from the
    statistics the engine thread publishes after every step.
    """

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.http_requests = Counter(
            "moeplex_http_requests", "HTTP requests answered, by endpoint and status code", ["endpoint", "status"], registry=r
        )
        self.finished = Counter(
            "moeplex_requests_finished",
            "Engine requests finished, by reason: stop, length, abort (client gone), error (engine failure), "
            "rejected (refused at admission)",
            ["reason"],
            registry=r,
        )
        self.prompt_tokens = Counter("moeplex_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("moeplex_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram(
            "moeplex_time_to_first_token_seconds", "From the HTTP request to its first token", buckets=TTFT_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "moeplex_inter_token_latency_seconds", "Between consecutive tokens of one request", buckets=ITL_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "moeplex_e2e_request_latency_seconds", "From the HTTP request to its last token", buckets=E2E_BUCKETS, registry=r
        )
        self.spec_accept_length = Histogram(
            "moeplex_spec_accept_length", "Per finished request: tokens gained per speculative verify step "
            "(accepted drafts + 1)", buckets=ACCEPT_LENGTH_BUCKETS, registry=r,
        )
        self.spec_accept_rate = Histogram(
            "moeplex_spec_accept_rate", "Per finished request: share of its drafted tokens the target accepted",
            buckets=ACCEPT_RATE_BUCKETS, registry=r,
        )
        self.running = Gauge("moeplex_num_running_requests", "Requests the scheduler is running", registry=r)
        self.queued = Gauge("moeplex_num_queued_requests", "Requests waiting for admission", registry=r)
        self.kv_pages_total = Gauge("moeplex_kv_pages_total", "Pages of the KV cache", registry=r)
        self.kv_pages_used = Gauge(
            "moeplex_kv_pages_used", "Pages of the KV cache held by requests (their own and cached ones they read)", registry=r
        )
        self.kv_pages_evictable = Gauge(
            "moeplex_kv_pages_cached_evictable", "Prefix-cache pages no request reads (reuse, freed on demand)", registry=r
        )
        self.kv_usage = Gauge("moeplex_kv_cache_usage_ratio", "Fraction of KV cache pages held by requests", registry=r)
        self.kv_pages_cached = Gauge(
            "moeplex_prefix_cache_pages", "KV pages the prefix cache holds (in use or evictable)", registry=r
        )

    def watch(self, stats: Callable[[], object]) -> None:
        """Read the engine gauges from `stats()` (an object with num_running, num_queued, kv_pages_*) at scrape time."""
        self.running.set_function(lambda: stats().num_running)
        self.queued.set_function(lambda: stats().num_queued)
        self.kv_pages_total.set_function(lambda: stats().kv_pages_total)
        self.kv_pages_used.set_function(lambda: stats().kv_pages_used)
        self.kv_pages_evictable.set_function(lambda: stats().kv_pages_evictable)
        self.kv_usage.set_function(lambda: stats().kv_pages_used / max(stats().kv_pages_total, 1))
        self.kv_pages_cached.set_function(lambda: stats().kv_pages_cached)
        self.registry.register(SummedCounters(stats, "cache_total", PREFIX_CACHE_COUNTERS))
        self.registry.register(SummedCounters(stats, "spec_total", SPECULATION_COUNTERS))
        self.registry.register(SummedCounters(stats, "grammar_total", GRAMMAR_COUNTERS))
        self.registry.register(StepCounters(stats))

    def watch_transfers(self, transfers: Callable[[], object]) -> None:
        """Disaggregation: the leader's TransferStats (None on a co-located server) at scrape time."""
        self.registry.register(TransferMetrics(transfers))

    def tokens_generated(self, count: int, since_previous: float, first: bool) -> None:
        """`count` new tokens of one request, `since_previous` seconds after its submission or previous token."""
        self.generation_tokens.inc(count)
        if first:
            self.ttft.observe(since_previous)
        else:
            for _ in range(count):
                self.itl.observe(since_previous / count)

    def speculation_finished(self, spec_counts: tuple[int, int, int]) -> None:
        """A finished request's accept length and rate (requests that verified no drafts are not counted)."""
        length, rate = accept_length(spec_counts), accept_rate(spec_counts)
        if length is not None:
            self.spec_accept_length.observe(length)
        if rate is not None:
            self.spec_accept_rate.observe(rate)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class SummedCounters:
    """Counters of the engine's statistics summed over the DP groups, read at scrape time: `total` names the
    LoopStats method that sums one (cache_total, spec_total, grammar_total)."""

    def __init__(self, stats: Callable[[], object], total: str, counters: tuple[tuple[str, str, str], ...]):
        self.stats = stats
        self.total = total
        self.counters = counters

    def collect(self):
        total = getattr(self.stats(), self.total)
        for counter, name, documentation in self.counters:
            family = CounterMetricFamily(name, documentation)
            family.add_metric([], total(counter))
            yield family


class StepCounters:
    """The engine's steps by kind and the overlap schedule's breaks by reason (step_log.py), read at scrape time."""

    def __init__(self, stats: Callable[[], object]):
        self.stats = stats

    def collect(self):
        stats = self.stats()
        steps = CounterMetricFamily("moeplex_engine_steps", "Engine steps by what they launched", labels=["kind"])
        seconds = CounterMetricFamily("moeplex_engine_step_seconds",
                                      "Host seconds of the engine steps, by what they launched", labels=["kind"])
        for kind, (count, total) in stats.step_totals().items():
            steps.add_metric([kind], count)
            seconds.add_metric([kind], total)
        breaks = CounterMetricFamily("moeplex_engine_overlap_breaks",
                                     "Steps in flight read before the next step was launched, by reason", labels=["reason"])
        for reason, count in stats.break_totals().items():
            breaks.add_metric([reason], count)
        yield from (steps, seconds, breaks)
        for name, documentation, scales in (
            ("moeplex_spec_verify_cost_scale", "The adaptive draft policy's verify step costs as serving measured them "
             "over the start-up measurement, per batch size (where they moved)", stats.verify_cost_scales()),
            ("moeplex_spec_break_cost_scale", "The adaptive draft policy's cost of a break of the overlap schedule as "
             "serving measured it over the start-up measurement, per batch size (where it moved)",
             stats.break_cost_scales()),
            ("moeplex_spec_mixed_verify_cost_scale", "The adaptive draft policy's cost of a verify step holding prompt "
             "tokens (synchronous) as serving measured it over the start-up measurement of a verify step, per batch "
             "size (where one was timed)", stats.mixed_verify_cost_scales()),
        ):
            family = GaugeMetricFamily(name, documentation, labels=["requests"])
            for size, scale in scales.items():
                family.add_metric([str(size)], scale)
            yield family


PREFIX_CACHE_COUNTERS = (
    ("queried_tokens", "moeplex_prefix_cache_queried_tokens", "Tokens looked up in the prefix cache at admission"),
    ("hit_tokens", "moeplex_prefix_cache_hit_tokens", "Looked-up tokens found in the prefix cache"),
    ("evicted_pages", "moeplex_prefix_cache_evicted_pages", "KV pages evicted from the prefix cache"),
)
# the draft policy's decisions (--speculative-policy): decode steps that verified drafts and that did not, drafts
# verified, requests that drafted (per verify step, summed); drafts per verify step and requests drafting per
# verify step are the ratios
SPECULATION_COUNTERS = (
    ("verify_steps", "moeplex_spec_verify_steps", "Decode steps that verified drafts (speculative decoding)"),
    ("plain_steps", "moeplex_spec_plain_steps", "Decode steps in which the draft policy drafted for no request"),
    ("drafts", "moeplex_spec_drafts_verified", "Draft tokens verified"),
    ("drafting", "moeplex_spec_requests_drafting", "Requests that verified drafts, summed over verify steps"),
)
# structured outputs: the steps that waited for a grammar (a compile or matcher not ready when the request's token
# was drawn)
GRAMMAR_COUNTERS = (
    ("mask_waits", "moeplex_grammar_mask_waits", "Steps that waited for a structured-output grammar"),
    ("mask_wait_seconds", "moeplex_grammar_mask_wait_seconds", "Seconds steps waited for structured-output grammars"),
)


class TransferMetrics:
    """KV transfers of a prefill or decode server: by outcome, bytes, rate, and the requests in each state."""

    def __init__(self, transfers: Callable[[], object]):
        self.transfers = transfers

    def collect(self):
        stats = self.transfers()
        if stats is None:
            return
        ended = CounterMetricFamily("moeplex_kv_transfers", "KV transfers ended, by outcome (done, failed, timeout)",
                                    labels=["role", "outcome"])
        for outcome in ("done", "failed", "timeout"):
            ended.add_metric([stats.role, outcome], stats.outcomes.get(outcome, 0))
        yield ended
        moved = CounterMetricFamily("moeplex_kv_transfer_bytes", "Bytes of KV moved by finished transfers", labels=["role"])
        moved.add_metric([stats.role], stats.bytes)
        yield moved
        rate = GaugeMetricFamily("moeplex_kv_transfer_gb_per_second",
                                 "Bytes of finished transfers over their summed duration, in GB/s", labels=["role"])
        rate.add_metric([stats.role], stats.bytes / stats.seconds / 1e9 if stats.seconds else 0.0)
        yield rate
        states = GaugeMetricFamily("moeplex_kv_transfer_requests", "Requests moving KV, by state", labels=["role", "state"])
        for state, count in stats.states.items():
            states.add_metric([stats.role, state], count)
        yield states
