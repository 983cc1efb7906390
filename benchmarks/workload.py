"""The offline benchmark workload: pure Python, so other engines' runners can import it too."""

from __future__ import annotations

import random


def mixed_workload(num_requests: int = 64, seed: int = 0, prompt_range=(32, 256), output_range=(16, 256), vocab: int = 256):
    """(prompt token ids, new tokens wanted) pairs: prompts of 32-256 byte tokens after a bos, outputs of 16-256."""
    rng = random.Random(seed)
    work = []
    for _ in range(num_requests):
        prompt = [256] + [rng.randrange(vocab) for _ in range(rng.randint(*prompt_range) - 1)]
        work.append((prompt, rng.randint(*output_range)))
    return work
