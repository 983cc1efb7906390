"""Each role with its own parallel sizes: a prefill server over two gloo ranks (TP 2, and DP attention 2) feeds a
decode server of one rank; a decode server whose KV layout differs refuses at connect time in one sentence."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from moeplex.disagg.layout import KVLayout
from moeplex.sampling import SamplingParams

from pd_cluster import PDRouter, RoleServer, running, wait_idle
from test_server_parallel import DP2, TP2, folder, reference  # noqa: F401 (fixtures: the tiny DeepSeek-V3 and its engine)

PROMPTS = [[256, 1, 2, 3, 4], [256, 9, 8, 7] * 5, list(range(30, 70)), [256, 100, 7, 3]]


@pytest.fixture(scope="module")
def fleet(folder):
    tp2 = RoleServer(folder, "prefill", *TP2)
    dp2 = RoleServer(folder, "prefill", *DP2)
    decode = RoleServer(folder, "decode")
    other_pages = RoleServer(folder, "decode", "--page-size", "32")
    with running(tp2, dp2, decode, other_pages):
        yield tp2, dp2, decode, other_pages


def greedy(reference, prompt, n=6):
    return reference.generate([prompt], SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))[0].output_ids


@pytest.mark.parametrize("which", ["tp2", "dp2"])
def test_a_two_rank_prefill_feeds_a_one_rank_decode(fleet, reference, which):
    tp2, dp2, decode, _ = fleet
    prefill = tp2 if which == "tp2" else dp2
    with PDRouter([prefill], [decode]) as router, ThreadPoolExecutor(len(PROMPTS)) as pool:
        def ask(prompt):  # at once: the prefill's DP groups share them
            body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
            return router.client.post("/v1/completions", json=body)

        for prompt, answer in zip(PROMPTS, pool.map(ask, PROMPTS)):
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["token_ids"] == greedy(reference, prompt)
    wait_idle(prefill, decode)
    if which == "dp2":  # both DP groups prefilled some of them
        assert all(group["requests_admitted"] > 0 for group in prefill.info()["parallel"]["dp_groups"])


def test_a_page_size_mismatch_is_refused_at_connect_time_naming_both(fleet):
    tp2, _, _, other_pages = fleet
    body = {"prompt": [1, 2, 3], "max_tokens": 2, "bootstrap_host": "127.0.0.1", "bootstrap_port": tp2.bootstrap_port,
            "bootstrap_room": 12345}
    answer = other_pages.client.post("/v1/completions", json=body)
    assert answer.status_code == 409
    assert answer.json()["error"]["message"] == (
        f"the prefill server 127.0.0.1:{tp2.bootstrap_port} has page size 16 but this decode server has 32"
    )
    wait_idle(other_pages)


def test_layout_mismatches_name_both_sides():
    shapes = (((512 + 64,),),) * 2
    ours = KVLayout("abc", 2, shapes, "fp32", 16, 1, 1)
    assert ours.mismatch(ours, "p:1") is None
    assert ours.mismatch(KVLayout("abc", 2, shapes, "bf16", 16, 1, 1), "p:1") == (
        "the prefill server p:1 has KV dtype bf16 but this decode server has fp32")
    assert ours.mismatch(KVLayout("xyz", 2, shapes, "fp32", 16, 1, 1), "p:1") == (
        "the prefill server p:1 has checkpoint xyz but this decode server has abc")
    wider = KVLayout("abc", 2, shapes, "fp32", 16, 2, 1)
    assert "attention TP size 1 but this decode server has 2" in wider.mismatch(ours, "p:1")
    assert ours.mismatch(wider, "p:1") is None  # a decode rank per prefill rank: P's rank 0 sends
