"""The nextn drafter: DeepSeek-V3's MTP layer drafts, output unchanged for 1..3 steps, its own KV kept right
through prompts, chunks, verify steps and rejections; refused where the checkpoint has no MTP layer."""

from __future__ import annotations

import attrs
import pytest
import torch

from moeplex.batch_builder import ScheduledSeq, build_forward_batch
from moeplex.config import EngineConfig
from moeplex.engine import Engine
from moeplex.interfaces import PluginError
from moeplex.kv_cache import KVPool
from moeplex.models.make_model import write_checkpoint
from moeplex.models.mtp import target_hidden_and_logits
from moeplex.sampling import SamplingParams

PAGE = 4
PROMPTS = [[256] + list(range(10, 20)) * 3, [256, 5, 6, 7, 5, 6, 7, 5, 6], [256] + list(range(40, 75))]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def mtp_folder(tmp_path_factory):
    return write_checkpoint(str(tmp_path_factory.mktemp("mtp")), "deepseek_v3", "tiny", seed=0, mtp=1)


def engine(folder: str, **overrides) -> Engine:
    settings = dict(model=folder, dtype="fp32", show_progress=False, max_total_tokens=2048, page_size=PAGE,
                    disable_speculative_backoff=True,  # random MTP weights miss: backoff would pause the chains
                    speculative_policy="fixed")  # ... and so would the adaptive policy
    return Engine(EngineConfig(**{**settings, **overrides}))


@pytest.fixture(scope="module")
def plain(mtp_folder):
    return [r.output_ids for r in engine(mtp_folder).generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("steps", [1, 2, 3])
def test_nextn_changes_no_token(mtp_folder, plain, steps):
    spec = engine(mtp_folder, speculative_algorithm="nextn", speculative_num_steps=steps, chunked_prefill_size=16)
    got = spec.generate(PROMPTS, GREEDY)
    assert [r.output_ids for r in got] == plain
    # every decode step but the last (no room left under max_new_tokens) carried a full chain of drafts
    assert all(r.spec_verify_steps == GREEDY.max_new_tokens - 2 for r in got)
    assert all(r.spec_draft_tokens > (steps - 1) * r.spec_verify_steps for r in got)
    assert spec.kv.num_free_pages + spec.prefix_cache.num_pages == spec.kv.num_pages
    assert not spec.speculation.drafter.starts  # every request's chain state dropped when it ended


def reference_chain_start(model, ids: list[int]) -> torch.Tensor:
    """The MTP layer's hidden at the last position of `ids[:-1]`, computed over the whole sequence at once in
    a fresh pool: target hidden of positions 0..L-2, then the MTP layer with the tokens at 1..L-1."""
    kv = KVPool(64, PAGE, model.kv_shapes() + model.mtp_kv_shapes()[:1], torch.float32, "cpu")
    pages = kv.allocate(kv.pages_for(len(ids)))
    batch = build_forward_batch([ScheduledSeq(ids[:-1], 0, pages)], kv, "cpu")
    from moeplex.registry import lookup

    strategy = lookup("overlap", "none")()
    with torch.inference_mode():
        normed, _ = target_hidden_and_logits(model, batch, kv, strategy)
        layer = model.mtp_layers[0]
        hidden, _ = layer(normed, batch, kv, input_ids=torch.tensor(ids[1:]))
    return hidden[-1]


def test_the_mtp_kv_built_step_by_step_equals_the_whole_sequence_at_once(mtp_folder):
    """After a chunked prompt and several verify steps with rejected drafts, the MTP layer's state at a
    request's last position equals the one computed from scratch: its KV rows were written at the right
    slots from the target's hidden states, and the rows of rejected drafts were overwritten."""
    spec = engine(mtp_folder, speculative_algorithm="nextn", speculative_num_steps=3, chunked_prefill_size=8)
    request = spec.add_request(PROMPTS[2], SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True))
    for _ in range(12):
        spec.step()
    assert request.spec_verify_steps > 3 and not request.finished
    spec.speculation.drafter.catch_up([request.rid])  # the last step's rows wait for the next draft
    start = spec.speculation.drafter.starts[request.rid]
    assert start.position == request.num_cached - 1
    want = reference_chain_start(spec.model, request.all_ids)
    torch.testing.assert_close(start.hidden, want, atol=1e-4, rtol=1e-4)
    spec.abort(request.rid)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_request_that_does_not_draft_costs_the_mtp_layer_nothing_until_it_drafts_again(mtp_folder, plain, overlap):
    """Random MTP weights miss, so the adaptive policy (under a cost model where rows cost something) stops
    drafting: the plain steps between take the engine's ordinary path (under the overlap schedule too, forced on
    here: the drafter then hears of each step one step late), keep the target's hidden rows and run no MTP layer;
    a request that drafts again catches up in one batch, to the state computed from scratch; output unchanged."""
    from moeplex.speculation.costs import StepCosts, grid_sizes
    from moeplex.speculation.policy import AdaptivePolicy

    spec = engine(mtp_folder, speculative_algorithm="nextn", speculative_num_steps=3, speculative_policy="adaptive",
                  overlap_schedule=overlap, max_running_requests=4)  # (few sizes to measure at start-up)
    assert spec.overlap_schedule == overlap
    drafter = spec.speculation.drafter
    spec.speculation.policy = AdaptivePolicy(3, StepCosts(grid_sizes(64), lambda n: [1.0] + [1.1 + 0.1 * n * k
                                                                                               for k in range(4)]))
    calls = []
    run = drafter.run_now
    drafter.run_now = lambda step: calls.append(sum(len(ids) for ids in step.next_ids)) or run(step)
    got = spec.generate(PROMPTS, GREEDY)
    assert [r.output_ids for r in got] == plain
    counts = spec.speculation.counts
    assert counts.verify_steps > 0 and counts.plain_steps > 2 * counts.verify_steps
    assert len(calls) <= counts.verify_steps  # the layer ran only for steps that drafted (prompts included)
    assert not drafter.pending and not drafter.starts

    request = spec.add_request(PROMPTS[2], SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True))
    for _ in range(25):
        spec.step()
    if spec.in_flight is not None:  # the step in flight tells the drafter its rows when it is read
        spec._complete(spec.in_flight)
        spec.in_flight = None
    assert sum(len(p.next_ids) for p in drafter.pending[request.rid]) > 8  # many plain steps' rows, waiting
    drafter.catch_up([request.rid])
    start = drafter.starts[request.rid]
    assert start.position == request.num_cached - 1
    torch.testing.assert_close(start.hidden, reference_chain_start(spec.model, request.all_ids), atol=1e-4, rtol=1e-4)
    spec.abort(request.rid)


