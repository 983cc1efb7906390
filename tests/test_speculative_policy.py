"""The adaptive draft policy: its choices follow the step-cost model and each request's acceptance, its cost model
is measured lazily per batch size and robust to noise, and no token depends on the policy (greedy and seeded
sampling, fixed vs adaptive vs no speculation)."""

from __future__ import annotations

import pytest

from moeplex.config import EngineConfig
from moeplex.engine import Engine
from moeplex.request import Request
from moeplex.sampling import SamplingParams
from moeplex.speculation import costs as costs_module
from moeplex.speculation.costs import StepCosts, grid_sizes, time_size
from moeplex.speculation.policy import MAX_COLD, AdaptivePolicy, FixedPolicy
from moeplex.speculation.step import PromptGaps

import script_drafters
from test_speculative import PAGE, PROMPTS, conserved, script_distribution, scripted  # noqa: F401 (a fixture)

STEPS = 3


def table(plain: float, per_row: float, fixed: float = 0.0):
    """A cost model: a plain step costs `plain`; a verify step `fixed` more plus `per_row` per row beyond one."""
    return lambda n: [plain] + [plain + fixed + per_row * n * (k - 1) for k in range(1, STEPS + 2)]


def request(rid: str, outputs: int = 1) -> Request:
    r = Request(rid, [1, 2, 3], SamplingParams(max_new_tokens=100))
    r.output_ids.extend([5] * outputs)
    return r


def test_cheap_rows_draft_fully_and_dear_rows_not_at_all():
    cheap = AdaptivePolicy(STEPS, StepCosts(grid_sizes(64), table(1.0, 0.001)))
    assert cheap.choose([request("a")], [STEPS]) == [STEPS]
    # a verify row costs what a decode row does: no draft can pay (each is accepted with probability < 1)
    dear = AdaptivePolicy(STEPS, StepCosts(grid_sizes(64), lambda n: [n * 1.0] + [n * k * 1.0 for k in range(1, 5)]))
    assert dear.choose([request(str(i)) for i in range(8)], [STEPS] * 8) == [0] * 8
    assert not dear.may_draft(8) and cheap.may_draft(8)  # dear: not even a sure draft pays, so no page is reserved
    # room (pages, max_new_tokens) bounds the choice
    assert cheap.choose([request("a"), request("b")], [1, 0]) == [1, 0]


def test_a_request_that_misses_stops_drafting_while_one_that_lands_goes_on():
    policy = AdaptivePolicy(STEPS, StepCosts(grid_sizes(64), table(1.0, 0.1, fixed=0.1)))
    good, bad = request("good"), request("bad")
    for _ in range(6):
        policy.record(good, STEPS, STEPS)
        policy.record(bad, STEPS, 0)
    assert policy.choose([good, bad], [STEPS, STEPS]) == [STEPS, 0]
    # tokens decoded without drafts fade the bad record back toward the prior: it is tried again later
    bad.output_ids.extend([5] * 200)
    assert policy.choose([good, bad], [STEPS, STEPS])[1] > 0


def test_the_batch_decides_together_at_the_fixed_cost_of_a_verify_step():
    """A verify step's fixed cost is paid once for the batch: one weak request alone does not pay for it, but
    it is worth a few rows where others already make the step a verify step (and the positions that pay)."""
    costs = StepCosts(grid_sizes(64), table(1.0, 0.1, fixed=0.7))
    policy = AdaptivePolicy(STEPS, costs)
    weak, strong = request("weak"), request("strong")
    for _ in range(4):  # the first draft lands half the time, the second never
        policy.record(weak, STEPS, 1)
        policy.record(weak, STEPS, 0)
        policy.record(strong, STEPS, STEPS)
    assert policy.choose([weak], [STEPS]) == [0]
    assert policy.choose([weak, strong], [STEPS, STEPS]) == [1, STEPS]


