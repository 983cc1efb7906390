"""Verify steps under the overlap schedule (speculation/overlap.py): with a drafter that drafts on the device, the
next verify step is launched before the host reads the one in flight, and no token changes: greedy equal to
non-speculative greedy with the overlap schedule on and off, stops inside accepted runs, max_new_tokens, preemption,
the prefix cache, sampled requests (seeded ones reproduce), and the KV pool back to empty after each run."""

from __future__ import annotations

import attrs
import pytest
import torch

from moeplex.config import EngineConfig
from moeplex.engine import Engine
from moeplex.models.make_model import write_checkpoint
from moeplex.models.setup import read_config
from moeplex.models.synthetic_mtp import next_token_map
from moeplex.sampling import SamplingParams
from moeplex.speculation.overlap import VerifyInFlight

from test_speculative import PROMPTS, conserved, script_distribution, scripted, settings  # noqa: F401 (a fixture)

GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
NGRAM = dict(speculative_algorithm="ngram", speculative_num_steps=3)


def engine(folder: str, **overrides) -> Engine:
    return Engine(EngineConfig(**settings(folder, **overrides)))


class Launches:
    """Counts the verify steps that follow a verify step in flight, and the first steps of runs (from the host's
    tokens or from a plain step in flight: after_plain)."""

    def __init__(self, engine: Engine):
        self.following = self.first = self.admitted = 0  # admitted: requests a following step admitted
        launch = engine.overlap_verify.launch

        def counted(requests, counts, previous, hooks=None, prompts=()):
            if previous is None or previous.ahead:
                self.first += 1
            else:
                self.following += 1
            self.admitted += len(prompts)
            return launch(requests, counts, previous, hooks, prompts)

        engine.overlap_verify.launch = counted


def admit_beside(spec: Engine) -> None:
    """Let the engine's verify steps admit waiting requests (OverlapVerify.follow) within its token budget, as a GPU
    engine's do within its largest decode graph: a CPU engine has no graphs, and admits in steps of its own."""
    assert spec.overlap_verify.admit_rows is None  # (build.admit_rows: none without graphs)
    spec.overlap_verify.admit_rows = spec.scheduler.token_budget


def arriving(spec: Engine, prompts, params: SamplingParams) -> list:
    """The prompts added one every other step, then run to the end; their requests."""
    requests = []
    for prompt in prompts:
        requests.append(spec.add_request(prompt, params))
        spec.step(), spec.step()
    while spec.has_work:
        spec.step()
    return requests


def outputs(requests) -> list[list[int]]:
    return [list(r.output_ids) for r in requests]


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    """Non-speculative outputs, overlap schedule off, per architecture."""
    return {arch: outputs(engine(tiny_model_dir(arch)).generate(PROMPTS, GREEDY)) for arch in ("deepseek_v3", "qwen3_moe")}


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe"])
@pytest.mark.parametrize("steps", [1, 3])
def test_greedy_ngram_under_the_overlap_schedule_changes_no_token(tiny_model_dir, plain, arch, steps):
    spec = engine(tiny_model_dir(arch), overlap_schedule=True, speculative_algorithm="ngram", speculative_num_steps=steps)
    launches = Launches(spec)
    got = spec.generate(PROMPTS, GREEDY)
    assert outputs(got) == plain[arch]
    assert launches.following > launches.first > 0, "verify steps were not launched ahead of the read"
    assert sum(r.spec_draft_tokens for r in got) > 0  # the repeated prompts gave it something to draft
    assert conserved(spec)


@pytest.mark.parametrize("steps", [1, 3])
def test_the_device_oracle_is_always_accepted_under_the_overlap_schedule(tiny_model_dir, plain, script_distribution,
                                                                         steps):
    """The oracle drafting on the device (the benchmarks' ceiling of the overlapped verify step): every draft is
    accepted, every step after the first is launched before the one in flight is read, no token changes."""
    scripted(PROMPTS, plain["qwen3_moe"])
    spec = engine(tiny_model_dir("qwen3_moe"), overlap_schedule=True, speculative_algorithm="test-oracle-device",
                  speculative_num_steps=steps, speculative_policy="fixed")
    launches = Launches(spec)
    got = spec.generate(PROMPTS, GREEDY)
    assert outputs(got) == plain["qwen3_moe"]
    assert launches.following > launches.first > 0
    assert all(r.spec_accept_rate == 1.0 and r.spec_verify_steps > 0 for r in got)
    assert conserved(spec)