def test_the_rows_held_for_the_mtp_layer_stay_within_their_budget(mtp_folder, plain, monkeypatch):
    """Over MAX_PENDING_ROWS rows held in all, the requests holding the most catch up (batches of at most
    CATCH_UP_ROWS rows) while the others keep theirs: the count stays exact, and a request caught up early then
    drafts from the state computed from scratch."""
    import moeplex.plugins.drafters.nextn as nextn

    monkeypatch.setattr(nextn, "MAX_PENDING_ROWS", 24)
    monkeypatch.setattr(nextn, "CATCH_UP_ROWS", 16)
    spec = engine(mtp_folder, speculative_algorithm="nextn", speculative_num_steps=3, max_running_requests=4)
    drafter = spec.speculation.drafter
    spec.speculation.policy.may_draft = lambda n: False  # every step plain: rows only pile up
    batches = []
    run = drafter.run_now
    drafter.run_now = lambda step: batches.append(sum(len(ids) for ids in step.next_ids)) or run(step)
    requests = [spec.add_request(p, SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)) for p in PROMPTS]
    for _ in range(20):
        spec.step()
        held = sum(len(p.next_ids) for segments in drafter.pending.values() for p in segments)
        assert drafter.pending_rows == held <= 24 + 40
    assert batches and max(batches) <= 16 + 40  # (a single request's rows may exceed a batch: its prompt)
    longest = requests[2]
    drafter.catch_up([longest.rid])
    start = drafter.starts[longest.rid]
    assert start.position == longest.num_cached - 1
    torch.testing.assert_close(start.hidden, reference_chain_start(spec.model, longest.all_ids), atol=1e-4, rtol=1e-4)
    while spec.has_work:
        spec.step()
    assert [r.output_ids[:12] for r in requests] == plain
    assert drafter.pending_rows == 0 and not drafter.pending


