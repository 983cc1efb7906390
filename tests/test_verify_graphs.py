"""Overlapped verify steps replayed from graphs (speculation/verify_graphs.py) and ngram's static drafting.

On the CPU everything but the capture runs: the target's DecodeGraphs and the verify steps' pre / post graphs get
a `capture` that runs the function again into the tensors its first run returned (a graph's static outputs), so a
step reads and writes only static tensors, as a replayed graph does (the decode graphs through Triton's
interpreter). The `gpu` test captures for real.
"""

from __future__ import annotations

import random

import pytest
import torch

from moeplex.attention.triton_backend import INTERPRETED
from moeplex.config import EngineConfig
from moeplex.cuda_graph import DecodeGraphs, DecodeInputs, capture_sizes, graph_sizes, max_pages_per_request
from moeplex.engine import Engine
from moeplex.interfaces import DeviceTokens, DraftRequest
from moeplex.plugins.drafters.ngram import NgramDrafter
from moeplex.sampling import SamplingParams
from moeplex.speculation.build import admit_rows, graph_rows
from moeplex.speculation.overlap import VerifyInFlight
from moeplex.speculation.verify_graphs import VerifyGraphs, verify_graphs

from test_spec_overlap import ECHO_PROMPTS, echo  # noqa: F401 (a fixture)
from test_speculative import conserved

PAGE = 4
MAX_BS = 16
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)

interpreted = pytest.mark.skipif(not INTERPRETED, reason="the CPU check of replay through the static inputs")


def static_capture(step):
    """A CPU stand-in for a CUDA graph: each replay runs `step` again into the outputs of its first run."""
    out = step()

    def replay():
        new = step()
        for kept, fresh in zip(_leaves(out), _leaves(new)):
            kept.copy_(fresh)
        return out

    return replay


def _leaves(value):
    if isinstance(value, torch.Tensor):
        return [value]
    return [leaf for item in value for leaf in _leaves(item)] if isinstance(value, (tuple, list)) else []


# --- ngram's StaticLookup ------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(4))
def test_static_lookup_drafts_what_propose_on_device_does(seed):
    """Growing requests, pending tokens the host has not read, padding rows, rows rewritten when full, rids
    finished and reused: the static path's drafts equal the dynamic path's and the host drafter's."""
    rng = random.Random(seed)
    dynamic, static, host = NgramDrafter(3), NgramDrafter(3), NgramDrafter(3)
    dynamic.window = static.window = host.window = 6
    proposer = static.static_proposer(8, 4)
    live: dict[str, list[int]] = {}
    for _ in range(50):
        if len(live) < 5 and rng.random() < 0.4:
            live.setdefault(str(rng.randrange(8)), [rng.randrange(4) for _ in range(rng.randint(1, 30))])
        if not live:
            continue
        rids = rng.sample(sorted(live), rng.randint(1, len(live)))
        requests = [DraftRequest(rid, list(live[rid]), len(live[rid]) - 1) for rid in rids]
        extra = [[rng.randrange(4) for _ in range(rng.randint(0, 4))] for _ in rids]
        tokens = torch.tensor([e + [rng.randrange(9)] * (4 - len(e)) for e in extra], dtype=torch.int64)
        pending = DeviceTokens(tokens, torch.tensor([len(e) for e in extra]))
        want = dynamic.propose_on_device(requests, pending)
        rows = rng.choice([r for r in (1, 2, 4, 8) if r >= len(rids)])  # padded, as a graph's rows are
        proposer.stage(requests, rows)
        padded = DeviceTokens(torch.cat([tokens, torch.full((rows - len(rids), 4), 7)]),
                              torch.cat([pending.counts, torch.full((rows - len(rids),), 3)]))
        got = proposer.propose(padded)
        assert got.tokens.shape == (rows, 3)
        assert torch.equal(got.tokens[: len(rids)], want.tokens) and torch.equal(got.counts[: len(rids)], want.counts)
        assert (got.counts[len(rids):] == 0).all()  # padding drafts nothing
        full = [DraftRequest(r.rid, r.token_ids + e, len(r.token_ids) + len(e) - 1) for r, e in zip(requests, extra)]
        assert [got.tokens[i, : got.counts[i]].tolist() for i in range(len(rids))] == host.propose(full).tokens
        assert proposer.replayable()
        for rid, e in zip(rids, extra):
            live[rid] += e + [rng.randrange(4) for _ in range(rng.randint(0, 3))]
        for rid in list(live):
            if rng.random() < 0.1:
                del live[rid]
                for drafter in (dynamic, static, host):
                    drafter.finished(rid)


