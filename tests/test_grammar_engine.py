"""Structured outputs in the engine: every finished output of a constrained request satisfies its constraint
(jsonschema validates it), and one cut by max_new_tokens is a prefix the grammar still accepts; on all three
architectures with random weights, both built-in backends, greedy and seeded sampling, with the overlap
schedule, chunked prefill and preemption."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from moeplex.config import EngineConfig
from moeplex.engine import Engine
from moeplex.interfaces import EBNF, JSON_OBJECT, JSON_SCHEMA, REGEX, Constraint
from moeplex.models.make_model import ARCHES
from moeplex.request import FinishReason
from moeplex.sampling import SamplingParams

from grammar_schemas import EBNF_GRAMMARS, REGEXES, SCHEMAS

ENGINE = dict(dtype="fp32", show_progress=False, max_total_tokens=8192, page_size=4, max_running_requests=64)
MAX_TOKENS = 80  # the longest output any schema here allows is shorter


def params(constraint: Constraint, i: int, max_new_tokens: int = MAX_TOKENS) -> SamplingParams:
    # even rows greedy, odd rows sampled from their own seeded stream: both paths through the sampler
    sampled = dict(temperature=1.0, seed=i) if i % 2 else dict(temperature=0.0)
    return SamplingParams(max_new_tokens=max_new_tokens, constraint=constraint, **sampled)


def run(engine: Engine, constraints: list[Constraint], max_new_tokens: int = MAX_TOKENS):
    prompts = [engine.encode(f"Answer {i} in JSON:") for i in range(len(constraints))]
    return engine.generate(prompts, [params(c, i, max_new_tokens) for i, c in enumerate(constraints)])


def assert_prefix(engine: Engine, constraint: Constraint, output_ids: list[int]) -> None:
    """A length-finished output is a valid prefix: a fresh matcher accepts every one of its tokens."""
    backend = engine.grammar.compiler.backend
    matcher = backend.matcher(backend.compile(constraint))
    assert all(matcher.accept(t) for t in output_ids)


def check_json(engine: Engine, requests, schemas: list[dict]) -> int:
    stopped = 0
    for request, schema in zip(requests, schemas):
        assert request.error is None, request.error
        if request.finish_reason == FinishReason.STOP:
            jsonschema.validate(json.loads(request.text), schema)
            stopped += 1
        else:
            assert request.finish_reason == FinishReason.LENGTH
            assert_prefix(engine, Constraint(JSON_SCHEMA, json.dumps(schema)), request.output_ids)
    return stopped


@pytest.mark.parametrize("arch", ARCHES)
def test_every_schema_is_followed(tiny_model_dir, arch):
    engine = Engine(EngineConfig(model=tiny_model_dir(arch), **ENGINE))
    requests = run(engine, [Constraint(JSON_SCHEMA, json.dumps(s)) for s in SCHEMAS])
    stopped = check_json(engine, requests, SCHEMAS)
    assert stopped >= 0.9 * len(SCHEMAS), f"only {stopped} of {len(SCHEMAS)} outputs finished"
    assert engine.kv.num_free_pages == engine.kv.num_pages or engine.prefix_cache is not None


def test_llguidance_follows_every_schema(tiny_model_dir):
    engine = Engine(EngineConfig(model=tiny_model_dir("qwen3_moe"), grammar_backend="llguidance", **ENGINE))
    requests = run(engine, [Constraint(JSON_SCHEMA, json.dumps(s)) for s in SCHEMAS])
    assert check_json(engine, requests, SCHEMAS) >= 0.9 * len(SCHEMAS)


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_regex_ebnf_and_json_object(tiny_model_dir, backend):
    engine = Engine(EngineConfig(model=tiny_model_dir("mixtral"), grammar_backend=backend, **ENGINE))
    constraints = [Constraint(REGEX, r) for r in REGEXES] + [Constraint(EBNF, g) for g, _ in EBNF_GRAMMARS]
    constraints.append(Constraint(JSON_OBJECT))
    requests = run(engine, constraints, max_new_tokens=40)  # every regex and grammar here ends within 40 bytes
    for request, constraint in zip(requests, constraints):
        assert request.error is None, request.error
        if request.finish_reason != FinishReason.STOP:
            assert_prefix(engine, constraint, request.output_ids)
        elif constraint.kind == REGEX:
            assert re.fullmatch(constraint.text, request.text), (constraint.text, request.text)
        elif constraint.kind == JSON_OBJECT:
            assert isinstance(json.loads(request.text), dict)
    ebnf = requests[len(REGEXES)]
    assert ebnf.finish_reason == FinishReason.STOP and ebnf.text in EBNF_GRAMMARS[0][1]
    assert sum(r.finish_reason == FinishReason.STOP for r in requests[: len(REGEXES)]) == len(REGEXES)


def test_length_finished_output_is_a_valid_prefix(tiny_model_dir):
    engine = Engine(EngineConfig(model=tiny_model_dir("deepseek_v3"), **ENGINE))
    schema = {"type": "object", "properties": {"text": {"type": "string", "minLength": 40}}, "required": ["text"]}
    constraint = Constraint(JSON_SCHEMA, json.dumps(schema))
    [request] = run(engine, [constraint], max_new_tokens=12)
    assert request.finish_reason == FinishReason.LENGTH and len(request.output_ids) == 12
    assert request.text.startswith('{"text": "')
    assert_prefix(engine, constraint, request.output_ids)


def test_overlap_schedule_chunked_prefill_and_preemption(tiny_model_dir):
    """Under the overlap schedule a constrained request's token is read before its next mask is made; chunked
    prefill masks only the last chunk's row; a preempted request keeps its matcher (its tokens are kept)."""
    settings = dict(ENGINE, max_total_tokens=192, chunked_prefill_size=16, max_batched_tokens=64)
    engine = Engine(EngineConfig(model=tiny_model_dir("deepseek_v3"), overlap_schedule=True, **settings))
    schemas = SCHEMAS[:12]
    prompts = [engine.encode(f"A longer prompt number {i} that spans several chunks:") for i in range(len(schemas))]
    requests = engine.generate(prompts, [params(Constraint(JSON_SCHEMA, json.dumps(s)), i, 48) for i, s in enumerate(schemas)])
    assert sum(r.num_preemptions for r in requests) > 0, "the pool was meant to be too small for every request at once"
    assert check_json(engine, requests, schemas) >= 0.9 * len(schemas)


