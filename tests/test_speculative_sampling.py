"""Rejection sampling keeps the target's distribution (chi-square, fixed seeds), and start-up refuses
speculative settings that cannot run, in one sentence."""

from __future__ import annotations

import io
from contextlib import redirect_stdout
from types import SimpleNamespace

import attrs
import pytest
import torch

from moeplex import registry
from moeplex.cli import plugins as plugins_cli
from moeplex.config import EngineConfig
from moeplex.interfaces import MASKED, DispatcherCaps, Drafter, DrafterCaps, PluginError
from moeplex.sampler import filtered_probs
from moeplex.sampling import SamplingParams
from moeplex.speculation.checks import check_model, check_speculation
from moeplex.speculation.verify import accept_greedy, accept_sampled

TRIALS = 4000
# chi-square critical values at p = 0.001: a correct sampler fails one seed in a thousand, and the seeds are fixed
CRITICAL = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}


def chi_square(samples: list[int], probs: torch.Tensor) -> tuple[float, int]:
    support = [t for t in range(probs.numel()) if probs[t] > 0]
    assert all(s in support for s in samples), "a token outside the target's support was emitted"
    counts = torch.bincount(torch.tensor(samples), minlength=probs.numel()).double()
    expected = probs.double() / probs.double().sum() * len(samples)  # the sampler's multinomial normalizes too
    stat = float(((counts[support] - expected[support]) ** 2 / expected[support]).sum())
    return stat, len(support) - 1


def target(seed: int, params: SamplingParams, rows: int = 3, vocab: int = 6) -> torch.Tensor:
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 1.5
    return filtered_probs(logits, [params] * rows)  # as verify gets them: top-p and min-p rows unnormalized


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=4),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=2.0, top_p=0.6, min_p=0.05),
], ids=["plain", "top_k", "top_p", "top_p-min_p"])
@pytest.mark.parametrize("draft_rank", [0, 2, 5], ids=["likely-draft", "middling-draft", "unlikely-draft"])
def test_point_mass_drafts_keep_the_target_distribution(params, draft_rank):
    probs = target(draft_rank, params)
    order = torch.argsort(probs, dim=-1, descending=True)
    draft = [int(order[0, draft_rank]), int(order[1, 0])]  # the second draft follows the first
    gen = torch.Generator().manual_seed(1234)
    runs = [accept_sampled(probs, draft, gen) for _ in range(TRIALS)]
    stat, df = chi_square([r[0] for r in runs], probs[0])
    assert stat < CRITICAL[df]
    # given the first draft was accepted, the next token follows the target's next distribution
    second = [r[1] for r in runs if r[0] == draft[0] and len(r) > 1]
    if len(second) > 500:
        stat, df = chi_square(second, probs[1])
        assert stat < CRITICAL[df]
    assert all(len(r) <= 3 for r in runs)


def test_drafts_with_probabilities_keep_the_target_distribution():
    probs = target(7, SamplingParams(temperature=1.0))
    q = torch.softmax(torch.randn(2, 6, generator=torch.Generator().manual_seed(8)), -1)
    gen = torch.Generator().manual_seed(99)
    firsts = []
    for _ in range(TRIALS):
        draft = [int(torch.multinomial(q[0], 1, generator=gen)), int(torch.multinomial(q[1], 1, generator=gen))]
        firsts.append(accept_sampled(probs, draft, gen, q)[0])
    stat, df = chi_square(firsts, probs[0])
    assert stat < CRITICAL[df]


def test_greedy_keeps_the_matching_prefix_and_adds_the_targets_token():
    assert accept_greedy([5, 6, 7], [5, 6, 9, 1], [True] * 4) == [5, 6, 9]
    assert accept_greedy([5, 6], [5, 6, 4], [True] * 3) == [5, 6, 4]
    assert accept_greedy([3], [5, 6], [True, True]) == [5]
    assert accept_greedy([5, 6], [5, 6, 4], [True, False, True]) == [5, -1]


def test_the_same_generator_seed_gives_the_same_tokens():
    probs = target(3, SamplingParams(temperature=1.0))
    one = [accept_sampled(probs, [1, 2], torch.Generator().manual_seed(5)) for _ in range(3)]
    assert one[0] == one[1] == one[2]


# --- start-up refusals ------------------------------------------------------------------------------
def one_sentence(message: str) -> bool:
    return message.count(". ") == 0