def test_a_static_lookup_whose_buffer_grew_no_longer_replays():
    drafter = NgramDrafter(2)
    proposer = drafter.static_proposer(2, 3)
    proposer.stage([DraftRequest(str(i), [1, 2, 1], 2) for i in range(2)], 2)
    assert proposer.replayable()
    proposer.stage([DraftRequest(str(i), [1, 2, 1], 2) for i in range(2, 4)], 2)  # more live requests than rows
    assert not proposer.replayable()


# --- the engine's verify steps replayed -----------------------------------------------------------------------

def engine(folder: str, **overrides) -> Engine:
    settings = dict(model=folder, dtype="fp32", show_progress=False, max_total_tokens=512, page_size=PAGE,
                    attention_backend="triton", mixed_chunk=False, disable_speculative_backoff=True,
                    speculative_policy="fixed")
    return Engine(EngineConfig(**{**settings, **overrides}))


def install_graphs(spec: Engine, capture=static_capture, sizes=capture_sizes(MAX_BS)) -> list[tuple[int, int]]:
    """Give a CPU engine decode graphs and verify graphs; returns the log of the replayed (R, W) shapes."""
    kv, model = spec.kv, spec.model
    inputs = DecodeInputs.allocate(sizes[-1], max_pages_per_request(kv, None), kv, "cpu")
    spec.runner.graphs = DecodeGraphs(model, kv, spec.runner.strategy, inputs, sizes, capture)
    made = verify_graphs(spec.speculation.drafter, spec.runner.graphs, spec.vocab_size,
                         spec.config.max_running_requests, capture)
    assert isinstance(made, VerifyGraphs)
    spec.overlap_verify.graphs = made
    replayed = []
    for shape, replay in made.post.items():
        made.post[shape] = lambda shape=shape, replay=replay: replayed.append(shape) or replay()
    return replayed


@pytest.fixture(scope="module")
def plain(echo):
    """Greedy outputs without drafts, on the model that repeats itself (ngram's drafts are accepted in runs)."""
    return [r.output_ids for r in engine(echo, attention_backend="torch").generate(ECHO_PROMPTS, GREEDY)]


@interpreted
def test_replayed_verify_steps_change_no_token(echo, plain):
    """Long accepted runs: each step's pending tokens, shifted rows and last token come from the accepted state."""
    spec = engine(echo, overlap_schedule=True, speculative_algorithm="ngram", speculative_num_steps=3)
    assert spec.overlap_verify is not None and spec.overlap_verify.graphs is None  # a CPU: no graphs of its own
    replayed = install_graphs(spec)
    after_plain, followed = spec.overlap_verify.after_plain, []  # runs entered from a plain step in flight
    spec.overlap_verify.after_plain = lambda *args: followed.append(len(replayed)) or after_plain(*args)
    got = spec.generate(ECHO_PROMPTS, GREEDY)
    assert [r.output_ids for r in got] == plain
    assert len(replayed) > 3 and (4, 4) in replayed  # 3 requests padded to 4, full width
    assert followed and followed[0] < len(replayed)  # (the step after_plain launched was replayed)
    assert sum(r.spec_accepted_tokens for r in got) > 6
    assert conserved(spec)


