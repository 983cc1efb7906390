"""`moeplex router` on loopback: fake workers (python -m moeplex.router.fake_worker) and real `moeplex serve` workers."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict

import httpx
import pytest

from moeplex.cli import main as cli_main
from moeplex.config import EngineConfig
from moeplex.engine import Engine
from moeplex.server import ServerSettings, build_app

from live_server import LiveServer
from router_helpers import fake_worker, live_router, wait_for

ENGINE = dict(dtype="fp32", show_progress=False, max_total_tokens=4096, page_size=16, max_running_requests=64)




class FakeWorkers:
    """`count` fake workers in one subprocess, so a test can kill them for real."""

    def __init__(self, count: int, delay_ms: float, slots: int = 0):
        command = [sys.executable, "-m", "moeplex.router.fake_worker", "--count", str(count), "--delay-ms", str(delay_ms),
                   "--slots", str(slots)]
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        assert line, "the fake workers did not start"
        self.urls = [f"http://127.0.0.1:{port}" for port in json.loads(line)["ports"]]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.wait(10)


def served_by(answer: dict) -> str:
    return "http://" + answer["worker"]


async def send_all(url: str, bodies: list[dict], concurrency: int, path: str = "/v1/completions",
                   on_answer=None, time_limit: float = 60) -> list[tuple[int, dict]]:
    """POST every body with `concurrency` in flight; (status, JSON) of each, in the bodies' order."""
    results: list = [None] * len(bodies)
    queue = list(reversed(range(len(bodies))))
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=httpx.Limits(max_connections=concurrency)) as http:
        async def sender():
            while queue:
                i = queue.pop()
                r = await http.post(path, json=bodies[i])
                results[i] = (r.status_code, r.json())
                if on_answer is not None:
                    on_answer(len(bodies) - len(queue))

        await asyncio.wait_for(asyncio.gather(*(sender() for _ in range(concurrency))), time_limit)
    return results


def grouped_bodies(groups: int, per_group: int, seed: int = 0) -> list[tuple[int, dict]]:
    rng = random.Random(seed)
    prefixes = ["".join(rng.choices("abcdefgh ", k=200)) for _ in range(groups)]
    items = [(g, {"prompt": f"{prefixes[g]} question {i}", "max_tokens": 4}) for g in range(groups) for i in range(per_group)]
    rng.shuffle(items)
    return items


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


# --- fake workers --------------------------------------------------------------------------------


def test_requests_sharing_a_prefix_stay_on_one_worker_under_concurrency():
    items = grouped_bodies(groups=24, per_group=20)
    with FakeWorkers(4, delay_ms=10) as fakes, live_router(fakes.urls) as router:
        results = asyncio.run(send_all(router.url, [b for _, b in items], concurrency=32))
        metrics = httpx.get(f"{router.url}/metrics").text
    assert all(status == 200 for status, _ in results)
    by_group: dict[int, Counter] = defaultdict(Counter)
    for (group, _), (_, answer) in zip(items, results):
        by_group[group][served_by(answer)] += 1
    on_main_worker = sum(c.most_common(1)[0][1] for c in by_group.values())
    assert on_main_worker / len(items) >= 0.99, by_group
    assert len({c.most_common(1)[0][0] for c in by_group.values()}) == 4, "the groups spread over every worker"
    assert metric(metrics, 'moeplex_router_decisions_total{reason="cache_hit"}') >= len(items) - 24 - 5
    assert metric(metrics, "moeplex_router_requests_total") == len(items)


