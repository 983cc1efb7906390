"""The grammar book's masks filled ahead (in a worker thread, right after a step's tokens are accepted) are the
masks filled on the step loop: for the same batch in the same order, a batch in another order, a request that
joins and one that leaves; and in a steady batch no mask row is filled on the step loop."""

from __future__ import annotations

import json
import threading

import torch

from moeplex.grammar.book import GrammarBook
from moeplex.interfaces import JSON_SCHEMA, REGEX, Constraint
from moeplex.tokenizer import load_tokenizer

from grammar_schemas import SCHEMAS

VOCAB = 512


def book(folder: str) -> GrammarBook:
    return GrammarBook.named("xgrammar", load_tokenizer(folder), VOCAB, {2})


def test_masks_filled_ahead_equal_masks_filled_on_the_step_loop(tiny_model_dir):
    folder = tiny_model_dir("qwen3_moe")
    ahead, inline = book(folder), book(folder)
    constraints = {f"r{i}": Constraint(JSON_SCHEMA, json.dumps(s)) for i, s in enumerate(SCHEMAS[:4])}
    constraints["late"] = Constraint(REGEX, "[a-z]{3,40}")
    for b in (ahead, inline):
        for rid, constraint in list(constraints.items())[:4]:
            b.add(rid, constraint)
    threads = []
    backend_fill = ahead._start().backend.fill_masks

    def fill_masks(*args):
        threads.append(threading.current_thread().name)
        return backend_fill(*args)

    ahead.compiler.backend.fill_masks = fill_masks
    batches = [["r0", "r1", "r2", "r3"]] * 3 + [["r3", "r2", "r1", "r0"], ["r0", "late", "r1", "r2", "r3"],
                                                ["r0", "late", "r1", "r3"]] + [["r0", "late", "r1", "r3"]] * 3
    generator = torch.Generator().manual_seed(0)
    for step, rids in enumerate(batches):
        if "late" in rids and "late" not in inline._matchers:
            for b in (ahead, inline):
                b.add("late", constraints["late"])
        logits = torch.randn(len(rids), VOCAB, generator=generator)
        masked = ahead.mask(logits, rids)
        assert torch.equal(masked, inline.mask(logits, rids)), f"step {step}: {rids}"
        if step in (1, 2, 7, 8):  # the batch of the step before, in its order: every row was filled ahead
            assert threads and all(name.startswith("grammar-mask-ahead") for name in threads), threads
        tokens = masked.argmax(-1).tolist()
        threads.clear()
        ahead.accept_step(rids, tokens, fill_ahead=True)
        inline.accept_step(rids, tokens)
        for rid, token in zip(rids, tokens):
            assert ahead.accept(rid, token) == inline.accept(rid, token)
    for b in (ahead, inline):
        b.close()