def test_where_acceptance_is_forced_the_device_oracle_drafts_from_the_closest_script(monkeypatch):
    """A benchmark that forces acceptance (FALLBACK) measures the ceiling only while every request drafts: one whose
    own tokens left its script (a near tie broken the other way by another batch shape) drafts by position from the
    sequence sharing its longest prefix, where it used to draft nothing for the rest of its life."""
    import script_drafters as sd
    from moeplex.interfaces import DeviceTokens, DraftRequest

    monkeypatch.setattr(sd, "SCRIPT", [])
    sd.set_script([[1, 2, 3, 10, 11, 12, 13], [1, 5, 6, 20, 21, 22, 23]])
    left = DraftRequest("a", [1, 5, 6, 99], 3)  # the second script, left after its prompt
    for fallback, row in ((False, 2), (True, 1)):
        monkeypatch.setattr(sd, "FALLBACK", fallback)
        table = sd.ScriptTable("cpu", rows=2, width=8)
        assert table.rows([left]) == [[row, 4]]
        meta = torch.tensor(table.rows([left]))
        drafts = table.propose(meta, DeviceTokens(torch.tensor([[7]]), torch.tensor([1])), 2)
        assert drafts.counts.tolist() == [2 * fallback]
        assert drafts.tokens.tolist() == [[22, 23] if fallback else [-1, -1]]
    assert sd.closest_row([4, 4]) == -1  # shares no token with any sequence


def test_a_step_the_policy_drafts_nothing_for_is_a_plain_step(tiny_model_dir, plain, monkeypatch):
    """No overlapped verify step is launched without a draft chosen (it would pay its drafting and acceptance for
    a plain step's work): once the requests' drafts keep missing, the adaptive policy's steps take the ordinary
    path. The step costs are given (a verify step a little dearer than a plain one), not measured."""
    import moeplex.speculation.build
    from moeplex.speculation.costs import StepCosts, grid_sizes

    monkeypatch.setattr(moeplex.speculation.build, "measure_step_costs",
                        lambda *a, **k: StepCosts(grid_sizes(4), lambda n: [1.0, 1.05, 1.1, 1.15, 1.2]))
    spec = engine(tiny_model_dir("qwen3_moe"), overlap_schedule=True, max_running_requests=4,
                  speculative_policy="adaptive", speculative_cost_calibration=False, **NGRAM)  # (the table is given)
    chosen = []
    launch = spec.overlap_verify.launch
    spec.overlap_verify.launch = lambda requests, counts, *rest: chosen.append(list(counts)) or launch(requests, counts,
                                                                                                      *rest)
    got = spec.generate(PROMPTS, attrs.evolve(GREEDY, max_new_tokens=32))
    assert [o[:16] for o in outputs(got)] == plain["qwen3_moe"]  # (plain: 16 tokens each)
    assert chosen and all(any(counts) for counts in chosen), chosen
    assert spec.speculation.counts.plain_steps > 0 and spec.speculation.counts.verify_steps > 0
    assert conserved(spec)


@pytest.mark.parametrize("break_cost", [0.0, 0.2, 3.0])
def test_a_run_goes_on_through_steps_of_no_drafts_while_that_costs_less_than_its_breaks(tiny_model_dir, plain,
                                                                                       monkeypatch, break_cost):
    """Where ending a run of overlapped verify steps costs breaks of the overlap schedule (one now, one when drafts
    are wanted again), a step the policy drafts nothing for is a verify step of no drafts (width 1) while the run's
    idle steps cost less than two breaks (ski rental: a verify step of one row costs 0.3 more than a plain one
    here, and drafts of a random model rarely pay), then the run ends. Breaks that cost nothing end it at once. No
    token changes either way."""
    import moeplex.speculation.build
    from moeplex.speculation.costs import StepCosts, grid_sizes

    monkeypatch.setattr(moeplex.speculation.build, "measure_step_costs", lambda *a, **k: StepCosts(
        grid_sizes(4), lambda n: [1.0, 1.1, 1.9, 2.7, 3.5], lambda n: break_cost))
    spec = engine(tiny_model_dir("qwen3_moe"), overlap_schedule=True, max_running_requests=4,
                  speculative_policy="adaptive", speculative_cost_calibration=False, **NGRAM)  # (the table is given)
    idles = []
    launch = spec.overlap_verify.launch

    def counted(requests, counts, previous, hooks=None, prompts=()):
        step = launch(requests, counts, previous, hooks, prompts)
        idles.append((previous is not None, any(counts)))
        return step

    spec.overlap_verify.launch = counted
    follow = spec.overlap_verify.follow
    longest = []
    spec.overlap_verify.follow = lambda *a, **k: (lambda step: longest.append(step.idle if step else 0) or step)(
        follow(*a, **k))
    got = spec.generate(PROMPTS, attrs.evolve(GREEDY, max_new_tokens=32))
    assert [o[:16] for o in outputs(got)] == plain["qwen3_moe"]
    idle_steps = sum(following and not drafted for following, drafted in idles)
    most = 2 * break_cost / 0.1  # idle steps in a row the rule allows
    assert max(longest, default=0) < max(most, 1)
    if break_cost == 0.0:
        assert idle_steps == 0  # as before: the policy's plain steps
    else:
        assert idle_steps > 0, idles
    assert conserved(spec)


