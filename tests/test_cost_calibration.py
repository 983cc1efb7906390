"""The step-cost table scaled to what steps take while serving (speculation/calibration.py): verify steps that take
longer than the table says, against plain steps, make the policy draft less; what slows both alike changes
nothing; only steps inside runs count; breaks that expose more host work than the start-up measure price breaks
higher; ranks agree on the slowest rank's scale; and no token depends on it."""

from __future__ import annotations

import numpy as np
import pytest

from moeplex.config import EngineConfig
from moeplex.engine import Engine
from moeplex.sampling import SamplingParams
from moeplex.speculation import calibration as calibration_module
from moeplex.speculation.calibration import Calibration
from moeplex.speculation.costs import StepCosts, grid_sizes
from moeplex.speculation.policy import AdaptivePolicy
from moeplex.step_log import StepLog, TimedStep

import script_drafters
from test_speculative import PAGE, PROMPTS, conserved, script_distribution  # noqa: F401 (fixtures)
from test_speculative_policy import STEPS, request, table

PLAIN, PER_ROW = 1.0, 0.02  # a verify row costs 2% of a plain step: drafting pays at every size


def costs(break_cost: float = 0.0) -> StepCosts:
    c = StepCosts(grid_sizes(8), table(PLAIN, PER_ROW, fixed=0.05), lambda n: break_cost)
    c.measure_all()
    return c


def run(calibration: Calibration, n: int, kind: str, times: int, slower: float = 1.0, rows: int | None = None,
        broken: bool = False) -> None:
    rows = rows if rows is not None else (n if kind == "decode" else 3 * n)
    seconds = calibration.costs.table_cost(max(n, 1), max(rows, 1), kind != "decode") * slower
    for _ in range(times):
        calibration.observe(TimedStep(kind, n, rows, seconds, broken))


def test_verify_steps_slower_than_the_table_scale_its_verify_costs_and_stop_the_drafts():
    c = costs()
    calibration, policy = Calibration(c), AdaptivePolicy(STEPS, c)
    batch = [request(str(i)) for i in range(8)]
    before = sum(policy.choose(batch, [STEPS] * 8))
    assert policy.may_draft(8) and before == 8 * STEPS
    for _ in range(20):  # runs of plain steps as the table says, runs of verify steps at 3.5x it
        run(calibration, 8, "decode", 8)
        run(calibration, 8, "verify_overlap", 8, slower=3.5)
    assert 3.0 < c.scale(8) <= 3.5  # (the prior's weight: "as the table says" counts as a few steps)
    assert c.cost(8, 24, verify=True) == pytest.approx(c.scale(8) * c.table_cost(8, 24, verify=True))
    # not even sure drafts pay now: none chosen, no page reserved for them
    assert not policy.may_draft(8) and policy.choose(batch, [STEPS] * 8) == [0] * 8
    assert c.scale(1) == 1.0  # other sizes keep the table
    # plain steps alone fade the evidence back towards the table: the size is tried again later
    run(calibration, 8, "decode", 1000)
    assert c.scale(8) < 1.2 and policy.may_draft(8)


def test_what_slows_plain_and_verify_steps_alike_changes_nothing():
    c = costs()
    calibration, version = Calibration(c), c.version
    for _ in range(20):
        run(calibration, 4, "decode", 8, slower=2.0)
        run(calibration, 4, "verify", 8, slower=2.0)
    assert c.scale(4) == 1.0 and c.version == version  # (a scale within MOVE of the last is not published)


def test_verify_steps_faster_than_the_table_leave_it_alone():
    """Calibration only ever makes the policy more careful: one scale covers a size's steps with and without drafts,
    and a scale below 1 priced a step of no draft below a plain one (runs of them then never ended)."""
    c = costs()
    calibration = Calibration(c)
    for _ in range(20):
        run(calibration, 4, "decode", 8)
        run(calibration, 4, "verify_overlap", 8, slower=0.5)
    assert c.scale(4) == 1.0