@interpreted
def test_replayed_and_eager_steps_alternate_and_stops_land_inside_runs(echo, plain):
    """A sampled request (no seed) sends its steps to the eager path, graphed steps follow eager ones and back;
    greedy requests keep their tokens, and a short max_new_tokens ends a request inside an accepted run."""
    spec = engine(echo, overlap_schedule=True, speculative_algorithm="ngram", speculative_num_steps=3)
    replayed = install_graphs(spec)
    launches = []
    launch = spec.overlap_verify.launch
    spec.overlap_verify.launch = lambda *args: launches.append(1) or launch(*args)
    sampled = SamplingParams(max_new_tokens=6, temperature=0.8)
    short = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in (5, 12)]
    got = spec.generate(ECHO_PROMPTS, [short[0], sampled, short[1]])
    assert got[0].output_ids == plain[0][:5]
    assert got[2].output_ids == plain[2]
    assert len(got[1].output_ids) == 6 and 0 < len(replayed) < len(launches)  # some steps eager, some replayed
    assert sum(r.spec_accepted_tokens for r in got) > 0
    assert conserved(spec)


@interpreted
def test_the_graphs_around_the_forward_are_timed_and_priced_into_verify_steps(echo, plain):
    """VerifyGraphs.overhead replays a shape's pre and post graphs on padding rows (no request's state touched:
    the engine's output after it is unchanged); the step costs add it to every verify shape of that width."""
    from moeplex.speculation.setup import measure_step_costs

    spec = engine(echo, overlap_schedule=True, speculative_algorithm="ngram", speculative_num_steps=3)
    install_graphs(spec)
    graphs = spec.overlap_verify.graphs
    replays = []
    pre = graphs.pre[(4, 2)]
    graphs.pre[(4, 2)] = lambda: replays.append(1) or pre()
    took = graphs.overhead(3, 2, rounds=2, repeat=3)  # 3 requests: the graphs of 4
    assert took > 0 and len(replays) == 3 * 3  # a warm-up round, then 2 timed ones
    assert graphs.overhead(3, 9) == 0.0  # a width no graph holds
    assert [r.output_ids for r in spec.generate(ECHO_PROMPTS, GREEDY)] == plain

    extra = {1: 0.25, 2: 0.5, 3: 0.75, 4: 1.0}  # seconds: far above the measured forward, so it shows
    costs = measure_step_costs(spec.runner, spec.kv, spec.config, False, False, spec._agree, spec.parallel.world,
                               overlap=True, overlap_verify=True, verify_overhead=lambda n, k: extra[k])
    measured = costs.at(1)
    assert all(measured[k] >= extra[k] for k in extra) and measured[0] < extra[1]


@pytest.mark.gpu
def test_on_gpu_graphed_verify_steps_change_no_token(tiny_model_dir):
    """The real capture: a CUDA engine's overlapped ngram steps replay verify graphs and keep greedy's tokens."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    folder = tiny_model_dir("qwen3_moe")
    cuda = dict(device="cuda", dtype="fp32", moe_kernel="triton", cuda_graph_max_bs=16, page_size=16)
    want = [r.output_ids for r in engine(folder, **cuda).generate(ECHO_PROMPTS, GREEDY)]
    spec = engine(folder, **cuda, speculative_algorithm="ngram", speculative_num_steps=3)
    assert spec.overlap_verify is not None and isinstance(spec.overlap_verify.graphs, VerifyGraphs)
    replayed = []
    for shape, replay in spec.overlap_verify.graphs.post.items():
        spec.overlap_verify.graphs.post[shape] = lambda shape=shape, replay=replay: replayed.append(shape) or replay()
    got = spec.generate(ECHO_PROMPTS, GREEDY)
    assert [r.output_ids for r in got] == want and replayed
    assert conserved(spec)


@interpreted
def test_a_request_joining_a_replayed_run_takes_its_token_from_the_host(echo, plain):
    """A request admitted during a run of replayed verify steps joins the run: its row's last token is staged from
    the host while the others' come from the accepted state, and no token changes."""
    spec = engine(echo, overlap_schedule=True, speculative_algorithm="ngram", speculative_num_steps=3)
    install_graphs(spec)
    graphs, mixed = spec.overlap_verify.graphs, []
    launch = graphs.launch

    def staged(shape, requests, counts, previous_rows, *args, **kwargs):
        mixed.append(min(previous_rows) < 0 <= max(previous_rows))
        return launch(shape, requests, counts, previous_rows, *args, **kwargs)

    graphs.launch = staged
    requests = [spec.add_request(p, GREEDY) for p in ECHO_PROMPTS[:2]]
    while not isinstance(spec.in_flight, VerifyInFlight):
        spec.step()
    requests.append(spec.add_request(ECHO_PROMPTS[2], GREEDY))
    while spec.has_work:
        spec.step()
    assert [r.output_ids for r in requests] == plain
    assert any(mixed), "no replayed step had both carried and joined rows"
    assert conserved(spec)


