"""Drafter contract: whatever a drafter proposes, the engine's output is the output without speculation, and
its proposals are well formed (one list per request asked, at most num_steps ids each, ids in the vocabulary,
draft probabilities [requests, num_steps, vocab] where it declares gives_probs).

Each drafter runs in a real engine on a tiny random checkpoint of the first architecture it supports
(DeepSeek-V3 with MTP layers for a drafter that needs them), greedy, with 1 and 3 steps, prompts that repeat
themselves beside ones that do not; the KV pool is back to empty afterwards.

A random model's output rarely repeats, so a lookup-style drafter may propose nothing there. The second test
drives every drafter where it will draft: the same checkpoint with its embedding scaled up and tied to the
output head, so greedy decoding repeats each prompt's last token. There every proposal is checked, the drafter
must propose something, and its proposals must belong to the request asked: the requests run one after
another under one reused request id (finished() between them) and then together in one batch, and each
request's proposal at each length must be the same in both runs (a drafter that answers in the wrong order,
or keeps a request's state past finished(), differs).
"""

from __future__ import annotations

import inspect
import os
import shutil

import pytest

from moeplex.conformance.plugin import load_plugin

ARCHES = ("deepseek_v3", "qwen3_moe", "mixtral")
PROMPTS = [[256] + list(range(10, 18)) * 3, [256, 5, 6, 7, 5, 6, 7, 5, 6], [256] + list(range(40, 71))]


@pytest.fixture(scope="module")
def drafter_cls(moeplex_plugin):
    return load_plugin(moeplex_plugin)


@pytest.fixture(scope="module")
def model_folder(drafter_cls, tmp_path_factory):
    from moeplex.models.make_model import write_checkpoint

    supported = drafter_cls.caps.architectures
    arch = next((a for a in ARCHES if supported is None or a in supported), None)
    if arch is None:
        pytest.skip(f"the drafter supports {sorted(supported)}, none of which `moeplex make-model` writes")
    extra = {}
    if drafter_cls.caps.needs_weights:
        if "mtp" not in inspect.signature(write_checkpoint).parameters:
            pytest.skip("this moeplex cannot write MTP layers (make-model --mtp)")
        extra["mtp"] = 1
    return write_checkpoint(str(tmp_path_factory.mktemp(arch)), arch, "tiny", seed=0, **extra)


def engine(folder: str, **settings):
    from moeplex.config import EngineConfig
    from moeplex.engine import Engine

    return Engine(EngineConfig(model=folder, dtype="fp32", show_progress=False, max_total_tokens=1024, page_size=4, **settings))


def check_drafts(drafts, requests, steps: int, vocab: int, gives_probs: bool) -> None:
    assert len(drafts.tokens) == len(requests), f"{len(drafts.tokens)} draft lists for {len(requests)} requests"
    for tokens in drafts.tokens:
        assert len(tokens) <= steps, f"{len(tokens)} drafts, more than num_steps {steps}"
        assert all(isinstance(t, int) and 0 <= t < vocab for t in tokens), f"a draft id outside 0..{vocab - 1}: {tokens}"
    if gives_probs:
        assert drafts.probs is not None and tuple(drafts.probs.shape) == (len(requests), steps, vocab)


@pytest.mark.parametrize("steps", [1, 3])
def test_output_is_unchanged_and_proposals_are_well_formed(moeplex_plugin, drafter_cls, model_folder, steps):
    from moeplex.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    want = [r.output_ids for r in engine(model_folder).generate(PROMPTS, params)]
    # the fixed policy asks the drafter at every decode step (the adaptive one asks as its measured costs say)
    spec = engine(model_folder, speculative_algorithm=moeplex_plugin.name, speculative_num_steps=steps,
                  speculative_policy="fixed")
    drafter, vocab = spec.speculation.drafter, spec.vocab_size
    asked = []
    propose = drafter.propose

    def checked(requests):
        drafts = propose(requests)
        check_drafts(drafts, requests, steps, vocab, drafter_cls.caps.gives_probs)
        if drafter_cls.caps.drafts_on_device:  # the same drafts from its device state (no pending tokens here)
            on_device = drafter.propose_on_device(requests)
            rows = [on_device.tokens[i, : on_device.counts[i]].tolist() for i in range(len(requests))]
            assert rows == [list(t) for t in drafts.tokens], f"propose_on_device gave {rows}, propose {drafts.tokens}"
        asked.append(len(requests))
        return drafts

    drafter.propose = checked
    got = [r.output_ids for r in spec.generate(PROMPTS, params)]
    assert got == want
    assert asked, "the engine never asked the drafter for drafts"
    assert propose([]).tokens == []
    cache = spec.prefix_cache
    assert spec.kv.num_free_pages + (cache.num_pages if cache else 0) == spec.kv.num_pages
    if drafter_cls.caps.drafts_on_device:  # its verify steps under the overlap schedule (drafted on the device)
        overlapped = engine(model_folder, speculative_algorithm=moeplex_plugin.name, speculative_num_steps=steps,
                            speculative_policy="fixed", overlap_schedule=True)
        assert [r.output_ids for r in overlapped.generate(PROMPTS, params)] == want
        cache = overlapped.prefix_cache
        assert overlapped.kv.num_free_pages + (cache.num_pages if cache else 0) == overlapped.kv.num_pages


