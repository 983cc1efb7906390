"""Start-up faults end quickly and say why: a busy or unreachable rendezvous, a rank that cannot load its model."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import sys
import time

import pytest
import torch

from moeplex.ranks.launcher import RankFailed, Rendezvous, launch
from moeplex.parallel import ParallelConfig

import fault_ranks

CLI = [sys.executable, "-c", "import sys; from moeplex.cli import main; sys.exit(main())"]


def busy_port() -> socket.socket:
    """A socket listening on a loopback port, as another server's rendezvous would."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    return sock


def test_one_node_meets_on_a_free_loopback_port_whatever_the_default_address():
    with busy_port() as busy:
        address = f"127.0.0.1:{busy.getsockname()[1]}"
        assert launch(fault_ranks.world_sum, parallel := ParallelConfig(tp_size=2, dist_init_addr=address, timeout_s=30),
                      parallel) == 2
    rendezvous = Rendezvous(ParallelConfig(tp_size=2, dist_init_addr="0.0.0.0:29517"))
    try:
        assert rendezvous.bound[0] == "127.0.0.1" and rendezvous.port != 29517
    finally:
        rendezvous.close()


def test_node_0_on_a_busy_rendezvous_address_says_so():
    with busy_port() as busy:
        address = f"127.0.0.1:{busy.getsockname()[1]}"
        with pytest.raises(RankFailed, match=f"cannot host the rendezvous on {address}"):
            Rendezvous(ParallelConfig(tp_size=2, nnodes=2, dist_init_addr=address))


@pytest.mark.parametrize("ranks", ["1", "2"])
def test_serve_exits_with_the_reason_when_rank_0_cannot_load_its_model(tiny_model_dir, tmp_path, ranks):
    """A tensor of the wrong shape passes the start-up check of the headers (a truncated file does not:
    test_cli_errors) and fails in the ranks as they load it: serve must still exit with the reason."""
    from safetensors.torch import load_file, save_file

    broken = shutil.copytree(tiny_model_dir("deepseek_v3"), tmp_path / "broken")
    weights = load_file(broken / "model.safetensors")
    name = "model.layers.1.mlp.experts.5.down_proj.weight"
    weights[name] = torch.zeros(weights[name].shape[0] + 1, weights[name].shape[1])
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    command = [*CLI, "serve", "--model", str(broken), "--port", "0", "--tp-size", ranks, "--log-level", "warning"]
    started = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("moeplex serve hung after rank 0 failed to start")
    # every rank reads the broken file: whichever fails first is named
    assert done.returncode != 0 and re.search(rf"rank \d failed: .*{name} has shape", done.stderr), done.stderr[-2000:]
    assert "Traceback" not in done.stderr.splitlines()[-1]
    print(f"exited {done.returncode} after {time.monotonic() - started:.1f} s: {done.stderr.splitlines()[-1]}")