@pytest.fixture(scope="module")
def echo(tiny_model_dir, tmp_path_factory):
    """The tiny DeepSeek-V3 made to repeat its last token under greedy decoding (embedding scaled, output head tied
    to it, as the drafter conformance suite does): ngram's drafts are then accepted in long runs."""
    import os
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path_factory.mktemp("echo") / "model"
    shutil.copytree(tiny_model_dir("deepseek_v3"), folder)
    shards = {name: load_file(folder / name) for name in sorted(os.listdir(folder)) if name.endswith(".safetensors")}
    embed = next(t["model.embed_tokens.weight"] for t in shards.values() if "model.embed_tokens.weight" in t)
    scaled = (embed.float() * (30.0 / embed.float().std())).to(embed.dtype)
    for name, tensors in shards.items():
        touched = {k for k in ("model.embed_tokens.weight", "lm_head.weight") if k in tensors}
        if touched:
            save_file({**tensors, **{k: scaled.clone() for k in touched}}, folder / name, metadata={"format": "pt"})
    return str(folder)


ECHO_PROMPTS = [[256, 5, 6, 7, 5, 6, 7, 7, 7], [300, 301, 99, 99], [256] + list(range(40, 60))]


def test_requests_waiting_for_a_slot_do_not_end_a_run(echo):
    """With every running slot taken, waiting requests cannot be admitted, so they do not end a run of verify steps
    (every follow did, and an offline batch larger than --max-running-requests broke the overlap schedule at every
    step). With one slot the next request's prompt goes on with the run where its request ends. No token changes."""
    want = outputs(engine(echo).generate(ECHO_PROMPTS, GREEDY))
    spec = engine(echo, overlap_schedule=True, max_running_requests=1, **NGRAM)
    admit_beside(spec)
    launches = Launches(spec)
    got = spec.generate(ECHO_PROMPTS, GREEDY)
    assert outputs(got) == want
    assert launches.following > 2 * launches.first, (launches.following, launches.first)
    assert spec.step_log.breaks["verify_run_ended"] <= len(ECHO_PROMPTS)  # one per admission at most
    assert launches.admitted >= 1  # (a step of the next prompt alone, launched before the ended request's is read)
    assert conserved(spec)


@pytest.mark.parametrize("cached", [False, True])
def test_requests_admitted_beside_a_verify_step_keep_the_run_going(echo, cached):
    """Where a slot frees during a run, the waiting request is admitted into the next verify step with its whole
    prompt as decode rows beside the grid (its prefix-cached part skipped), so no admission ends the run; a request
    asking for logprobs (its tokens are needed on the host before its next step) and one whose prompt does not fit
    beside the grid take the ordinary path. No token changes and the pool ends as it began."""
    prompts = ECHO_PROMPTS * 2 + [[256] + list(range(100, 150))]
    params = [attrs.evolve(GREEDY, max_new_tokens=6 + 5 * i) for i in range(len(prompts))]  # (they end apart)
    params[4] = attrs.evolve(params[4], logprobs=1)

    def generate(spec: Engine) -> list:
        requests = [spec.add_request(p, q) for p, q in zip(prompts, params)]
        while spec.has_work:
            spec.step()
        return requests

    want = outputs(generate(engine(echo)))
    spec = engine(echo, overlap_schedule=True, max_running_requests=2, max_batched_tokens=48, **NGRAM)
    admit_beside(spec)
    if cached:  # the same prompts again: their cached prefixes are not rows
        assert outputs(generate(spec)) == want
    launches = Launches(spec)
    admitted = []
    admit = spec.scheduler.admit_whole
    spec.scheduler.admit_whole = lambda *a: (lambda got: admitted.extend(got) or got)(admit(*a))
    got = generate(spec)
    assert outputs(got) == want
    assert launches.admitted >= 2 and len(admitted) == launches.admitted
    assert got[4] not in admitted and got[-1] not in admitted  # logprobs; 51 rows beside a grid do not fit
    assert len(got[4].logprobs) == len(got[4].output_ids)
    assert spec.step_log.breaks["verify_run_ended"] < len(prompts) - launches.admitted
    assert conserved(spec)


@pytest.mark.parametrize("max_new", [1, 2, 7, 16])
def test_accepted_runs_stops_and_lengths_under_the_overlap_schedule(echo, max_new):
    """Long accepted runs (the echo model repeats, ngram predicts it): the same tokens, a stop token inside a run
    ends the request there, max_new_tokens inside a run too."""
    greedy = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    want = outputs(engine(echo).generate(ECHO_PROMPTS, greedy))
    spec = engine(echo, overlap_schedule=True, **NGRAM)
    launches = Launches(spec)
    got = spec.generate(ECHO_PROMPTS, greedy)
    assert outputs(got) == want
    if max_new >= 7:
        assert launches.following > 0 and sum(r.spec_accepted_tokens for r in got) > 0
    assert conserved(spec)


