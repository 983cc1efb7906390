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


# --- prefix-cache workloads (benchmarks/prefix_cache.py, router_cache.py, vllm_prefix_cache.py) -----------------


def tokens(rng: random.Random, n: int) -> list[int]:
    """n random byte tokens (ids 0-255)."""
    return [rng.randrange(256) for _ in range(n)]


def shared_prefix_prompts(groups: int, per_group: int, system_len: int, question_len: int, rng: random.Random) -> list[list[int]]:
    """groups x per_group prompts: a system prompt of its group (bos first) and a question of its own, in a random order."""
    prompts = []
    for _ in range(groups):
        system = [256] + tokens(rng, system_len - 1)
        prompts += [system + tokens(rng, question_len) for _ in range(per_group)]
    rng.shuffle(prompts)
    return prompts


def no_reuse_prompts(count: int, length: int, rng: random.Random) -> list[list[int]]:
    """Random prompts sharing nothing but the bos."""
    return [[256] + tokens(rng, length - 1) for _ in range(count)]


def multi_turn_openings(clients: int, opening_len: int, rng: random.Random) -> list[list[int]]:
    """Each conversation's first prompt; later turns append the answer and next_turn(rng, n)."""
    return [[256] + tokens(rng, opening_len - 1) for _ in range(clients)]