def test_a_verify_step_costs_the_mtp_chain_it_runs(mtp_folder, monkeypatch):
    """The adaptive policy weighs a verify step with the drafter's proposals in it: nextn times its chain of d MTP
    steps on the scratch page for every d (real forwards: more than nothing, never less for more steps), and the
    step-cost table adds the chain of d steps to the verify shape of d drafts per request (that of one to the shape
    of none), never to the plain step."""
    import moeplex.plugins.drafters.nextn as nextn

    spec = engine(mtp_folder, speculative_algorithm="nextn", speculative_num_steps=3, speculative_policy="adaptive",
                  max_running_requests=2)
    costs = spec.speculation.drafter.proposal_costs(2)
    assert len(costs) == 3 and 0.0 < costs[0] <= costs[1] <= costs[2] and spec.speculation.drafter.proposal_cost(2) > 0
    monkeypatch.setattr(nextn.NextNDrafter, "proposal_costs", lambda self, n: [10.0, 20.0, 30.0])  # seconds: far
    spec = engine(mtp_folder, speculative_algorithm="nextn", speculative_num_steps=3, speculative_policy="adaptive",
                  max_running_requests=2)  # above any step
    plain, *verify = spec.step_costs.at(1)
    assert plain < 10.0 and [int(cost // 10) for cost in verify] == [1, 1, 2, 3]


def test_the_chain_is_timed_on_rows_that_route_apart(mtp_folder):
    """proposal_costs times rows of distinct ids and distinct hidden states: equal rows all go to the same top-k
    experts, and an H100 priced nextn's chain for 32 requests at a fraction of what it took (18 ms a step)."""
    spec = engine(mtp_folder, speculative_algorithm="nextn", speculative_num_steps=2)
    drafter = spec.speculation.drafter
    seen = []
    real = drafter.rows_step
    drafter.rows_step = lambda batch, hidden: seen.append((batch.input_ids.tolist(), hidden.clone())) or real(batch,
                                                                                                          hidden)
    drafter.proposal_costs(4)
    ids, hidden = seen[0]
    assert len(set(ids)) == 4 and len({tuple(row.tolist()) for row in hidden}) == 4


def test_nextn_chains_only_as_far_as_the_engine_verifies(mtp_folder):
    """DraftRequest.max_drafts: a request verifying one draft gets it from the catch-up alone (no chain step), one
    verifying two runs one chain step, and the drafts equal the first ones of a full chain."""
    from moeplex.interfaces import DraftRequest

    spec = engine(mtp_folder, speculative_algorithm="nextn", speculative_num_steps=3)
    drafter = spec.speculation.drafter
    request = spec.add_request(PROMPTS[2], GREEDY)
    spec.step()
    request.pages.extend(spec.kv.allocate(2))  # pages for the chain's rows (the scheduler reserves them when drafting)
    steps = []
    real = drafter.rows_step
    drafter.rows_step = lambda batch, hidden: steps.append(hidden.shape[0]) or real(batch, hidden)
    ask = [DraftRequest(request.rid, request.token_view, request.num_cached, tuple(request.pages))]
    full = drafter.propose(ask).tokens[0]
    assert len(full) == 3
    for most in (1, 2, 3):
        steps.clear()
        ask = [attrs.evolve(ask[0], max_drafts=most)]
        assert drafter.propose(ask).tokens[0] == full[:most]
        assert len(steps) == most - 1
    while spec.has_work:
        spec.step()


def test_nextn_without_mtp_weights_is_refused(tiny_model_dir):
    with pytest.raises(PluginError, match="has none"):
        engine(tiny_model_dir("deepseek_v3"), speculative_algorithm="nextn")
    with pytest.raises(PluginError, match="supports deepseek_v3 models"):
        engine(tiny_model_dir("qwen3_moe"), speculative_algorithm="nextn")


@pytest.mark.slow
def test_nextn_over_ranks_changes_no_token(mtp_folder, plain):
    """tp2 with the experts (the MTP layer's too) over 2 ranks through the naive all-to-all."""
    import parallel_ranks
    from moeplex.parallel import ParallelConfig
    from moeplex.ranks.launcher import launch
    from test_parallel import LAYOUTS, free_address

    parallel = ParallelConfig(dist_init_addr=free_address(), timeout_s=120, **LAYOUTS["ep2"])
    spec = {"speculative_algorithm": "nextn", "speculative_num_steps": 2, "dtype": "fp32"}
    results = launch(parallel_ranks.generate_with_settings, parallel, parallel, [mtp_folder], PROMPTS,
                     [GREEDY] * len(PROMPTS), spec)
    assert [r["output_ids"] for r in results[mtp_folder]] == plain


def test_nextn_under_preemption_and_the_prefix_cache(mtp_folder):
    """A small pool preempts requests between verify steps; resumed ones restart from cached pages (whose MTP
    rows came from their first run) and observe again: output unchanged, pages conserved."""
    prompts = [[256] + list(range(k, k + 9)) for k in range(0, 40, 10)]
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    want = [r.output_ids for r in engine(mtp_folder).generate(prompts, params)]
    spec = engine(mtp_folder, max_total_tokens=14 * PAGE, speculative_algorithm="nextn", speculative_num_steps=3)
    got = spec.generate(prompts, params)
    assert [r.output_ids for r in got] == want
    assert sum(r.num_preemptions for r in got) > 0
    assert spec.kv.num_free_pages + spec.prefix_cache.num_pages == spec.kv.num_pages


def test_rows_held_from_before_a_run_on_the_device_are_kept_and_caught_up(mtp_folder):
    """Under the overlap schedule a run of verify steps puts its positions through the MTP layer on the device;
    the rows a request held from before the run stay held (a segment of their own, not dropped as a restart would
    drop them), and the catch-up over both segments leaves the layer's state equal to the whole sequence's."""
    from moeplex.executor import run_layers
    from moeplex.interfaces import TargetStep
    from moeplex.registry import lookup

    spec = engine(mtp_folder, speculative_algorithm="nextn", speculative_num_steps=3)
    drafter, model, kv = spec.speculation.drafter, spec.model, spec.kv
    ids = PROMPTS[2] + [5, 6, 7, 8, 9, 10]
    n = len(ids) - 1
    pages = kv.allocate(kv.pages_for(len(ids)))
    with torch.inference_mode():  # the target's pre-norm hidden rows of positions 0 .. n-1, in the engine's pool
        batch = build_forward_batch([ScheduledSeq(ids[:-1], 0, pages)], kv, "cpu")
        hidden = run_layers(model, batch, kv, lookup("overlap", "none")())

    def kept(start: int, end: int) -> TargetStep:
        return TargetStep(["r"], [start], [ids[start + 1 : end + 1]], [pages], hidden[start:end])

    before, run_end = n - 6, n - 3
    drafter.observe(kept(0, before))  # plain steps' rows: held
    drafter.run_now(kept(before, run_end))  # what the verify steps of a run write on the device
    drafter.observe(kept(run_end, n))  # the run's last step, observed once read
    assert [(p.start, len(p.next_ids)) for p in drafter.pending["r"]] == [(0, before), (run_end, n - run_end)]
    assert drafter.pending_rows == before + n - run_end
    drafter.catch_up(["r"])
    assert drafter.starts["r"].position == n - 1 and not drafter.pending and drafter.pending_rows == 0
    torch.testing.assert_close(drafter.starts["r"].hidden, reference_chain_start(model, ids), atol=1e-4, rtol=1e-4)
    drafter.observe(kept(2, 5))  # before where it left off (a restart after preemption): held anew
    assert [(p.start, len(p.next_ids)) for p in drafter.pending["r"]] == [(2, 3)]
    drafter.finished("r")
    kv.release(pages)