@interpreted
def test_idle_steps_inside_a_replayed_run_change_no_token(echo, plain):
    """A run that goes on through steps of no drafts (keeps_run) replays the one-row-wide graphs there: each idle
    step's last tokens come from the accepted state and it emits one token per request; drafting then resumes in
    the same run, and no token changes."""
    spec = engine(echo, overlap_schedule=True, speculative_algorithm="ngram", speculative_num_steps=3)
    replayed = install_graphs(spec)
    policy = spec.speculation.policy
    choose, calls = policy.choose, []

    def every_third_idle(requests, rooms, *args, **kwargs):
        calls.append(1)
        counts = choose(requests, rooms, *args, **kwargs)
        return [0] * len(counts) if len(calls) % 3 == 0 else counts

    policy.choose = every_third_idle
    policy.keeps_run = lambda n, idle: True
    got = spec.generate(ECHO_PROMPTS, GREEDY)
    assert [r.output_ids for r in got] == plain
    assert (4, 1) in replayed and (4, 4) in replayed, replayed  # idle and full-width steps of the 3 requests
    assert spec.step_log.breaks["verify_run_ended"] <= 1  # (the run ends once: the last request finishes)
    assert conserved(spec)


@interpreted
def test_admitted_prompts_ride_in_a_replayed_verify_step(echo):
    """A request admitted into a run of replayed verify steps (OverlapVerify.follow) has its prompt's rows written
    after the grid the "pre" graph wrote, the decode graph holding them all replayed, and the grid's logits handed
    to the "post" graph: the step stays graphed, and no token changes. The decode graphs are the ones the engine
    sizes on a GPU (graph_rows): --cuda-graph-max-bs 8 beside a grid of 2 x 4 rows, 16 in all, so every prompt rides
    in a graph above 8 rows (none of 8 holds a grid row and a 4-token prompt's 3 rows beside 4 more)."""
    prompts = ECHO_PROMPTS * 2
    params = [SamplingParams(max_new_tokens=6 + 4 * i, temperature=0.0, ignore_eos=True) for i in range(len(prompts))]
    want = [r.output_ids for r in engine(echo, attention_backend="torch").generate(prompts, params)]
    spec = engine(echo, overlap_schedule=True, speculative_algorithm="ngram", speculative_num_steps=3,
                  mixed_chunk=True, max_running_requests=2, cuda_graph_max_bs=8)
    rows = graph_rows(spec.config, type(spec.speculation.drafter), overlap_schedule=True)
    install_graphs(spec, sizes=graph_sizes(spec.config, spec.runner.strategy, admit_rows=rows))
    decode = spec.runner.graphs
    assert rows == 16 and decode.sizes == [1, 2, 4, 8, 16]
    spec.overlap_verify.admit_rows = admit_rows(spec.scheduler, decode, prompt_graphs=True)  # (as the engine's build)
    assert spec.overlap_verify.admit_rows == 16
    graphs, replayed = spec.overlap_verify.graphs, []
    launch, extra = graphs.launch, []
    graphs.launch = lambda *args: extra.append(args[-1] is not None) or launch(*args)
    for size, replay in decode.replays.items():
        decode.replays[size] = lambda size=size, replay=replay: replayed.append(size) or replay()
    got = spec.generate(prompts, params)
    assert [r.output_ids for r in got] == want
    assert any(extra), "no admitted prompt rode in a replayed verify step"
    assert 16 in replayed, replayed
    assert conserved(spec)
