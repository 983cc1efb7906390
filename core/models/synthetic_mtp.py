"""Synthetic DeepSeek-V3 weights whose MTP layer's drafts are accepted at a chosen rate (make-model --mtp-acceptance),
and synthetic targets of any architecture that follow a fixed next-token map (make-model --synthetic-map).

Random weights make a target whose next token no draft model can guess, and random MTP weights guess nothing:
neither measures what `nextn` costs and gains. These weights make both predictable, and say how often they agree:

- a fixed next-token map f, one cycle through the vocabulary (the eos ids left out, so ignore_eos is not needed):
  the target's greedy next token after x is f(x), whatever came before;
- unit vectors u_x (random, made orthogonal to one more random unit vector v), the embedding
  e_x = sqrt(H) * (u_x + C * v if x is in S else u_x), and lm_head row f(x) = (SCALE / sqrt(H)) * u_x: after the
  final norm the hidden state points along u_x (and v, which lm_head does not see), and u_x has the largest
  inner product with itself, so the target's logits peak at f(x);
- every projection that writes to the residual stream (attention o_proj, MLP and expert down_proj) scaled by
  RESIDUAL, so the layers (all of them run, at full cost) only nudge that: the target is close to the map;
- the MTP layer: norms of ones, eh_proj = [A | 0] with A = I + (u_w - v) v^T (the target's hidden half unused),
  so its input is e_y for a token y outside S, and e_y with v turned into u_w for y in S: the MTP layer then
  predicts f(y) for y outside S (its draft is the target's token) and f(w), a fixed wrong token, for y in S.
S is a random set of round((1 - acceptance) * V) tokens: a draft for the token after y is accepted when y is not
in S, so each draft position is accepted with probability `acceptance` along the map's cycle (the tokens a long
generation visits), independently of the others: the accept length with k steps is about 1 + a + ... + a^k.

Every tensor is a function of its name, the seed and the config (as random weights are: random_weights.py), so
make-model writes and --load-format dummy makes the same synthetic model; the config.json key
`moeplex_synthetic_mtp` ({"acceptance": a}) turns it on. Synthetic weights: not a language model of anything.

Without an MTP layer (--synthetic-map, any architecture; the key's acceptance 1.0, so S is empty) the same target
remains: it copies any stretch of a prompt that walks the map, which is what prompt lookup (ngram) drafts from,
so a document that walks the map, with some of its tokens edited, and then its first tokens again, is copied on
from there and ngram's drafts are accepted wherever the copy has no edit (benchmarks/speculative.py --copy).
"""

from __future__ import annotations

import functools
import math

import torch

from .random_weights import named_random_tensor

CONFIG_KEY = "moeplex_synthetic_mtp"
C = 2.0  # the weight of v in the embedding of a token in S (the MTP layer's "wrong" switch)
SCALE = 25.0  # the target's logit of its own next token, for a token outside S: a sharp distribution
RESIDUAL = 0.02  # what the layers' residual writes are scaled by


def acceptance_of(hf_config: dict) -> float | None:
    spec = hf_config.get(CONFIG_KEY)
    return None if spec is None else float(spec["acceptance"])


@functools.lru_cache(maxsize=1)  # a pure function of its arguments, asked for by 3-5 tensors in a row
def _structure(vocab: int, hidden: int, acceptance: float, seed: int, eos: frozenset[int]):
    """(u [V, H], v [H], successor f as a [V] index tensor, predecessor f^-1, in_S [V] bool, w), on the CPU
    (drawn there whatever the model's device, so every device makes the same model)."""
    gen = torch.Generator(device="cpu").manual_seed(seed * 7919 + 17)
    v = torch.randn(hidden, generator=gen)
    v /= v.norm()
    u = torch.randn(vocab, hidden, generator=gen)
    u -= (u @ v)[:, None] * v[None, :]
    u /= u.norm(dim=1, keepdim=True)
    cycle = [t for t in torch.randperm(vocab, generator=gen).tolist() if t not in eos]
    successor = torch.arange(vocab)
    successor[cycle] = torch.tensor(cycle[1:] + cycle[:1])
    for t in eos:
        successor[t] = cycle[0]
    predecessor = torch.full_like(successor, -1)  # -1: no token leads to it (the eos ids)
    predecessor[torch.tensor(cycle[1:] + cycle[:1])] = torch.tensor(cycle)
    wrong = torch.randperm(vocab, generator=gen)[: round((1.0 - acceptance) * vocab)]
    in_s = torch.zeros(vocab, dtype=torch.bool)
    in_s[wrong] = True
    w = cycle[len(cycle) // 2]
    return u, v, successor, predecessor, in_s, w


def synthetic_tensor(name: str, shape: tuple[int, ...], seed: int, hf_config: dict, device="cpu") -> torch.Tensor:
    """The tensor `name` of the synthetic model (fp32); the random one where the construction leaves it alone."""
    acceptance = acceptance_of(hf_config)
    vocab, hidden = hf_config["vocab_size"], hf_config["hidden_size"]
    eos = _eos(hf_config)
    if name.endswith(("o_proj.weight", "down_proj.weight", ".w2.weight")):  # (.w2: Mixtral's expert down projection)
        return RESIDUAL * named_random_tensor(name, shape, seed, device)
    if name == "model.norm.weight" or name.endswith(("enorm.weight", "hnorm.weight", "shared_head.norm.weight")):
        return torch.ones(shape, device=device)
    if name.endswith(("embed_tokens.weight", "lm_head.weight", "shared_head.head.weight", "eh_proj.weight")):
        u, v, _, predecessor, in_s, w = (
            t.to(device) if isinstance(t, torch.Tensor) else t for t in _structure(vocab, hidden, acceptance, seed, eos)
        )
        if name.endswith("embed_tokens.weight"):
            return math.sqrt(hidden) * (u + C * in_s[:, None].float() * v[None, :])
        if name.endswith("eh_proj.weight"):
            a = torch.eye(hidden, device=device) + torch.outer(u[w] - v, v)
            return torch.cat((a, torch.zeros(hidden, hidden, device=device)), dim=1)
        before = predecessor.to(device)
        rows = (SCALE / math.sqrt(hidden)) * u[before.clamp_min(0)]  # lm_head row z: u of the token before z
        return rows * (before >= 0)[:, None].float()  # an eos row of zeros: never the greedy next token
    return named_random_tensor(name, shape, seed, device)


def next_token_map(hf_config: dict, seed: int) -> list[int]:
    """f: the target's greedy next token after each token (for tests and docs)."""
    _, _, successor, _, _, _ = _structure(hf_config["vocab_size"], hf_config["hidden_size"],
                                          acceptance_of(hf_config), seed, _eos(hf_config))
    return successor.tolist()


def _eos(hf_config: dict) -> frozenset[int]:
    eos = hf_config.get("eos_token_id")
    return frozenset(eos if isinstance(eos, list) else [eos] if eos is not None else [])
