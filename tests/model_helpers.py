"""Shared by the architecture tests: a random transformers checkpoint, our model on it, steps through the paged cache.

The reference is always the transformers model itself, run on whole sequences without a cache.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import torch
import transformers

from moeplex.batch_builder import ScheduledSeq, build_forward_batch
from moeplex.config import EngineConfig
from moeplex.kv_cache import KVPool
from moeplex.models.setup import load_model
from moeplex.registry import lookup
from moeplex.selection import resolve

TOLERANCE = 1e-4  # max |ours - reference| / max |reference|, fp32
PAGE_SIZE = 4


def write_hf_checkpoint(config: dict, folder: str, seed: int = 0) -> transformers.PreTrainedModel:
    """Build the transformers model of a config.json dict, give it random weights, save it to `folder`."""
    fields = dict(config)
    hf_config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager", dtype=torch.float32)
    randomize(model, seed)
    model.save_pretrained(folder)
    return model.eval()


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights that keep activations near unit scale, so logits are peaked and routing is decisive."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if "norm" in name:  # norm weights near one, but not one, so a missing norm shows
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                param.copy_(0.1 * noise)
            elif "embed_tokens" in name:
                param.copy_(noise)
            else:
                param.copy_(noise / math.sqrt(param.shape[-1]))


def reference_logits(model: transformers.PreTrainedModel, tokens: Sequence[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([list(tokens)])).logits[0].float()


def load_ours(folder: str):
    config = EngineConfig(model=folder, dtype="fp32", show_progress=False)
    return load_model(folder, config, resolve(config))


def new_pool(model, num_pages: int = 64) -> KVPool:
    return KVPool(num_pages, PAGE_SIZE, model.kv_shapes(), dtype=torch.float32, device="cpu")


def scattered_pages(kv: KVPool, count: int) -> list[int]:
    """`count` pages that are neither contiguous nor ascending, as a pool in use hands them out."""
    everything = kv.allocate(kv.num_free_pages)
    chosen = everything[::-3][:count]
    kv.release(chosen)
    kv.release([p for p in everything if p not in chosen])
    pages = kv.allocate(count)
    assert pages == chosen
    return pages


@functools.cache
def no_overlap():
    """The `none` overlap strategy, looked up once: entry-point discovery takes a while."""
    return lookup("overlap", "none")()


def step(model, kv: KVPool, seqs: Sequence[ScheduledSeq]) -> torch.Tensor:
    """Our logits [T, vocab] for every new token of one forward step."""
    batch = build_forward_batch(seqs, kv, "cpu")
    with torch.no_grad():
        return model(batch, kv, no_overlap(), logits_at=torch.arange(batch.num_tokens))


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours - reference).abs().max() / reference.abs().max()).item()


def assert_matches(ours: torch.Tensor, reference: torch.Tensor, what: str) -> None:
    assert ours.shape == reference.shape, f"{what}: shape {tuple(ours.shape)} != {tuple(reference.shape)}"
    error = relative_error(ours, reference)
    assert error <= TOLERANCE, f"{what}: max relative error {error:.2e} > {TOLERANCE:.0e}"


def token_sequence(length: int, seed: int) -> list[int]:
    """bos, then random byte tokens."""
    gen = torch.Generator().manual_seed(seed)
    return [256] + torch.randint(0, 256, (length - 1,), generator=gen).tolist()


# The specification every architecture meets, written once; the per-architecture files call these.


def check_prefill(ours, hf, tokens: Sequence[int]) -> None:
    kv = new_pool(ours)
    pages = kv.allocate(kv.pages_for(len(tokens)))
    logits = step(ours, kv, [ScheduledSeq(tokens, 0, pages)])
    assert_matches(logits, reference_logits(hf, tokens), "one-shot prefill")


def check_chunked_prefill(ours, hf, tokens: Sequence[int], chunk_ends: Sequence[int]) -> None:
    """The sequence in chunks that end mid-page, its pages scattered over the pool."""
    reference = reference_logits(hf, tokens)
    kv = new_pool(ours)
    pages = scattered_pages(kv, kv.pages_for(len(tokens)))
    start = 0
    for end in chunk_ends:
        logits = step(ours, kv, [ScheduledSeq(tokens[start:end], start, pages)])
        assert_matches(logits, reference[start:end], f"chunk {start}..{end}")
        start = end
    assert start == len(tokens)


def check_batched_decode(ours, hf, sequences: Sequence[Sequence[int]], decode_steps: int) -> None:
    """Prefill several prompts of different lengths in one step, then decode them together token by token.

    Each sequence's last `decode_steps` tokens are fed one per step; the reference runs
    transformers on each whole sequence once.
    """
    kv = new_pool(ours)
    pages = [scattered_pages(kv, kv.pages_for(len(seq))) for seq in sequences]
    references = [reference_logits(hf, seq) for seq in sequences]
    prompt_lens = [len(seq) - decode_steps for seq in sequences]
    logits = step(ours, kv, [ScheduledSeq(seq[:n], 0, p) for seq, n, p in zip(sequences, prompt_lens, pages)])
    assert_matches(logits, torch.cat([ref[:n] for ref, n in zip(references, prompt_lens)]), "batched prefill")
    for i in range(decode_steps):
        positions = [n + i for n in prompt_lens]
        batch_seqs = [ScheduledSeq([seq[pos]], pos, p) for seq, pos, p in zip(sequences, positions, pages)]
        assert build_forward_batch(batch_seqs, kv, "cpu").mode.name == "DECODE"
        logits = step(ours, kv, batch_seqs)
        expected = torch.stack([ref[pos] for ref, pos in zip(references, positions)])
        assert_matches(logits, expected, f"decode step {i}")
