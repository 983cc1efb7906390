"""The offline engine (Engine.generate, `moeplex generate`) gives what `moeplex serve` gives, token for token and in
text, while its step loop does less: no text decoded per step unless stop strings need it."""

from __future__ import annotations

import random
import types

import attrs
import pytest

from moeplex.config import EngineConfig
from moeplex.engine import Engine
from moeplex.messages import Round
from moeplex.ranks.group import EngineGroup
from moeplex.request import Request
from moeplex.sampling import SamplingParams
from moeplex.tokenizer import Detokenizer, front_end_detokenizer

CONCURRENCY = 4  # both engines' running limit and the served clients: admissions trickle in as requests finish


def make_engine(folder: str, gpu_schedule: bool) -> Engine:
    # gpu_schedule: what a CUDA engine with decode graphs runs (the overlap schedule, prompts in steps of their own)
    return Engine(EngineConfig(
        model=folder, show_progress=False, max_total_tokens=4096, page_size=4, max_running_requests=CONCURRENCY,
        max_batched_tokens=64, chunked_prefill_size=32, overlap_schedule=gpu_schedule, mixed_chunk=not gpu_schedule,
    ))


def workload(engine: Engine, count: int = 10, seed: int = 0) -> list[tuple[list[int], SamplingParams]]:
    """Mixed prompts and lengths; every other request stops at a token it would generate (a token of a first greedy
    run of it on `engine`), so both endings, the length and a stop, are compared."""
    rng = random.Random(seed)
    prompts = [[256] + [rng.randrange(256) for _ in range(rng.randrange(3, 60))] for _ in range(count)]
    plain = [SamplingParams(max_new_tokens=rng.randrange(4, 24), temperature=0.0, ignore_eos=True) for _ in prompts]
    first = engine.generate(prompts, plain)
    work = []
    for i, (prompt, params, request) in enumerate(zip(prompts, plain, first)):
        if i % 2:
            params = attrs.evolve(params, stop_token_ids=(request.output_ids[len(request.output_ids) // 2],))
        work.append((prompt, params))
    return work


def served(engine: Engine, work) -> list[Request]:
    """Rank 0 of a server as its leader runs it, with CONCURRENCY clients: one new request for each that finished,
    the text and ids of each request as the front end's mirror puts them together from the rounds' Updates."""
    group = EngineGroup(engine)
    mirrors = {}
    pending = list(enumerate(work))

    def admit(count: int) -> None:
        for _ in range(min(count, len(pending))):
            i, (prompt, params) = pending.pop(0)
            mirrors[str(i)] = types.SimpleNamespace(request=Request(str(i), list(prompt), params),  # the front end's
                                                    detok=front_end_detokenizer(group.engine.tokenizer, params))
            group.add_request(prompt, params, rid=str(i))

    admit(CONCURRENCY)
    while group.needs_round:
        finished = 0
        for report in group.step():
            report.updates.apply(mirrors)
            finished += len(report.updates.finished())
        admit(finished)
    return [mirrors[str(i)].request for i in range(len(work))]


@pytest.mark.parametrize("arch,gpu_schedule", [
    ("deepseek_v3", True), ("qwen3_moe", True), ("mixtral", True), ("deepseek_v3", False),
], ids=["deepseek_v3-gpu-schedule", "qwen3_moe-gpu-schedule", "mixtral-gpu-schedule", "deepseek_v3-cpu-schedule"])
def test_offline_equals_served_token_for_token(tiny_model_dir, arch, gpu_schedule):
    folder = tiny_model_dir(arch)
    engine = make_engine(folder, gpu_schedule)
    work = workload(engine)
    offline = engine.generate([p for p, _ in work], [sp for _, sp in work])
    streamed = served(make_engine(folder, gpu_schedule), work)
    assert [r.output_ids for r in offline] == [r.output_ids for r in streamed]
    assert [r.finish_reason for r in offline] == [r.finish_reason for r in streamed]
    assert [r.text for r in offline] == [r.text for r in streamed]
    assert {r.finish_reason.value for r in offline} >= {"length", "stop"}  # both endings were compared


def test_generate_decodes_no_text_per_step_unless_stop_strings_need_it(tiny_model_dir, monkeypatch):
    pushed = []
    push = Detokenizer.push
    monkeypatch.setattr(Detokenizer, "push", lambda self, token: pushed.append(token) or push(self, token))
    engine = make_engine(tiny_model_dir("qwen3_moe"), gpu_schedule=True)
    plain = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    [request] = engine.generate([[256, 1, 2, 3]], plain)
    assert pushed == [] and request.text == engine.tokenizer.decode(request.output_ids)
    # a stop string is searched in the text as it grows: those requests still decode per token
    stop = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True, stop=("\x00never",))
    [request] = engine.generate([[256, 1, 2, 3]], stop)
    assert pushed == request.output_ids