def test_the_fixed_policy_is_backoff():
    policy = FixedPolicy(STEPS)
    r = request("r", outputs=4)
    assert policy.choose([r], [2]) == [2]
    policy.record(r, STEPS, 0)
    policy.record(r, STEPS, 0)
    assert policy.choose([r], [STEPS]) == [0]  # paused for 2 of its tokens
    r.output_ids.extend([5, 5])
    assert policy.choose([r], [STEPS]) == [STEPS]


def test_step_costs_measure_each_size_once_on_first_use_and_interpolate():
    asked = []

    def measure(n):
        asked.append(n)
        return table(1.0 * n, 0.5)(n)

    costs = StepCosts(grid_sizes(12), measure)
    assert costs.sizes == [1, 2, 4, 8, 12] and asked == []
    assert costs.cost(3, 3, verify=False) == 4.0  # 3 requests: the size 4 measurement, as a graph pads to it
    assert costs.cost(3, 6, verify=True) == pytest.approx(4.0 + 0.5 * 4 * 1)  # 2 rows per request
    assert costs.cost(3, 9, verify=True) == pytest.approx(4.0 + 0.5 * 4 * 2)
    assert costs.cost(3, 4, verify=True) == pytest.approx(4.0 + 0.5 * 4 * (4 / 3 - 1))  # fractional rows
    assert costs.cost(4, 4, verify=False) == 4.0 and asked == [4]
    assert costs.cost(24, 24, verify=False) == pytest.approx(12.0 * 2)  # beyond the grid: per request
    assert asked == [4, 12]


def test_a_noisy_small_batch_costs_at_most_what_a_larger_one_does():
    noisy = {1: [9.0, 9.0, 9.5, 9.5, 9.5], 2: [2.0, 2.1, 2.4, 2.6, 3.0]}  # size 1 measured during a burst
    costs = StepCosts([1, 2], lambda n: noisy[n])
    assert costs.cost(1, 1, verify=False) == 9.0
    costs.at(2)
    assert costs.measured[1] == [2.0, 2.1, 2.4, 2.6, 3.0]


def test_timing_keeps_the_fastest_run_and_more_rows_never_cost_less(monkeypatch):
    """A fake clock: shape k takes base[k], plus a spike on some runs; the table is the spike-free one with the
    envelope applied (verify x2 measured slower than x3 costs what x3 does)."""
    base = [1.0, 1.1, 1.6, 1.5, 2.0]
    clock, runs = [0.0], []

    def run(n, k):
        runs.append(k)
        clock[0] += base[k] + (5.0 if len(runs) % 4 == 0 else 0.0)

    monkeypatch.setattr(costs_module.time, "perf_counter", lambda: clock[0])
    assert time_size(1, 4, run) == pytest.approx([1.0, 1.1, 1.5, 1.5, 2.0])


def test_shapes_timed_over_two_steps_are_compared_per_step(monkeypatch):
    """Under the overlap schedule a plain step is timed as two back to back: 1.6 for two is 0.8 a step, below a
    synchronous verify step's 1.1, and stays 0.8 (compared per run, the envelope would cap it at 1.1 / 2)."""
    base = [1.6, 1.1, 1.3, 1.5, 2.0]
    clock = [0.0]

    def run(n, k):
        clock[0] += base[k]

    monkeypatch.setattr(costs_module.time, "perf_counter", lambda: clock[0])
    assert time_size(1, 4, run, steps_per_run=[2, 1, 1, 1, 1]) == pytest.approx([0.8, 1.1, 1.3, 1.5, 2.0])
    assert time_size(1, 4, run, steps_per_run=[2, 2, 2, 2, 2]) == pytest.approx([0.55, 0.55, 0.65, 0.75, 1.0])


def config(folder: str, **overrides) -> EngineConfig:
    base = dict(model=folder, dtype="fp32", show_progress=False, max_total_tokens=2048, page_size=PAGE,
                speculative_num_steps=STEPS)
    return EngineConfig(**{**base, **overrides})