@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
def test_the_policy_changes_no_token_under_the_overlap_schedule(tiny_model_dir, plain, policy):
    # at most 4 requests (3 are sent): the adaptive policy measures its step costs at start-up for every batch size
    # of its grid (1, 2, 4, ... max_running_requests); 64 measured sizes 8..64 no request here reaches
    spec = engine(tiny_model_dir("deepseek_v3"), overlap_schedule=True, speculative_policy=policy,
                  max_running_requests=4, **NGRAM)
    assert outputs(spec.generate(PROMPTS, GREEDY)) == plain["deepseek_v3"]
    assert conserved(spec)


@pytest.mark.parametrize("drafter", ["test-oracle", "test-adversary"])
def test_host_drafters_keep_the_synchronous_path_and_change_no_token(tiny_model_dir, plain, script_distribution,
                                                                      drafter):
    import script_drafters

    script_drafters.SCRIPT[:] = [list(p) + list(o) for p, o in zip(PROMPTS, plain["deepseek_v3"])]
    spec = engine(tiny_model_dir("deepseek_v3"), overlap_schedule=True, speculative_algorithm=drafter)
    assert spec.overlap_verify is None  # it drafts on the host only
    got = spec.generate(PROMPTS, GREEDY)
    assert outputs(got) == plain["deepseek_v3"]
    assert sum(r.spec_draft_tokens for r in got) > 0
    assert conserved(spec)


@pytest.mark.parametrize("repeats", [2, 3, 6])
def test_a_stop_inside_an_accepted_run_ends_the_request_there(echo, repeats):
    """The echo model's output repeats the prompt's last token (one byte of text each): a stop string of that byte
    `repeats` times is met inside a run of accepted drafts."""
    stops = [SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True, stop=chr(p[-1]) * repeats)
             for p in ECHO_PROMPTS]
    want = engine(echo).generate(ECHO_PROMPTS, stops)
    spec = engine(echo, overlap_schedule=True, **NGRAM)
    launches = Launches(spec)
    got = spec.generate(ECHO_PROMPTS, stops)
    assert [(r.output_ids, r.text, r.finish_reason) for r in got] == [(r.output_ids, r.text, r.finish_reason) for r in want]
    assert [len(r.output_ids) for r in got] == [repeats] * len(ECHO_PROMPTS)
    if repeats > 2:
        assert launches.first > 0 and sum(r.spec_accepted_tokens for r in got) > 0
    assert conserved(spec)


def test_stops_and_max_new_tokens_on_a_random_model(tiny_model_dir, plain):
    """Every token the plain output holds, as a stop token, ends each request at the same place; lengths 1..5 too."""
    folder = tiny_model_dir("deepseek_v3")
    want = plain["deepseek_v3"]
    for k in (1, 2, 5, 9):
        stops = [SamplingParams(max_new_tokens=16, temperature=0.0, stop_token_ids=[out[k]]) for out in want]
        base = outputs(engine(folder).generate(PROMPTS, stops))
        spec = engine(folder, overlap_schedule=True, **NGRAM)
        assert outputs(spec.generate(PROMPTS, stops)) == base
        assert conserved(spec)
    for n in (1, 2, 3, 5):
        params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
        spec = engine(folder, overlap_schedule=True, **NGRAM)
        assert outputs(spec.generate(PROMPTS, params)) == [out[:n] for out in want]
        assert conserved(spec)


def test_preemption_and_the_prefix_cache_under_the_overlap_schedule(tiny_model_dir):
    folder = tiny_model_dir("qwen3_moe")
    prompts = PROMPTS * 3
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    want = outputs(engine(folder).generate(prompts, params))
    tight = engine(folder, overlap_schedule=True, max_total_tokens=192, **NGRAM)
    got = tight.generate(prompts, params)
    assert outputs(got) == want
    assert sum(r.num_preemptions for r in got) > 0, "the pool was not tight enough to preempt"
    assert conserved(tight)
    cached = engine(folder, overlap_schedule=True, **NGRAM)
    assert outputs(cached.generate(prompts, params)) == want
    assert outputs(cached.generate(prompts, params)) == want  # the second time from the prefix cache
    assert cached.prefix_cache.hit_tokens > 0
    assert conserved(cached)


