"""A prefill server, a decode server and `moeplex router --pd`, each its own process on loopback ports (zmq)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import httpx

from test_server_parallel import RankedServer, _answers, _running, free_port

MAIN = ("-c", "import sys; from moeplex.cli import main; sys.exit(main())")


class RoleServer(RankedServer):
    """`moeplex serve` in one role (prefill, decode or none), with its own plugin and parallel flags."""

    def __init__(self, folder: str, mode: str, *flags: str):
        self.bootstrap_port = free_port()
        pd = ("--disaggregation-mode", mode, "--disaggregation-bootstrap-port", str(self.bootstrap_port)) if mode != "none" else ()
        super().__init__(folder, *pd, *flags)
        self.mode = mode

    def start(self) -> "RoleServer":
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(self.command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, text=True)
        return self

    def wait(self) -> "RoleServer":
        deadline = time.monotonic() + 300  # a loaded CI machine (start-ups overlap)
        while not _answers(f"{self.url}/health"):
            assert self.proc.poll() is None, self.proc.stderr.read()
            assert time.monotonic() < deadline, "moeplex serve did not come up"
            time.sleep(0.2)
        self.client = httpx.Client(base_url=self.url, timeout=60)
        self.rank_pids = [r["pid"] for r in self.info()["parallel"]["ranks"]]
        return self

    def __enter__(self):
        if not hasattr(self, "proc"):
            self.start()
        return self.wait()

    def kv(self) -> dict:
        return self.info()["kv_cache"]

    def idle(self) -> bool:
        """No request running, queued or moving KV, and every page free or in the prefix cache."""
        info = self.info()
        kv, moving = info["kv_cache"], info["disaggregation"].get("states", {})
        return (info["num_running_requests"] == info["num_queued_requests"] == 0 and not any(moving.values())
                and kv["free_pages"] + kv["cached_pages"] == kv["num_pages"])

    def flush(self) -> None:
        self.client.post("/flush_cache")

    def stop(self) -> None:
        if not hasattr(self, "rank_pids") and self.proc.poll() is None:  # its ranks unknown: let it halt them
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                pass
        for pid in [*getattr(self, "rank_pids", []), self.proc.pid]:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(10)
        if hasattr(self, "client"):
            self.client.close()

    def kill(self) -> None:
        for pid in [*self.rank_pids, self.proc.pid]:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(10)

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            super().__exit__(*exc)
        else:
            self.client.close()


class PDRouter:
    def __init__(self, prefill: list[RoleServer], decode: list[RoleServer], *flags: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [
            sys.executable, *MAIN, "router", "--pd", "--port", str(self.port), "--log-level", "warning",
            "--prefill", *[f"{p.url},{p.bootstrap_port}" for p in prefill], "--decode", *[d.url for d in decode],
            "--health-check-interval-secs", "1", *flags,
        ]

    def __enter__(self):
        self.proc = subprocess.Popen(self.command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 30
        while not _answers(f"{self.url}/health"):
            assert self.proc.poll() is None, self.proc.stderr.read()
            assert time.monotonic() < deadline, "moeplex router --pd did not come up"
            time.sleep(0.1)
        self.client = httpx.Client(base_url=self.url, timeout=60)
        return self

    def __exit__(self, *exc):
        self.client.close()
        self.proc.kill()
        self.proc.wait(10)


@contextlib.contextmanager
def running(*servers: RoleServer):
    """Start every server at once (their start-ups overlap), then wait for each; stop them all at the end."""
    with contextlib.ExitStack() as stack:
        for server in servers:
            server.start()
            stack.callback(server.stop)  # also those that never came up, or a later one's failure would leak them
        for server in servers:
            server.wait()
        yield servers


def wait_idle(*servers: RoleServer, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    for server in servers:
        while not server.idle():
            assert time.monotonic() < deadline, f"{server.mode} server did not go idle: {server.info()}"
            time.sleep(0.05)
