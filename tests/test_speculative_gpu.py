"""Speculative decoding on a GPU: verify steps as decode rows through triton attention (MLA's latent and GQA)
replaying the decode CUDA graphs; output equal to the GPU engine without speculation."""

from __future__ import annotations

import pytest

from moeplex.config import EngineConfig
from moeplex.engine import Engine
from moeplex.models.make_model import write_checkpoint
from moeplex.sampling import SamplingParams

from test_speculative import PROMPTS, conserved, scripted, script_distribution  # noqa: F401 (a fixture)

GPU = dict(device="cuda", dtype="fp32", moe_kernel="triton", attention_backend="triton", cuda_graph_max_bs=16,
           max_running_requests=16, show_progress=False, max_total_tokens=4096, page_size=16)
GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)


def gpu_engine(folder: str, **overrides) -> Engine:
    return Engine(EngineConfig(model=folder, **{**GPU, **overrides}))


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe"])
@pytest.mark.parametrize("drafter", ["ngram", "test-oracle", "test-adversary"])
def test_on_gpu_speculation_changes_no_token(tiny_model_dir, script_distribution, arch, drafter):  # noqa: F811
    folder = tiny_model_dir(arch)
    plain = gpu_engine(folder)
    want = [r.output_ids for r in plain.generate(PROMPTS, GREEDY)]
    scripted(PROMPTS, want)
    spec = gpu_engine(folder, speculative_algorithm=drafter, speculative_num_steps=3, speculative_policy="fixed")
    graphs = spec.runner.graphs
    # ngram reads no hidden states: the steps between drafting ones overlap, and its verify steps too, whose largest
    # graph holds a full grid of 16 x 4 rows with 16 prompt rows beside it (the host drafters' steps admit none)
    assert graphs is not None and spec.overlap_schedule
    assert max(graphs.sizes) == (16 * 4 + 16 if drafter == "ngram" else 16)
    replayed, run = [], graphs.run
    # the decode and verify steps' sizes (a prompt replayed as decode rows, sample_rows set, is no such step)
    graphs.run = lambda batch, rows=None: (
        (batch.sample_rows is None and replayed.append(batch.batch_size)) or run(batch, rows))
    got = spec.generate(PROMPTS, GREEDY)
    assert [r.output_ids for r in got] == want
    if drafter == "test-oracle":  # every decode step verified drafts: 3 requests x 4 rows, from the graphs
        assert max(replayed) == 12
    assert conserved(spec)


@pytest.mark.gpu
def test_on_gpu_nextn_changes_no_token(tmp_path):
    folder = write_checkpoint(str(tmp_path), "deepseek_v3", "tiny", seed=0, mtp=1)
    want = [r.output_ids for r in gpu_engine(folder).generate(PROMPTS, GREEDY)]
    spec = gpu_engine(folder, speculative_algorithm="nextn", speculative_num_steps=3, speculative_policy="fixed")
    got = spec.generate(PROMPTS, GREEDY)
    assert [r.output_ids for r in got] == want
    assert all(r.spec_verify_steps > 0 for r in got)
    assert conserved(spec)


@pytest.mark.gpu
@pytest.mark.parametrize("drafter", ["ngram", "test-oracle"])
def test_on_gpu_the_adaptive_policy_changes_no_token(tiny_model_dir, script_distribution, drafter):  # noqa: F811
    """The adaptive policy's cost model measured through the decode graphs (verify rows replayed), lazily, for
    the batch sizes the steps ask for; output as without speculation."""
    folder = tiny_model_dir("qwen3_moe")
    want = [r.output_ids for r in gpu_engine(folder).generate(PROMPTS, GREEDY)]
    scripted(PROMPTS, want)
    spec = gpu_engine(folder, speculative_algorithm=drafter, speculative_num_steps=3)
    got = spec.generate(PROMPTS, GREEDY)
    assert [r.output_ids for r in got] == want
    assert 4 in spec.step_costs.measured and all(c > 0 for c in spec.step_costs.measured[4])
    if drafter == "test-oracle":  # a record of full acceptance at batch <= 4 on a GPU: it keeps drafting
        assert sum(r.spec_verify_steps for r in got) > 0
    assert conserved(spec)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe"])
def test_on_gpu_verify_steps_with_a_prompt_replay_graphs_as_rows(tiny_model_dir, script_distribution, arch):  # noqa: F811
    """--mixed-chunk on: a prompt admitted while others decode shares their verify step, its tokens run as decode rows
    with the verify rows (ModelRunner.verify_rows) and the step replays a decode graph; no token changes."""
    folder = tiny_model_dir(arch)
    plain = gpu_engine(folder)
    want = [r.output_ids for r in plain.generate(PROMPTS, GREEDY)]
    scripted(PROMPTS, want)
    spec = gpu_engine(folder, speculative_algorithm="test-oracle", speculative_num_steps=3, speculative_policy="fixed",
                      mixed_chunk=True, chunked_prefill_size=8)
    graphs, verify_forward, shared = spec.runner.graphs, spec.runner.verify_forward, []

    def counted(batch, rows, with_hidden):  # a verify step's rows and a prompt's, replayed from one graph
        shared.append(batch.sample_rows is not None and batch.batch_size == batch.num_tokens > len(rows)
                      and graphs.can_run(batch))
        return verify_forward(batch, rows, with_hidden)

    spec.runner.verify_forward = counted
    requests = [spec.add_request(p, GREEDY) for p in PROMPTS[:2]]
    for _ in range(3):
        spec.step()
    requests.append(spec.add_request(PROMPTS[2], GREEDY))
    while spec.has_work:
        spec.step()
    assert [r.output_ids for r in requests] == want
    assert any(shared)
    assert conserved(spec)
