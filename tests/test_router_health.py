"""Which workers `moeplex router` routes to: its own health checks decide, clients' /health reads them."""

from __future__ import annotations

import time

import httpx

from router_helpers import fake_worker, live_router, wait_for


def states(router) -> dict[str, str]:
    return {w["url"]: w["state"] for w in httpx.get(f"{router.url}/list_workers").json()["workers"]}


def in_routing(router) -> dict[str, bool]:
    return {w["url"]: w["healthy"] for w in httpx.get(f"{router.url}/list_workers").json()["workers"]}


def test_a_clients_health_request_probes_nothing_and_takes_no_worker_out():
    worker, server = fake_worker()
    # one failure would take the worker out, and the router's own next check is far away
    with server, live_router([server.url], health_failure_threshold=1, health_check_interval_secs=60) as router:
        assert in_routing(router) == {server.url: True}
        worker.sick = True
        for _ in range(5):
            assert httpx.get(f"{router.url}/health").status_code == 200
        assert in_routing(router) == {server.url: True}
        assert httpx.post(f"{router.url}/v1/completions", json={"prompt": "x"}).status_code == 200


def test_a_loading_worker_is_starting_until_it_answers_then_serves_at_once():
    worker, server = fake_worker()  # bound, not listening: connections are refused as while a model loads
    fast = dict(health_check_interval_secs=0.2, health_failure_threshold=2, health_success_threshold=3)
    with live_router([server.url], **fast) as router:
        time.sleep(1.0)  # past the failure threshold several times over
        assert httpx.get(f"{router.url}/health").status_code == 503
        refused = httpx.post(f"{router.url}/v1/completions", json={"prompt": "x"})
        assert refused.status_code == 503 and "no healthy worker" in refused.json()["error"]["message"]
        with server:
            wait_for(lambda: httpx.get(f"{router.url}/health").status_code == 200, what="the router's /health to say 200")
            # in routing from the first passed check: no second check, no window of 503s
            assert httpx.post(f"{router.url}/v1/completions", json={"prompt": "x"}).status_code == 200
        assert states(router) == {server.url: "healthy"}


def test_a_worker_that_never_comes_up_is_out_after_the_grace_period():
    worker, server = fake_worker()
    with live_router([server.url], health_check_interval_secs=0.1, worker_startup_timeout_secs=0.5) as router:
        assert states(router) == {server.url: "starting"}
        refused = httpx.post(f"{router.url}/v1/completions", json={"prompt": "x"})
        assert refused.status_code == 503 and "1 starting" in refused.json()["error"]["message"]
        wait_for(lambda: states(router) == {server.url: "out"}, timeout=5, what="the grace period to end")


def test_a_hung_worker_is_taken_out_without_delaying_anyone_elses_checks():
    hung, hung_server = fake_worker()
    late, late_server = fake_worker()
    checks = dict(health_check_interval_secs=0.1, health_check_timeout_secs=0.5, health_failure_threshold=2)
    with hung_server, live_router([hung_server.url, late_server.url], **checks) as router:
        wait_for(lambda: in_routing(router) == {hung_server.url: True, late_server.url: False}, what="the first checks")
        hung.hung = True  # accepts connections, answers nothing (a stopped process)
        try:
            with late_server:
                up = time.monotonic()
                wait_for(lambda: in_routing(router)[late_server.url], what="the late worker to be in")
                assert time.monotonic() - up < 0.9, "a hung probe held up another worker's check"
                wait_for(lambda: not in_routing(router)[hung_server.url], what="the hung worker to be out")
                answers = [httpx.post(f"{router.url}/v1/completions", json={"prompt": f"p{i}"}) for i in range(4)]
                assert {a.json()["worker"] for a in answers} == {late.name}
        finally:
            hung.hung = False


def test_a_worker_whose_health_says_503_is_taken_out():
    sick, sick_server = fake_worker()
    with sick_server, live_router([sick_server.url], health_check_interval_secs=0.1, health_failure_threshold=2) as router:
        sick.sick = True
        wait_for(lambda: states(router) == {sick_server.url: "out"}, what="the sick worker to be out")
        assert httpx.get(f"{router.url}/health").status_code == 503


def test_the_open_health_endpoint_counts_workers_and_names_none():
    worker, server = fake_worker()
    late, late_server = fake_worker()
    with server, live_router([server.url, late_server.url]) as router:
        answer = httpx.get(f"{router.url}/health")
    assert answer.status_code == 200
    assert answer.json()["workers"] == {"healthy": 1, "starting": 1, "out": 0} and "127.0.0.1" not in answer.text
