"""The speculative step's host shortcuts change nothing: the policy's "nothing can pay" exit gives the exact
choice, the drafter's token view equals all_ids, and ngram's incremental history equals a lookup over the list."""

from __future__ import annotations

import random

import numpy as np
import pytest

from moeplex.config import EngineConfig
from moeplex.engine import Engine
from moeplex.interfaces import DraftRequest
from moeplex.plugins.drafters.ngram import NgramDrafter, SuffixIndex, lookup
from moeplex.request import Request, TokenIds
from moeplex.sampling import SamplingParams
from moeplex.speculation.costs import StepCosts, grid_sizes
from moeplex.speculation.policy import AdaptivePolicy

from test_speculative import GREEDY, conserved, plain, script_distribution, scripted, settings  # noqa: F401 (fixtures)

STEPS = 3


class Exact(AdaptivePolicy):
    """The policy without its shortcut: every choice computed in full."""

    def least_paying_worth(self, n: int) -> float:
        return float("-inf")


def costs(plain: float, per_row: float, fixed: float):
    return StepCosts(grid_sizes(64), lambda n: [plain * n ** 0.3] + [plain * n ** 0.3 + fixed + per_row * n * (k - 1)
                                                                     for k in range(1, STEPS + 2)])


@pytest.mark.parametrize("fixed,per_row", [(0.05, 0.02), (0.3, 0.05), (0.7, 0.1), (0.1, 0.4)])
def test_the_nothing_pays_exit_gives_the_exact_choice(fixed, per_row):
    rng = random.Random(int(fixed * 100 + per_row * 1000))
    model = costs(1.0, per_row, fixed)
    fast, exact = AdaptivePolicy(STEPS, model), Exact(STEPS, model)
    requests = [Request(str(i), [1, 2, 3], SamplingParams(max_new_tokens=500)) for i in range(32)]
    skipped = drafted = 0
    for step in range(300):
        batch = rng.sample(requests, rng.choice([1, 2, 5, 8, 17, 32]))
        rooms = [rng.randrange(STEPS + 1) for _ in batch]
        offers = rng.random() < 0.5
        choice = fast.choose(batch, rooms, expect_offers=offers)
        assert choice == exact.choose(batch, rooms, expect_offers=offers), step
        skipped += not any(choice)
        drafted += any(choice)
        for r, m in zip(batch, choice):  # the same records in both, from choices that are the same
            r.output_ids.extend([5] * rng.randrange(1, 4))
            accepted = rng.randrange(m + 1) if rng.random() < 0.3 else 0
            given = rng.random() < 0.7
            for policy in (fast, exact):
                policy.offered(r, given)
                if m:
                    policy.record(r, m, accepted)
    assert skipped and drafted  # both ways were taken


def test_the_token_view_is_all_ids_without_the_copy():
    r = Request("a", [1, 2, 3, 4], SamplingParams(max_new_tokens=10))
    r.output_ids.extend([7, 8])
    view = r.token_view
    ids = r.all_ids
    assert view == ids and list(view) == ids and len(view) == 6
    for s in (slice(None), slice(-3, None), slice(2, 5), slice(-100, 2), slice(4, 4), slice(None, None, 2)):
        assert view[s] == ids[s]
    assert [view[i] for i in range(-6, 6)] == [ids[i] for i in range(-6, 6)]
    assert view + [9] == ids + [9] and [0] + view == [0] + ids
    with pytest.raises(IndexError):
        view[6]
    r.output_ids.append(9)  # a view made earlier shows the ids there were then
    assert view == ids and len(view) == 6 and r.token_view == ids + [9]