def test_only_steps_inside_runs_count():
    """The first step of a run (its time holds the step before, of the other class), a step during which the overlap
    schedule broke, prompt steps and steps of no request are never compared with the table."""
    c = costs()
    calibration = Calibration(c)
    for _ in range(64):
        run(calibration, 8, "decode", 1)
        run(calibration, 8, "verify_overlap", 1, slower=3.0)  # each the first of its run
        run(calibration, 8, "prompt", 2, slower=3.0)
    run(calibration, 8, "verify_overlap", 64, slower=3.0, broken=True)
    run(calibration, 0, "verify", 64, slower=3.0)
    assert c.scale(8) == 1.0
    run(calibration, 8, "verify_idle", 64, slower=3.0, rows=8)  # idle verify steps are verify steps
    assert c.scale(8) > 2.0  # (no plain step measured: the table's plain cost stands)


def test_a_host_drafters_synchronous_verify_steps_count_alone():
    """Under the overlap schedule a drafter that drafts on the host verifies in synchronous steps between plain ones,
    each breaking the schedule: for such a drafter (isolated) each counts at what it took, so that a drafter whose
    steps cost 4x the table's bare forward stops drafting where that loses. Overlapped and prompt steps alone still
    do not count, and a drafter with overlapped verify steps keeps the runs-only rule."""
    c, other = costs(), costs()
    calibration, runs_only = Calibration(c, isolated=True), Calibration(other)
    policy = AdaptivePolicy(STEPS, c)
    for cal in (calibration, runs_only):
        for _ in range(40):
            run(cal, 8, "decode", 6)
            run(cal, 8, "verify", 1, slower=4.0, broken=True)
            run(cal, 8, "decode", 2)
            run(cal, 8, "verify_overlap", 1, slower=3.0)  # the first of its run
            run(cal, 8, "prompt", 1, slower=3.0)
    assert 3.0 < c.scale(8) <= 4.0 and other.scale(8) == 1.0
    assert not policy.may_draft(8)


def test_every_rank_takes_the_slowest_ranks_scale():
    seen = []

    def slowest(values):  # a second rank measured 2.5x for size 2 (what the all-gather would return); the verify
        seen.append(list(values))  # scales come first, then the breaks'
        sizes = grid_sizes(8)
        return [max(v, 2.5) if i < len(sizes) and sizes[i] == 2 else v for i, v in enumerate(values)]

    c = costs()
    calibration = Calibration(c, slowest)
    run(calibration, 2, "decode", calibration_module.EARLY[0] + 1)  # (the first starts the run)
    assert len(seen) == 1 and c.scale(2) == 2.5 and c.scale(8) == 1.0


def test_the_engine_stops_drafting_where_its_verify_steps_measurably_lose_and_no_token_changes(
        tiny_model_dir, script_distribution):
    greedy = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = PROMPTS[:2]
    folder = tiny_model_dir("qwen3_moe")
    base = dict(model=folder, dtype="fp32", show_progress=False, page_size=PAGE, max_running_requests=2)
    plain = Engine(EngineConfig(**base))
    reference = [r.output_ids for r in plain.generate(prompts, greedy)]
    script_drafters.set_script([p + out for p, out in zip(prompts, reference)])
    verified = {}
    for on in (False, True):
        engine = Engine(EngineConfig(**base, speculative_algorithm="test-slow-oracle", speculative_num_steps=STEPS,
                                     speculative_cost_calibration=on))
        assert (engine.calibration is not None) == on
        done = engine.generate(prompts * 5, greedy)
        assert [r.output_ids for r in done] == reference * 5
        verified[on] = sum(r.spec_verify_steps for r in done)
        assert conserved(engine)
    # 100 ms of host work on a verify step of a few ms: four tokens cost more than four plain steps
    assert engine.step_costs.scale(2) > 2.0, engine.step_costs.scales
    assert verified[True] < verified[False] / 2, verified