def test_sampled_requests_under_the_overlap_schedule(tiny_model_dir):
    """Unseeded requests verify on the overlapped path; seeded ones take the synchronous path and give the same
    tokens as without speculation."""
    folder = tiny_model_dir("deepseek_v3")
    seeded = [SamplingParams(max_new_tokens=12, temperature=0.8, top_k=20, seed=11 + i) for i in range(len(PROMPTS))]
    want = outputs(engine(folder).generate(PROMPTS, seeded))
    spec = engine(folder, overlap_schedule=True, **NGRAM)
    assert outputs(spec.generate(PROMPTS, seeded)) == want
    free = SamplingParams(max_new_tokens=12, temperature=0.8, top_k=20, ignore_eos=True)
    spec = engine(folder, overlap_schedule=True, **NGRAM)
    launches = Launches(spec)
    got = spec.generate(PROMPTS, free)
    assert all(len(r.output_ids) == 12 and all(0 <= t < 512 for t in r.output_ids) for r in got)
    assert launches.first > 0
    assert conserved(spec)


@pytest.mark.slow
def test_ngram_over_ep2_ranks_under_the_overlap_schedule(tiny_model_dir, plain):
    """tp2 with experts over 2 gloo ranks: every rank launches the same verify steps ahead of its reads, and admits
    the request waiting for a slot into the same verify step (two slots; the first request ends early)."""
    import parallel_ranks
    from moeplex.parallel import ParallelConfig
    from moeplex.ranks.launcher import launch
    from test_parallel import LAYOUTS, free_address

    folder = tiny_model_dir("deepseek_v3")
    parallel = ParallelConfig(dist_init_addr=free_address(), timeout_s=120, **LAYOUTS["ep2"])
    spec = {"speculative_algorithm": "ngram", "speculative_num_steps": 2, "dtype": "fp32", "overlap_schedule": True,
            "max_running_requests": 2}
    params = [attrs.evolve(GREEDY, max_new_tokens=5)] + [GREEDY] * (len(PROMPTS) - 1)
    results = launch(parallel_ranks.generate_admitting_beside, parallel, parallel, [folder], PROMPTS, params, spec)
    want = plain["deepseek_v3"]
    assert [r["output_ids"] for r in results[folder]] == [want[0][:5]] + want[1:]


def test_device_drafts_outside_the_vocabulary_are_void(echo):
    """A drafter that drafts on the device and proposes an id past the vocabulary: that request's drafts are not
    verified (decided on the device) and no token changes."""
    from moeplex.interfaces import DeviceDrafts

    greedy = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    want = outputs(engine(echo).generate(ECHO_PROMPTS, greedy))
    spec = engine(echo, overlap_schedule=True, **NGRAM)
    drafter = spec.speculation.drafter
    propose = drafter.propose_on_device

    def faulty(requests, pending=None):
        drafts = propose(requests, pending)
        tokens = drafts.tokens.clone()
        tokens[0, 0] = spec.vocab_size + 3  # the first request's first draft, whatever its count
        return DeviceDrafts(tokens, drafts.counts)

    drafter.propose_on_device = faulty
    launches = Launches(spec)
    got = spec.generate(ECHO_PROMPTS, greedy)
    assert outputs(got) == want
    assert launches.following > 0
    assert got[0].spec_draft_tokens == 0 < got[1].spec_draft_tokens
    assert conserved(spec)


def test_an_abort_while_a_verify_step_is_in_flight(echo):
    """A request aborted between steps (a client gone) while its verify step is in flight: its late tokens are
    dropped, the others' outputs do not change, every page comes back."""
    from moeplex.speculation.overlap import VerifyInFlight

    greedy = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    want = outputs(engine(echo).generate(ECHO_PROMPTS, greedy))
    spec = engine(echo, overlap_schedule=True, **NGRAM)
    requests = [spec.add_request(p, greedy) for p in ECHO_PROMPTS]
    while not isinstance(spec.in_flight, VerifyInFlight):
        spec.step()
    spec.abort(requests[1].rid)
    kept = len(requests[1].output_ids)
    while spec.has_work:
        spec.step()
    assert outputs([requests[0], requests[2]]) == [want[0], want[2]]
    assert requests[1].finish_reason.value == "abort" and len(requests[1].output_ids) == kept
    assert conserved(spec)


@pytest.mark.gpu
def test_on_gpu_verify_steps_overlap_and_replay_the_decode_graphs(echo):
    """On a GPU (the overlap schedule on by default): ngram's verify steps are launched ahead of their reads,
    replay the decode graphs (3 requests x 4 rows: a graphed verify step replays the graph of its padded size
    over the static inputs it wrote, `replay_loaded`), and give the tokens of the GPU engine without speculation."""
    from test_speculative_gpu import gpu_engine

    greedy = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    want = outputs(gpu_engine(echo).generate(ECHO_PROMPTS, greedy))
    spec = gpu_engine(echo, speculative_policy="fixed", **NGRAM)
    assert spec.overlap_schedule and spec.overlap_verify is not None
    graphs = spec.runner.graphs
    replayed, run, loaded = [], graphs.run, graphs.replay_loaded
    graphs.run = lambda batch, rows=None: replayed.append(batch.batch_size) or run(batch, rows)
    graphs.replay_loaded = lambda size: replayed.append(size) or loaded(size)
    launches = Launches(spec)
    got = spec.generate(ECHO_PROMPTS, greedy)
    assert outputs(got) == want
    assert launches.following > 0 and max(replayed) >= 12, replayed
    assert sum(r.spec_accepted_tokens for r in got) > 0
    assert conserved(spec)


