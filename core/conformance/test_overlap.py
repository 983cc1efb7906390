"""Overlap strategy contract: logits equal those of `none`, and `plan` is a pure function of CPU-side metadata.

A tiny random Qwen3-MoE runs an EXTEND batch of requests of different lengths, then a
DECODE step on the KV cache the extend wrote, once under `none` and once under the
strategy, each with a fresh KV pool.
"""

from __future__ import annotations

import pytest
import torch

from moeplex.batch_builder import ScheduledSeq, build_forward_batch
from moeplex.config import EngineConfig
from moeplex.conformance.plugin import load_plugin
from moeplex.forward_batch import ForwardMode
from moeplex.interfaces import BatchMeta
from moeplex.kv_cache import KVPool
from moeplex.models.make_model import write_checkpoint
from moeplex.models.setup import load_model
from moeplex.registry import lookup
from moeplex.selection import resolve

PROMPTS = ([3, 14, 15, 92, 65], [35, 89, 79, 32, 38, 46, 26, 43, 38], [27, 18, 28])
NEXT_TOKENS = (11, 200, 7)  # fed to the decode step, the same under every strategy
PAGE_SIZE = 4
TOLERANCE = 1e-4  # fp32; micro-batches may sum in another order
PLAN_METAS = {
    "extend": BatchMeta(ForwardMode.EXTEND, (5, 9, 3)),
    "long_extend": BatchMeta(ForwardMode.EXTEND, (700, 300, 1)),
    "one_token": BatchMeta(ForwardMode.EXTEND, (1,)),
    "decode": BatchMeta(ForwardMode.DECODE, (1,) * 64),
    "idle": BatchMeta(ForwardMode.IDLE, ()),
}


@pytest.fixture(scope="module")
def overlap_cls(moeplex_plugin):
    return load_plugin(moeplex_plugin)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    folder = write_checkpoint(str(tmp_path_factory.mktemp("tiny_qwen3_moe")), arch="qwen3_moe", preset="tiny", seed=0)
    config = EngineConfig(model=folder, dtype="fp32", show_progress=False)
    return load_model(folder, config, resolve(config))


@torch.no_grad()
def extend_then_decode(model, strategy) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, vocab] logits of the extend step and of the decode step after it."""
    kv = KVPool(num_pages=64, page_size=PAGE_SIZE, layer_shapes=model.kv_shapes(), dtype=torch.float32, device="cpu")
    pages = [kv.allocate(kv.pages_for(len(prompt) + 1)) for prompt in PROMPTS]
    extend = build_forward_batch([ScheduledSeq(p, 0, pg) for p, pg in zip(PROMPTS, pages)], kv, "cpu")
    extend_logits = model(extend, kv, strategy)
    decode_seqs = [ScheduledSeq([t], len(p), pg) for t, p, pg in zip(NEXT_TOKENS, PROMPTS, pages)]
    decode = build_forward_batch(decode_seqs, kv, "cpu")
    assert decode.mode == ForwardMode.DECODE
    return extend_logits, model(decode, kv, strategy)


@pytest.fixture(scope="module")
def none_logits(tiny_model):
    return extend_then_decode(tiny_model, lookup("overlap", "none")())


@pytest.fixture(scope="module")
def strategy_logits(tiny_model, overlap_cls):
    return extend_then_decode(tiny_model, overlap_cls())


def assert_same_logits(got: torch.Tensor, want: torch.Tensor, step: str) -> None:
    torch.testing.assert_close(
        got, want, rtol=TOLERANCE, atol=TOLERANCE, msg=lambda detail: f"{step} logits differ from none's\n{detail}"
    )


def test_extend_logits_equal_none(strategy_logits, none_logits):
    assert_same_logits(strategy_logits[0], none_logits[0], "EXTEND")


def test_decode_logits_equal_none(strategy_logits, none_logits):
    assert_same_logits(strategy_logits[1], none_logits[1], "DECODE")


@pytest.mark.parametrize("meta_name", list(PLAN_METAS))
def test_plan_is_pure_with_cuts_inside_the_batch(overlap_cls, meta_name):
    meta = PLAN_METAS[meta_name]
    strategy = overlap_cls()
    plan = strategy.plan(meta)
    assert plan == overlap_cls().plan(meta) == strategy.plan(meta), "plan differs between equal calls"
    if plan is None:
        return
    cuts = list(plan)
    assert all(isinstance(cut, int) for cut in cuts), f"cut points {cuts} are not ints"
    assert cuts == sorted(set(cuts)), f"cut points {cuts} are not strictly increasing"
    assert all(0 < cut < meta.num_tokens for cut in cuts), f"cut points {cuts} outside (0, {meta.num_tokens})"
