"""Penalties, logit_bias, allowed_token_ids and min_tokens against references written here from their published
definitions (OpenAI's frequency and presence penalties; the multiplicative repetition penalty of CTRL as vLLM and
SGLang apply it; vLLM's order: biases and masks first, then penalties)."""

from __future__ import annotations

import collections
import random

import pytest
import torch

from moeplex.config import EngineConfig
from moeplex.engine import Engine
from moeplex.penalties import LogitAdjuster
from moeplex.request import Request
from moeplex.sampling import SamplingParams

transformers = pytest.importorskip("transformers")

EOS = 257
ENGINE = dict(dtype="fp32", show_progress=False, max_total_tokens=4096, page_size=4)


def reference_adjust(logits: torch.Tensor, prompt, output, p: SamplingParams, eos_ids=(EOS,)) -> torch.Tensor:
    x = logits.clone().double()
    if p.allowed_token_ids:
        keep = torch.full_like(x, float("-inf"))
        keep[list(p.allowed_token_ids)] = 0.0
        x = x + keep
    for token, bias in p.logit_bias:
        x[token] += bias
    if len(output) < p.min_tokens:
        for token in set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids)):
            x[token] = float("-inf")
    if p.repetition_penalty != 1.0:
        for token in set(prompt) | set(output):
            x[token] = x[token] / p.repetition_penalty if x[token] > 0 else x[token] * p.repetition_penalty
    for token, count in collections.Counter(output).items():
        x[token] -= p.frequency_penalty * count + p.presence_penalty
    return x.float()


CASES = {
    "frequency": SamplingParams(frequency_penalty=1.5),
    "presence": SamplingParams(presence_penalty=1.2),
    "repetition": SamplingParams(repetition_penalty=1.8),
    "repetition-below-1": SamplingParams(repetition_penalty=0.7),
    "logit-bias": SamplingParams(logit_bias={"65": 5.0, "66": -3.0, "300": 100}),
    "allowed": SamplingParams(allowed_token_ids=[65, 66, 67, EOS]),
    "min-tokens": SamplingParams(min_tokens=6, stop_token_ids=[70]),
    "combined": SamplingParams(frequency_penalty=0.5, presence_penalty=-0.3, repetition_penalty=1.3,
                               logit_bias={"70": 2.5}, min_tokens=3),
}


@pytest.mark.parametrize("name", list(CASES))
def test_adjusted_logits_equal_the_definitions_for_random_histories(name):
    torch.manual_seed(0)
    rng = random.Random(1)
    p = CASES[name]
    vocab = 512
    adjuster = LogitAdjuster(vocab, torch.device("cpu"), {EOS})
    requests, outputs = [], []
    for i in range(5):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 20))]
        output = [rng.choice([65, 66, 70, rng.randrange(vocab)]) for _ in range(rng.randrange(0, 12))]
        request = Request(str(i), prompt, p)
        requests.append(request)
        outputs.append(output)
        if output:  # counted the way a step counts what it drew
            adjuster.record(torch.tensor(output), [request] * len(output))
            request.output_ids.extend(output)
    logits = torch.randn(5, vocab) * 3
    got = adjuster.adjust(logits, requests, [len(o) for o in outputs])
    for i, request in enumerate(requests):
        want = reference_adjust(logits[i], request.prompt_ids, outputs[i], p)
        torch.testing.assert_close(got[i], want)


def test_a_verify_row_sees_the_drafts_before_it():
    p = SamplingParams(frequency_penalty=1.0, presence_penalty=0.5, repetition_penalty=1.5, min_tokens=3)
    adjuster = LogitAdjuster(64, torch.device("cpu"), {EOS % 64})
    request = Request("a", [1, 2, 3], p)
    adjuster.record(torch.tensor([5]), [request])
    request.output_ids = [5]
    drafts = [5, 9, 9]
    logits = torch.randn(4, 64)
    got = adjuster.adjust(logits, [request] * 4, [1 + k for k in range(4)], [drafts[:k] for k in range(4)])
    for k in range(4):
        want = reference_adjust(logits[k], [1, 2, 3], [5] + drafts[:k], p, eos_ids=(EOS % 64,))
        torch.testing.assert_close(got[k], want)


