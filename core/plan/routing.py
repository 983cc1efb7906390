"""How a step's (token, expert) pairs spread over experts: uniform routing, or a recorded run's.

The routed-experts term (costs.experts_us) reads measured times per hit expert, taken under uniform routing. A
real router does not route uniformly, and neither does the dummy (random-weight) model our one-GPU tables were
measured with: its random correction bias (0.1 x noise against sigmoid scores of spread ~0.2) and grouped top-k
concentrate a batch on fewer experts, some with many rows. A tiled MoE kernel reads an expert's weights once per
tile of BLOCK_M rows it runs for that expert, so at decode sizes (weight reads are the cost) the experts term
scales with the tiles a step runs: sum over hit experts of ceil(rows / BLOCK_M). `Routing` holds a recorded run's
histogram (benchmarks/plan_routing.py: per batch, the mean number of experts that received r pairs in a decode
step) and scales the uniform-routing time by recorded tiles over the tiles uniform routing would run.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass


def uniform_distinct(experts: int, top_k: int, tokens: float) -> float:
    """Expected distinct experts `tokens` tokens hit, each choosing `top_k` distinct experts of `experts` uniformly."""
    if tokens <= 0 or experts <= 0:
        return 0.0
    return experts * (1.0 - (1.0 - min(top_k, experts) / experts) ** tokens)


def tiles(histogram, block_m: float) -> float:
    """Kernel tiles of a step whose `histogram` is [(rows, experts with that many rows)]: each hit expert runs
    ceil(rows / block_m) tiles (block_m = inf: one per hit expert, the distinct experts)."""
    return sum(n * (1 if math.isinf(block_m) else math.ceil(r / block_m)) for r, n in histogram if r > 0)


def uniform_histogram(experts: int, top_k: int, tokens: int) -> list[tuple[int, float]]:
    """Expected experts with r pairs under uniform routing: each expert's rows are Binomial(tokens, top_k / experts)."""
    p = min(top_k, experts) / experts
    return [(r, experts * math.comb(tokens, r) * p**r * (1 - p) ** (tokens - r)) for r in range(1, tokens + 1)]


@dataclass(frozen=True)
class RecordedBatch:
    tokens: int
    experts: int
    top_k: int
    histogram: tuple[tuple[int, float], ...]  # (rows, mean experts with that many rows per step and MoE layer)

    def distinct(self) -> float:
        return sum(n for _, n in self.histogram)

    def tile_ratio(self, block_m: float) -> float:
        """Tiles this recorded routing runs over those uniform routing of the same batch would run."""
        uniform = tiles(uniform_histogram(self.experts, self.top_k, self.tokens), block_m)
        return tiles(self.histogram, block_m) / uniform if uniform else 1.0


@dataclass(frozen=True)
class Routing:
    """Uniform (no batches), or a recorded run's batches."""

    batches: tuple[RecordedBatch, ...] = ()
    source: str = "uniform routing"

    def __post_init__(self):
        object.__setattr__(self, "batches", tuple(sorted(self.batches, key=lambda b: b.tokens)))

    @classmethod
    def from_profile(cls, entry: dict, source: str) -> "Routing":
        """The profile entry plan_routing.py writes: {experts, top_k, batches: [[tokens, [[rows, experts], ...]], ...]}."""
        batches = tuple(
            RecordedBatch(int(tokens), int(entry["experts"]), int(entry["top_k"]), tuple((int(r), float(n)) for r, n in hist))
            for tokens, hist in entry["batches"]
        )
        return cls(batches, source)

    def scale(self, tokens: float, block_m: float = math.inf) -> float:
        """What the experts term takes at `tokens` per step relative to uniform routing: the recorded tile ratio,
        interpolated in log2(tokens) between recorded batches; 1 (uniform) outside them, which the record does not
        describe."""
        xs = [b.tokens for b in self.batches]
        if not xs or tokens < xs[0] or tokens > xs[-1]:
            return 1.0
        i = bisect.bisect_left(xs, tokens)
        if xs[i] == tokens:
            return self.batches[i].tile_ratio(block_m)
        r0, r1 = self.batches[i - 1].tile_ratio(block_m), self.batches[i].tile_ratio(block_m)
        t = (math.log2(tokens) - math.log2(xs[i - 1])) / (math.log2(xs[i]) - math.log2(xs[i - 1]))
        return r0 + t * (r1 - r0)


UNIFORM = Routing()


def routing_for(profile, arch: str) -> Routing:
    """The routing recorded for `arch`'s dummy-weight runs in `profile` (entry routing_<arch>), else uniform."""
    key = f"routing_{arch}"
    if key not in profile.values:
        return UNIFORM
    return Routing.from_profile(profile.values[key], profile.sources[key])


def block_m(profile, kernel: str, rows_per_expert: float) -> float:
    """BLOCK_M of the tile `kernel` runs at this many rows per expert: the profile's `<kernel>_block_m` table
    ([[rows per expert, BLOCK_M]], nearest in log2 as the kernel picks it), else inf (one tile per hit expert)."""
    points = profile.values.get(f"{kernel}_block_m")
    if not points:
        return math.inf
    target = math.log2(max(rows_per_expert, 1e-6))
    return float(min(points, key=lambda p: (abs(math.log2(p[0]) - target), -p[0]))[1])  # ties to the larger
