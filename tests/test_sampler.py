"""Batched sampling filters every row as the one-row reference does, and seeded rows stay reproducible."""

import pytest
import torch

from moeplex.request import Request
from moeplex.sampler import Sampler, filtered_probs
from moeplex.sampling import SamplingParams


def _filtered_probs(logits: torch.Tensor, params) -> torch.Tensor:
    """The reference: temperature, then top-k, top-p and min-p filtering of one row, written out per row."""
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs

MIXED = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.6),
    SamplingParams(temperature=0.9, min_p=0.2),
    SamplingParams(temperature=1.1, top_k=12, top_p=0.8, min_p=0.05),
    SamplingParams(temperature=0.5, top_k=100),  # larger than the vocabulary: no cut
]


def test_batched_filtering_equals_the_row_reference():
    logits = torch.randn(len(MIXED), 40, generator=torch.Generator().manual_seed(0)) * 3
    batched = filtered_probs(logits, MIXED)
    for row, params in enumerate(MIXED):
        torch.testing.assert_close(batched[row], _filtered_probs(logits[row], params))
    assert (batched[1] > 0).sum() == 5 and (batched[4] > 0).sum() <= 12


@pytest.mark.parametrize("params", MIXED, ids=range(len(MIXED)))
def test_every_drawn_token_is_one_the_filters_keep(params):
    torch.manual_seed(1)
    logits = torch.randn(64, 40, generator=torch.Generator().manual_seed(2)) * 3
    kept = filtered_probs(logits, [params] * 64) > 0
    requests = [Request(str(i), [1], params) for i in range(64)]
    for _ in range(5):
        tokens = torch.tensor(Sampler()(logits, requests))
        assert kept[torch.arange(64), tokens].all()


def test_a_seeded_row_draws_the_same_tokens_whatever_shares_its_batch():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(3)) * 2
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=11)

    def draws(others: list[SamplingParams]) -> list[int]:
        request = Request("s", [1], seeded)
        batch = [request] + [Request(str(i), [1], p) for i, p in enumerate(others)]
        return [Sampler()(logits[: len(batch)], batch)[0] for _ in range(8)]

    assert draws([]) == draws([SamplingParams(temperature=0.8), SamplingParams(temperature=0.0)])


# --- one row cannot fail its batch -------------------------------------------------------------------

DEGENERATE = [
    SamplingParams(temperature=1e-40),  # valid in float64, 0 in float32: 1/t would be inf
    SamplingParams(temperature=1e-300),
    SamplingParams(temperature=5e-324),
    SamplingParams(temperature=1.0, top_p=1e-50),  # 0 in float32: every token would be dropped
    SamplingParams(temperature=0.7, top_p=1e-50, seed=5),
]


def test_tiny_temperatures_and_top_p_draw_the_most_likely_token_beside_ordinary_rows():
    logits = torch.randn(len(DEGENERATE) + 2, 40, generator=torch.Generator().manual_seed(4)) * 3
    params = DEGENERATE + [SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, top_k=3, seed=1)]
    requests = [Request(str(i), [1], p) for i, p in enumerate(params)]
    tokens = Sampler()(logits, requests)
    assert tokens[: len(DEGENERATE)] == logits[: len(DEGENERATE)].argmax(-1).tolist()
    assert all(0 <= t < 40 for t in tokens)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_a_row_with_non_finite_logits_fails_alone(sampled):
    from moeplex.sampler import FAILED

    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(6)) * 2
    logits[1, 7] = float("nan")
    logits[2] = float("-inf")
    params = SamplingParams(temperature=0.9 if sampled else 0.0)
    requests = [Request(str(i), [1], params) for i in range(3)] + [Request("s", [1], SamplingParams(temperature=1.0, seed=3))]
    tokens = Sampler.draw(logits, requests).tolist()
    assert tokens[1] == tokens[2] == FAILED
    assert 0 <= tokens[0] < 40 and 0 <= tokens[3] < 40


@pytest.mark.parametrize("field, value", [("temperature", float("nan")), ("temperature", float("inf")),
                                          ("top_p", float("nan")), ("min_p", float("nan"))])
def test_non_finite_values_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