ECHO_PROMPTS = [[256] + list(range(10, 18)) * 2, [256, 5, 6, 7, 5, 6], [300, 301, 99], [256] + list(range(40, 60))]
ECHO_SCALE = 30.0  # embedding rows of norm ~30 sqrt(H): the residual stream outweighs every layer's output


@pytest.fixture(scope="module")
def echo_folder(model_folder, tmp_path_factory):
    """The checkpoint made to repeat the last token under greedy decoding (embedding scaled, output head tied to
    it): the hidden state stays closest to the embedding of the token it started from."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path_factory.mktemp("echo") / "model"
    shutil.copytree(model_folder, folder)
    shards = {name: load_file(folder / name) for name in sorted(os.listdir(folder)) if name.endswith(".safetensors")}
    embed = next(t["model.embed_tokens.weight"] for t in shards.values() if "model.embed_tokens.weight" in t)
    scaled = (embed.float() * (ECHO_SCALE / embed.float().std())).to(embed.dtype)
    for name, tensors in shards.items():
        touched = {k for k in ("model.embed_tokens.weight", "lm_head.weight") if k in tensors}
        if touched:
            save_file({**tensors, **{k: scaled.clone() for k in touched}}, folder / name, metadata={"format": "pt"})
    return str(folder)


class Recorder:
    """Wraps a drafter's propose: checks each answer and keeps it by (prompt index, length of token_ids)."""

    def __init__(self, drafter, steps: int, vocab: int, gives_probs: bool):
        self.propose, self.steps, self.vocab, self.gives_probs = drafter.propose, steps, vocab, gives_probs
        self.owner: dict[str, int] = {}  # rid -> index in ECHO_PROMPTS of the request now under it
        self.by_key: dict[tuple[int, int], tuple[int, ...]] = {}
        drafter.propose = self

    def __call__(self, requests):
        drafts = self.propose(requests)
        check_drafts(drafts, requests, self.steps, self.vocab, self.gives_probs)
        for request, tokens in zip(requests, drafts.tokens):
            index = self.owner[request.rid]
            assert list(request.token_ids[: len(ECHO_PROMPTS[index])]) == ECHO_PROMPTS[index]
            self.by_key[(index, len(request.token_ids))] = tuple(tokens)
        return drafts

    @property
    def drafted(self) -> int:
        return sum(1 for tokens in self.by_key.values() if tokens)


def run_requests(spec, recorder: Recorder, batches, params) -> dict[int, list[int]]:
    """Each batch of (rid, prompt index) runs to its end before the next one starts; outputs by prompt index."""
    outputs = {}
    for batch in batches:
        requests = {}
        for rid, index in batch:
            recorder.owner[rid] = index
            requests[index] = spec.add_request(ECHO_PROMPTS[index], params, rid=rid)
        while spec.has_work:
            spec.step()
        outputs.update({index: list(r.output_ids) for index, r in requests.items()})
    return outputs


def test_proposals_belong_to_the_request_asked(moeplex_plugin, drafter_cls, echo_folder):
    from moeplex.sampling import SamplingParams

    steps, params = 3, SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    want = [r.output_ids for r in engine(echo_folder).generate(ECHO_PROMPTS, params)]
    assert all(set(out) == {prompt[-1]} for prompt, out in zip(ECHO_PROMPTS, want)), f"not an echo model: {want}"
    runs = []
    for batches in (
        [[("reused", i)] for i in range(len(ECHO_PROMPTS))],  # one at a time, one request id for all
        [[(f"req-{i}", i) for i in reversed(range(len(ECHO_PROMPTS)))]],  # all at once
    ):
        spec = engine(echo_folder, speculative_algorithm=moeplex_plugin.name, speculative_num_steps=steps,
                      speculative_policy="fixed", disable_speculative_backoff=True)  # asked at every decode step
        recorder = Recorder(spec.speculation.drafter, steps, spec.vocab_size, drafter_cls.caps.gives_probs)
        outputs = run_requests(spec, recorder, batches, params)
        assert [outputs[i] for i in range(len(ECHO_PROMPTS))] == want
        assert recorder.drafted, (
            "the drafter proposed nothing for requests whose output repeats their last token; the suite can only "
            "check drafts it is given")
        runs.append(recorder.by_key)
    alone, together = runs
    common = sorted(set(alone) & set(together))
    assert common, "the two runs asked for drafts at no common (request, length)"
    differ = [(key, alone[key], together[key]) for key in common if alone[key] != together[key]]
    assert not differ, (
        "proposals for the same request and tokens differ between requests run one at a time under one reused "
        f"id and run together (prompt index, length, alone, together): {differ[:4]}")
