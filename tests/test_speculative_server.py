"""Speculation over HTTP: /generate's meta_info gives accept length and rate, /metrics their histograms."""

from __future__ import annotations

import httpx

from moeplex.config import EngineConfig
from moeplex.engine import Engine
from moeplex.sampling import SamplingParams
from moeplex.server import ServerSettings, build_app

from live_server import LiveServer


def test_generate_meta_and_prometheus_report_acceptance(tiny_model_dir):
    folder = tiny_model_dir("deepseek_v3")
    config = EngineConfig(model=folder, dtype="fp32", show_progress=False, max_total_tokens=1024, page_size=4,
                          speculative_algorithm="ngram", speculative_num_steps=2,
                          disable_speculative_backoff=True)  # ngram has nothing to say before step 16
    plain = Engine(EngineConfig(model=folder, dtype="fp32", show_progress=False, max_total_tokens=1024, page_size=4))
    ids = [256] + list(range(40, 75))  # its answer repeats itself, so ngram drafts from step 16 on
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}}
    with LiveServer(build_app(Engine(config), ServerSettings(served_model_name="tiny"))) as live:
        answer = httpx.post(f"{live.url}/generate", json=body, timeout=60).json()
        text = httpx.get(f"{live.url}/metrics").text
    [want] = plain.generate([ids], SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True))
    assert answer["output_ids"] == want.output_ids
    meta = answer["meta_info"]
    assert meta["spec_verify_ct"] >= 1 and meta["spec_accept_length"] >= 1.0 and 0.0 <= meta["spec_accept_rate"] <= 1.0
    assert "moeplex_spec_accept_length_count 1.0" in text and "moeplex_spec_accept_rate_count 1.0" in text