@pytest.mark.slow
def test_tensor_parallel_ranks_publish_the_same_scales_and_change_no_token(tiny_model_dir):
    """tp2 with the experts over 2 ranks: each rank times its own steps, the scales reach the tables as the slowest
    rank's (had they differed, the ranks' choices would part and their collectives hang), and no token changes."""
    import parallel_ranks

    from moeplex.parallel import ParallelConfig
    from moeplex.ranks.launcher import launch
    from test_parallel import free_address

    folder = tiny_model_dir("qwen3_moe")
    params = [SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)] * 2
    single = [r.output_ids for r in Engine(EngineConfig(model=folder, dtype="fp32", show_progress=False,
                                                        page_size=4)).generate(PROMPTS[:2], params)]
    parallel = ParallelConfig(tp_size=2, ep_size=2, dist_init_addr=free_address(), timeout_s=120)
    outputs, scales, observed = launch(parallel_ranks.calibrated_generate, parallel, parallel, folder, PROMPTS[:2],
                                       params, {"speculative_algorithm": "ngram", "speculative_num_steps": 2,
                                                "dtype": "fp32"})
    assert outputs == single
    assert observed[0] == observed[1] >= 8  # the same steps observed, and published at least twice
    assert scales[0] == scales[1]


BREAK = 0.5  # the start-up measure's break: half a plain step


def broken(calibration: Calibration, n: int, kind: str, times: int, exposed: float) -> None:
    for _ in range(times):
        calibration.observe(TimedStep(kind, n, n, PLAIN * 2, True, exposed=exposed))


def test_breaks_that_expose_more_than_the_start_up_measure_price_breaks_higher():
    """A broken step's exposed host work (the read step's tokens on the host to the step's end), against the table's
    break: three times it makes the policy's break three times dearer, so a run must save more to be entered, and a
    run of steps of no draft goes on longer before it ends (two breaks' worth)."""
    c = costs(BREAK)
    calibration, policy = Calibration(c), AdaptivePolicy(STEPS, c)
    batch, counts = [request(str(i)) for i in range(8)], [STEPS] * 8
    pays_from = next(s for s in np.arange(0.25, 50.0, 0.25) if policy.run_pays(batch, counts, s, breaks=1))
    assert c.break_cost(8) == BREAK and not policy.keeps_run(8, 30)
    broken(calibration, 8, "mixed", 40, exposed=3 * BREAK)
    assert 2.5 < c.break_scales[8] <= 3.0 and c.break_cost(8) == pytest.approx(BREAK * c.break_scales[8])
    assert not policy.run_pays(batch, counts, pays_from, breaks=1) and policy.keeps_run(8, 30)
    assert c.table_break_cost(8) == BREAK and c.scale(8) == 1.0 and 1 not in c.break_scales  # nothing else moved


def test_only_breaks_of_launches_that_leave_the_host_at_once_count_and_never_below_the_table():
    """A synchronous verify step's exposure holds its own forward, a step that launched nothing exposes nothing, and an
    exposure not timed (a device that does not run ahead of the host: 0.0) says nothing; cheaper breaks than the
    start-up measure leave it as it is (calibration only makes the policy more careful)."""
    c = costs(BREAK)
    calibration = Calibration(c)
    broken(calibration, 8, "verify", 40, exposed=10 * BREAK)
    broken(calibration, 8, "none", 40, exposed=10 * BREAK)
    broken(calibration, 8, "decode", 40, exposed=0.0)
    broken(calibration, 8, "verify_overlap", 40, exposed=0.2 * BREAK)
    assert c.break_cost(8) == BREAK and not c.break_scales
    free = costs(0.0)  # no break measured (verify steps that do not overlap): nothing to scale
    broken(Calibration(free), 8, "mixed", 40, exposed=3 * BREAK)
    assert free.break_cost(8) == 0.0 and not free.break_scales


def test_every_rank_takes_the_slowest_ranks_break():
    sizes = grid_sizes(8)

    def slowest(values):  # a second rank's breaks at size 4 exposed 4x the table
        return [max(v, 4.0) if i == len(sizes) + sizes.index(4) else v for i, v in enumerate(values)]

    c = costs(BREAK)
    calibration = Calibration(c, slowest)
    broken(calibration, 4, "mixed", calibration_module.EARLY[0], exposed=BREAK)
    assert c.break_scales == {4: 4.0} and not c.scales