def test_draft_tokens_must_be_steps_plus_one():
    with pytest.raises(ValueError, match="must be --speculative-num-steps \\+ 1 \\(4\\)"):
        EngineConfig(model="unused", speculative_num_steps=3, speculative_num_draft_tokens=5)
    assert EngineConfig(model="unused", speculative_algorithm="ngram").tokens_per_decode == 4


def test_an_unknown_drafter_is_refused_naming_the_installed_ones():
    with pytest.raises(PluginError, match="ngram") as err:
        check_speculation(EngineConfig(model="unused", speculative_algorithm="eagle9"), DispatcherCaps("standard", False), 64)
    assert one_sentence(str(err.value))


def test_the_overlap_schedule_is_accepted_with_every_drafter():
    """nextn reads hidden states; its plain steps keep them on the ordinary path, overlap schedule included."""
    for name in ("nextn", "ngram"):
        config = EngineConfig(model="unused", speculative_algorithm=name, overlap_schedule=True)
        assert check_speculation(config, DispatcherCaps("standard", False), 64) is not None


def test_a_fixed_dispatch_buffer_must_hold_a_verify_step_of_every_request():
    caps = DispatcherCaps(layout=MASKED, multi_rank=True, fixed_max_tokens=True)
    config = EngineConfig(model="unused", speculative_algorithm="ngram", max_running_requests=32,
                          dispatcher="deepep-ll", max_batched_tokens=2048)
    with pytest.raises(PluginError, match="32 x --speculative-num-draft-tokens 4 sends 128") as err:
        check_speculation(config, caps, 64)
    assert one_sentence(str(err.value))
    assert check_speculation(config, caps, 128) is not None
    # deepep-auto's verify steps are decode steps, in its low-latency mode: its decode buffer must hold them
    auto = DispatcherCaps(layout="standard", multi_rank=True, fixed_max_tokens=True, other_layouts=frozenset({MASKED}))
    with pytest.raises(PluginError, match="sends 128"):
        check_speculation(attrs.evolve(config, dispatcher="deepep-auto"), auto, 32)
    assert config.dispatch_tokens_per_rank(auto) == 128  # the default buffer is sized for them


class NeedsMTP(Drafter):
    caps = DrafterCaps(needs_weights=True, architectures=frozenset({"deepseek_v3"}))

    def propose(self, requests):
        raise AssertionError


def test_mtp_drafters_need_mtp_weights_and_their_architecture():
    config = EngineConfig(model="/models/x", speculative_algorithm="mtp-like")
    with pytest.raises(PluginError, match="has none") as err:
        check_model(config, NeedsMTP, {"model_type": "deepseek_v3", "num_nextn_predict_layers": 0}, has_mtp=False)
    assert one_sentence(str(err.value))
    with pytest.raises(PluginError, match="is qwen3_moe"):
        check_model(config, NeedsMTP, {"model_type": "qwen3_moe"}, has_mtp=False)
    check_model(config, NeedsMTP, {"model_type": "deepseek_v3"}, has_mtp=True)


def test_drafters_are_a_plugin_kind_listed_by_moeplex_plugins():
    assert "ngram" in registry.discover("drafter")
    out = io.StringIO()
    with redirect_stdout(out):
        plugins_cli.run(SimpleNamespace(json=False))
    assert "drafters:" in out.getvalue() and "ngram" in out.getvalue()


BROKEN_DRAFTER = '''
from moeplex.interfaces import Drafter, DrafterCaps, Drafts


class TooMany(Drafter):
    caps = DrafterCaps()

    def propose(self, requests):
        return Drafts([[1] * (self.num_steps + 1) for _ in requests])
'''


@pytest.mark.slow
def test_the_drafter_suite_catches_a_drafter_that_proposes_too_many_tokens(tmp_path):
    from test_conformance import conformance, outcomes, report

    (tmp_path / "broken_drafter.py").write_text(BROKEN_DRAFTER)
    info = tmp_path / "broken_drafter-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-drafter\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[moeplex.drafters]\ntoo-many = broken_drafter:TooMany\n")
    result = conformance("--moeplex-plugin", "drafter:too-many", cwd=tmp_path, pythonpath=tmp_path)
    assert result.returncode == 1, report(result)
    assert any(outcome == "FAILED" for _, _, outcome in outcomes(result)), report(result)
    assert "more than num_steps" in result.stdout, report(result)
