"""KV transfer with the pools in GPU memory: the conformance suite on cuda-ipc (prefill and decode as two
processes on one GPU), zmq (pages staged through pinned host memory) and loopback; cuda-ipc refuses a peer
on another host."""

from __future__ import annotations

import json

import pytest
import torch

from moeplex.interfaces import PluginError, kv_regions
from test_kv_transfer_conformance import run_suite, third_party  # noqa: F401  (the fixture)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", ["cuda-ipc", "zmq", "loopback"])
def test_conformance_on_gpu_pools(third_party, name):  # noqa: F811
    outcomes = run_suite(name)
    ran = {test: o for test, o in outcomes.items() if o != "skipped"}
    assert len(ran) >= 15 and set(ran.values()) == {"passed"}, outcomes


def test_cuda_ipc_refuses_a_peer_on_another_host():
    from moeplex.plugins.kv_transfer.cuda_ipc import CudaIpcTransfer

    pool = [[torch.zeros(64, 4, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2)] for _ in range(2)]
    mine, theirs = CudaIpcTransfer(), CudaIpcTransfer()
    mine.register(kv_regions(pool, 16), 64)
    theirs.register(kv_regions(pool, 16), 64)
    endpoint = json.loads(theirs.endpoint())
    endpoint["host"] = "elsewhere/0"
    with pytest.raises(PluginError, match="one host only"):
        mine.connect(json.dumps(endpoint).encode())
    mine.close(), theirs.close()