def test_a_broken_steps_exposure_runs_from_the_first_read_to_its_end():
    log = StepLog()
    log.arrived(10.0)
    log.launched("mixed", 8, 8)
    assert log.timed(0.004, 10.003).exposed == 0.0  # not broken: nothing exposed
    log.broke("verify_run_ended")
    log.arrived(20.0)
    log.arrived(20.002)  # a later read in the same step (after the launch) is not the break's
    log.launched("mixed", 8, 8)
    step = log.timed(0.006, 20.003)
    assert step.broken and step.exposed == pytest.approx(0.003)
    log.broke("drafts_wanted")  # no read timed (the device does not run ahead): nothing exposed
    assert log.timed(0.001, 30.0).exposed == 0.0


def mixed(calibration: Calibration, n: int, rows: int, times: int, exposed: float) -> None:
    """Synchronous verify steps holding a prompt beside n decoding requests, each read the step in flight for its
    drafts (broken) and exposed `exposed` seconds."""
    for _ in range(times):
        calibration.observe(TimedStep("verify", n, rows, PLAIN * 9, True, True, exposed, prompt=True))


def test_mixed_verify_steps_that_expose_more_than_drafts_pay_for_keep_mixed_steps_plain():
    """A verify step holding a prompt prices the mixed steps that verify (StepCosts.sync_cost): what it exposed, from
    the read of the step in flight to its end, against the table's verify step of its decoding rows. Before any was
    timed it costs what a calibrated verify step does, and drafts pay; at three times the table they do not. Nothing
    else moves: verify steps without a prompt, breaks, other sizes."""
    c = costs(BREAK)
    calibration, policy = Calibration(c), AdaptivePolicy(STEPS, c)
    batch, counts = [request(str(i)) for i in range(8)], [STEPS] * 8
    rows = 8 * (STEPS + 1)
    assert c.sync_cost(8, rows) == c.cost(8, rows, verify=True) and policy.mixed_pays(batch, counts)
    mixed(calibration, 8, rows, 40, exposed=3 * c.table_cost(8, rows, verify=True))
    assert 2.5 < c.sync_scales[8] <= 3.0
    assert c.sync_cost(8, rows) == pytest.approx(c.sync_scales[8] * c.table_cost(8, rows, verify=True))
    assert not policy.mixed_pays(batch, counts)
    assert policy.run_pays(batch, counts, 40.0) and policy.may_draft(8)  # overlapped runs are priced as before
    assert c.scale(8) == 1.0 and not c.break_scales and set(c.sync_scales) == {8}
    # steps of any other kind fade the evidence back towards the verify steps' scale: mixed steps are tried again
    # later, also where the steps between them verify (overlapped) and none is plain
    run(calibration, 8, "verify_overlap", 1000)
    assert c.sync_scales[8] < 1.2 and policy.mixed_pays(batch, counts) and c.scale(8) == 1.0


def test_a_mixed_verify_step_counts_neither_as_a_verify_step_nor_untimed():
    """Its shape counts only its decoding rows, so it must not price verify steps (steady or, for a drafter that
    drafts on the host, alone); an exposure not timed (0.0: the device does not run ahead) says nothing."""
    c = costs(BREAK)
    calibration = Calibration(c, isolated=True)
    for _ in range(40):
        run(calibration, 8, "decode", 2)
        calibration.observe(TimedStep("verify", 8, 32, 10 * PLAIN, False, prompt=True))
    mixed(calibration, 8, 32, 40, exposed=0.0)
    assert not c.scales and not c.sync_scales and c.sync_cost(8, 32) == c.cost(8, 32, verify=True)


def test_every_rank_takes_the_slowest_ranks_mixed_verify_step():
    sizes = grid_sizes(8)

    def slowest(values):  # a second rank's mixed verify steps at size 4 took 5x the table; this one timed none
        return [max(v, 5.0) if i == 2 * len(sizes) + sizes.index(4) else v for i, v in enumerate(values)]

    c = costs(BREAK)
    calibration = Calibration(c, slowest)
    run(calibration, 4, "decode", calibration_module.EARLY[0] + 1)  # (the first is no step inside a run)
    assert c.sync_scales == {4: 5.0} and not c.scales and not c.break_scales