def test_nothing_is_touched_without_penalties():
    adjuster = LogitAdjuster(32, torch.device("cpu"))
    logits = torch.randn(3, 32)
    requests = [Request(str(i), [1], SamplingParams()) for i in range(3)]
    assert adjuster.adjust(logits, requests, [0, 0, 0]) is logits
    adjuster.record(torch.tensor([1, 2, 3]), requests)
    assert adjuster.slots == {} and adjuster.counts.shape[0] == 0


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    from moeplex.models.make_model import write_checkpoint

    folder = write_checkpoint(str(tmp_path_factory.mktemp("qwen")), "qwen3_moe", "tiny", seed=0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, hf


def reference_greedy(hf, prompt: list[int], p: SamplingParams) -> list[int]:
    out: list[int] = []
    with torch.no_grad():
        while len(out) < p.max_new_tokens:
            logits = hf(torch.tensor([prompt + out])).logits[0, -1].float()
            token = int(torch.argmax(reference_adjust(logits, prompt, out, p)))
            out.append(token)
            if len(out) >= p.min_tokens and (token in p.stop_token_ids or (token == EOS and not p.ignore_eos)):
                break
    return out


PROMPTS = [[256] + list(b"the the the cat sat on"), [256] + list(b"ab ab ab ab"), [256] + list(b"Mixture")]


@pytest.fixture(scope="module")
def greedy_reference(qwen):
    """reference_greedy on the module's transformers model, each (prompt, case) computed once: the sequential and
    the overlap-schedule engines are checked against the same tokens (transformers without a cache is the
    slowest part of the check)."""
    _, hf = qwen
    known: dict[tuple, list[int]] = {}

    def get(prompt: list[int], case: str, p: SamplingParams) -> list[int]:
        key = (tuple(prompt), case)
        if key not in known:
            known[key] = reference_greedy(hf, prompt, p)
        return known[key]

    return get


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlap-schedule"])
def test_greedy_outputs_equal_the_reference_in_a_mixed_batch(qwen, greedy_reference, overlap):
    folder, _ = qwen
    engine = Engine(EngineConfig(model=folder, overlap_schedule=overlap, **ENGINE))
    plain = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    alone = [r.output_ids for r in engine.generate(PROMPTS, plain)]
    names = list(CASES)
    prompts, params = [], []
    for i, name in enumerate(names):
        prompts.append(PROMPTS[i % len(PROMPTS)])
        params.append(CASES[name].__class__(**{**_fields(CASES[name]), "max_new_tokens": 12, "temperature": 0.0}))
        prompts.append(PROMPTS[i % len(PROMPTS)])  # a neighbour that uses nothing: its output must not change
        params.append(plain)
    results = engine.generate(prompts, params)
    for i, name in enumerate(names):
        got, neighbour = results[2 * i], results[2 * i + 1]
        assert got.output_ids == greedy_reference(prompts[2 * i], name, params[2 * i]), name
        assert neighbour.output_ids == alone[i % len(PROMPTS)], name
    assert engine.sampler.adjuster.slots == {}  # every slot back when its request ended
    assert engine.flush_cache() and engine.kv.num_free_pages == engine.kv.num_pages


def _fields(p: SamplingParams) -> dict:
    import attrs

    values = attrs.asdict(p, recurse=False)
    values.pop("logit_bias")
    values["logit_bias"] = dict(p.logit_bias)
    return values


def test_logit_bias_forces_and_bans_under_sampling(qwen):
    folder, _ = qwen
    engine = Engine(EngineConfig(model=folder, **ENGINE))
    forced = SamplingParams(max_new_tokens=8, temperature=1.0, seed=3, logit_bias={"77": 100})
    banned_token = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=1, temperature=0.0))[0].output_ids[0]
    banned = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True, logit_bias={str(banned_token): -100})
    got_forced, got_banned = engine.generate([PROMPTS[1], PROMPTS[0]], [forced, banned])
    assert got_forced.output_ids == [77] * 8
    assert banned_token not in got_banned.output_ids


def test_seeded_sampling_with_penalties_is_the_same_alone_and_in_a_batch(qwen):
    folder, _ = qwen
    p = SamplingParams(max_new_tokens=10, temperature=0.9, top_k=20, seed=7, frequency_penalty=0.8,
                       repetition_penalty=1.2, ignore_eos=True)
    alone = Engine(EngineConfig(model=folder, **ENGINE)).generate([PROMPTS[0]], p)[0].output_ids
    plain = SamplingParams(max_new_tokens=6, temperature=1.0, seed=1)
    batch = Engine(EngineConfig(model=folder, **ENGINE)).generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]], [plain, p, plain])
    assert batch[1].output_ids == alone


def test_min_tokens_holds_back_eos(qwen):
    folder, _ = qwen
    engine = Engine(EngineConfig(model=folder, **ENGINE))
    eos_first = SamplingParams(max_new_tokens=10, temperature=0.0, logit_bias={str(EOS): 50})
    assert engine.generate([PROMPTS[0]], eos_first)[0].output_ids == [EOS]
    held = SamplingParams(max_new_tokens=10, temperature=0.0, logit_bias={str(EOS): 50}, min_tokens=4)
    out = engine.generate([PROMPTS[0]], held)[0]
    assert EOS not in out.output_ids[:4] and out.output_ids[4] == EOS and out.finish_reason.value == "stop"


@pytest.mark.parametrize("name", list(CASES))
def test_the_fused_kernel_equals_the_torch_code(name):
    """The Triton kernel (under its interpreter here) against the torch code path, for every case."""
    torch.manual_seed(1)
    rng = random.Random(2)
    p = CASES[name]
    vocab = 5000  # more than one block of the kernel
    plain, fused = (LogitAdjuster(vocab, torch.device("cpu"), {EOS}, fused=f) for f in (False, True))
    requests = []
    for i in range(3):
        request = Request(str(i), [rng.randrange(vocab) for _ in range(9)], p if i != 1 else SamplingParams())
        output = [rng.choice([65, 66, 4097, rng.randrange(vocab)]) for _ in range(7)]
        for adjuster in (plain, fused):
            adjuster.record(torch.tensor(output), [request] * len(output))
        request.output_ids.extend(output)
        requests.append(request)
    logits = torch.randn(3, vocab) * 3
    want = plain.adjust(logits, requests, [7, 7, 7])
    got = fused.adjust(logits.clone(), requests, [7, 7, 7], in_place=True)
    torch.testing.assert_close(got, want)
