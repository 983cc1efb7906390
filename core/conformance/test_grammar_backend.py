"""Grammar backend contract: following the mask always yields output that satisfies the constraint (checked
independently: `re.fullmatch`, `json.loads` and the schema's own rules), a forbidden token is refused, ids beyond
the tokenizer's vocabulary are never allowed, rollback restores the state exactly (where declared), compiling a
large schema leaves other Python threads running (it must not hold the GIL), and a constraint that cannot
compile raises GrammarError.

Each backend runs on the byte-level tokenizer `moeplex make-model` writes (any string is spelt byte by byte),
with a logits width past the tokenizer's, walking the mask from seeded random streams.
"""

from __future__ import annotations

import json
import random
import re
import threading
import time

import pytest
import torch

from moeplex.conformance.plugin import load_plugin

MAX_STALL_S = 0.25  # the longest a compile may keep every other thread waiting
EOS = 257  # the byte-level tokenizer's end token
VOCAB = 320  # logits wider than the tokenizer's 259 ids
REGEXES = [r"[a-c]{2,4}-[0-9]", r"(yes|no)!", r"#[0-9a-f]{3}"]
EBNF = ('root ::= "(" item ("," item)? ")"\nitem ::= [x-z]', re.compile(r"\([x-z](,[x-z])?\)"))
SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["a", "b"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2},
    },
    "required": ["kind", "n"],
    "additionalProperties": False,
}


def _schema_holds(value) -> bool:
    """SCHEMA's rules, checked without the jsonschema package (a third party's environment may lack it)."""
    return (
        isinstance(value, dict) and set(value) <= {"kind", "n", "tags"} and {"kind", "n"} <= set(value)
        and value["kind"] in ("a", "b") and type(value["n"]) is int and 0 <= value["n"] <= 9
        and all(t in ("x", "y") for t in value.get("tags", [])) and len(value.get("tags", [])) <= 2
    )


@pytest.fixture(scope="module")
def backend(moeplex_plugin):
    from moeplex.interfaces import GrammarVocab
    from moeplex.models.make_model import byte_level_tokenizer

    return load_plugin(moeplex_plugin)(GrammarVocab(byte_level_tokenizer(), VOCAB, (EOS,)))


def _constraint(kind: str, text: str = ""):
    from moeplex.interfaces import Constraint

    return Constraint(kind, text)