def run(folder, params, policy_costs=None, **overrides):
    if policy_costs is not None:
        overrides.setdefault("speculative_cost_calibration", False)  # (the table is given, not this CPU's)
    engine = Engine(config(folder, **overrides))
    if policy_costs is not None:  # a cost model where the choice depends on each request's record
        engine.speculation.policy = AdaptivePolicy(STEPS, StepCosts(grid_sizes(64), policy_costs))
    return engine, engine.generate(PROMPTS, params)


GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
SEEDED = [SamplingParams(max_new_tokens=24, temperature=0.9, top_k=30, seed=s, ignore_eos=True) for s in (3, 4, 5)]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_no_token_depends_on_the_policy(tiny_model_dir, params):
    """ngram on prompts it can and cannot predict: the fixed policy drafts every step, the adaptive one (under a
    cost model where a row costs something) only where the record pays; both give the tokens of decoding without speculation, seeded sampling included (each emitted token is the target's
    own draw from the request's stream)."""
    folder = tiny_model_dir("qwen3_moe")
    want = [r.output_ids for r in Engine(config(folder)).generate(PROMPTS, params)]
    fixed, got_fixed = run(folder, params, speculative_algorithm="ngram", speculative_policy="fixed",
                           disable_speculative_backoff=True)
    adaptive, got_adaptive = run(folder, params, table(1.0, 0.04, fixed=0.2), speculative_algorithm="ngram")
    for got in (got_fixed, got_adaptive):
        assert [r.output_ids for r in got] == want
    drafted = [sum(r.spec_draft_tokens for r in got) for got in (got_fixed, got_adaptive)]
    assert 0 < drafted[1] < drafted[0]  # the policies decided differently
    assert adaptive.speculation.counts.plain_steps > 0 and adaptive.speculation.counts.verify_steps > 0
    for engine in (fixed, adaptive):
        assert conserved(engine)


def test_the_measured_cost_model_changes_no_token(tiny_model_dir):
    """The default: costs measured on this machine's own steps (noisy here, so its choices are anyone's guess)."""
    folder = tiny_model_dir("mixtral")
    want = [r.output_ids for r in Engine(config(folder)).generate(PROMPTS, SEEDED)]
    engine, got = run(folder, SEEDED, speculative_algorithm="ngram")
    assert [r.output_ids for r in got] == want
    assert 4 in engine.step_costs.measured  # three requests: the size a graph would pad them to
    assert conserved(engine)


