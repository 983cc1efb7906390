"""Decode graphs over several gloo ranks: the step agreement, padding to the agreed size, idle ranks, tbo.

Each rank's engine replays DecodeGraphs whose capture returns the step (tests/graph_ranks.py), so
everything but the CUDA capture runs: the agreement collective, every rank padding to one size, an
idle DP rank replaying that size with padding rows only, the `naive` dispatcher's fixed-block path
the captured batch selects, and `tbo`'s split fixed per captured size. Greedy fp32 outputs must equal
the eager run on the same ranks and the one-rank engine, and every KV page must be back at the end.
"""

from __future__ import annotations

import pytest
import torch

from moeplex.config import EngineConfig
from moeplex.cuda_graph import capture_sizes, padded_size
from moeplex.forward_batch import ForwardMode
from moeplex.ranks.launcher import launch
from moeplex.ranks.offline import generate
from moeplex.parallel import ParallelConfig
from moeplex.sampling import SamplingParams
from moeplex.step_agreement import Vote, agree

import graph_ranks
from test_parallel import free_address

# DP group 0 gets the first and third prompt, group 1 the second: group 1 stops after 2 tokens and then idles
PROMPTS = [[256, 1, 2, 3, 4], [256] + list(range(40, 52)), [256, 9, 8]]
PARAMS = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, logprobs=3) for n in (6, 2, 5)]
SIZES = capture_sizes(graph_ranks.MAX_BS)


def test_agreement_pads_every_rank_to_the_size_holding_the_largest_count():
    rows = [Vote(3, False, True, True).row(), Vote(0, False, False, True).row()]  # rank 1 idle
    agreed = agree(rows, SIZES)
    assert agreed.counts == (3, 0) and agreed.all_decode and agreed.split and agreed.graph_size == 4
    assert agree([Vote(1, False, True, True).row()] * 2, SIZES).graph_size == 1
    # any rank that cannot replay (a batch too large, a page table too wide, recording): everyone runs eagerly
    assert agree([Vote(2, False, True, True).row(), Vote(2, False, True, False).row()], SIZES).graph_size is None
    # any rank extending: eager, and not all decode
    extending = agree([Vote(2, False, True, True).row(), Vote(7, True, True, False).row()], SIZES)
    assert extending.graph_size is None and not extending.all_decode
    assert agree([Vote(5, False, True, True).row()] * 2, SIZES).graph_size is None  # above the largest graph
    assert agree([Vote(0, False, False, True).row()] * 2, SIZES) is None  # nobody has tokens: nobody steps
    assert not agree([Vote(2, False, True, True).row(), Vote(2, False, False, True).row()], SIZES).split


def single_rank(folder):
    config = EngineConfig(model=folder, show_progress=False, max_total_tokens=256, page_size=4)
    return generate(config, PROMPTS, PARAMS)


def assert_same_tokens(ours, reference, what, tolerance=1e-4):
    for i, (a, b) in enumerate(zip(ours, reference)):
        assert a["output_ids"] == b["output_ids"], f"{what}: prompt {i}"
        for step, ref_step in zip(a["logprobs"], b["logprobs"]):
            assert [t for t, _ in step["top_logprobs"]] == [t for t, _ in ref_step["top_logprobs"]], what
            for (_, x), (_, y) in zip(step["top_logprobs"], ref_step["top_logprobs"]):
                assert abs(x - y) <= tolerance * max(1.0, abs(y)), what


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir("deepseek_v3")


@pytest.fixture(scope="module")
def dp2(folder):
    """DP attention over 2 ranks (EP 2): eager, graphs under the overlap schedule, graphs with tbo."""
    parallel = ParallelConfig(tp_size=2, ep_size=2, dp_size=2, enable_dp_attention=True,
                              dist_init_addr=free_address(), timeout_s=120)
    variants = {
        "eager": ({}, False),
        "graphs": ({"overlap_schedule": True}, True),
        "graphs_tbo": ({"overlap": "tbo"}, True),
    }
    return launch(graph_ranks.run_engines, parallel, parallel, folder, PROMPTS, PARAMS, variants)


@pytest.mark.parametrize("variant", ["graphs", "graphs_tbo"])
def test_dp_ranks_replaying_graphs_equal_eager_and_one_rank(dp2, folder, variant):
    assert_same_tokens(dp2[variant]["results"], dp2["eager"]["results"], f"{variant} vs eager on 2 ranks")
    assert_same_tokens(dp2[variant]["results"], single_rank(folder), f"{variant} vs one rank")
    assert all(rank["pages_conserved"] for rank in dp2[variant]["ranks"])
    assert all(rank["pages_conserved"] for rank in dp2["eager"]["ranks"])
    assert [rank["overlap_schedule"] for rank in dp2["graphs"]["ranks"]] == [True, True]


