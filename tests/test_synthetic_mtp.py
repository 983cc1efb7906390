"""make-model --mtp-acceptance: a DeepSeek-V3 checkpoint whose target follows a fixed next-token map and whose MTP
layer's drafts it accepts at the chosen rate per position; --load-format dummy makes the same weights."""

from __future__ import annotations

import pytest
import torch

from moeplex.config import EngineConfig
from moeplex.engine import Engine
from moeplex.models.make_model import write_checkpoint
from moeplex.models.setup import read_config
from moeplex.models.synthetic_mtp import next_token_map
from moeplex.sampling import SamplingParams

GREEDY = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
PROMPTS = [[256] + [(7 * i + 3 * k) % 250 for k in range(12)] for i in range(4)]


def engine(folder: str, **overrides) -> Engine:
    return Engine(EngineConfig(model=folder, dtype="fp32", show_progress=False, max_total_tokens=2048, page_size=4,
                               **overrides))


@pytest.mark.parametrize("acceptance", [0.8])
def test_drafts_are_accepted_at_the_chosen_rate(tmp_path, acceptance):
    folder = write_checkpoint(str(tmp_path), "deepseek_v3", "tiny", seed=0, mtp=1, mtp_acceptance=acceptance)
    want = engine(folder).generate(PROMPTS, GREEDY)
    follow = next_token_map(read_config(folder), seed=0)
    assert all(follow[a] == b for r in want for a, b in zip(r.output_ids, r.output_ids[1:]))  # the target is the map
    spec = engine(folder, speculative_algorithm="nextn", speculative_num_steps=3, speculative_policy="fixed",
                  disable_speculative_backoff=True)
    verified = []  # (drafts, accepted) per request and verify step
    record = spec.speculation.policy.record
    spec.speculation.policy.record = lambda r, m, a: verified.append((m, a)) or record(r, m, a)
    got = spec.generate(PROMPTS, GREEDY)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    tried = sum(min(a + 1, m) for m, a in verified)  # positions reached: the accepted ones and the first miss
    rate = sum(a for _, a in verified) / tried
    assert abs(rate - acceptance) < 0.12, rate  # ~150 positions: a few standard deviations


def test_dummy_weights_are_the_synthetic_checkpoint(tmp_path):
    written = write_checkpoint(str(tmp_path / "w"), "deepseek_v3", "tiny", seed=3, mtp=1, mtp_acceptance=0.7)
    config_only = write_checkpoint(str(tmp_path / "c"), "deepseek_v3", "tiny", seed=3, mtp=1, mtp_acceptance=0.7,
                                   config_only=True)
    a = engine(written, speculative_algorithm="nextn", speculative_policy="fixed")
    b = engine(config_only, load_format="dummy", seed=3, speculative_algorithm="nextn", speculative_policy="fixed")
    weights = dict(b.model.named_parameters())
    for name, tensor in a.model.named_parameters():
        torch.testing.assert_close(tensor, weights[name], msg=name)
    assert b.generate(PROMPTS[:1], GREEDY)[0].output_ids == a.generate(PROMPTS[:1], GREEDY)[0].output_ids


def test_the_rate_needs_mtp_layers(tmp_path):
    with pytest.raises(ValueError, match="--mtp-acceptance"):
        write_checkpoint(str(tmp_path), "deepseek_v3", "tiny", mtp_acceptance=0.8)
    with pytest.raises(ValueError, match="--mtp-acceptance"):
        write_checkpoint(str(tmp_path), "deepseek_v3", "tiny", mtp=1, mtp_acceptance=1.5)
