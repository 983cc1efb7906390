"""Prompt steps run as decode rows, one per token, so that they replay the decode graphs (model_runner.prompt_rows).

On the CPU everything but the capture runs: the engine gets DecodeGraphs whose `capture` runs the step again over
the static inputs (through Triton's interpreter), so a prompt step goes through the rows path a GPU replays. The
reference is the same engine with --disable-prompt-graphs (prompts as ordinary extends, decode steps replayed alike)
and an engine without graphs on the torch attention backend. The `gpu` test captures for real.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from moeplex.attention.triton_backend import INTERPRETED
from moeplex.config import EngineConfig
from moeplex.cuda_graph import DecodeGraphs, DecodeInputs, capture_sizes, max_pages_per_request
from moeplex.engine import Engine
from moeplex.model_runner import PROMPT_ROW_READS, ModelRunner
from moeplex.sampling import SamplingParams
from moeplex.speculation.costs import StepCosts, grid_sizes
from moeplex.speculation.policy import AdaptivePolicy

from test_speculative import conserved, script_distribution, scripted  # noqa: F401 (a fixture)
from test_speculative_policy import table

PAGE = 4
MAX_BS = 16
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
SHARED = [256] + list(range(60, 71))  # 12 tokens: the second prompt that starts with it finds 3 pages cached
PROMPTS = [
    [256, 5, 6, 7],
    SHARED + [3, 4],
    list(range(100, 130)),  # 30 tokens: more rows than the largest graph, an ordinary extend
    [256, 9],
    SHARED + [8, 9, 10],
]

interpreted = pytest.mark.skipif(not INTERPRETED, reason="the CPU check of replay through the static inputs")


def engine(folder: str, **overrides) -> Engine:
    settings = dict(model=folder, dtype="fp32", show_progress=False, max_total_tokens=512, page_size=PAGE,
                    attention_backend="triton", mixed_chunk=False, max_running_requests=4)
    return Engine(EngineConfig(**{**settings, **overrides}))


def with_graphs(spec: Engine, decodes: list | None = None) -> list[tuple[int, bool]]:
    """Give a CPU engine decode graphs (each replay runs the step again over the static inputs); returns the log of
    its prompt steps (logged_prompts)."""
    kv, model = spec.kv, spec.model
    inputs = DecodeInputs.allocate(MAX_BS, max_pages_per_request(kv, None), kv, "cpu")
    spec.runner.graphs = DecodeGraphs(model, kv, spec.runner.strategy, inputs, capture_sizes(MAX_BS),
                                      lambda step: step)
    return logged_prompts(spec.runner, decodes)


def logged_prompts(runner: ModelRunner, decodes: list | None = None) -> list[tuple[int, bool]]:
    """The log of the runner's steps that hold prompt tokens: (tokens, whether they ran as rows); `decodes`, if
    given, gets the count of decoding requests beside the prompts of each."""
    log = []
    decide = runner.prompt_rows

    def logged(work):
        rows = decide(work)
        decoding = [w.num_tokens == 1 and w.request.num_cached > 0 for w in work]
        if not all(decoding):
            log.append((sum(w.num_tokens for w in work), rows))
            if decodes is not None:
                decodes.append(sum(decoding))
        return rows

    runner.prompt_rows = logged
    return log


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    folder = tiny_model_dir("qwen3_moe")
    return [r.output_ids for r in engine(folder, attention_backend="torch").generate(PROMPTS, GREEDY)]


@interpreted
@pytest.mark.parametrize("overlap", [False, True])
def test_prompt_steps_replayed_as_rows_change_no_token(tiny_model_dir, reference, overlap):
    """One request at a time: fresh prompts, a prompt after a cached prefix (3 new tokens after 12), a prompt too
    long for any graph (eager). The tokens of plain decoding, and the pools empty afterwards."""
    spec = engine(tiny_model_dir("qwen3_moe"), overlap_schedule=overlap, max_running_requests=1)
    log = with_graphs(spec)
    assert [r.output_ids for r in spec.generate(PROMPTS, GREEDY)] == reference
    assert {(4, True), (14, True), (30, False), (3, True)} <= set(log)
    assert conserved(spec)


@interpreted
def test_prompt_chunks_run_as_rows_and_only_the_last_samples(tiny_model_dir, reference):
    """--chunked-prefill-size 8: every chunk of the 30-token prompt fits a graph, later chunks read the earlier
    ones' KV from the cache, and a chunk that does not end its prompt samples nothing."""
    spec = engine(tiny_model_dir("qwen3_moe"), chunked_prefill_size=8, max_batched_tokens=16)
    log = with_graphs(spec)
    assert [r.output_ids for r in spec.generate(PROMPTS, GREEDY)] == reference
    assert log and all(rows for _, rows in log)
    assert conserved(spec)