def _allowed(backend, matcher) -> list[int]:
    bitmask = torch.zeros(1, -(-VOCAB // 32), dtype=torch.int32)
    backend.fill_masks([matcher], bitmask, [0])
    bits = (bitmask[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.reshape(-1)[:VOCAB].nonzero()[:, 0].tolist()


def _walk(backend, constraint, seed: int, steps: int = 120) -> tuple[bytes, bool, list[int]]:
    """Follow the mask from a seeded stream: (bytes produced, whether it ended, the tokens accepted)."""
    rng = random.Random(seed)
    matcher = backend.matcher(backend.compile(constraint))
    out, tokens = bytearray(), []
    for _ in range(steps):
        allowed = _allowed(backend, matcher)
        assert allowed, f"the mask allows nothing after {bytes(out)!r} and the output has not ended"
        assert max(allowed) < 259, f"the mask allows id {max(allowed)}, beyond the tokenizer's vocabulary"
        token = EOS if EOS in allowed and rng.random() < 0.5 else rng.choice(allowed)
        forbidden = [t for t in range(256) if t not in allowed]
        if forbidden:
            assert not matcher.accept(rng.choice(forbidden)), "the matcher accepted a token its own mask forbids"
        assert matcher.accept(token), f"the matcher refused token {token}, which its mask allowed"
        tokens.append(token)
        if token == EOS:
            return bytes(out), True, tokens
        out.append(token)
    return bytes(out), False, tokens


@pytest.mark.parametrize("seed", range(4))
def test_following_the_mask_satisfies_a_regex(backend, seed):
    for pattern in REGEXES:
        text, ended, _ = _walk(backend, _constraint("regex", pattern), seed)
        assert ended and re.fullmatch(pattern, text.decode()), f"{text!r} does not match {pattern}"


@pytest.mark.parametrize("seed", range(4))
def test_following_the_mask_satisfies_a_json_schema(backend, seed):
    text, ended, _ = _walk(backend, _constraint("json_schema", json.dumps(SCHEMA)), seed)
    assert ended, f"no end after {text!r}"
    value = json.loads(text)  # strict: raw control characters inside strings are not JSON
    assert _schema_holds(value), f"{value!r} breaks the schema"


@pytest.mark.parametrize("seed", range(4))
def test_following_the_mask_satisfies_an_ebnf_grammar_and_json_object(backend, seed):
    grammar, language = EBNF
    text, ended, _ = _walk(backend, _constraint("ebnf", grammar), seed)
    assert ended and language.fullmatch(text.decode()), text
    text, ended, _ = _walk(backend, _constraint("json_object"), seed, steps=400)
    if ended:
        assert isinstance(json.loads(text), dict), text


@pytest.mark.parametrize("seed", range(3))
def test_a_matcher_ends_exactly_on_an_end_token_where_declared(backend, seed):
    """GrammarBackendCaps.ends_at_end_token: every token the mask allows is accepted (_walk checks that) and the
    matcher is terminated after an end token and only then: the engine reads outcomes off the mask."""
    if not backend.caps.ends_at_end_token:
        pytest.skip("the backend does not declare ends_at_end_token")
    for constraint in (_constraint("json_schema", json.dumps(SCHEMA)), _constraint("regex", REGEXES[1])):
        matcher = backend.matcher(backend.compile(constraint))
        _, ended, tokens = _walk(backend, constraint, seed)
        assert ended
        for token in tokens:
            assert matcher.accept(token)
            assert matcher.is_terminated() == (token == EOS), f"terminated is {matcher.is_terminated()} after {token}"


def test_rollback_restores_the_state(backend):
    if not backend.caps.rollback:
        pytest.skip("the backend declares no rollback")
    _, _, tokens = _walk(backend, _constraint("json_schema", json.dumps(SCHEMA)), seed=7)
    matcher = backend.matcher(backend.compile(_constraint("json_schema", json.dumps(SCHEMA))))
    keep = len(tokens) // 2
    states = []
    for token in tokens[:-1]:
        states.append(_allowed(backend, matcher))
        assert matcher.accept(token)
    matcher.rollback(len(tokens) - 1 - keep)
    assert _allowed(backend, matcher) == states[keep], "after rollback the mask is not the one at that position"
    for token in tokens[keep:]:
        assert matcher.accept(token), "after rollback the same tokens are not accepted again"
    assert matcher.is_terminated()


def test_compiling_leaves_other_threads_running(backend):
    """The engine compiles in worker threads while the step loop and the HTTP server go on: a compile that holds
    the GIL stalls both for its whole length."""
    fields = {f"field_{i}": {"type": "object", "properties": {f"v{j}": {"type": ["string", "integer", "null"],
                                                                      "pattern": "^[a-z]{1,8}$"} for j in range(10)}}
              for i in range(60)}
    constraint = _constraint("json_schema", json.dumps({"type": "object", "properties": fields}))
    done = threading.Event()
    took = []

    def compile_it():
        start = time.perf_counter()
        backend.matcher(backend.compile(constraint))
        took.append(time.perf_counter() - start)
        done.set()

    worker = threading.Thread(target=compile_it)
    stall, last = 0.0, time.perf_counter()  # taken before the start: the worker may hold the GIL from its first moment
    worker.start()
    while not done.is_set():
        time.sleep(0.002)
        now = time.perf_counter()
        stall, last = max(stall, now - last), now
    worker.join()
    # a quarter second without the GIL is a visible hiccup in every stream the server is sending
    assert stall <= MAX_STALL_S, f"the compile ({took[0]:.2f} s) stalled other threads for {stall:.2f} s at once"


@pytest.mark.parametrize("kind, text", [("json_schema", "{not json"), ("regex", "(unclosed"), ("ebnf", "root ::= nowhere")])
def test_a_constraint_that_cannot_compile_raises_grammar_error(backend, kind, text):
    from moeplex.interfaces import GrammarError

    with pytest.raises(GrammarError) as error:
        backend.compile(_constraint(kind, text))
    assert str(error.value)