@pytest.mark.parametrize("balanced", [True, False])
def test_a_hot_prefix_spreads_once_load_is_imbalanced(balanced):
    thresholds = dict(balance_abs_threshold=4, balance_rel_threshold=1.5) if balanced else dict(balance_abs_threshold=10**6)
    bodies = [{"prompt": "the one hot system prompt " * 8 + str(i), "max_tokens": 4} for i in range(96)]
    with FakeWorkers(4, delay_ms=40) as fakes, live_router(fakes.urls, **thresholds) as router:
        results = asyncio.run(send_all(router.url, bodies, concurrency=24))
        peaks = [httpx.get(f"{url}/fake/stats").json()["peak_in_flight"] for url in fakes.urls]
    assert all(status == 200 for status, _ in results)
    per_worker = Counter(served_by(answer) for _, answer in results)
    if balanced:
        # a hit goes to its worker only while max - min <= 4 or max <= 1.5 min, so with 24 in flight
        # over 4 workers no worker holds more than 11 requests
        assert max(peaks) <= 11, peaks
        assert len(per_worker) == 4 and max(per_worker.values()) < 0.6 * len(bodies), per_worker
    else:  # the control: without the thresholds, affinity alone sends everything to one worker
        assert max(peaks) == 24 and len(per_worker) == 1


