"""`moeplex router` as a public front door: client and admin keys, the worker URL allow-list, body limits."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from moeplex.cli import main as cli_main
from moeplex.router import RouterSettings

from router_helpers import fake_worker, live_router

CLIENT, ADMIN = {"Authorization": "Bearer client-key"}, {"Authorization": "Bearer admin-key"}
KEYS = dict(api_key="client-key", admin_api_key="admin-key")


def test_clients_need_the_api_key_and_probes_do_not():
    worker, server = fake_worker()
    with server, live_router([server.url], **KEYS) as router:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "client-key"}, ADMIN):
            refused = httpx.post(f"{router.url}/v1/completions", json={"prompt": "x"}, headers=headers)
            assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
            assert httpx.get(f"{router.url}/v1/models", headers=headers).status_code == 401
        assert httpx.post(f"{router.url}/v1/completions", json={"prompt": "x"}, headers=CLIENT).status_code == 200
        assert httpx.get(f"{router.url}/health").status_code == 200
        assert httpx.get(f"{router.url}/metrics").status_code == 200


@pytest.mark.parametrize("worker_api_key", [None, "worker-key"])
def test_a_clients_key_never_reaches_a_worker_and_the_worker_key_does(worker_api_key):
    worker, server = fake_worker()
    with server, live_router([server.url], worker_api_key=worker_api_key, **KEYS) as router:
        answer = httpx.post(f"{router.url}/v1/completions", json={"prompt": "x"}, headers=CLIENT).json()
    assert answer["authorization"] == (f"Bearer {worker_api_key}" if worker_api_key else None)


def test_credentials_of_every_spelling_stay_with_the_router():
    worker, server = fake_worker()
    sent = {**CLIENT, "X-Api-Key": "client-key", "Cookie": "session=secret", "Proxy-Authorization": "Basic x",
            "X-Request-Id": "r-1", "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    with server, live_router([server.url], worker_api_key="worker-key", **KEYS) as router:
        answer = httpx.post(f"{router.url}/v1/completions", json={"prompt": "x"}, headers=sent).json()
    names = set(answer["header_names"])
    assert not names & {"x-api-key", "cookie", "proxy-authorization"}, names
    assert {"x-request-id", "traceparent", "content-type"} <= names and answer["authorization"] == "Bearer worker-key"


@pytest.mark.parametrize("keys", [KEYS, dict(api_key="client-key")], ids=["admin-key", "client-key-only"])
def test_management_needs_a_key_whenever_one_is_set(keys):
    """With only --api-key (on loopback), management needs the client key: no local process can add a worker that
    would receive every client's prompts without the credentials inference needs."""
    key = {"Authorization": f"Bearer {keys.get('admin_api_key', keys['api_key'])}"}
    worker, server = fake_worker()
    with server, live_router([], host="127.0.0.1", **keys) as router:
        for headers in [{}, {"Authorization": "Bearer wrong"}] + ([CLIENT] if "admin_api_key" in keys else []):
            for path in ("/add_worker", "/remove_worker"):
                refused = httpx.post(f"{router.url}{path}", params={"url": server.url}, headers=headers)
                assert refused.status_code == 401, (path, headers)
            assert httpx.get(f"{router.url}/list_workers", headers=headers).status_code == 401
        assert httpx.get(f"{router.url}/list_workers", headers=key).json()["urls"] == []
        assert httpx.post(f"{router.url}/add_worker", params={"url": server.url}, headers=key).status_code == 200
        assert httpx.post(f"{router.url}/remove_worker", params={"url": server.url}, headers=key).status_code == 200


def test_the_start_up_says_what_management_needs():
    from moeplex.router.access import management_access

    assert "admin key" in management_access("c", "a", "127.0.0.1")
    assert "client key (--api-key)" in management_access("c", None, "127.0.0.1")
    assert "open to every process of this machine" in management_access(None, None, "127.0.0.1")
    assert "are off" in management_access(None, None, "0.0.0.0")


def test_management_needs_the_admin_key():
    worker, server = fake_worker()
    with server, live_router([], **KEYS) as router:
        for headers in ({}, CLIENT):
            for path in ("/add_worker", "/remove_worker"):
                refused = httpx.post(f"{router.url}{path}", params={"url": server.url}, headers=headers)
                assert refused.status_code == 401, (path, headers)
            assert httpx.get(f"{router.url}/list_workers", headers=headers).status_code == 401
        assert httpx.get(f"{router.url}/list_workers", headers=ADMIN).json()["urls"] == []
        assert httpx.post(f"{router.url}/add_worker", params={"url": server.url}, headers=ADMIN).status_code == 200
        assert httpx.post(f"{router.url}/remove_worker", params={"url": server.url}, headers=ADMIN).status_code == 200


def test_without_an_admin_key_management_answers_only_on_a_loopback_binding():
    worker, server = fake_worker()
    # the router runs on loopback here; the check reads the address it was told to bind
    with server, live_router([server.url], host="0.0.0.0") as router:
        for method, path in (("POST", "/add_worker"), ("POST", "/remove_worker"), ("GET", "/list_workers")):
            refused = httpx.request(method, f"{router.url}{path}", params={"url": server.url})
            assert refused.status_code == 403 and "--admin-api-key" in refused.json()["error"]["message"]
        assert httpx.post(f"{router.url}/v1/completions", json={"prompt": "x"}).status_code == 200
    with live_router([], host="127.0.0.1") as router:
        assert httpx.get(f"{router.url}/list_workers").status_code == 200


