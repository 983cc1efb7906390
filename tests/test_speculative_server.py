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
                          speculative_policy="fixed",
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
    # the policy's decisions: every decode step asked; those where ngram drafted verified its drafts
    verify_steps, drafts = metric(text, "moeplex_spec_verify_steps_total"), metric(text, "moeplex_spec_drafts_verified_total")
    assert verify_steps == meta["spec_verify_ct"] == metric(text, "moeplex_spec_requests_drafting_total")
    assert verify_steps <= drafts <= 2 * verify_steps
    gained = round(meta["spec_accept_length"] * meta["spec_verify_ct"])  # tokens the verify steps gave
    assert gained + metric(text, "moeplex_spec_plain_steps_total") == 19  # 20 tokens: the first from the prompt
    # the engine's steps by what they launched (no overlap schedule on a CPU: verify steps are synchronous)
    assert metric(text, 'moeplex_engine_steps_total{kind="verify"}') == verify_steps
    assert metric(text, 'moeplex_engine_steps_total{kind="prompt"}') == 1
    assert metric(text, 'moeplex_engine_steps_total{kind="decode"}') == metric(text, "moeplex_spec_plain_steps_total")
    assert metric(text, 'moeplex_engine_step_seconds_total{kind="verify"}') > 0
    assert metric(text, 'moeplex_engine_overlap_breaks_total{reason="drafts_wanted"}') == 0


def metric(text: str, name: str) -> float:
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def test_the_calibrated_verify_and_break_costs_are_in_metrics_and_server_info(tiny_model_dir):
    folder = tiny_model_dir("deepseek_v3")
    engine = Engine(EngineConfig(model=folder, dtype="fp32", show_progress=False, max_total_tokens=1024, page_size=4,
                                 speculative_algorithm="ngram", speculative_num_steps=2))
    assert engine.calibration is not None  # the adaptive policy's default
    engine.step_costs.set_scale(2, 1.75)  # as the calibration publishes what it measured
    engine.step_costs.set_break_scale(2, 3.5)
    engine.step_costs.set_sync_scale(2, 2.25)
    body = {"input_ids": [256, 40, 41], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    with LiveServer(build_app(engine, ServerSettings(served_model_name="tiny"))) as live:
        httpx.post(f"{live.url}/generate", json=body, timeout=60).raise_for_status()  # (stats come with a round)
        text = httpx.get(f"{live.url}/metrics").text
        info = httpx.get(f"{live.url}/get_server_info").json()
    assert metric(text, 'moeplex_spec_verify_cost_scale{requests="2"}') == 1.75
    assert info["spec_verify_cost_scales"] == {"2": 1.75}
    assert metric(text, 'moeplex_spec_break_cost_scale{requests="2"}') == 3.5
    assert info["spec_break_cost_scales"] == {"2": 3.5}
    assert metric(text, 'moeplex_spec_mixed_verify_cost_scale{requests="2"}') == 2.25
    assert info["spec_mixed_verify_cost_scales"] == {"2": 2.25}