def test_a_worker_killed_mid_load_costs_no_failed_request():
    with FakeWorkers(3, delay_ms=30) as fakes, FakeWorkers(1, delay_ms=30) as victim, \
            live_router(fakes.urls + victim.urls, max_retries=3, retry_backoff_ms=20) as router:
        items = grouped_bodies(groups=16, per_group=20)
        killed = threading.Event()

        def kill_at_a_third(answered: int) -> None:
            if answered >= len(items) // 3 and not killed.is_set():
                killed.set()
                victim.proc.kill()

        results = asyncio.run(send_all(router.url, [b for _, b in items], concurrency=16, on_answer=kill_at_a_third))
        metrics = httpx.get(f"{router.url}/metrics").text
        workers = httpx.get(f"{router.url}/list_workers").json()["workers"]
    assert killed.is_set()
    assert [status for status, _ in results] == [200] * len(items), "every request was answered"
    assert metric(metrics, "moeplex_router_retries_total") >= 1, "requests in flight on the killed worker were retried"
    assert metric(metrics, "moeplex_router_failed_requests_total") == 0
    assert {w["url"]: w["healthy"] for w in workers}[victim.urls[0]] is False, "the dead worker is out of routing"
    assert all(served_by(answer) != victim.urls[0] for _, answer in results[len(items) // 2:])


def test_a_workers_4xx_comes_back_as_it_is_and_streams_pass_through_chunk_by_chunk():
    with FakeWorkers(2, delay_ms=80) as fakes, live_router(fakes.urls) as router:
        direct = httpx.post(f"{fakes.urls[0]}/v1/completions", content=b'{"prompt":')
        routed = httpx.post(f"{router.url}/v1/completions", content=b'{"prompt":')
        assert routed.status_code == direct.status_code == 400 and routed.content == direct.content
        arrivals, events = [], []
        with httpx.stream("POST", f"{router.url}/v1/completions", json={"prompt": "hi", "stream": True}) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            for line in r.iter_lines():
                if line.startswith("data: "):
                    arrivals.append(time.monotonic())
                    events.append(line[6:])
        assert events[-1] == "[DONE]" and [json.loads(e)["index"] for e in events[:-1]] == [0, 1, 2, 3]
        # the fake worker spaces its 4 chunks 20 ms apart: a buffered answer would arrive all at once
        assert arrivals[-1] - arrivals[0] >= 0.04
        state = httpx.get(f"{router.url}/list_workers").json()["workers"]
    assert all(w["load"] == 0 for w in state), "a finished stream no longer counts as load"


def test_a_worker_dying_mid_stream_ends_the_stream_with_an_error_event():
    with FakeWorkers(1, delay_ms=400) as fake, live_router(fake.urls) as router:
        events = []
        with httpx.stream("POST", f"{router.url}/v1/completions", json={"prompt": "hi", "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    fake.proc.kill()
        assert len(events) == 3, events
        assert json.loads(events[0])["index"] == 0, "the chunk sent before the failure arrived"
        # as the workers' own streams end a failure (core/server/sse.py): an error event, then [DONE]
        assert "incomplete" in json.loads(events[1])["error"]["message"] and events[2] == "[DONE]"
        [worker] = httpx.get(f"{router.url}/list_workers").json()["workers"]
        metrics = httpx.get(f"{router.url}/metrics").text
    assert worker["load"] == 0 and worker["failures_in_a_row"] == 1
    assert metric(metrics, "moeplex_router_forward_failures_total") == 1


def test_workers_are_added_removed_and_listed_at_run_time():
    with FakeWorkers(2, delay_ms=5) as fakes, live_router(fakes.urls[:1], policy="round_robin") as router:
        first, second = fakes.urls
        added = httpx.post(f"{router.url}/add_worker", params={"url": second})
        assert added.status_code == 200 and added.json()["healthy"] is True
        assert httpx.get(f"{router.url}/list_workers").json()["urls"] == [first, second]
        bodies = [{"prompt": f"p{i}"} for i in range(8)]
        assert {served_by(a) for _, a in asyncio.run(send_all(router.url, bodies, 2))} == {first, second}
        assert httpx.post(f"{router.url}/add_worker", json={"url": second}).status_code == 400  # already there
        assert httpx.post(f"{router.url}/add_worker", params={"url": "ftp://x"}).status_code == 400
        assert httpx.post(f"{router.url}/remove_worker", json={"url": first}).status_code == 200
        assert httpx.get(f"{router.url}/list_workers").json()["urls"] == [second]
        assert {served_by(a) for _, a in asyncio.run(send_all(router.url, bodies, 2))} == {second}
        assert httpx.post(f"{router.url}/remove_worker", params={"url": first}).status_code == 404


def test_health_checks_take_a_failing_worker_out_and_put_it_back():
    fast = dict(health_check_interval_secs=0.1, health_failure_threshold=2, health_success_threshold=2,
                policy="round_robin")
    with FakeWorkers(2, delay_ms=5) as fakes, live_router(fakes.urls, **fast) as router:
        sick, well = fakes.urls

        def healthy() -> dict:
            return {w["url"]: w["healthy"] for w in httpx.get(f"{router.url}/list_workers").json()["workers"]}

        httpx.post(f"{sick}/fake/sick", params={"on": "1"})
        wait_for(lambda: healthy() == {sick: False, well: True}, what="the sick worker to be taken out")
        bodies = [{"prompt": f"p{i}"} for i in range(6)]
        assert {served_by(a) for _, a in asyncio.run(send_all(router.url, bodies, 2))} == {well}
        assert httpx.get(f"{router.url}/health").status_code == 200
        httpx.post(f"{well}/fake/sick", params={"on": "1"})
        wait_for(lambda: healthy() == {sick: False, well: False}, what="both workers to be out")
        assert httpx.get(f"{router.url}/health").status_code == 503
        refused = httpx.post(f"{router.url}/v1/completions", json={"prompt": "x"})
        assert refused.status_code == 503 and "no healthy worker" in refused.json()["error"]["message"]
        for url in fakes.urls:
            httpx.post(f"{url}/fake/sick", params={"on": "0"})
        wait_for(lambda: healthy() == {sick: True, well: True}, what="both workers to be put back")
        assert {served_by(a) for _, a in asyncio.run(send_all(router.url, bodies, 2))} == {sick, well}
        metrics = httpx.get(f"{router.url}/metrics").text
    assert metric(metrics, "moeplex_router_workers_taken_out_total") == 2
    assert metric(metrics, 'moeplex_router_worker_healthy{worker="' + sick + '"}') == 1


def test_moeplex_router_refuses_a_bad_flag_in_one_sentence(capsys):
    assert cli_main(["router", "--worker-urls", "ftp://127.0.0.1:1"]) == 2
    assert "http://" in capsys.readouterr().err


# --- real `moeplex serve` workers ----------------------------------------------------------------


@pytest.fixture(scope="module")
def real_workers(tiny_model_dir):
    folder = tiny_model_dir("qwen3_moe")
    apps = [build_app(Engine(EngineConfig(model=folder, **ENGINE)), ServerSettings(served_model_name="tiny"))
            for _ in range(2)]
    with LiveServer(apps[0]) as a, LiveServer(apps[1]) as b:
        yield [a.url, b.url]


def completions_served(url: str) -> float:
    return metric(httpx.get(f"{url}/metrics").text, 'moeplex_http_requests_total{endpoint="/v1/completions",status="200"}')


def test_real_workers_answer_through_the_router_as_they_do_directly(real_workers):
    with live_router(real_workers) as router:
        body = {"prompt": "Hello there", "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        direct = httpx.post(f"{real_workers[0]}/v1/completions", json=body, timeout=60).json()
        routed = httpx.post(f"{router.url}/v1/completions", json=body, timeout=60).json()
        assert routed["choices"][0]["token_ids"] == direct["choices"][0]["token_ids"]
        with httpx.stream("POST", f"{router.url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert [t for e in events[:-1] for t in json.loads(e)["choices"][0]["token_ids"]] == direct["choices"][0]["token_ids"]
        bad = {"prompt": "x", "max_tokens": 0}
        answers = [httpx.post(f"{url}/v1/completions", json=bad) for url in (real_workers[0], router.url)]
        assert answers[0].status_code == answers[1].status_code == 400 and answers[0].content == answers[1].content
        assert answers[1].json()["error"]["param"] == "max_tokens"
        assert httpx.get(f"{router.url}/v1/models").json()["data"][0]["id"] == "tiny"


def test_real_workers_keep_each_prefix_on_one_worker(real_workers):
    with live_router(real_workers) as router:
        for group in range(4):
            before = [completions_served(url) for url in real_workers]
            prefix = f"conversation {group}: " + "the same long system prompt, " * 6
            bodies = [{"prompt": prefix + f"turn {i}", "max_tokens": 2} for i in range(8)]
            assert all(status == 200 for status, _ in asyncio.run(send_all(router.url, bodies, concurrency=4)))
            gained = sorted(completions_served(url) - b for url, b in zip(real_workers, before))
            assert gained == [0, 8], f"group {group} was split over the workers: {gained}"


def test_the_tree_keeps_no_text_of_a_request_a_worker_refused():
    worker, server = fake_worker()
    with server, live_router([server.url]) as router:
        refused = httpx.post(f"{router.url}/v1/completions", json={"prompt": "r" * 100, "fake_status": 400})
        failed = httpx.post(f"{router.url}/v1/completions", json={"prompt": "f" * 100, "fake_status": 500})
        assert (refused.status_code, failed.status_code) == (400, 500)
        assert metric(httpx.get(f"{router.url}/metrics").text, "moeplex_router_tree_size_chars") == 0
        assert httpx.post(f"{router.url}/v1/completions", json={"prompt": "a" * 100}).status_code == 200
        assert metric(httpx.get(f"{router.url}/metrics").text, "moeplex_router_tree_size_chars") == 100


def test_a_worker_going_silent_mid_stream_ends_the_stream_with_an_error_event():
    worker, server = fake_worker(delay=0.4)  # chunks 100 ms apart
    with server, live_router([server.url], request_timeout_secs=0.5) as router:
        events = []
        try:
            with httpx.stream("POST", f"{router.url}/v1/completions", json={"prompt": "hi", "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        worker.hung = True  # a stopped process: the connection stays open, nothing more comes
        finally:
            worker.hung = False
    assert json.loads(events[0])["index"] == 0 and len(events) == 3, events
    assert "incomplete" in json.loads(events[1])["error"]["message"] and events[2] == "[DONE]"