def test_the_adaptive_policy_drafts_fully_for_the_oracle_and_stops_for_the_adversary(tiny_model_dir,
                                                                                      script_distribution):
    folder = tiny_model_dir("deepseek_v3")
    plain = Engine(config(folder)).generate(PROMPTS, GREEDY)
    want = [r.output_ids for r in plain]
    scripted(PROMPTS, want)
    costs = table(1.0, 0.02, fixed=0.1)
    _, oracle = run(folder, GREEDY, costs, speculative_algorithm="test-oracle")
    assert [r.output_ids for r in oracle] == want
    assert all(r.spec_accepted_tokens == r.spec_draft_tokens > 0 for r in oracle)
    assert sum(r.spec_verify_steps for r in oracle) <= sum(-(-23 // (STEPS + 1)) for _ in oracle)  # full drafts
    adversary, got = run(folder, GREEDY, costs, speculative_algorithm="test-adversary")
    assert [r.output_ids for r in got] == want
    # it tries (the prior is optimistic), misses, and stops: far fewer verify steps than decode steps
    assert 0 < adversary.speculation.counts.verify_steps <= 3 * 4 < adversary.speculation.counts.plain_steps
    assert conserved(adversary)


def test_under_the_overlap_schedule_every_size_is_measured_at_start_up(tiny_model_dir):
    """A step may be in flight when a size is first asked for: its graph outputs must not be replayed over, so
    the whole grid is measured before serving; output as without speculation."""
    folder = tiny_model_dir("mixtral")
    want = [r.output_ids for r in Engine(config(folder)).generate(PROMPTS, GREEDY)]
    engine = Engine(config(folder, speculative_algorithm="ngram", overlap_schedule=True, max_running_requests=4))
    assert engine.overlap_schedule and sorted(engine.step_costs.measured) == [1, 2, 4]
    # and what a break of the schedule costs at each size (what a try out of plain steps adds twice)
    assert sorted(engine.step_costs.breaks) == [1, 2, 4] and all(b >= 0 for b in engine.step_costs.breaks.values())
    assert [r.output_ids for r in engine.generate(PROMPTS, GREEDY)] == want
    assert conserved(engine)


def test_where_the_prior_advises_against_drafts_a_request_tries_them_now_and_then():
    """A verify step of one request costs 2.5 plain steps: the prior (0.6 a position: 2.2 tokens) never pays, a
    drafter that lands every draft (4 tokens) would. A fresh engine tries at once; a try that lands keeps the
    request drafting; one that misses waits explore_every tokens, set so that trying costs at most 1%."""
    costs = StepCosts(grid_sizes(64), table(1.0, 0.25, fixed=0.75))
    policy = AdaptivePolicy(STEPS, costs)
    lands, misses = request("lands"), request("misses")
    assert policy.choose([lands], [STEPS]) == [STEPS]  # no record anywhere: a try
    policy.record(lands, STEPS, STEPS)
    for _ in range(3):
        assert policy.choose([lands], [STEPS]) == [STEPS]  # its record now pays
        policy.record(lands, STEPS, STEPS)
        lands.output_ids.extend([5] * 4)
    every = policy._size(1).explore_every
    assert every == 150  # (2.5 - 1) / 1 / 1%
    policy = AdaptivePolicy(STEPS, costs)  # a drafter whose drafts miss
    first = request("first")
    assert policy.choose([first], [STEPS]) == [STEPS]
    policy.record(first, STEPS, 0)
    assert policy.choose([first], [STEPS]) == [0]
    assert policy.choose([misses], [STEPS]) == [0]  # a record exists: a new request waits its turn
    misses.output_ids.extend([5] * every)
    assert policy.choose([misses], [STEPS]) == [STEPS]
    policy.offered(misses, True)  # (the drafter asked, as the engine does, before the verify step)
    policy.record(misses, STEPS, 0)  # a try that came to nothing: the next one is due after twice the interval
    misses.output_ids.extend([5] * (2 * every - 1))
    assert policy.choose([misses], [STEPS]) == [0]
    misses.output_ids.append(5)
    assert policy.choose([misses], [STEPS]) == [STEPS]
    policy.record(misses, STEPS, 1)  # a try that lands: the interval is back to `every`
    misses.output_ids.extend([5] * every)
    assert policy._missed_tries == 0 and policy.choose([misses], [STEPS]) != [0]


def test_requests_shorter_than_the_exploring_interval_are_tried_too():
    """The interval between tries counts the batch's tokens, not one request's: in a stream of 40-token requests
    where a try is due every 150 tokens (a verify step of 2.5 plain ones), one request in about four tries; counted
    per request (as it was), none ever did, and a drafter whose drafts land (nextn, accepted at 0.8 a position) was
    never found out at batch 1 on an H100. Tries that all miss double the interval (150, 300, 600 tokens...)."""
    policy = AdaptivePolicy(STEPS, StepCosts(grid_sizes(64), table(1.0, 0.25, fixed=0.75)))
    first = request("first")
    assert policy.choose([first], [STEPS]) == [STEPS]  # fresh: a try at once
    policy.record(first, STEPS, 0)
    policy.finished(first.rid)
    tried = []
    for i in range(30):
        r = request(f"r{i}")
        for _ in range(40):
            if policy.choose([r], [STEPS]) != [0]:
                tried.append((i, len(r.output_ids)))
                policy.record(r, STEPS, 0)
            r.output_ids.append(5)
        policy.finished(r.rid)
    gaps = [b[0] * 40 + b[1] - a[0] * 40 - a[1] for a, b in zip(tried, tried[1:])]
    assert len(tried) == 3 and all(gap >= 150 << k for k, gap in enumerate(gaps, start=1)), tried  # 30 x 40 tokens


def test_only_a_fresh_engine_has_every_newcomer_try_at_once():
    """All requests' record fades with each new request; once it is below one try, newcomers still wait for the
    batch's exploring clock (it used to count as a fresh engine, where every newcomer tries at once)."""
    policy = AdaptivePolicy(STEPS, StepCosts(grid_sizes(64), table(1.0, 0.25, fixed=0.75)))
    first, second = request("first"), request("second")
    assert policy.choose([first, second], [STEPS, STEPS]) == [STEPS, STEPS]  # fresh: both try
    policy.record(first, STEPS, 0)
    policy.record(second, STEPS, 0)
    policy.all.fade(0.97 ** 200)  # as 200 new requests since fade it
    assert policy.all.tried[0] < 1.0
    newcomers = [request(f"new{i}") for i in range(4)]
    assert policy.choose(newcomers, [STEPS] * 4) == [0] * 4


def test_a_request_whose_drafts_keep_missing_only_explores_even_where_verifying_is_cheap():
    """A verify step of one request costs 1.16 plain steps (the CPU's batch 1): the prior alone would have a
    request that never lands try again every few tokens. After two verify steps running with every draft missed
    it drafts only when due to explore, and a landing draft makes it warm again."""
    costs = StepCosts(grid_sizes(64), table(1.0, 0.04, fixed=0.04))
    policy = AdaptivePolicy(STEPS, costs)
    r = request("r")
    for _ in range(2):
        assert policy.choose([r], [STEPS])[0] > 0
        policy.record(r, STEPS, 0)
        r.output_ids.append(5)
    every = policy._size(1).explore_every
    assert every == 16  # 0.16 / 1 / 1%
    for _ in range(every - 1):
        assert policy.choose([r], [STEPS]) == [0]
        r.output_ids.append(5)
    assert policy.choose([r], [STEPS]) == [STEPS]
    policy.record(r, STEPS, 2)
    assert policy.choose([r], [STEPS])[0] > 0


def test_a_try_out_of_plain_steps_is_priced_with_the_two_breaks_it_makes():
    """Under the overlap schedule a try breaks it twice (into the verify step, out of it): the exploring interval
    counts both, so trying still costs at most 1% (150 tokens without breaks, 200 with breaks of 0.25 plain steps)."""
    cost = table(1.0, 0.25, fixed=0.75)
    assert AdaptivePolicy(STEPS, StepCosts(grid_sizes(64), cost))._size(1).explore_every == 150  # (2.5 - 1) / 1%
    costs = StepCosts(grid_sizes(64), cost, measure_break=lambda n: 0.25)
    assert costs.break_cost(1) == 0.25 and costs.break_cost(3) == 0.25  # (the grid size at or above)
    assert AdaptivePolicy(STEPS, costs)._size(1).explore_every == 200  # (2.5 - 1 + 2 x 0.25) / 1%
    negative = StepCosts(grid_sizes(64), cost, measure_break=lambda n: -0.1)  # noise: a break never pays
    assert negative.break_cost(1) == 0.0


def test_a_run_of_verify_steps_goes_on_without_drafts_while_that_costs_less_than_two_breaks():
    """keeps_run: ending a run of overlapped verify steps costs two breaks (now, and when drafts come back); a verify
    step of no drafts costs `fixed` beyond a plain one. Ski rental: go on while the idle steps' extra stays below
    the two breaks; never where breaks cost nothing, nor where no draft could pay at the size; never for the fixed
    policy."""
    costs = StepCosts(grid_sizes(64), table(1.0, 0.1, fixed=0.1), measure_break=lambda n: 0.25)
    policy = AdaptivePolicy(STEPS, costs)
    assert [policy.keeps_run(1, idle) for idle in range(1, 7)] == [True] * 4 + [False] * 2  # 0.1 x idle < 0.5
    free = AdaptivePolicy(STEPS, StepCosts(grid_sizes(64), table(1.0, 0.1, fixed=0.1)))
    assert not free.keeps_run(1, 1)
    dear = StepCosts(grid_sizes(64), lambda n: [n * 1.0] + [n * k * 1.0 for k in range(1, 5)], lambda n: 5.0)
    assert not AdaptivePolicy(STEPS, dear).keeps_run(8, 1)  # no draft pays at 8 requests: nothing to wait for
    assert not FixedPolicy(STEPS).keeps_run(1, 1)


def test_a_run_is_entered_from_plain_steps_only_where_it_saves_more_before_the_next_prompt_than_two_breaks():
    """run_pays: a run entered from plain steps breaks the overlap schedule now and when the next prompt step ends
    it. A plain step costs 1.0, a verify step of one / three drafts 1.2 / 1.4, a break 0.25: a draft that lands
    half the time saves 1.5 - 1.2 = 0.3 a step, so it pays for the 0.5 of two breaks in runs of 2 steps, not 1;
    three sure drafts save 2.6 a step, and pay in one. An exploring try (no saving by the records) was priced
    with its breaks already; the fixed policy enters every run."""
    costs = StepCosts(grid_sizes(64), table(1.0, 0.1, fixed=0.1), measure_break=lambda n: 0.25)
    policy = AdaptivePolicy(STEPS, costs)
    weak, strong = request("weak"), request("strong")
    for _ in range(20):
        policy.record(weak, STEPS, 1)  # the first draft lands half the time, the second never
        policy.record(weak, STEPS, 0)
        policy.record(strong, STEPS, STEPS)
    assert policy.choose([weak], [STEPS]) == [1]
    assert [policy.run_pays([weak], [1], steps) for steps in (1, 2, 5, float("inf"))] == [False, True, True, True]
    assert policy.choose([strong], [STEPS]) == [STEPS] and policy.run_pays([strong], [STEPS], 1)
    fresh = request("fresh")
    assert policy.run_pays([fresh], [0], 1)  # nothing chosen: nothing to price
    free = AdaptivePolicy(STEPS, StepCosts(grid_sizes(64), table(1.0, 0.1, fixed=0.1)))  # breaks cost nothing
    assert free.run_pays([weak], [1], 1)
    cold = AdaptivePolicy(STEPS, costs)
    for _ in range(20):
        cold.record(weak, STEPS, 0)
    assert cold.run_pays([weak], [STEPS], 1)  # a try: its saving by the record is none
    assert FixedPolicy(STEPS).run_pays([weak], [1], 1)


def test_prompt_gaps_count_steps_between_prompt_steps():
    gaps = PromptGaps()
    assert gaps.expected() == float("inf")
    for holds in (True, False, False, False, True):  # (the gap before the first prompt step is start-up's)
        gaps.stepped(holds)
    assert gaps.mean == 4 and gaps.expected() == 4
    for holds in (False, True):
        gaps.stepped(holds)
    assert gaps.mean == pytest.approx(0.8 * 4 + 0.2 * 2)
    for _ in range(9):
        gaps.stepped(False)
    assert gaps.expected() == 9  # at least the gap under way


def test_drafts_are_wanted_only_where_the_run_pays(tiny_model_dir):
    """wants_drafts (a plain step in flight would be read for them) asks run_pays with the steps the engine has
    seen between prompt steps; no token changes either way."""
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    want = [r.output_ids for r in Engine(EngineConfig(model=tiny_model_dir("qwen3_moe"), dtype="fp32",
                                                      show_progress=False, max_total_tokens=4096, page_size=PAGE)
                                         ).generate(PROMPTS, params)]
    for pays in (True, False):
        engine = Engine(EngineConfig(model=tiny_model_dir("qwen3_moe"), dtype="fp32", show_progress=False,
                                     max_total_tokens=4096, page_size=PAGE, overlap_schedule=True,
                                     speculative_algorithm="ngram", speculative_num_steps=STEPS))
        spec = engine.speculation
        asked = []
        spec.policy.run_pays = lambda requests, counts, steps, breaks=2: asked.append(steps) or pays
        spec.policy.choose = lambda requests, rooms, expect_offers=False: [1] * len(requests)
        assert [r.output_ids for r in engine.generate(PROMPTS, params)] == want
        assert asked and all(steps >= 1 for steps in asked)
        if pays:
            assert engine.step_log.steps["verify_overlap"] > 0
        else:
            assert engine.step_log.breaks["drafts_wanted"] == 0
        assert conserved(engine)


def test_newcomers_start_from_the_drafters_recent_rate():
    """All requests' record is what a new request starts from: in a stream of short requests whose first drafts
    land one time in ten, a newcomer's first draft is worth about 0.1 (0.13: the prior's 0.6 weighs 2 against ~19
    recent tries), where a fade of 0.97^8 per new request kept ~4 tries and left it at 0.21, twice the rate."""
    policy = AdaptivePolicy(STEPS, StepCosts(grid_sizes(64), table(1.0, 0.1, fixed=0.1)))
    for i in range(60):
        r = request(f"r{i}")
        policy.record(r, 1, 1 if i % 10 == 0 else 0)
        policy.finished(r.rid)
    newcomer = policy.worth(request("new"))
    assert 0.1 <= newcomer[0] < 0.15, newcomer


def test_two_misses_in_a_row_do_not_make_a_request_of_a_good_drafter_cold():
    """Where all requests' first drafts land 0.8 of the time, two all-miss verify steps in a row are bad luck (one in
    25), not a request whose drafts never land: it goes cold only after cold_after() of them (three: one in 125), and
    a drafter that never lands still goes cold after two. (Its own misses lower all requests' rate too, so the
    streak it takes grows a little as it goes.)"""
    costs = StepCosts(grid_sizes(64), table(1.0, 0.04, fixed=0.04))
    policy = AdaptivePolicy(STEPS, costs)
    for i in range(20):  # earlier requests: 4 of 5 first drafts land
        earlier = request(f"earlier{i}")
        policy.record(earlier, STEPS, 0 if i % 5 == 0 else STEPS)
        policy.finished(earlier.rid)
    assert policy.cold_after() == 3
    r = request("r")
    for _ in range(2):
        assert policy.choose([r], [STEPS])[0] > 0
        policy.record(r, STEPS, 0)
        r.output_ids.append(5)
    assert policy.choose([r], [STEPS])[0] > 0  # still warm
    misses = 2
    while policy._cold[r.rid] < policy.cold_after():  # (its own misses lower all requests' rate too)
        policy.record(r, STEPS, 0)
        r.output_ids.append(5)
        misses += 1
    assert 3 <= misses <= MAX_COLD
    assert policy.choose([r], [STEPS]) == [0]  # cold: only exploring from here
    never = AdaptivePolicy(STEPS, costs)
    for _ in range(3):
        never.record(request(f"x{_}"), STEPS, 0)
    assert never.cold_after() == 2


def test_the_fixed_policy_verifies_in_mixed_steps_whatever_they_cost():
    policy = FixedPolicy(STEPS)
    batch = [request("a"), request("b")]
    assert policy.mixed_pays(batch, [STEPS, 0]) and not policy.mixed_pays(batch, [0, 0])