@pytest.mark.parametrize("variant", ["eager", "graphs", "graphs_tbo"])
def test_a_step_agrees_in_one_collective_under_the_overlap_schedule_too(dp2, variant):
    """The graph size rides on the step's one agreement; the overlap schedule (the `graphs` variant) keeps it one."""
    for rank in dp2[variant]["ranks"]:
        assert rank["gathers_per_step"] and set(rank["gathers_per_step"]) == {1}, rank["gathers_per_step"]


@pytest.mark.parametrize("variant", ["graphs", "graphs_tbo"])
def test_every_dp_rank_replays_the_same_padded_size_and_an_idle_one_only_padding(dp2, variant):
    first, second = (rank["replays"] for rank in dp2[variant]["ranks"])
    assert first and len(first) == len(second), "both ranks replay in the same steps"
    for (size, rows, mode), (other_size, other_rows, other_mode) in zip(first, second):
        assert size == other_size == padded_size(max(rows, other_rows), SIZES)
    idle = [entry for entry in second if entry[2] == ForwardMode.IDLE.name]
    assert idle and all(rows == 0 for _, rows, _ in idle), second
    assert {size for size, _, _ in idle} == {2, 1}  # rank 0 decodes 2 requests, then 1


def test_tbo_splits_every_captured_size_it_would_split_at_capture(dp2):
    for rank in dp2["graphs_tbo"]["ranks"]:
        assert rank["cuts"] == {1: None, 2: [1], 4: [2]}
    for rank in dp2["graphs"]["ranks"]:
        assert rank["cuts"] == {1: None, 2: None, 4: None}


def test_tensor_parallel_attention_ranks_replay_graphs_with_expert_parallel_moe(folder):
    """EP 2 without DP attention: both ranks hold every request and pad alike; each routes half the padded
    tokens through naive's fixed blocks."""
    parallel = ParallelConfig(tp_size=2, ep_size=2, dist_init_addr=free_address(), timeout_s=120)
    variants = {"graphs": ({}, True)}
    out = launch(graph_ranks.run_engines, parallel, parallel, folder, PROMPTS, PARAMS, variants)["graphs"]
    assert_same_tokens(out["results"], single_rank(folder), "ep2 graphs vs one rank")
    first, second = (rank["replays"] for rank in out["ranks"])
    assert first and first == second
    assert all(rank["pages_conserved"] for rank in out["ranks"])


@pytest.mark.slow
def test_dp_groups_of_two_attention_ranks_replay_graphs(folder):
    """tp 4, dp 2, ep 4: each DP group's two ranks hold its requests and route half the padded tokens each;
    the idle group's two ranks replay padding."""
    parallel = ParallelConfig(tp_size=4, ep_size=4, dp_size=2, enable_dp_attention=True,
                              dist_init_addr=free_address(), timeout_s=120)
    variants = {"graphs": ({"overlap_schedule": True}, True)}
    out = launch(graph_ranks.run_engines, parallel, parallel, folder, PROMPTS, PARAMS, variants)["graphs"]
    assert_same_tokens(out["results"], single_rank(folder), "tp4-dp2-ep4 graphs vs one rank")
    replays = [rank["replays"] for rank in out["ranks"]]
    assert replays[0] == replays[1] and replays[2] == replays[3]  # the two ranks of a group
    assert [size for size, _, _ in replays[0]] == [size for size, _, _ in replays[2]]
    assert any(mode == ForwardMode.IDLE.name for _, _, mode in replays[2])
    assert all(rank["pages_conserved"] for rank in out["ranks"])


# --- on 2 GPUs: real captures over NCCL ----------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs; fewer are visible")
@pytest.mark.parametrize("overlap", ["none", "tbo"])
def test_dp_ranks_replaying_captured_graphs_on_two_gpus_equal_one_gpu(folder, overlap):
    """DP attention over 2 GPUs, `naive` + `triton` captured per rank (fixed blocks over NCCL), fp32 greedy."""
    settings = dict(model=folder, device="cuda", dtype="fp32", moe_kernel="triton", attention_backend="triton",
                    show_progress=False, max_total_tokens=1024, page_size=4, cuda_graph_max_bs=8, overlap=overlap)
    parallel = ParallelConfig(tp_size=2, ep_size=2, dp_size=2, enable_dp_attention=True,
                              dist_init_addr=free_address(), timeout_s=300)
    ours = generate(EngineConfig(dispatcher="naive", parallel=parallel, enable_multi_rank_cuda_graph=True, **settings),
                    PROMPTS, PARAMS)
    reference = generate(EngineConfig(dispatcher="local", disable_cuda_graph=True, **settings), PROMPTS, PARAMS)
    # the GPU kernels sum in an order that follows the batch: the fp32 criterion of ep_multi_gpu.py (1e-3)
    assert_same_tokens(ours, reference, f"2 GPUs in graphs ({overlap}) vs one GPU eager", tolerance=1e-3)
