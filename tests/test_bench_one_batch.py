"""`moeplex bench-one-batch` with speculative decoding: tokens per second count every token a decode step
produced (several per request and step), and the accept length is the tokens a verify step gained."""

from __future__ import annotations

import random

import pytest

from moeplex.cli.bench_one_batch import measure
from moeplex.config import EngineConfig
from moeplex.engine import Engine
from moeplex.sampling import SamplingParams

from test_speculative import script_distribution, scripted  # noqa: F401 (a fixture)

BATCH, INPUT, OUTPUT, STEPS = 2, 6, 9, 3


def engine(folder: str, **overrides) -> Engine:
    return Engine(EngineConfig(model=folder, dtype="fp32", show_progress=False, max_total_tokens=512, page_size=4,
                               **overrides))


def test_tokens_per_second_and_accept_length_with_the_oracle(tiny_model_dir, script_distribution):  # noqa: F811
    folder = tiny_model_dir("qwen3_moe")
    plain = engine(folder)
    rng = random.Random(BATCH)  # the prompts measure() makes
    prompts = [[rng.randrange(min(plain.vocab_size, 256)) for _ in range(INPUT)] for _ in range(BATCH)]
    outputs = [r.output_ids for r in plain.generate(prompts, SamplingParams(max_new_tokens=OUTPUT, temperature=0.0,
                                                                               ignore_eos=True))]
    scripted(prompts, outputs)
    without = measure(plain, BATCH, INPUT, OUTPUT)
    assert without["decode_steps"] == OUTPUT - 1 and without["accept_length"] == 0.0
    spec = engine(folder, speculative_algorithm="test-oracle", speculative_num_steps=STEPS, speculative_policy="fixed")
    row = measure(spec, BATCH, INPUT, OUTPUT)
    # 8 decode tokens per request: two verify steps of 3 accepted drafts + the target's token
    assert row["decode_steps"] == 2 and row["accept_length"] == STEPS + 1
    # tokens per second: 2 x 8 tokens over two steps, not 2 requests per step
    assert row["decode_tok_s"] == pytest.approx(BATCH * (OUTPUT - 1) / (2 * row["decode_step_ms"] / 1e3), rel=0.01)


def test_a_repeated_measurement_computes_its_prefill_again(tiny_model_dir):
    # the prompts of measure() repeat from call to call; the prefix cache must not turn the second prefill into a
    # lookup of the first one's pages (a 4k prefill timed at a quarter of its FLOP roofline did, on a GPU)
    plain = engine(tiny_model_dir("qwen3_moe"))
    assert plain.prefix_cache is not None
    for _ in range(2):
        plain.prefix_cache.reset_counters()
        measure(plain, BATCH, 4 * INPUT, 2)
        assert plain.prefix_cache.queried_tokens > 0 and plain.prefix_cache.hit_tokens == 0