@interpreted
def test_a_prompt_joins_the_decodes_beside_it_as_rows(tiny_model_dir, reference):
    """--mixed-chunk on: the fifth prompt is admitted while four requests decode (one at a time, as they finish), and
    its step of prompt rows and decode rows replays one graph."""
    spec = engine(tiny_model_dir("qwen3_moe"), mixed_chunk=True, max_running_requests=4)
    decodes = []
    log = with_graphs(spec, decodes)
    short = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)  # the first request leaves early
    got = [r.output_ids for r in spec.generate(PROMPTS, [short] + [GREEDY] * 4)]
    assert got == [reference[0][:3]] + reference[1:]
    assert any(rows and beside for (_, rows), beside in zip(log, decodes)), (log, decodes)
    assert conserved(spec)


@interpreted
def test_a_speculating_engines_mixed_steps_verify_where_their_rows_replay_a_graph(tiny_model_dir,
                                                                                 script_distribution):  # noqa: F811
    """--mixed-chunk auto with decode graphs (plain_mixed_steps): a step holding a prompt beside decodes verifies
    drafts where its rows, each decoding request at its full draft width, fit a graph (16 rows here), the prompt's
    tokens decode rows beside the verify rows in one replay; a 30-token prompt beside them makes a plain mixed step.
    The oracle's drafts, so every token is plain decoding's; pools empty afterwards."""
    folder = tiny_model_dir("qwen3_moe")
    prompts = [PROMPTS[0], PROMPTS[3], PROMPTS[1], PROMPTS[4], PROMPTS[2], [256, 7, 8]]
    short = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in (3, 5)]
    params = short + [GREEDY] * 4
    want = [r.output_ids for r in engine(folder, attention_backend="torch").generate(prompts, params)]
    scripted(prompts, want)
    spec = engine(folder, mixed_chunk=True, speculative_algorithm="test-oracle", speculative_num_steps=2,
                  speculative_policy="fixed", disable_speculative_backoff=True)
    spec.plain_mixed_steps = True  # what auto sets where decode steps replay graphs (a GPU)
    with_graphs(spec)
    steps = []  # per step holding a prompt beside decodes: (its tokens with one row per decode, drafts verified)
    prepare = spec.runner.prepare

    def prepared(work, *args, drafts=None, **kwargs):
        decodes = sum(1 for item in work if item.request.output_ids)
        if decodes < len(work) and decodes:
            steps.append((sum(item.num_tokens for item in work), sum(len(d) for d in drafts or ())))
        return prepare(work, *args, drafts=drafts, **kwargs)

    spec.runner.prepare = prepared
    assert [r.output_ids for r in spec.generate(prompts, params)] == want
    assert any(drafts for _, drafts in steps), steps  # the 3-token prompt beside 3 decodes: 12 rows with drafts
    assert any(tokens >= 30 and not drafts for tokens, drafts in steps), steps
    assert conserved(spec)


@interpreted
def test_the_adaptive_policy_keeps_mixed_steps_plain_where_they_cost_more_than_their_drafts_give(
        tiny_model_dir, script_distribution):  # noqa: F811
    """The same under the adaptive policy: where mixed verify steps are priced at the table's verify step they
    verify the oracle's drafts; where serving measured them at 32x it (StepCosts.sync_scales), every mixed step is
    plain, while steps of decodes alone still verify. Tokens as plain decoding's either way."""
    folder = tiny_model_dir("qwen3_moe")
    prompts = [PROMPTS[0], PROMPTS[3], PROMPTS[1], PROMPTS[4], PROMPTS[2], [256, 7, 8]]
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in (3, 5)] + [GREEDY] * 4
    want = [r.output_ids for r in engine(folder, attention_backend="torch").generate(prompts, params)]
    scripted(prompts, want)
    for dear in (False, True):
        spec = engine(folder, mixed_chunk=True, speculative_algorithm="test-oracle", speculative_num_steps=2)
        spec.plain_mixed_steps = True  # what auto sets where decode steps replay graphs (a GPU)
        with_graphs(spec)
        costs = StepCosts(grid_sizes(64), table(1.0, 0.01), lambda n: 0.1)  # rows cheap: drafting pays
        spec.speculation.policy = AdaptivePolicy(2, costs)
        costs.measure_all()
        if dear:
            costs.sync_scales.update(dict.fromkeys(costs.sizes, 32.0))
        drafted = {True: 0, False: 0}  # drafts verified in steps with / without a prompt
        prepare = spec.runner.prepare

        def prepared(work, *args, drafts=None, **kwargs):
            prompt = any(not item.request.output_ids for item in work)
            drafted[prompt] += sum(len(d) for d in drafts or ())
            return prepare(work, *args, drafts=drafts, **kwargs)

        spec.runner.prepare = prepared
        assert [r.output_ids for r in spec.generate(prompts, params)] == want
        assert drafted[False] > 0 and (drafted[True] == 0) == dear, (dear, drafted)
        assert conserved(spec)


@interpreted
def test_disabled_prompt_graphs_run_prompts_as_extends(tiny_model_dir, reference):
    spec = engine(tiny_model_dir("qwen3_moe"), disable_prompt_graphs=True)
    log = with_graphs(spec)
    assert [r.output_ids for r in spec.generate(PROMPTS, GREEDY)] == reference
    assert log and not any(rows for _, rows in log)


