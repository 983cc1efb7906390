"""Acceptance on the device (speculation/accept.py): the same tokens as the host's greedy rule, the target's
distribution under sampling (chi-square, fixed seeds), and the next step's inputs built from it."""

from __future__ import annotations

import random

import pytest
import torch

from moeplex.request import Request
from moeplex.sampler import FAILED, Sampler, filtered_probs
from moeplex.sampling import SamplingParams
from moeplex.speculation.accept import accept, draft_grid, next_inputs
from moeplex.speculation.verify import accept_greedy, verify

from test_speculative_sampling import CRITICAL, chi_square

GREEDY = SamplingParams(temperature=0.0)


def _case(seed: int, requests: int, steps: int, vocab: int = 7):
    """Logits whose argmax the drafts often equal (so runs of several accepted drafts occur), some rows not finite."""
    rng = random.Random(seed)
    drafts = [[rng.randrange(vocab) for _ in range(rng.randint(0, steps))] for _ in range(requests)]
    rows = sum(len(d) + 1 for d in drafts)
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))
    at = 0
    for draft in drafts:
        for k, token in enumerate(draft):
            if rng.random() < 0.7:
                logits[at + k, token] += 10.0  # the target agrees with this draft
        at += len(draft) + 1
    for row in range(rows):
        if rng.random() < 0.05:
            logits[row, rng.randrange(vocab)] = float("nan")
    return logits, drafts


@pytest.mark.parametrize("seed", range(40))
def test_greedy_on_the_device_equals_the_host_rule(seed):
    logits, drafts = _case(seed, requests=1 + seed % 5, steps=1 + seed % 4)
    best = torch.argmax(logits, -1)
    finite = torch.isfinite(logits.gather(-1, best[:, None])[:, 0])
    want, at = [], 0
    for draft in drafts:
        span = slice(at, at + len(draft) + 1)
        want.append(accept_greedy(draft, best[span].tolist(), finite[span].tolist()))
        at += len(draft) + 1
    requests = [Request(str(i), [1], GREEDY) for i in range(len(drafts))]
    assert verify(logits, requests, drafts) == want


def test_the_grid_pads_short_requests_with_their_last_row():
    index, grid, counts = draft_grid([[5, 6], [], [7]], width=3)
    assert index.tolist() == [[0, 1, 2], [3, 3, 3], [4, 5, 5]]
    assert grid.tolist() == [[5, 6], [-1, -1], [7, -1]]
    assert counts.tolist() == [2, 0, 1]


def test_a_failed_draw_ends_the_run_and_is_emitted():
    drawn = torch.tensor([[3, FAILED, 4], [FAILED, 1, 1], [3, 4, 9]])
    drafts = torch.tensor([[3, 4], [3, 4], [3, 4]])
    accepted = accept(drawn, drafts, torch.tensor([2, 2, 2]))
    assert accepted.to_host() == [[3, FAILED], [FAILED], [3, 4, 9]]


def test_next_inputs_start_after_the_emitted_run():
    accepted = accept(torch.tensor([[3, 4, 9], [3, 8, 9]]), torch.tensor([[3, 4], [3, 4]]), torch.tensor([2, 2]))
    ids, positions = next_inputs(accepted, torch.tensor([[11, 12], [13, -1]]), torch.tensor([10, 20]))
    assert accepted.counts.tolist() == [2, 1]
    assert ids.tolist() == [[9, 11, 12], [8, 13, 0]]  # the last emitted token, then the next drafts
    assert positions.tolist() == [[13, 14, 15], [22, 23, 24]]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=4),
    SamplingParams(temperature=1.3, top_p=0.8),
], ids=["plain", "top_k", "top_p"])
@pytest.mark.parametrize("draft_rank", [0, 2], ids=["likely-draft", "unlikely-draft"])
def test_sampled_acceptance_on_the_device_keeps_the_target_distribution(params, draft_rank):
    """Many requests with the same logits and drafts in one step: the emitted first token follows p_0, and after
    an accepted first draft the next token follows p_1 (the point-mass rejection rule, all rows drawn at once)."""
    trials = 4000
    logits = torch.randn(3, 6, generator=torch.Generator().manual_seed(10 + draft_rank)) * 1.5
    probs = filtered_probs(logits, [params] * 3)
    order = torch.argsort(probs, dim=-1, descending=True)
    draft = [int(order[0, draft_rank]), int(order[1, 0])]
    torch.manual_seed(4321)
    requests = [Request(str(i), [1], params) for i in range(trials)]
    runs = verify(logits[:3].repeat(trials, 1), requests, [draft] * trials)
    stat, df = chi_square([r[0] for r in runs], probs[0])
    assert stat < CRITICAL[df]
    second = [r[1] for r in runs if r[0] == draft[0]]
    if len(second) > 500:
        stat, df = chi_square(second, probs[1])
        assert stat < CRITICAL[df]


def test_a_seeded_request_draws_as_plain_decoding_does_whatever_was_drafted():
    """Its stream gives one draw per emitted token: the tokens equal plain sampling's with the same seed."""
    params = SamplingParams(temperature=1.0, seed=7)
    logits = torch.randn(8, 11, generator=torch.Generator().manual_seed(3))
    plain_request = Request("p", [1], params)
    plain = [int(Sampler.draw(logits[k : k + 1], [plain_request])[0]) for k in range(8)]
    request, got, at = Request("s", [1], params), [], 0
    while at < 8:
        draft = plain[at : at + 2] if at % 3 else [(plain[at] + 1) % 11]  # right drafts, then a wrong one
        rows = logits[at : at + len(draft) + 1]
        if rows.shape[0] < len(draft) + 1:
            draft = draft[: rows.shape[0] - 1]
        tokens = verify(rows, [request], [draft])[0]
        got += tokens
        at += len(tokens)
    assert got[:8] == plain


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(8))
def test_on_gpu_greedy_acceptance_equals_the_host_rule(seed):
    logits, drafts = _case(seed, requests=16, steps=3, vocab=50)
    requests = [Request(str(i), [1], GREEDY) for i in range(len(drafts))]
    assert verify(logits.cuda(), requests, drafts) == verify(logits, requests, drafts)
