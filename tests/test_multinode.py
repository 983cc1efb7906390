"""Two "nodes" on loopback: two `moeplex generate` launchers of one rank each make one world of two ranks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from ports import free_port

CLI = [sys.executable, "-c", "import sys; from moeplex.cli import main; sys.exit(main())", "generate"]
PROMPTS = ["256,1,2,3,4", "256,9,8,7"]


def node(folder: str, rank: int, address: str, tokens: int) -> subprocess.Popen:
    command = [*CLI, "--model", folder, "--input-ids", *PROMPTS, "--max-new-tokens", str(tokens), "--ignore-eos",
               "--json", "--tp-size", "2", "--nnodes", "2", "--node-rank", str(rank), "--dist-init-addr", address,
               "--dist-timeout", "60"]
    # a session of its own, so a node can be killed whole (launcher and rank) as a machine would die
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir("deepseek_v3")


def test_two_nodes_generate_what_one_process_does(folder):
    one = subprocess.run([*CLI, "--model", folder, "--input-ids", *PROMPTS, "--max-new-tokens", "6", "--ignore-eos",
                          "--json"], capture_output=True, text=True, timeout=120)
    assert one.returncode == 0, one.stderr
    address = f"127.0.0.1:{free_port()}"
    nodes = [node(folder, rank, address, 6) for rank in (0, 1)]
    try:
        outs = [n.communicate(timeout=120) for n in nodes]
    finally:
        for n in nodes:
            n.kill()
    assert [n.returncode for n in nodes] == [0, 0], [err[-2000:] for _, err in outs]
    expected = [json.loads(line)["output_ids"] for line in one.stdout.splitlines()]
    assert [json.loads(line)["output_ids"] for line in outs[0][0].splitlines()] == expected
    assert outs[1][0] == ""  # node 0 prints the completions


def test_a_node_that_dies_is_named_by_the_other(folder):
    address = f"127.0.0.1:{free_port()}"
    first, second = node(folder, 0, address, 100000), node(folder, 1, address, 100000)
    try:
        time.sleep(1)
        deadline = time.monotonic() + 90
        while not _rank_running(second):  # node 1's rank is up and generating
            assert time.monotonic() < deadline and first.poll() is None, first.stderr.read()
            time.sleep(0.5)
        time.sleep(1)  # a little way into its tokens
        os.killpg(second.pid, signal.SIGKILL)
        killed = time.monotonic()
        _, err = first.communicate(timeout=60)
        took = time.monotonic() - killed
    finally:
        for n in (first, second):
            n.kill()
    last = err.strip().splitlines()[-1]
    print(f"node 0 exited {first.returncode} {took:.1f} s after node 1 died: {last}")
    assert first.returncode != 0 and "node 1 (ranks 1..1) stopped answering" in last, err[-3000:]


def _rank_running(launcher: subprocess.Popen) -> bool:
    """Whether the launcher's spawned rank has been working for a while (its CPU time, from /proc)."""
    for child in _children(launcher.pid):
        with open(f"/proc/{child}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        if int(fields[11]) + int(fields[12]) > 300:  # utime + stime, in clock ticks
            return True
    return False


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except FileNotFoundError:
        return []


def test_two_serve_nodes_answer_as_one_process_and_node_0_names_the_node_that_died(folder):
    from test_server_parallel import RankedServer, greedy_ids
    from moeplex.config import EngineConfig
    from moeplex.engine import Engine

    [expected] = greedy_ids(Engine(EngineConfig(model=folder, show_progress=False, max_total_tokens=4096)), [[256, 1, 2, 3]], 6)
    address = f"127.0.0.1:{free_port()}"
    flags = ("--tp-size", "2", "--nnodes", "2", "--dist-init-addr", address, "--dist-timeout", "60")
    second = subprocess.Popen(
        [*CLI[:-1], "serve", "--model", folder, *flags, "--node-rank", "1", "--max-total-tokens", "4096",
         "--log-level", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        with RankedServer(folder, *flags, "--node-rank", "0") as first:
            # RankedServer passes a --dist-init-addr of its own; ours comes later in the command and wins
            body = {"prompt": [256, 1, 2, 3], "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
            assert first.client.post("/v1/completions", json=body).json()["choices"][0]["token_ids"] == expected
            os.killpg(second.pid, signal.SIGKILL)
            cut = first.client.post("/v1/completions", json=body)  # a round now, rather than at the next keep-alive
            assert cut.status_code == 503, cut.text
            assert first.proc.wait(timeout=60) != 0
            assert "node 1 (ranks 1..1) stopped answering" in first.proc.stderr.read()
    finally:
        second.kill()
