"""The expert-load endpoints: record, dump, rebalance over HTTP while serving."""

from __future__ import annotations

import json

import httpx
import pytest

from moeplex.config import EngineConfig
from moeplex.engine import Engine
from moeplex.server.app import build_app
from moeplex.server.settings import ServerSettings

from live_server import LiveServer

ENGINE = dict(dtype="fp32", show_progress=False, max_total_tokens=2048, balancer="eplb", ep_num_redundant_experts=4)


@pytest.fixture(scope="module")
def client(tiny_model_dir, tmp_path_factory):
    engine = Engine(EngineConfig(model=tiny_model_dir("deepseek_v3"), **ENGINE))
    dump_dir = str(tmp_path_factory.mktemp("dumps"))
    with LiveServer(build_app(engine, ServerSettings(expert_load_dir=dump_dir))) as server:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            yield c


def complete(client, prompt: str) -> list[int]:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    reply = client.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["token_ids"]


def test_record_dump_and_rebalance_keep_serving_the_same_tokens(client):
    assert client.post("/rebalance_experts").status_code == 400  # nothing recorded yet
    assert client.post("/start_expert_distribution_record", json={"mode": "sideways"}).status_code == 400
    assert client.post("/start_expert_distribution_record").status_code == 200
    before = complete(client, "The experts of the mixture")
    assert client.post("/stop_expert_distribution_record").status_code == 200
    dump = client.post("/dump_expert_distribution_record")
    assert dump.status_code == 200
    with open(dump.json()["path"]) as f:
        counts = json.load(f)["logical_count"]
    assert sum(map(sum, counts)) > 0
    rebalanced = client.post("/rebalance_experts")
    assert rebalanced.status_code == 200 and "phy2log" in rebalanced.json()
    assert complete(client, "The experts of the mixture") == before
