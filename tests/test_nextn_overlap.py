"""nextn's verify steps under the overlap schedule (plugins/drafters/nextn_device.py): the MTP layer drafts step
N + 1 on the device from step N's emitted tokens and hidden rows, before the host reads step N.

The reference is nextn's host path (synchronous verify steps): wherever both paths draft for a request at the same
position, the drafts are the same ids (the device path writes the same MTP KV rows and chains from the same
states). Tokens equal greedy decoding without speculation, through preemption, the prefix cache, requests arriving
mid-run and replays through the static inputs (the verify graphs, on the CPU through Triton's interpreter); the
pools end empty. The checkpoint is the synthetic one (make-model --mtp-acceptance), so drafts are accepted in runs.
"""

from __future__ import annotations

import attrs
import pytest
import torch

from moeplex.attention.triton_backend import INTERPRETED
from moeplex.config import EngineConfig
from moeplex.cuda_graph import DecodeGraphs, DecodeInputs, capture_sizes, max_pages_per_request
from moeplex.engine import Engine
from moeplex.models.make_model import write_checkpoint
from moeplex.sampling import SamplingParams
from moeplex.speculation.verify_graphs import VerifyGraphs, verify_graphs

from test_spec_overlap import Launches, admit_beside
from test_speculative import conserved
from test_verify_graphs import static_capture

PAGE = 4
PROMPTS = [[256] + list(range(10, 20)) * 3, [256, 5, 6, 7, 5, 6, 7, 5, 6], [256] + list(range(40, 75))]
GREEDY = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
NEXTN = dict(speculative_algorithm="nextn", speculative_num_steps=3)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    return write_checkpoint(str(tmp_path_factory.mktemp("mtp")), "deepseek_v3", "tiny", seed=0, mtp=1,
                            mtp_acceptance=0.8)


def engine(folder: str, **overrides) -> Engine:
    settings = dict(model=folder, dtype="fp32", show_progress=False, max_total_tokens=2048, page_size=PAGE,
                    disable_speculative_backoff=True, speculative_policy="fixed")
    return Engine(EngineConfig(**{**settings, **overrides}))


@pytest.fixture(scope="module")
def random_mtp(tmp_path_factory):
    """Random MTP weights: drafts that depend on every KV row the layer reads (the synthetic layer's attention
    only nudges its output, so a wrong KV row rarely changes its drafts)."""
    return write_checkpoint(str(tmp_path_factory.mktemp("mtp_random")), "deepseek_v3", "tiny", seed=0, mtp=1)


@pytest.fixture(scope="module")
def plain(synthetic):
    return [r.output_ids for r in engine(synthetic).generate(PROMPTS, GREEDY)]


def drafts_by_position(spec: Engine) -> dict:
    """Record every draft the engine's nextn makes, by (request, the position of the input it drafts after)."""
    drafter, made = spec.speculation.drafter, {}
    host, device = drafter.propose, drafter.propose_on_device

    def on_host(requests):
        out = host(requests)
        for r, tokens in zip(requests, out.tokens):
            made[r.rid, r.num_cached] = list(tokens)
        return out

    def on_device(requests, pending=None):
        out = device(requests, pending)
        emitted = pending.counts.tolist() if pending is not None else [0] * len(requests)
        for r, tokens, n, k in zip(requests, out.tokens.tolist(), out.counts.tolist(), emitted):
            made[r.rid, r.num_cached + k] = tokens[:n]
        return out

    drafter.propose, drafter.propose_on_device = on_host, on_device
    return made


def same_drafts(host: dict, device: dict) -> int:
    """How many (request, position) both paths drafted at (something); asserts their drafts agree there."""
    common = [key for key in set(host) & set(device) if host[key] and device[key]]
    for key in common:
        n = min(len(host[key]), len(device[key]))
        assert host[key][:n] == device[key][:n], f"request {key[0]} at position {key[1]}"
    return len(common)


