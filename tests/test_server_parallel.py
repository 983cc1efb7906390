"""`moeplex serve` over several gloo ranks: the tokens of one process, DP groups, aborts, shutdown, a dead rank."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from moeplex.config import EngineConfig
from moeplex.engine import Engine
from moeplex.sampling import SamplingParams

from test_server import PROMPT, metric, sse, wait_until_idle
from ports import free_port

TP2 = ("--tp-size", "2", "--ep-size", "2", "--dispatcher", "naive", "--balancer", "eplb")
DP2 = TP2 + ("--dp-size", "2", "--enable-dp-attention", "--dist-timeout", "6")
STALL_S = 4
PROMPTS = [[256, 1, 2, 3, 4], [256, 9, 8, 7], [256, 40, 41, 42], [256, 100, 7, 3]]


class RankedServer:
    """`moeplex serve` in a subprocess (which starts its ranks), on loopback ports."""

    def __init__(self, folder: str, *flags: str):
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.command = [
            sys.executable, "-c", "import sys; from moeplex.cli import main; sys.exit(main())", "serve", "--model", folder,
            "--port", str(port), "--dist-init-addr", f"127.0.0.1:{free_port()}", "--max-total-tokens", "4096",
            "--shutdown-timeout", "10", "--log-level", "warning", *flags,
        ]

    def __enter__(self):
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(self.command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, text=True)
        deadline = time.monotonic() + 90
        while not _answers(f"{self.url}/health"):
            assert self.proc.poll() is None, self.proc.stderr.read()
            assert time.monotonic() < deadline, "moeplex serve did not come up"
            time.sleep(0.2)
        self.client = httpx.Client(base_url=self.url, timeout=60)
        self.rank_pids = [r["pid"] for r in self.info()["parallel"]["ranks"]]
        return self

    def __exit__(self, *exc):
        self.client.close()
        for pid in [self.proc.pid, *self.rank_pids]:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(10)

    def info(self) -> dict:
        return self.client.get("/get_server_info").json()

    def groups(self) -> list[dict]:
        return self.info()["parallel"]["dp_groups"]


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:  # a process that exited but was not reaped yet is a zombie: "Z"
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_for(condition, what: str, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, what
        time.sleep(0.05)
    return value


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir("deepseek_v3")


@pytest.fixture(scope="module")
def reference(folder):
    return Engine(EngineConfig(model=folder, show_progress=False, max_total_tokens=4096))


def greedy_ids(engine: Engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    return [r.output_ids for r in engine.generate(prompts, params)]


@pytest.fixture(scope="module")
def tp2(folder):
    with RankedServer(folder, *TP2, "--stall-timeout", str(STALL_S)) as server:
        yield server


@pytest.fixture(scope="module")
def dp2(folder):
    with RankedServer(folder, *DP2) as server:
        yield server


# --- tensor + expert parallel, one DP group -----------------------------------------------------------


def test_tp2_ep2_answers_with_the_tokens_of_one_process(tp2, reference):
    [expected] = greedy_ids(reference, [reference.encode(PROMPT)], 12)
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    assert tp2.client.post("/v1/completions", json=body).json()["choices"][0]["token_ids"] == expected
    with tp2.client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        events = sse(r)
    assert events[-1] == "[DONE]" and [t for e in events[:-1] for t in e["choices"][0]["token_ids"]] == expected
    sampling = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    batch = tp2.client.post("/generate", json={"input_ids": PROMPTS, "sampling_params": sampling}).json()
    assert [b["output_ids"] for b in batch] == greedy_ids(reference, PROMPTS, 8)
    streamed = {"input_ids": PROMPTS[0], "sampling_params": sampling, "stream": True}
    with tp2.client.stream("POST", "/generate", json=streamed) as r:
        assert sse(r)[-2]["output_ids"] == greedy_ids(reference, PROMPTS[:1], 8)[0]
    layout = tp2.info()["parallel"]
    assert [r["rank"] for r in layout["ranks"]] == [0, 1] and layout["dp_groups"][0]["ranks"] == [0, 1]
    assert all(r["experts_mib"] > 0 and r["kv_cache_tokens"] == 4096 for r in layout["ranks"])


def test_tp2_degenerate_sampling_values_neither_fail_the_batch_nor_stop_the_server(tp2, reference):
    """Values valid in float64 that underflow float32 (1/1e-40 = inf, top_p 1e-50 = 0) once failed every
    request of the batch and, across ranks, stopped the server: now they sample the most likely token."""
    for tiny in ({"temperature": 1e-40}, {"temperature": 5e-324}, {"top_p": 1e-50}):
        sampling = {"max_new_tokens": 6, "ignore_eos": True, **tiny}
        batch = tp2.client.post("/generate", json={"input_ids": PROMPTS, "sampling_params": sampling})
        assert batch.status_code == 200, batch.text
        assert [b["output_ids"] for b in batch.json()] == greedy_ids(reference, PROMPTS, 6)
    assert tp2.client.get("/health").status_code == 200


def test_tp2_expert_load_calls_run_on_every_rank(tp2, reference):
    """Recording, dumping and rebalancing are collectives: they work only if every rank runs them in step."""
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    assert tp2.client.post("/start_expert_distribution_record").status_code == 200
    before = tp2.client.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]
    assert tp2.client.post("/stop_expert_distribution_record").status_code == 200
    dump = tp2.client.post("/dump_expert_distribution_record").json()
    reference.start_recording()
    greedy_ids(reference, [reference.encode(PROMPT)], 6)
    assert dump["logical_count"] == reference.dump_recording()["logical_count"]  # both ranks' counts, summed
    reference.stop_recording()
    rebalanced = tp2.client.post("/rebalance_experts")
    assert rebalanced.status_code == 200, rebalanced.text
    assert tp2.client.post("/v1/completions", json=body).json()["choices"][0]["token_ids"] == before


def aborted(server: RankedServer) -> float:
    return metric(server.client.get("/metrics").text, 'moeplex_requests_finished_total{reason="abort"}')


def test_tp2_client_leaving_mid_stream_frees_the_kv_cache(tp2):
    before = aborted(tp2)
    body = {"prompt": PROMPT, "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=tp2.url, timeout=30) as own, own.stream("POST", "/v1/completions", json=body) as r:
        assert sum(1 for _, line in zip(range(6), r.iter_lines()) if line.startswith("data: ")) == 3
    wait_until_idle(tp2.client)
    assert aborted(tp2) == before + 1


def test_a_stopped_rank_turns_health_503_and_fails_the_requests_in_flight_naming_it(tp2):
    wait_until_idle(tp2.client)
    body = {"prompt": PROMPT, "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=tp2.url, timeout=30) as own, own.stream("POST", "/v1/completions", json=body) as r:
        stream = _events(r)
        next(stream)
        os.kill(tp2.rank_pids[1], signal.SIGSTOP)
        try:
            stopped = time.monotonic()
            health = wait_for(lambda: (h := tp2.client.get("/health")).status_code == 503 and h, "/health stayed 200")
            noticed = time.monotonic() - stopped
            latency = time.monotonic()
            refused = tp2.client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
            latency = time.monotonic() - latency
            rest = list(stream)
        finally:
            os.kill(tp2.rank_pids[1], signal.SIGCONT)
    print(f"stall noticed after {noticed:.1f} s (--stall-timeout {STALL_S}); a request meanwhile answered in {latency:.2f} s")
    assert STALL_S <= noticed < STALL_S + 10
    assert "rank 1 stopped answering" in health.json()["error"]["message"]
    assert refused.status_code == 503 and "rank 1 stopped answering" in refused.json()["error"]["message"]
    error = json.loads(rest[-2][len("data: "):])["error"]
    assert rest[-1] == "data: [DONE]" and "rank 1 stopped answering" in error["message"]
    wait_for(lambda: tp2.client.get("/health").status_code == 200, "/health did not recover after SIGCONT")
    assert tp2.client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200
    wait_until_idle(tp2.client)


def test_sigterm_drains_the_stream_in_flight_and_stops_every_rank(tp2):
    body = {"prompt": PROMPT, "max_tokens": 40, "ignore_eos": True, "stream": True, "return_token_ids": True}
    with httpx.Client(base_url=tp2.url, timeout=30) as own, own.stream("POST", "/v1/completions", json=body) as r:
        stream = _events(r)
        events = [next(stream)]
        tp2.proc.send_signal(signal.SIGTERM)
        events += list(stream)
    assert events[-1] == "data: [DONE]"
    assert sum(len(json.loads(e[6:])["choices"][0]["token_ids"]) for e in events[:-1]) == 40
    assert tp2.proc.wait(timeout=30) == 0, tp2.proc.stderr.read()
    assert not any(_running(pid) for pid in tp2.rank_pids)


# --- DP attention: two groups, each scheduling its own requests ---------------------------------------


def test_dp2_spreads_concurrent_requests_over_both_groups_with_the_tokens_of_one_process(dp2, reference):
    sampling = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    before = [g["requests_admitted"] for g in dp2.groups()]

    async def one(http: httpx.AsyncClient, prompt: list[int]) -> list[int]:
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        return (await http.post("/v1/completions", json=body)).json()["choices"][0]["token_ids"]

    async def concurrently() -> list:
        async with httpx.AsyncClient(base_url=dp2.url, timeout=60) as http:
            batch = http.post("/generate", json={"input_ids": PROMPTS, "sampling_params": sampling})
            return await asyncio.gather(batch, *(one(http, p) for p in PROMPTS))

    batch, *singles = asyncio.run(concurrently())
    expected = greedy_ids(reference, PROMPTS, 8)
    assert [b["output_ids"] for b in batch.json()] == expected and singles == expected
    admitted = [g["requests_admitted"] - b for g, b in zip(dp2.groups(), before)]
    assert sum(admitted) == 8 and min(admitted) >= 2, admitted
    assert [g["ranks"] for g in dp2.groups()] == [[0], [1]]


def test_dp2_abort_frees_the_pages_of_the_group_that_held_the_request(dp2):
    wait_until_idle(dp2.client)
    before = aborted(dp2)
    body = {"prompt": PROMPT, "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=dp2.url, timeout=30) as http, http.stream("POST", "/v1/completions", json=body) as kept:
        kept_events = _events(kept)
        next(kept_events)  # both groups were idle: the tie goes to group 0
        admitted = dp2.groups()[1]["requests_admitted"]
        other_body = {**body, "prompt": "A different prompt, so that no cached prefix draws it to group 0."}
        with httpx.Client(base_url=dp2.url, timeout=30) as other, other.stream("POST", "/v1/completions", json=other_body) as left:
            next(_events(left))
            busy = dp2.groups()[1]
            assert busy["requests_admitted"] == admitted + 1 and busy["kv_pages_free"] < busy["kv_pages_total"]
        groups = wait_for(lambda: _pages_freed(dp2.groups(), 1), "group 1 kept the pages of the request that left")
        assert groups[1]["num_running"] == 0 and aborted(dp2) == before + 1
        assert groups[0]["num_running"] == 1 and groups[0]["kv_pages_free"] < groups[0]["kv_pages_total"]
        next(kept_events)  # group 0 carries on
    wait_until_idle(dp2.client)


def _events(response: httpx.Response):
    return (line for line in response.iter_lines() if line.startswith("data: "))


def _pages_freed(groups: list[dict], dp_rank: int) -> list[dict] | None:
    group = groups[dp_rank]
    # the request's own pages freed; what it computed may stay in the prefix cache, no longer read by anyone
    return groups if group["kv_pages_free"] + group["kv_pages_cached"] == group["kv_pages_total"] else None


def test_dp2_idle_ranks_outlive_the_collective_timeout_without_spinning(dp2):
    wait_until_idle(dp2.client)
    steps = dp2.info()["steps"]
    time.sleep(8)  # longer than --dist-timeout 6: rank 0 keeps the followers' wait alive with empty rounds
    idle_rounds = dp2.info()["steps"] - steps
    assert 2 <= idle_rounds <= 10, idle_rounds
    body = {"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True}
    assert dp2.client.post("/v1/completions", json=body).status_code == 200


def test_dp2_a_request_sharing_a_long_prefix_follows_the_first_to_its_group(dp2, reference):
    """Group 0 is busy when the first request comes, so it goes to group 1; once both are idle, least-loaded
    alone would send the second to group 0, but it shares 64 tokens with the first: it goes to group 1 and hits."""
    wait_until_idle(dp2.client)
    prefix = [256] + [(37 * i + 11) % 256 for i in range(63)]
    first, second = prefix + [1, 2, 3, 4], prefix + [9, 8, 7]
    body = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    busy = {"prompt": "Keep group 0 busy.", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    outputs = []
    with httpx.Client(base_url=dp2.url, timeout=30) as http, http.stream("POST", "/v1/completions", json=busy) as kept:
        kept_events = _events(kept)  # held: a generator dropped here would close the stream
        next(kept_events)
        before = dp2.groups()
        outputs.append(http.post("/v1/completions", json={**body, "prompt": first}).json()["choices"][0]["token_ids"])
        assert [g["requests_admitted"] - b["requests_admitted"] for g, b in zip(dp2.groups(), before)] == [0, 1]
    wait_until_idle(dp2.client)
    outputs.append(dp2.client.post("/v1/completions", json={**body, "prompt": second}).json()["choices"][0]["token_ids"])
    after = dp2.groups()
    assert [g["requests_admitted"] - b["requests_admitted"] for g, b in zip(after, before)] == [0, 2]
    assert after[1]["cache_hit_tokens"] - before[1]["cache_hit_tokens"] == 64
    assert after[0]["cache_hit_tokens"] == before[0]["cache_hit_tokens"]
    assert outputs == greedy_ids(reference, [first, second], 6)


def test_a_dead_rank_stops_the_server_with_an_error_naming_it(dp2):
    """The client in flight is told which rank died, as the log is, never gloo's internal error text."""
    body = {"prompt": PROMPT, "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=dp2.url, timeout=60) as own, own.stream("POST", "/v1/completions", json=body) as r:
        stream = _events(r)
        next(stream)
        os.kill(dp2.rank_pids[1], signal.SIGKILL)
        rest = list(stream)
    error = json.loads(rest[-2][len("data: "):])["error"]["message"]
    assert rest[-1] == "data: [DONE]" and "rank 1 died (exit code -9)" in error, error
    assert ".cc:" not in error and "gloo" not in error.lower(), error
    assert dp2.proc.wait(timeout=45) == 2
    assert "rank 1 died" in dp2.proc.stderr.read()


# --- one rank: the engine in a process of its own -------------------------------------------------------


def test_one_rank_runs_apart_from_the_http_process_and_its_death_stops_the_server(folder, reference):
    with RankedServer(folder) as one:
        assert len(one.rank_pids) == 1 and one.rank_pids[0] != one.proc.pid
        [expected] = greedy_ids(reference, [reference.encode(PROMPT)], 6)
        body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        assert one.client.post("/v1/completions", json=body).json()["choices"][0]["token_ids"] == expected
        os.kill(one.rank_pids[0], signal.SIGKILL)
        assert one.proc.wait(timeout=30) == 2
        assert "rank 0 died" in one.proc.stderr.read()