def test_worker_urls_outside_the_allow_list_are_refused():
    allow = ("http://127.0.0.1:*",)
    with live_router([], worker_url_allow=allow) as router:
        refused = httpx.post(f"{router.url}/add_worker", params={"url": "http://203.0.113.9:8000"})
        assert refused.status_code == 400 and "--worker-url-allow http://127.0.0.1:*" in refused.json()["error"]["message"]
        assert httpx.get(f"{router.url}/list_workers").json()["urls"] == []
    with pytest.raises(ValueError, match="worker-url-allow"):
        RouterSettings(worker_urls=["http://203.0.113.9:8000"], worker_url_allow=allow)


def raw_post(url: str, path: str, headers: str, first_bytes: bytes) -> tuple[bytes, float]:
    """Send headers and the body's first bytes only; the router's answer and how long it took."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        start = time.monotonic()
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\n{headers}\r\n".encode() + first_bytes)
        answer = sock.recv(4096)
        return answer, time.monotonic() - start


@pytest.mark.parametrize("path", ["/add_worker", "/remove_worker", "/v1/completions"])
def test_a_huge_body_is_refused_by_its_length_before_it_is_read(path):
    with live_router([], max_request_bytes=1 << 20) as router:
        # 200 MB declared, 1 KB sent: a router that reads bodies whole waits for the rest and answers nothing
        answer, took = raw_post(router.url, path, f"Content-Length: {200 << 20}\r\nContent-Type: application/json\r\n",
                                b"{" + b" " * 1023)
    assert answer.startswith(b"HTTP/1.1 413") and took < 2, answer[:200]


def test_a_management_body_without_a_length_is_cut_off_at_its_cap():
    with live_router([]) as router:
        chunk = b" " * 8192
        body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(10))  # 80 KiB, over the 64 KiB cap
        answer, _ = raw_post(router.url, "/add_worker", "Transfer-Encoding: chunked\r\n", body)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]


def test_every_new_flag_has_help_text(capsys):
    with pytest.raises(SystemExit):
        cli_main(["router", "--help"])
    text = capsys.readouterr().out
    for flag in ("--api-key", "--admin-api-key", "--worker-api-key", "--worker-url-allow", "--worker-startup-timeout-secs",
                 "--body-timeout-secs"):
        assert flag in text


BAD_PORTS = ["http://127.0.0.1:31001.evil.example", "http://127.0.0.1:31000031090", "http://127.0.0.1:31001x",
             "http://127.0.0.1:3100-31090", "http://127.0.0.1:0", "http://127.0.0.1:65536", "http://127.0.0.1:",
             "http://127.0.0.1:+3100", "http://127.0.0.1:031001"]
BAD_HOSTS = ["http://999.1.1.1:31001", "http://a_b:31001", "http://-a.example:31001", "http://[zz::1]:31001",
             "http://user@127.0.0.1:31001", "http://:31001"]


@pytest.mark.parametrize("url", BAD_PORTS + BAD_HOSTS)
def test_a_url_must_have_a_numeric_port_and_a_real_host_before_any_pattern(url):
    from moeplex.router.access import WorkerUrlRule

    for rule in (WorkerUrlRule(("http://127.0.0.1:3100*", "http://*:*")), WorkerUrlRule(())):
        assert rule.refusal(url), (url, rule.patterns)
    assert WorkerUrlRule(("http://127.0.0.1:3100*",)).refusal("http://127.0.0.1:31001") is None


def test_add_worker_refuses_a_port_that_only_starts_like_an_allowed_one():
    with live_router([], worker_url_allow=("http://127.0.0.1:3100*",)) as router:
        for url in BAD_PORTS[:4]:
            refused = httpx.post(f"{router.url}/add_worker", params={"url": url})
            assert refused.status_code == 400 and "port must be a number" in refused.json()["error"]["message"], url
        assert httpx.get(f"{router.url}/list_workers").json()["urls"] == []


def test_an_allow_list_pattern_matches_part_by_part():
    from moeplex.router.access import WorkerUrlRule

    rule = WorkerUrlRule(("http://10.0.0.*:*", "https://*.internal.example:300?"))
    allowed = ["http://10.0.0.7:30001", "http://10.0.0.7", "https://w1.internal.example:3001"]
    refused = ["http://10.0.0.evil.example:80", "http://10.0.0.com:80", "https://w1.internal.example.evil.com:3001",
               "https://a.b.internal.example:3001", "http://10.0.0.7:30001/x", "https://w1.internal.example:4001",
               "http://w1.internal.example:3001"]
    assert [u for u in allowed if rule.refusal(u)] == [] and [u for u in refused if not rule.refusal(u)] == []


@pytest.mark.parametrize("path", ["/add_worker", "/v1/completions"])
def test_a_body_that_stops_arriving_is_refused_after_the_body_timeout(path):
    with live_router([], body_timeout_secs=0.3) as router:
        answer, took = raw_post(router.url, path, "Content-Length: 100\r\n", b'{"url": ')  # and then nothing
    assert answer.startswith(b"HTTP/1.1 408") and took < 2, answer[:200]
