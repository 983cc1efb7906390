"""Drafter contract: whatever a drafter proposes, the engine's output is the output without speculation, and
its proposals are well formed (one list per request asked, at most num_steps ids each, ids in the vocabulary,
draft probabilities [requests, num_steps, vocab] where it declares gives_probs).

Each drafter runs in a real engine on a tiny random checkpoint of the first architecture it supports
(DeepSeek-V3 with MTP layers for a drafter that needs them), greedy, with 1 and 3 steps, prompts that repeat
themselves (so prompt-lookup drafters find something) beside ones that do not; the KV pool is back to
empty afterwards.
"""

from __future__ import annotations

import inspect

import pytest

from moeplex.conformance.plugin import load_plugin

ARCHES = ("deepseek_v3", "qwen3_moe", "mixtral")
PROMPTS = [[256] + list(range(10, 18)) * 3, [256, 5, 6, 7, 5, 6, 7, 5, 6], [256] + list(range(40, 71))]


@pytest.fixture(scope="module")
def drafter_cls(moeplex_plugin):
    return load_plugin(moeplex_plugin)


@pytest.fixture(scope="module")
def model_folder(drafter_cls, tmp_path_factory):
    from moeplex.models.make_model import write_checkpoint

    supported = drafter_cls.caps.architectures
    arch = next((a for a in ARCHES if supported is None or a in supported), None)
    if arch is None:
        pytest.skip(f"the drafter supports {sorted(supported)}, none of which `moeplex make-model` writes")
    extra = {}
    if drafter_cls.caps.needs_weights:
        if "mtp" not in inspect.signature(write_checkpoint).parameters:
            pytest.skip("this moeplex cannot write MTP layers (make-model --mtp)")
        extra["mtp"] = 1
    return write_checkpoint(str(tmp_path_factory.mktemp(arch)), arch, "tiny", seed=0, **extra)


def engine(folder: str, **settings):
    from moeplex.config import EngineConfig
    from moeplex.engine import Engine

    return Engine(EngineConfig(model=folder, dtype="fp32", show_progress=False, max_total_tokens=1024, page_size=4, **settings))


def check_drafts(drafts, requests, steps: int, vocab: int, gives_probs: bool) -> None:
    assert len(drafts.tokens) == len(requests), f"{len(drafts.tokens)} draft lists for {len(requests)} requests"
    for tokens in drafts.tokens:
        assert len(tokens) <= steps, f"{len(tokens)} drafts, more than num_steps {steps}"
        assert all(isinstance(t, int) and 0 <= t < vocab for t in tokens), f"a draft id outside 0..{vocab - 1}: {tokens}"
    if gives_probs:
        assert drafts.probs is not None and tuple(drafts.probs.shape) == (len(requests), steps, vocab)


@pytest.mark.parametrize("steps", [1, 3])
def test_output_is_unchanged_and_proposals_are_well_formed(moeplex_plugin, drafter_cls, model_folder, steps):
    from moeplex.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    want = [r.output_ids for r in engine(model_folder).generate(PROMPTS, params)]
    # the fixed policy asks the drafter at every decode step (the adaptive one asks as its measured costs say)
    spec = engine(model_folder, speculative_algorithm=moeplex_plugin.name, speculative_num_steps=steps,
                  speculative_policy="fixed")
    drafter, vocab = spec.speculation.drafter, spec.vocab_size
    asked = []
    propose = drafter.propose

    def checked(requests):
        drafts = propose(requests)
        check_drafts(drafts, requests, steps, vocab, drafter_cls.caps.gives_probs)
        asked.append(len(requests))
        return drafts

    drafter.propose = checked
    got = [r.output_ids for r in spec.generate(PROMPTS, params)]
    assert got == want
    assert asked, "the engine never asked the drafter for drafts"
    assert propose([]).tokens == []
    cache = spec.prefix_cache
    assert spec.kv.num_free_pages + (cache.num_pages if cache else 0) == spec.kv.num_pages
