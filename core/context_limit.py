"""How long one sequence may grow, and the one sentence that refuses a request past it.

Shared by `moeplex serve` (a 400) and `moeplex generate` (an error before any step runs).
"""

from __future__ import annotations


def context_length(hf_config: dict, capacity_tokens: int) -> int:
    """The model's positions, but never more than one sequence's share of the KV cache."""
    max_positions = hf_config.get("max_position_embeddings") or capacity_tokens
    return min(capacity_tokens, max_positions)


def context_problem(num_prompt_tokens: int, max_new_tokens: int, context: int, param: str) -> str | None:
    """Why a prompt plus the tokens to generate does not fit in `context`; None when it fits."""
    if num_prompt_tokens + max_new_tokens <= context:
        return None
    return (
        f"this model's context is {context} tokens, but {num_prompt_tokens + max_new_tokens} were requested "
        f"({num_prompt_tokens} in the prompt, {max_new_tokens} to generate); shorten the prompt or lower {param}"
    )