def test_ngram_history_grows_and_rebuilds_under_a_reused_rid():
    rng = random.Random(0)
    drafter = NgramDrafter(STEPS)
    ids = [rng.randrange(20) for _ in range(300)]
    for n in range(2, 300, 7):
        got = drafter.propose([DraftRequest("r", TokenIds(ids[:n], []), n - 1)]).tokens[0]
        assert got == lookup(np.asarray(ids[:n]), drafter.max_n, drafter.min_n, STEPS)
    other = [rng.randrange(20) for _ in range(50)]  # another request under the same rid, without finished()
    assert drafter.propose([DraftRequest("r", other, 49)]).tokens[0] == lookup(np.asarray(other), 4, 1, STEPS)
    drafter.finished("r")
    assert "r" not in drafter._history


@pytest.mark.parametrize("seed", range(4))
def test_the_suffix_index_drafts_what_a_lookup_over_the_window_does(seed):
    """SuffixIndex (ngram's host path) against lookup over the latest `window` ids, as the sequence grows by one
    token or by runs, over small vocabularies (many matches) and windows the sequence outgrows (rebuilds)."""
    rng = random.Random(seed)
    for _ in range(60):
        vocab, window, min_n = rng.choice([3, 5, 20, 200]), rng.choice([8, 16, 64, 4096]), rng.choice([1, 2])
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 300))]
        index, n = SuffixIndex(4, min_n, window), 0
        while n < len(ids):
            n = min(len(ids), n + rng.choice([1, 1, 2, 4, 50]))
            index.sync(TokenIds(ids[:n], []))
            want = lookup(np.asarray(ids[:n][-window:]), 4, min_n, STEPS) if min(n, window) > 1 else []
            assert (index.draft(STEPS) if len(index.ids) > 1 else []) == want
        assert len(index.ids) <= 2 * window


def test_a_step_whose_drafter_had_nothing_takes_the_ordinary_path(tiny_model_dir, plain, script_distribution):
    """The oracle with no script proposes nothing: the steps it was asked for run as plain steps on the engine's
    ordinary path (no verify forward at all), and the output is unchanged."""
    from test_speculative import PROMPTS

    scripted([], [])
    engine = Engine(EngineConfig(**settings(tiny_model_dir("mixtral"), speculative_algorithm="test-oracle",
                                            speculative_num_steps=2)))
    verified = []
    real = engine.runner.verify_forward
    engine.runner.verify_forward = lambda *a, **k: verified.append(1) or real(*a, **k)
    asked = []
    propose = engine.speculation.drafter.propose
    engine.speculation.drafter.propose = lambda requests: asked.append(len(requests)) or propose(requests)
    got = engine.generate(PROMPTS, GREEDY)
    assert [r.output_ids for r in got] == plain["mixtral"]
    assert asked and not verified and engine.speculation.counts.verify_steps == 0
    assert engine.speculation.counts.plain_steps > 0 and conserved(engine)


def test_a_cheap_drafter_whose_proposals_keep_being_declined_is_asked_less_often():
    """Proposals the policy declines (too short to pay here) at step after step: the drafter is then left unasked
    for 2, 4, ... steps of the same batch size (or a larger one, or one request fewer of 8: a steady batch refilling a
    slot), and asked again at once when the batch shrinks further."""
    from moeplex.speculation.step import MAX_UNASKED, SpeculativeDecoding

    spec = SpeculativeDecoding(NgramDrafter(STEPS), kv=None, vocab_size=512, policy=AdaptivePolicy(STEPS, costs(1, 0.1, 0.3)))
    asked = []
    for step in range(200):
        if not spec._left_unasked(8):
            asked.append(step)
            spec._record_asked(proposed=True, kept=False, n=8)
    gaps = [b - a for a, b in zip(asked, asked[1:])]
    assert gaps[:5] == [1, 3, 5, 9, 17] and max(gaps) == MAX_UNASKED + 1
    assert spec._unasked[0] > 3
    assert spec._left_unasked(9) and spec._left_unasked(7)  # a larger batch, or one request fewer of 8: unasked
    assert not spec._left_unasked(6) and not spec._left_unasked(1)  # a batch that shrank more: asked
    spec._record_asked(proposed=True, kept=True, n=8)  # a kept draft ends the pause's growth
    assert spec._declined == 0
