"""Overlap strategies: the two-batch split, micro-batch views, and equal outputs across ranks."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moeplex.batch_builder import ScheduledSeq, build_forward_batch
from moeplex.config import EngineConfig
from moeplex.forward_batch import ForwardMode
from moeplex.interfaces import BatchMeta
from moeplex.kv_cache import KVPool
from moeplex.ranks.launcher import launch
from moeplex.ranks.offline import generate
from moeplex.parallel import ParallelConfig
from moeplex.plugins.overlap.tbo import BALANCE_TOLERANCE, TwoBatchOverlap, two_batch_cut
from moeplex.registry import lookup
from moeplex.sampling import SamplingParams

import parallel_ranks
from ports import free_address

# very different lengths: the extend step must cut through the long one or near a boundary
PROMPTS = [[256] + list(range(1, 60)), [256, 7, 8], [256] + list(range(90, 99)), [256, 5]]
PARAMS = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=12))
def test_extend_cut_is_balanced_and_never_empty(lens):
    meta = BatchMeta(ForwardMode.EXTEND, tuple(lens))
    total = sum(lens)
    cut = two_batch_cut(meta)
    if total < 2:
        assert cut is None
        return
    assert 0 < cut < total
    boundaries = {sum(lens[:i]) for i in range(1, len(lens))}

    def within(b: int) -> bool:  # a request boundary within the tolerance of the middle
        return abs(2 * b - total) <= 2 * BALANCE_TOLERANCE * total

    if any(within(b) for b in boundaries):
        assert cut in boundaries and within(cut)  # no sequence is cut when a boundary will do
    else:
        assert cut == total // 2  # the middle token (a boundary too for three one-token prompts)


@given(st.integers(1, 64))
def test_decode_cut_halves_the_requests(batch_size):
    cut = two_batch_cut(BatchMeta(ForwardMode.DECODE, (1,) * batch_size))
    assert cut == (None if batch_size == 1 else batch_size // 2)


def test_tbo_falls_back_below_its_token_threshold():
    strategy = TwoBatchOverlap(min_tokens=100)
    assert strategy.cuts(BatchMeta(ForwardMode.DECODE, (1,) * 99)) is None
    assert strategy.cuts(BatchMeta(ForwardMode.DECODE, (1,) * 100)) == [50]


def test_micro_batch_views_cover_the_batch():
    kv = KVPool(num_pages=32, page_size=4, layer_shapes=[[(1,)]], dtype=torch.float32, device="cpu")
    seqs = [ScheduledSeq(list(range(9)), 3, kv.allocate(3)), ScheduledSeq([5], 6, kv.allocate(2)), ScheduledSeq(list(range(4)), 0, kv.allocate(1))]
    batch = build_forward_batch(seqs, kv, "cpu")
    first, second = batch.slice_tokens(0, 5), batch.slice_tokens(5, batch.num_tokens)
    assert first.extend_lens == (5,) and first.prefix_lens == (3,)
    assert second.extend_lens == (4, 1, 4) and second.prefix_lens == (8, 6, 0)  # request 0 continues after its first part
    assert torch.equal(torch.cat([first.input_ids, second.input_ids]), batch.input_ids)
    assert torch.equal(second.kv_indices[:12], batch.kv_indices[:12])  # request 0 sees its whole sequence
    assert second.seq_lens.tolist() == [12, 7, 4]


def test_tbo_really_runs_two_micro_batches(tiny_model_dir):
    strategy = lookup("overlap", "tbo")()
    seen = []
    run = strategy.run
    strategy.run = lambda programs: (seen.append(len(programs)), run(programs))
    engine_config = EngineConfig(model=tiny_model_dir("deepseek_v3"), show_progress=False, max_total_tokens=1024, overlap="tbo")
    from moeplex.engine import Engine

    engine = Engine(engine_config)
    engine.runner.strategy = strategy
    outputs = engine.generate(PROMPTS, PARAMS)
    assert seen and all(n == 2 for n in seen)
    reference = generate(EngineConfig(model=engine_config.model, show_progress=False, max_total_tokens=1024), PROMPTS, PARAMS)
    assert [r.output_ids for r in outputs] == [r["output_ids"] for r in reference]


def test_tbo_keeps_one_transfer_in_flight_and_overlaps_each_with_the_other_micro_batch(tiny_model_dir):
    """DeepEP's low-latency buffers hold one transfer at a time: TBO must never launch a second."""
    from moeplex.engine import Engine

    engine = Engine(EngineConfig(model=tiny_model_dir("deepseek_v3"), show_progress=False, max_total_tokens=1024,
                                 overlap="tbo"))
    dispatcher = engine.model.moe_runtime.dispatcher
    events, in_flight, most = [], set(), [0]

    def tracked(name: str, launches: bool):
        inner = getattr(dispatcher, name)

        def call(*args, **kwargs):
            result = inner(*args, **kwargs)
            if launches:
                in_flight.add(id(result))
                most[0] = max(most[0], len(in_flight))
            else:
                in_flight.discard(id(args[0]))
            events.append(name)
            return result

        setattr(dispatcher, name, call)

    for name, launches in (("dispatch_start", True), ("dispatch_finish", False), ("combine_start", True),
                           ("combine_finish", False)):
        tracked(name, launches)
    kernel_apply = engine.model.moe_runtime.kernel.apply

    def apply(*args, **kwargs):
        events.append("experts")
        return kernel_apply(*args, **kwargs)

    engine.model.moe_runtime.kernel.apply = apply
    for layer in engine.model.model.layers:
        layer.self_attn.register_forward_hook(lambda *_: events.append("attention"))
    outputs = engine.generate(PROMPTS, PARAMS)
    assert most[0] == 1 and not in_flight
    # a launched transfer is in flight while the other micro-batch computes: its attention or its experts
    pairs = set(zip(events, events[1:]))
    assert {("dispatch_start", "attention"), ("dispatch_start", "experts"), ("combine_start", "experts"),
            ("combine_start", "attention")} <= pairs, sorted(pairs)
    reference = generate(EngineConfig(model=engine.config.model, show_progress=False, max_total_tokens=1024), PROMPTS, PARAMS)
    assert [r.output_ids for r in outputs] == [r["output_ids"] for r in reference]


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout", [dict(tp_size=2, ep_size=2), dict(tp_size=2, ep_size=2, dp_size=2, enable_dp_attention=True)], ids=["ep2", "dp2-attention"]
)
def test_overlap_strategies_equal_none_across_ranks(layout, tiny_model_dir):
    folders = [tiny_model_dir("deepseek_v3"), tiny_model_dir("qwen3_moe")]
    results = {}
    for overlap in ("none", "tbo", "sbo"):
        parallel = ParallelConfig(dist_init_addr=free_address(), timeout_s=120, **layout)
        rank_fn = functools.partial(parallel_ranks.generate_every_model, overlap=overlap)
        results[overlap] = launch(rank_fn, parallel, parallel, folders, PROMPTS, [PARAMS] * len(PROMPTS))
    for overlap in ("tbo", "sbo"):
        for folder in folders:
            for ours, base in zip(results[overlap][folder], results["none"][folder]):
                assert ours["output_ids"] == base["output_ids"], (overlap, folder)
                for a, b in zip(ours["logprobs"], base["logprobs"]):
                    assert abs(a["logprob"] - b["logprob"]) <= 1e-4