def run(spec: Engine, prompts, params):
    """Generate with rids r0, r1, ... (the drafts of two engines compare by rid)."""
    requests = [spec.add_request(p, params, rid=f"r{i}") for i, p in enumerate(prompts)]
    while spec.has_work:
        spec.step()
    return requests


@pytest.mark.parametrize("steps", [1, 3])
def test_nextn_drafts_on_the_device_under_the_overlap_schedule(synthetic, plain, steps):
    host = engine(synthetic, speculative_algorithm="nextn", speculative_num_steps=steps)
    assert host.overlap_verify is None
    host_drafts = drafts_by_position(host)
    run(host, PROMPTS, GREEDY)
    spec = engine(synthetic, overlap_schedule=True, speculative_algorithm="nextn", speculative_num_steps=steps)
    assert spec.overlap_verify is not None
    launches = Launches(spec)
    device_drafts = drafts_by_position(spec)
    got = run(spec, PROMPTS, GREEDY)
    assert [r.output_ids for r in got] == plain
    assert launches.following > 3, "the verify steps did not follow each other under the overlap schedule"
    assert same_drafts(host_drafts, device_drafts) > 10
    assert sum(r.spec_accepted_tokens for r in got) > len(got) * 3 * steps // 2  # the synthetic MTP is accepted
    assert conserved(spec)
    assert not spec.speculation.drafter.starts and not spec.speculation.drafter.pending


def test_requests_arriving_mid_run_preemption_and_the_prefix_cache(synthetic):
    """Arrivals end runs (their prompt steps) and join later ones; a run's last step is observed on the host, so the
    next run's first drafts (from the host's chain starts) equal the host path's too."""
    prompts = PROMPTS * 3
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    want = [r.output_ids for r in engine(synthetic).generate(prompts, params)]
    host = engine(synthetic, **NEXTN)
    host_drafts = drafts_by_position(host)
    run(host, prompts, params)

    spec = engine(synthetic, overlap_schedule=True, max_running_requests=4, **NEXTN)
    device_drafts = drafts_by_position(spec)
    requests = []
    for i, prompt in enumerate(prompts):  # one arrival every other step
        requests.append(spec.add_request(prompt, params, rid=f"r{i}"))
        spec.step()
        spec.step()
    while spec.has_work:
        spec.step()
    assert [r.output_ids for r in requests] == want
    assert same_drafts(host_drafts, device_drafts) > 20
    assert conserved(spec)

    tight = engine(synthetic, overlap_schedule=True, max_total_tokens=192, **NEXTN)
    got = tight.generate(prompts, params)
    assert [r.output_ids for r in got] == want
    assert sum(r.num_preemptions for r in got) > 0, "the pool was not tight enough to preempt"
    assert conserved(tight)
    cached = engine(synthetic, overlap_schedule=True, **NEXTN)
    assert [r.output_ids for r in cached.generate(prompts, params)] == want
    assert [r.output_ids for r in cached.generate(prompts, params)] == want  # from the prefix cache
    assert cached.prefix_cache.hit_tokens > 0 and conserved(cached)


def test_sampled_and_adaptive_steps_under_the_overlap_schedule(synthetic, plain):
    """Unseeded sampled requests verify on the overlapped (eager) path; the adaptive policy changes no token."""
    free = SamplingParams(max_new_tokens=12, temperature=0.8, top_k=20, ignore_eos=True)
    spec = engine(synthetic, overlap_schedule=True, **NEXTN)
    launches = Launches(spec)
    got = spec.generate(PROMPTS, free)
    assert all(len(r.output_ids) == 12 for r in got) and launches.first > 0
    assert conserved(spec)
    adaptive = engine(synthetic, overlap_schedule=True, speculative_policy="adaptive", max_running_requests=4, **NEXTN)
    assert [r.output_ids for r in adaptive.generate(PROMPTS, GREEDY)] == plain
    assert conserved(adaptive)