def fake_runner(sizes=(1, 2, 4, 8, 16), cuts=None, recording=False, enabled=True) -> ModelRunner:
    graphs = SimpleNamespace(sizes=list(sizes), cuts=cuts or {}, recording=recording)
    return ModelRunner(None, None, None, torch.device("cpu"), graphs=graphs, prompt_graphs=enabled)


def work(*items):
    """(cached, new) per request."""
    return [SimpleNamespace(request=SimpleNamespace(num_cached=c), num_tokens=n) for c, n in items]


def test_which_verify_steps_with_a_prompt_replay_as_rows():
    runner = fake_runner()
    assert runner.verify_replays(work((0, 5), (7, 1), (9, 1)), [0, 3, 3])  # 5 + 4 + 4 rows
    assert not runner.verify_replays(work((0, 9), (7, 1), (9, 1)), [0, 3, 3])  # 17 rows: no graph holds them
    assert not runner.verify_replays(work((7, 1), (9, 1)), [3, 3])  # no prompt: a verify batch as it is
    assert not runner.verify_replays(work((PROMPT_ROW_READS // 8, 8), (7, 1)), [0, 3])
    assert not fake_runner(cuts={16: [8]}).verify_replays(work((0, 9), (7, 1)), [0, 3])
    assert not fake_runner(recording=True).verify_replays(work((0, 4), (7, 1)), [0, 3])
    assert not fake_runner(enabled=False).verify_replays(work((0, 4), (7, 1)), [0, 3])
    assert not ModelRunner(None, None, None, torch.device("cpu")).verify_replays(work((0, 4), (7, 1)), [0, 3])


def test_which_prompt_steps_run_as_rows():
    runner = fake_runner()
    assert runner.prompt_rows(work((0, 16)))
    assert runner.prompt_rows(work((0, 5), (7, 1), (3, 2)))  # a prompt beside decodes (a mixed step)
    assert runner.prompt_rows(work((0, 1)))  # a one-token prompt (an extend: its first position)
    assert not runner.prompt_rows(work((4, 1), (9, 1)))  # a decode batch as it is
    assert not runner.prompt_rows(work((0, 17)))  # more rows than the largest graph
    assert not runner.prompt_rows(work((PROMPT_ROW_READS // 8, 8)))  # rows reading a long cached prefix
    assert not fake_runner(cuts={16: [8]}).prompt_rows(work((0, 12)))  # a size cut into micro-batches
    assert fake_runner(cuts={16: [8]}).prompt_rows(work((0, 8)))
    assert not fake_runner(recording=True).prompt_rows(work((0, 4)))
    assert not fake_runner(enabled=False).prompt_rows(work((0, 4)))
    assert not ModelRunner(None, None, None, torch.device("cpu")).prompt_rows(work((0, 4)))


def test_the_flag_turns_prompt_graphs_off(tiny_model_dir):
    from moeplex.cli import build_parser
    from moeplex.cli.flags import engine_config

    parser = build_parser()
    folder = tiny_model_dir("qwen3_moe")
    assert not engine_config(parser.parse_args(["serve", "--model", folder])).disable_prompt_graphs
    assert engine_config(parser.parse_args(["serve", "--model", folder, "--disable-prompt-graphs"])).disable_prompt_graphs


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_prompt_graphs_change_no_token_on_gpu(tiny_model_dir, arch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    settings = dict(device="cuda", moe_kernel="triton", max_total_tokens=4096, cuda_graph_max_bs=16,
                    max_running_requests=1)  # one prompt a step; graphs up to 16 rows all the same
    folder = tiny_model_dir(arch)
    rows, plain = engine(folder, **settings), engine(folder, disable_prompt_graphs=True, **settings)
    assert rows.runner.graphs is not None and rows.runner.graphs.sizes == capture_sizes(16)
    assert plain.runner.graphs.sizes == [1]  # decode rows only: at most --max-running-requests
    log = logged_prompts(rows.runner)
    assert [r.output_ids for r in rows.generate(PROMPTS, GREEDY)] == \
        [r.output_ids for r in plain.generate(PROMPTS, GREEDY)]
    assert {(4, True), (14, True), (30, False), (3, True)} <= set(log)


@pytest.mark.gpu
def test_on_gpu_prompts_share_steps_with_decodes_unless_prompts_run_eagerly(tiny_model_dir):
    """--mixed-chunk auto on a GPU: mixed steps where prompt graphs are captured, a speculating engine's too (its
    mixed steps then draft only where their rows with drafts replay a graph and the policy prices the drafts worth
    a synchronous step: plain_mixed_steps), within the largest graph's rows."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    settings = dict(device="cuda", moe_kernel="triton", max_total_tokens=4096, cuda_graph_max_bs=16)
    folder = tiny_model_dir("qwen3_moe")
    assert engine(folder, mixed_chunk=None, **settings).scheduler.mixed
    assert not engine(folder, mixed_chunk=None, disable_prompt_graphs=True, **settings).scheduler.mixed
    spec = engine(folder, mixed_chunk=None, speculative_algorithm="ngram", **settings)
    assert spec.scheduler.mixed and spec.plain_mixed_steps
