"""Tensor, expert and data parallelism over real gloo ranks equal the single-process engine."""

from __future__ import annotations


import pytest

from moeplex.config import EngineConfig
from moeplex.ranks.launcher import RankFailed, launch
from moeplex.models.make_model import ARCHES
from moeplex.ranks.offline import assign_to_dp_groups, generate
from moeplex.parallel import ParallelConfig
from moeplex.sampling import SamplingParams

import parallel_ranks
from ports import free_address

PROMPTS = [[256, 1, 2, 3, 4], [256] + list(range(40, 75)), [256, 9, 8], [256] + list(range(100, 112))]
PARAMS = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5)
LAYOUTS = {
    "ep2": dict(tp_size=2, ep_size=2),
    "tp2": dict(tp_size=2),
    "dp2-attention": dict(tp_size=2, ep_size=2, dp_size=2, enable_dp_attention=True),
    "ep4": dict(tp_size=4, ep_size=4),
    "tp4-dp2-ep4": dict(tp_size=4, ep_size=4, dp_size=2, enable_dp_attention=True),
}


@pytest.fixture(scope="module")
def folders(tiny_model_dir):
    return [tiny_model_dir(arch) for arch in ARCHES]


@pytest.fixture(scope="module")
def single_rank(folders):
    config = lambda f: EngineConfig(model=f, show_progress=False, max_total_tokens=1024, page_size=4)  # noqa: E731
    return {f: generate(config(f), PROMPTS, PARAMS) for f in folders}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_layouts_equal_one_process(layout, folders, single_rank):
    parallel = ParallelConfig(dist_init_addr=free_address(), timeout_s=120, **LAYOUTS[layout])
    results = launch(parallel_ranks.generate_every_model, parallel, parallel, folders, PROMPTS, [PARAMS] * len(PROMPTS))
    for folder in folders:
        for ours, reference in zip(results[folder], single_rank[folder]):
            assert ours["output_ids"] == reference["output_ids"], f"{layout} on {folder}"
            for step, ref_step in zip(ours["logprobs"], reference["logprobs"]):
                assert [t for t, _ in step["top_logprobs"]] == [t for t, _ in ref_step["top_logprobs"]]
                for (_, a), (_, b) in zip(step["top_logprobs"], ref_step["top_logprobs"]):
                    assert abs(a - b) <= 1e-4 * max(1.0, abs(b))


@pytest.mark.slow
def test_an_idle_dp_rank_does_not_hang_the_others(folders, single_rank):
    parallel = ParallelConfig(tp_size=2, ep_size=2, dp_size=2, enable_dp_attention=True, dist_init_addr=free_address(), timeout_s=60)
    one = PROMPTS[:1]  # DP group 1 gets nothing and must run IDLE batches while group 0 decodes
    results = launch(parallel_ranks.generate_every_model, parallel, parallel, folders[:1], one, [PARAMS])
    assert results[folders[0]][0]["output_ids"] == single_rank[folders[0]][0]["output_ids"]


def test_dp_groups_share_prompts_by_tokens():
    assert assign_to_dp_groups([[0] * 10, [0] * 3, [0] * 4, [0] * 2], 2) == [0, 1, 1, 1]


def test_with_the_prefix_cache_a_prompt_goes_to_the_group_given_its_prefix():
    system, other = [256] + list(range(64)), [256] + list(range(100, 108))
    prompts = [system, other, system + [7, 8, 9]]
    assert assign_to_dp_groups(prompts, 2, capacity_tokens=1024, cache_aware=True) == [0, 1, 0]
    assert assign_to_dp_groups(prompts, 2, capacity_tokens=1024, cache_aware=False) == [0, 1, 1]  # by load alone


def test_a_dead_rank_is_named():
    parallel = ParallelConfig(tp_size=2, dist_init_addr=free_address(), timeout_s=30)
    with pytest.raises(RankFailed, match="rank 1 died"):
        launch(parallel_ranks.die_after_joining, parallel, parallel)


def test_a_hung_rank_times_out_the_others():
    parallel = ParallelConfig(tp_size=2, dist_init_addr=free_address(), timeout_s=3)
    with pytest.raises(RankFailed, match="rank 0 failed"):
        launch(parallel_ranks.hang_after_joining, parallel, parallel)


@pytest.mark.parametrize(
    "settings,message",
    [
        (dict(tp_size=2, ep_size=3), "must be 1 .* or equal to --tp-size"),
        (dict(tp_size=2, dp_size=2), "needs --enable-dp-attention"),
        (dict(tp_size=4, dp_size=3, enable_dp_attention=True, ep_size=4), "must divide --tp-size"),
        (dict(tp_size=2, dp_size=2, enable_dp_attention=True), "set --ep-size equal to --tp-size"),
        (dict(tp_size=2, nnodes=4), "must divide --tp-size"),
    ],
)
def test_invalid_layouts_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**settings)


def test_each_rank_holds_only_its_shard(folders):
    folder = folders[0]
    alone = launch(parallel_ranks.memory_of_every_rank, ParallelConfig(), ParallelConfig(), folder)[0]
    parallel = ParallelConfig(tp_size=2, ep_size=2, dist_init_addr=free_address(), timeout_s=60)
    ranks = launch(parallel_ranks.memory_of_every_rank, parallel, parallel, folder)
    assert [r["rank"] for r in ranks] == [0, 1]
    for report in ranks:
        assert report["experts_mib"] == pytest.approx(alone["experts_mib"] / 2, rel=0.02)
        assert report["weights_mib"] < alone["weights_mib"]  # attention and dense layers split too