def replayed_drafts(spec: Engine, size: int) -> tuple[VerifyGraphs, dict]:
    """Give a CPU engine decode graphs of up to `size` rows (with hidden states) and verify graphs, through the CPU
    stand-in for a capture; (the verify graphs, the drafts their "pre" makes by (request, position))."""
    kv, model = spec.kv, spec.model
    inputs = DecodeInputs.allocate(size, max_pages_per_request(kv, None), kv, "cpu")
    spec.runner.graphs = DecodeGraphs(model, kv, spec.runner.strategy, inputs, capture_sizes(size), static_capture,
                                      with_hidden=True)
    made = verify_graphs(spec.speculation.drafter, spec.runner.graphs, spec.vocab_size,
                         spec.config.max_running_requests, static_capture)
    assert isinstance(made, VerifyGraphs) and made.state_hidden is not None
    spec.overlap_verify.graphs = made
    chain, device_drafts, staged = made.proposer, {}, []
    stage, propose = chain.stage, chain.propose

    def staging(requests, rows):
        staged[:] = requests
        stage(requests, rows)

    def proposing(pending):  # inside "pre": its drafts read back after each replay (a CPU: no graph to break)
        out = propose(pending)
        for r, tokens, n, k in zip(staged, out.tokens.tolist(), out.counts.tolist(), pending.counts.tolist()):
            device_drafts[r.rid, r.num_cached + k] = tokens[:n]
        return out

    chain.stage, chain.propose = staging, proposing
    return made, device_drafts


@pytest.mark.skipif(not INTERPRETED, reason="the CPU check of replay through the static inputs")
def test_replayed_verify_steps_draft_what_the_host_path_does(synthetic, plain):
    """The verify graphs (here a CPU stand-in for the capture) hold the MTP catch-up and chain: replayed steps carry
    the target's hidden rows from one step to the next in the graphs' state."""
    host = engine(synthetic, attention_backend="triton", **NEXTN)
    host_drafts = drafts_by_position(host)
    run(host, PROMPTS, GREEDY)
    spec = engine(synthetic, attention_backend="triton", overlap_schedule=True, **NEXTN)
    made, device_drafts = replayed_drafts(spec, 16)
    got = run(spec, PROMPTS, GREEDY)
    assert [r.output_ids for r in got] == plain
    assert same_drafts(host_drafts, device_drafts) > 10
    assert sum(r.spec_accepted_tokens for r in got) > len(got) * 4
    assert torch.isfinite(made.state_hidden).all()
    assert conserved(spec)