@pytest.mark.parametrize("seed", range(4))
def test_shifted_rows_equal_rows_built_at_the_shifted_positions(seed):
    """shift_rows moves a decode batch built at known positions by per-request offsets on the device: the same
    positions, lengths, KV slots and flattened KV indices as a batch built at the final positions."""
    import random

    import torch

    from moeplex.batch_builder import ScheduledSeq, build_forward_batch
    from moeplex.kv_cache import KVPool
    from moeplex.speculation.overlap import shift_rows

    rng = random.Random(seed)
    kv = KVPool(64, 4, [[(2,)]], torch.float32, torch.device("cpu"))
    width, bound = 1 + rng.randint(0, 3), 4
    starts = [rng.randint(1, 30) for _ in range(3)]
    offsets = [rng.randint(1, bound) for _ in starts]
    pages = [kv.allocate(kv.pages_for(s + bound + width)) for s in starts]
    base = build_forward_batch([ScheduledSeq([0], s + j, p) for s, p in zip(starts, pages) for j in range(width)], kv, "cpu")
    want = build_forward_batch([ScheduledSeq([0], s + o + j, p) for s, o, p in zip(starts, offsets, pages)
                                for j in range(width)], kv, "cpu")
    got = shift_rows(base, torch.tensor(offsets).repeat_interleave(width), bound, ragged=True)
    for field in ("positions", "seq_lens", "out_cache_loc", "kv_indices", "kv_indptr"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    assert all(a >= b for a, b in zip(got.seq_lens_cpu, want.seq_lens_cpu))  # host lengths: an upper bound


def test_the_step_costs_are_measured_on_rows_of_distinct_tokens(tiny_model_dir):
    """The measured steps' rows carry distinct ids, so they route as a real batch's do: one id on every row sent
    them all to the same top-k experts and priced a MoE step at a few experts' reads."""
    from moeplex.speculation.setup import measure_step_costs

    spec = engine(tiny_model_dir("qwen3_moe"), speculative_policy="fixed", **NGRAM)
    seen = []
    forward, verify = spec.runner.forward, spec.runner.verify_forward
    spec.runner.forward = lambda batch, *a, **k: seen.append(batch.input_ids.tolist()) or forward(batch, *a, **k)
    spec.runner.verify_forward = lambda batch, *a, **k: seen.append(batch.input_ids.tolist()) or verify(batch, *a, **k)
    measure_step_costs(spec.runner, spec.kv, spec.config, False, False, spec._agree, spec.parallel.world).at(4)
    assert seen and all(len(set(ids)) == len(ids) for ids in seen)
    assert {len(ids) for ids in seen} == {4, 8, 12, 16}  # plain, then 1..4 rows per request (x1 is one a request)


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe"])
@pytest.mark.parametrize("chunk", [512, 16])
def test_a_request_arriving_mid_run_is_prefilled_before_the_verify_step_in_flight_is_read(tiny_model_dir, plain, arch,
                                                                                          chunk):
    """Where a verify step's run ends because a request arrived, its prompt step (or first chunk of it) is launched
    before the step in flight is read (the device runs it meanwhile, as the plain overlap schedule admits), and no
    token changes. Prompt and decode steps apart, as on a GPU with graphs (a mixed step needs the tokens in flight)."""
    spec = engine(tiny_model_dir(arch), overlap_schedule=True, mixed_chunk=False, chunked_prefill_size=chunk, **NGRAM)
    order = []
    admit, read = spec._admit_ahead, spec.overlap_verify.read
    spec._admit_ahead = lambda: order.append("admit") or admit()
    spec.overlap_verify.read = lambda *args: order.append("read") or read(*args)
    ahead = []
    launch = spec._launch
    spec._launch = lambda work, batch: ahead.append(order[-1:] == ["admit"]) or launch(work, batch)
    requests = [spec.add_request(p, GREEDY) for p in PROMPTS[:2]]
    while not isinstance(spec.in_flight, VerifyInFlight):  # a run of verify steps under way
        spec.step()
    requests.append(spec.add_request(PROMPTS[2], GREEDY))
    while spec.has_work:
        spec.step()
    assert outputs(requests) == plain[arch]
    assert any(ahead), "no prompt step was launched ahead of a verify step's read"
    assert conserved(spec)


def test_the_step_log_counts_every_step_by_what_it_launched(tiny_model_dir, plain):
    """Engine.step_log (/metrics): every step counted once, by what it launched; the overlapped verify steps are
    the policy's verify steps; every read of a verify step in flight that launched nothing before it is a break
    (an admission launched ahead is not), and every plain step read because drafts were wanted is one too."""
    spec = engine(tiny_model_dir("qwen3_moe"), overlap_schedule=True, mixed_chunk=False, **NGRAM)
    log = spec.step_log
    ran, reads, wanted = 0, [], []
    read, complete = spec.overlap_verify.read, spec._complete
    spec.overlap_verify.read = lambda previous, following, *args: reads.append(
        following is None and log.kind == "none") or read(previous, following, *args)
    requests = [spec.add_request(p, GREEDY) for p in PROMPTS[:2]]
    while not isinstance(spec.in_flight, VerifyInFlight):
        spec.step()
        ran += 1
    requests.append(spec.add_request(PROMPTS[2], GREEDY))  # arrives mid-run: its prompt goes ahead of the read
    while spec.has_work:
        spec.step()
        ran += 1
    assert outputs(requests) == plain["qwen3_moe"][:3]
    assert sum(log.steps.values()) == ran and all(s >= 0 for s in log.seconds.values())
    counts = spec.speculation.counts  # (a verify step whose drafts did not come counts as a plain one there)
    assert log.steps["verify_overlap"] >= counts.verify_steps > 0
    # (and a decode step whose requests' tokens are all in flight is not counted there)
    assert counts.verify_steps + counts.plain_steps <= log.steps["verify_overlap"] + log.steps["decode"]
    assert log.steps["prompt"] >= 2 and log.steps["verify"] == log.steps["mixed"] == 0
    assert log.breaks["verify_run_ended"] == sum(reads)
    assert sum(log.seconds.values()) > 0


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe"])
def test_requests_arriving_mid_run_join_it_without_a_break(tiny_model_dir, plain, arch):
    """A request arriving during a run of verify steps: its prompt step goes ahead of the verify read, the other
    requests' verify step goes ahead of the prompt's read, and the newcomer joins the step after that (its last
    token from the host, the others' from the device): the overlap schedule is never broken for it, and no token
    changes (greedy equals plain decoding)."""
    spec = engine(tiny_model_dir(arch), overlap_schedule=True, mixed_chunk=False, **NGRAM)
    joined, launch = [], spec.overlap_verify.launch

    def counted(requests, counts, previous, hooks=None, prompts=()):
        if previous is not None:
            index = {id(r) for r in previous.requests}
            joined.append(sum(id(r) not in index for r in requests))
        return launch(requests, counts, previous, hooks, prompts)

    spec.overlap_verify.launch = counted
    requests = [spec.add_request(p, GREEDY) for p in PROMPTS[:2]]
    while not isinstance(spec.in_flight, VerifyInFlight):
        spec.step()
    breaks = dict(spec.step_log.breaks)
    requests.append(spec.add_request(PROMPTS[2], GREEDY))
    while spec.has_work:
        spec.step()
    assert outputs(requests) == plain[arch][:3]
    assert any(joined), "the newcomer never joined a verify step that followed one in flight"
    assert spec.step_log.breaks["drafts_wanted"] == breaks["drafts_wanted"]  # none for the arrival
    assert conserved(spec)


def test_a_full_prefix_cache_gives_its_pages_to_drafts(tiny_model_dir, plain):
    """A server whose prefix cache holds every page no request uses (any server after a while): the overlapped
    verify steps still get their draft pages, evicting cached ones (until 2026-12-06 they took free pages only, so
    no request drafted once the cache was full, and on a GPU almost every step broke the overlap schedule for
    drafts that could not come). No token changes."""
    spec = engine(tiny_model_dir("qwen3_moe"), overlap_schedule=True, max_total_tokens=384, **NGRAM)
    fillers = [[300 + i] + [(7 * i + j) % 250 + 1 for j in range(40)] for i in range(16)]
    spec.generate(fillers, attrs.evolve(GREEDY, max_new_tokens=1))
    cache = spec.prefix_cache
    assert spec.kv.num_free_pages < 10 and cache.evictable_pages > 64  # the cache holds the pool (the prompts need more)
    evicted = cache.evicted_pages
    got = spec.generate(PROMPTS, GREEDY)
    assert outputs(got) == plain["qwen3_moe"]
    assert spec.step_log.steps["verify_overlap"] > 0 and sum(r.spec_accepted_tokens for r in got) > 0
    assert spec.step_log.breaks["drafts_wanted"] <= spec.step_log.steps["verify_overlap"]
    assert cache.evicted_pages > evicted
    assert conserved(spec)


def test_reads_of_the_step_in_flight_that_launch_no_verify_step_back_off(tiny_model_dir, plain):
    """Wanting drafts reads the step in flight first (a break of the overlap schedule); where no verify step comes
    of it (here: never a page for drafts), drafts go unwanted for 1, 2, 4, ... steps, so the breaks stay few. No
    token changes."""
    spec = engine(tiny_model_dir("qwen3_moe"), overlap_schedule=True, speculative_policy="fixed",
                  disable_speculative_backoff=True, **NGRAM)
    spec.scheduler.draft_pages = spec.overlap_verify.draft_pages = lambda count: []
    got = spec.generate(PROMPTS, attrs.evolve(GREEDY, max_new_tokens=64))
    assert [o[:16] for o in outputs(got)] == plain["qwen3_moe"]
    steps = spec.step_log.steps["decode"]
    assert steps > 60
    assert 0 < spec.step_log.breaks["drafts_wanted"] <= 12  # (every step wanted drafts without the back-off)
    assert conserved(spec)


def test_no_step_in_flight_is_read_for_drafts_while_a_prompt_makes_the_next_step_a_plain_mixed_one(tiny_model_dir,
                                                                                                    plain):
    """An engine whose mixed steps draft nothing (--mixed-chunk auto with decode graphs): while a prompt waits to be
    admitted or is mid-way, the next step holds its tokens and verifies nothing, so the step in flight is not read
    for drafts (each such read broke the overlap schedule for nothing). Arrivals every other step; no token
    changes."""
    prompts = PROMPTS * 3
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    want = outputs(engine(tiny_model_dir("qwen3_moe"), mixed_chunk=True).generate(prompts, params))
    spec = engine(tiny_model_dir("qwen3_moe"), overlap_schedule=True, mixed_chunk=True, max_running_requests=4,
                  chunked_prefill_size=8, **NGRAM)
    spec.plain_mixed_steps = True  # what auto sets where decode steps replay graphs (a GPU)
    asked, wasted = [], []  # per read considered: whether a prompt was due; per read made: whether it was wasted
    wants, ended = spec.speculation.wants_drafts, spec.speculation.break_ended
    scheduler = spec.scheduler

    def wanting(running, breaks=2):
        asked.append(scheduler.may_admit or any(r.num_uncached > 1 for r in scheduler.running))
        return wants(running, breaks)

    spec.speculation.wants_drafts = wanting
    spec.speculation.break_ended = lambda verified: wasted.append(not verified) or ended(verified)
    requests = arriving(spec, prompts, params)
    assert outputs(requests) == want
    assert spec.step_log.steps["mixed"] > 0
    assert asked and not any(asked), "the step in flight was considered for drafts while a prompt was due"
    assert sum(wasted) <= 1  # (3 when it was: a read that finds the next step mixed verifies nothing)
    assert conserved(spec)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_a_verify_step_follows_a_plain_step_in_flight_without_reading_it(tmp_path, temperature):
    """A run of verify steps entered from a plain step in flight (a decode step, or a mixed step that admitted a
    request) launches before that step is read: each request the step samples for drafts from its token on the
    device (a new request's first token included), the others from the host (OverlapVerify.after_plain). Requests
    arrive every other step on a target that copies its prompt, so drafts land in runs; greedy tokens equal plain
    decoding's, sampled ones are valid ids of the right count, no step is read for drafts, pools end empty."""
    folder = write_checkpoint(str(tmp_path), "qwen3_moe", "tiny", seed=0, synthetic_map=True)
    follow = next_token_map(read_config(folder), seed=0)
    docs = []
    for start in range(6):
        doc = [40 * start + 1]
        while len(doc) < 40:
            doc.append(follow[doc[-1]])
        doc[25] = 3  # an edit: a miss in the copy
        docs.append(doc + doc[:4])
    params = SamplingParams(max_new_tokens=20, temperature=temperature, ignore_eos=True)
    want = outputs(engine(folder, mixed_chunk=True).generate(docs, params))
    spec = engine(folder, overlap_schedule=True, mixed_chunk=True, max_running_requests=4, **NGRAM)
    spec.plain_mixed_steps = True  # what auto sets where decode steps replay graphs (a GPU)
    first_tokens_in_flight = []
    after_plain = spec.overlap_verify.after_plain

    def counted(step, requests, *args):
        first_tokens_in_flight.append(any(not r.output_ids and r.pending_rows for r in requests))
        return after_plain(step, requests, *args)

    spec.overlap_verify.after_plain = counted
    requests = arriving(spec, docs, params)
    if temperature == 0.0:
        assert outputs(requests) == want
    else:
        assert all(len(r.output_ids) == 20 and all(0 <= t < spec.vocab_size for t in r.output_ids) for r in requests)
    assert any(first_tokens_in_flight), "no run started from a new request's first token in flight"
    assert spec.step_log.breaks["drafts_wanted"] == 0
    assert sum(r.spec_accepted_tokens for r in requests) > 20
    assert conserved(spec)
