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


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_a_synthetic_map_target_copies_a_document_and_ngram_drafts_land_where_it_has_no_edit(tmp_path, arch):
    """make-model --synthetic-map (no MTP layer): the target follows the map whatever the architecture, so a prompt
    that walks it and then repeats its start is copied on, and prompt lookup's drafts are accepted except at edits."""
    folder = write_checkpoint(str(tmp_path), arch, "tiny", seed=0, synthetic_map=True)
    follow = next_token_map(read_config(folder), seed=0)
    docs = []
    for start in (5, 50, 120):
        doc = [start]
        while len(doc) < 60:
            doc.append(follow[doc[-1]])
        doc[20] = doc[40] = 7  # two edits: there the document is not the map
        docs.append(doc + doc[:4])
    want = engine(folder).generate(docs, GREEDY)
    for doc, r in zip(docs, want):
        assert r.output_ids[:16] == doc[4:20]  # copied from the cue on
        assert all(follow[a] == b for a, b in zip(doc[3:4] + r.output_ids, r.output_ids))  # the map, not the edits
    spec = engine(folder, speculative_algorithm="ngram", speculative_num_steps=3, speculative_policy="fixed",
                  disable_speculative_backoff=True)
    got = spec.generate(docs, GREEDY)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    steps = sum(r.spec_verify_steps for r in got)
    assert (sum(r.spec_accepted_tokens for r in got) + steps) / steps > 3.0  # 4 at most: two misses per document


def test_random_weights_do_not_copy(tmp_path):
    """The reference for the test above: a random target does not follow the map's document."""
    folder = write_checkpoint(str(tmp_path), "qwen3_moe", "tiny", seed=0)
    synthetic = write_checkpoint(str(tmp_path / "s"), "qwen3_moe", "tiny", seed=0, synthetic_map=True)
    follow = next_token_map(read_config(synthetic), seed=0)
    doc = [5]
    while len(doc) < 40:
        doc.append(follow[doc[-1]])
    out = engine(folder).generate([doc + doc[:4]], GREEDY)[0].output_ids
    assert out[:8] != doc[4:12]