@pytest.mark.gpu
def test_on_gpu_nextn_verify_steps_replay_graphs_with_the_mtp_chain_inside(synthetic):
    """The real capture: a CUDA engine's overlapped nextn steps replay verify graphs whose "pre" runs the MTP layer,
    keep greedy's tokens and draft what the host path drafts."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    cuda = dict(device="cuda", moe_kernel="triton", cuda_graph_max_bs=16, page_size=16, overlap_schedule=True)
    want = [r.output_ids for r in engine(synthetic, **cuda).generate(PROMPTS, GREEDY)]
    host = engine(synthetic, **{**cuda, "overlap_schedule": False}, **NEXTN)
    host_got = run(host, PROMPTS, GREEDY)
    assert [r.output_ids for r in host_got] == want
    spec = engine(synthetic, **cuda, **NEXTN)
    graphs = spec.overlap_verify.graphs
    assert isinstance(graphs, VerifyGraphs) and graphs.state_hidden is not None
    replayed = []
    for shape, replay in graphs.post.items():
        graphs.post[shape] = lambda shape=shape, replay=replay: replayed.append(shape) or replay()
    got = run(spec, PROMPTS, GREEDY)
    assert [r.output_ids for r in got] == want and len(replayed) > 5
    # the replayed steps' drafts are accepted as the host path's are (the same drafts, on the same MTP KV; the steps
    # fall differently, so the counts need not be equal)
    assert sum(r.spec_accepted_tokens for r in got) >= 0.8 * sum(r.spec_accepted_tokens for r in host_got)
    assert conserved(spec)


@pytest.mark.gpu
def test_on_gpu_requests_admitted_beside_verify_steps_replay_a_decode_graph(synthetic):
    """On a CUDA engine with graphs: requests waiting for a slot join the run of verify steps with their prompts as
    decode rows (a decode graph replayed with the grid's logits picked), the steps before and after replaying verify
    graphs; greedy's tokens, and the pool ends as it began."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    cuda = dict(device="cuda", moe_kernel="triton", cuda_graph_max_bs=64, page_size=16, overlap_schedule=True,
                max_running_requests=2)
    prompts = PROMPTS * 2
    params = [attrs.evolve(GREEDY, max_new_tokens=8 + 5 * i) for i in range(len(prompts))]
    want = [r.output_ids for r in engine(synthetic, **cuda).generate(prompts, params)]
    spec = engine(synthetic, **cuda, **NEXTN)
    # the largest graph holds a full grid of 2 x 4 verify rows with --cuda-graph-max-bs of prompt rows beside it
    assert spec.overlap_verify.admit_rows == spec.runner.graphs.sizes[-1] == 2 * 4 + 64
    launches = Launches(spec)
    replays, forward = [], spec.runner.verify_forward  # (verify steps with prompt rows that replay a decode graph)
    spec.runner.verify_forward = lambda batch, rows, hidden: replays.append(
        batch.sample_rows is not None and spec.runner.graphs.can_run(batch)) or forward(batch, rows, hidden)
    got = spec.generate(prompts, params)
    assert [r.output_ids for r in got] == want
    assert launches.admitted >= 2 and sum(replays) >= 2
    assert sum(r.spec_accepted_tokens for r in got) > len(got) * 3  # the synthetic MTP is accepted
    assert conserved(spec)