def test_a_constraint_that_does_not_compile_fails_only_its_request(tiny_model_dir):
    engine = Engine(EngineConfig(model=tiny_model_dir("deepseek_v3"), **ENGINE))
    bad, good = run(engine, [Constraint(REGEX, "(unclosed"), Constraint(REGEX, "ok|no")])
    assert bad.finish_reason == FinishReason.ABORT and "does not compile" in bad.error
    assert good.finish_reason == FinishReason.STOP and good.text in ("ok", "no")
    assert engine.grammar.compiler.misses == 2
    run(engine, [Constraint(REGEX, "ok|no")])
    assert engine.grammar.compiler.hits >= 1  # the same text compiled once


def test_overlap_schedule_gives_the_same_tokens(tiny_model_dir):
    """Constrained and free requests in one batch: under the overlap schedule (a constrained request's token read
    while the next forward runs, before that step's draw) every request gets the tokens it gets without it."""
    outputs = []
    for overlap in (False, True):
        engine = Engine(EngineConfig(model=tiny_model_dir("qwen3_moe"), overlap_schedule=overlap, **ENGINE))
        prompts = [engine.encode(f"Request {i}:") for i in range(6)]
        params = [SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=i % 2 == 1,
                                 constraint=Constraint(JSON_SCHEMA, json.dumps(SCHEMAS[i])) if i % 2 == 0 else None)
                  for i in range(6)]
        outputs.append([(r.output_ids, r.finish_reason) for r in engine.generate(prompts, params)])
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_speculative_drafts_are_checked_by_the_matcher(tiny_model_dir, backend):
    """ngram drafts (from a prompt that repeats itself) verified against masked rows: a draft the grammar forbids
    is rejected and rolled back; the tokens are those of decoding without speculation, and they follow the
    schema."""
    schemas = SCHEMAS[:6]
    outputs = []
    for spec in ("none", "ngram"):
        engine = Engine(EngineConfig(model=tiny_model_dir("deepseek_v3"), speculative_algorithm=spec,
                                     grammar_backend=backend, disable_speculative_backoff=True, **ENGINE))
        prompts = [engine.encode('{"name": "ab", "age": 7} ' * 3 + f"#{i}") for i in range(len(schemas))]
        params = [SamplingParams(max_new_tokens=48, temperature=0.0, constraint=Constraint(JSON_SCHEMA, json.dumps(s)))
                  for s in schemas]
        requests = engine.generate(prompts, params)
        check_json(engine, requests, schemas)
        outputs.append([r.output_ids for r in requests])
        if spec == "ngram":
            assert sum(r.spec_draft_tokens for r in requests) > 0
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("overlap", [False, True])
def test_a_constraint_after_the_thinking_applies_to_the_answer_only(tiny_model_dir, overlap):
    """constraint_after (a reasoning model's "</think>"): the output is free up to the marker, then follows the
    constraint. The marker here is a character the free output holds, so the free part is that output's prefix."""
    engine = Engine(EngineConfig(model=tiny_model_dir("mixtral"), overlap_schedule=overlap, **ENGINE))
    prompt = engine.encode("Think first:")
    [free] = engine.generate([prompt], SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True))
    marker = next(ch for ch in free.text if ch.isprintable() and ch != "\ufffd")
    cut = free.text.index(marker) + 1
    regex = "(yes|no)"
    [answer] = engine.generate([prompt], SamplingParams(max_new_tokens=48, temperature=0.0, constraint_after=marker,
                                                        constraint=Constraint(REGEX, regex)))
    assert answer.text.startswith(free.text[:cut]), (free.text, answer.text)
    assert answer.finish_reason == FinishReason.STOP and re.fullmatch(regex, answer.text[answer.text.index(marker) + 1:])