def test_requests_that_draft_in_turns_hold_their_rows_until_they_draft(random_mtp):
    """Requests draft in blocks of four tokens, out of step with each other: a verify step runs the MTP layer over
    the held rows of the requests that draft in it only, the others keep theirs (in segments around the runs that
    went through the layer on the device) until they draft. The drafts still equal the host path's wherever both
    drafted at a position, so no position's MTP KV was skipped or written twice from different rows."""

    def in_turns(spec: Engine) -> list[int]:
        choose, caught = spec.speculation.policy.choose, []

        def chosen(requests, rooms, expect_offers=False):
            counts = choose(requests, rooms, expect_offers)
            return [c if (len(r.output_ids) // 4 + int(r.rid[1:])) % 2 == 0 else 0 for c, r in zip(counts, requests)]

        spec.speculation.policy.choose = chosen
        catch_up = spec.speculation.drafter.catch_up
        spec.speculation.drafter.catch_up = lambda rids: caught.append(len(rids)) or catch_up(rids)
        return caught

    plain = [r.output_ids for r in engine(random_mtp).generate(PROMPTS, GREEDY)]
    host = engine(random_mtp, **NEXTN)
    in_turns(host)
    host_drafts = drafts_by_position(host)
    assert [r.output_ids for r in run(host, PROMPTS, GREEDY)] == plain
    spec = engine(random_mtp, overlap_schedule=True, **NEXTN)
    caught = in_turns(spec)
    device_drafts = drafts_by_position(spec)
    got = run(spec, PROMPTS, GREEDY)
    assert [r.output_ids for r in got] == plain
    assert same_drafts(host_drafts, device_drafts) >= 10
    assert any(0 < n < len(PROMPTS) for n in caught), "every catch-up took every request"
    assert all(r.spec_verify_steps for r in got) and conserved(spec)
    assert not spec.speculation.drafter.pending and spec.speculation.drafter.pending_rows == 0


@pytest.mark.parametrize("slots", [1, 3])
def test_requests_admitted_beside_a_verify_step_draft_from_their_prompts_mtp_kv(random_mtp, slots):
    """A request arriving during a run is admitted into the next verify step with its whole prompt (decode rows
    beside the grid; with one slot, in a step of its own launched before the ended request's last step is read), so
    the run goes on; the drafter observes the prompt's rows from that step, and the MTP layer writes their KV before
    the newcomer's first drafts. With random MTP weights a draft depends on every KV row the layer reads: the
    newcomers' drafts equal the host path's wherever both drafted at a position."""
    prompts = PROMPTS * 2
    params = [attrs.evolve(GREEDY, max_new_tokens=8 + 5 * i) for i in range(len(prompts))]  # (they end apart)

    def generate(spec: Engine) -> list:
        requests = [spec.add_request(p, q, rid=f"r{i}") for i, (p, q) in enumerate(zip(prompts, params))]
        while spec.has_work:
            spec.step()
        return [r.output_ids for r in requests]

    plain = generate(engine(random_mtp))
    host = engine(random_mtp, **NEXTN)
    host_drafts = drafts_by_position(host)
    assert generate(host) == plain
    spec = engine(random_mtp, overlap_schedule=True, max_running_requests=slots, **NEXTN)
    admit_beside(spec)
    launches = Launches(spec)
    device_drafts = drafts_by_position(spec)
    assert generate(spec) == plain
    assert launches.admitted == len(prompts) - slots, "a request waiting for a slot was not admitted into a verify step"
    assert spec.step_log.breaks["verify_run_ended"] <= 1  # (the last request's end)
    assert same_drafts(host_drafts, device_drafts) >= 10
    newcomers = {f"r{i}" for i in range(slots, len(prompts))}
    assert any(key[0] in newcomers and host_drafts[key] for key in set(host_drafts) & set(device_drafts))
    assert conserved(spec)
    assert not spec.speculation.drafter.pending and spec.speculation.drafter.pending_rows == 0


@pytest.mark.skipif(not INTERPRETED, reason="the CPU check of replay through the static inputs")
def test_prompts_admitted_into_replayed_verify_steps_are_observed(random_mtp):
    """A request admitted into a replayed verify step (its prompt's rows after the grid, one decode graph for all;
    with one slot, a step of the next prompt alone where the run's request ends): the prompt rows' hidden states
    come out of that graph for the drafter, so the newcomer's drafts, made in later replayed steps, equal the host
    path's (random MTP weights: a draft depends on every MTP KV row it reads)."""
    prompts = [[256, 5, 6, 7, 5, 6, 7], [256, 7, 8, 9, 7], [256, 5, 6, 7, 5, 6, 7], [256, 7, 8, 9, 7]]
    params = [attrs.evolve(GREEDY, max_new_tokens=8 + 3 * i) for i in range(len(prompts))]

    def generate(spec: Engine) -> list:
        requests = [spec.add_request(p, q, rid=f"r{i}") for i, (p, q) in enumerate(zip(prompts, params))]
        while spec.has_work:
            spec.step()
        return [r.output_ids for r in requests]

    host = engine(random_mtp, attention_backend="triton", **NEXTN)
    host_drafts = drafts_by_position(host)
    want = generate(host)
    spec = engine(random_mtp, attention_backend="triton", overlap_schedule=True, max_running_requests=1, **NEXTN)
    made, device_drafts = replayed_drafts(spec, 8)
    spec.overlap_verify.admit_rows, extra, launch = 8, [], made.launch
    made.launch = lambda *args: extra.append(args[-1] is not None) or launch(*args)
    assert generate(spec) == want
    assert any(extra), "no admitted prompt rode in a replayed verify step"
    newcomers = {f"r{i}" for i in range(1, len(prompts))}
    assert same_drafts(host_drafts, device_drafts) >= 5
    assert any(key[0] in newcomers and host_drafts[key] for key in set(host_drafts) & set(device_drafts))
    assert conserved(spec)
