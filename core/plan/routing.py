"""How a step's (token, expert) pairs spread over experts: uniform routing, or a recorded run's distinct experts.

The routed-experts term reads one time per expert a step hits (costs.experts_us). Uniform routing of B tokens,
each choosing k distinct experts of E, hits E (1 - (1 - k/E)^B). A real router does not route uniformly, and
neither does the dummy (random-weight) model our one-GPU tables were measured with: its random correction bias,
grouped top-k and greedy tokens that grow alike concentrate a batch on fewer experts. `Routing` carries what a
recorded run hit (benchmarks/plan_routing.py: the mean distinct experts per decode step and MoE layer, at each
batch) as a ratio to uniform routing, which the model applies to the experts a step hits.
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


@dataclass(frozen=True)
class Routing:
    """Uniform (no points), or a recorded run's (tokens per step, mean distinct experts, uniform expectation)."""

    points: tuple[tuple[float, float, float], ...] = ()
    source: str = "uniform routing"

    def __post_init__(self):
        object.__setattr__(self, "points", tuple(sorted((float(t), float(d), float(u)) for t, d, u in self.points)))

    @classmethod
    def from_profile(cls, entry: list, source: str) -> "Routing":
        return cls(tuple(tuple(point) for point in entry), source)

    def hit_ratio(self, tokens: float) -> float:
        """Distinct experts hit, recorded over uniform, at `tokens` per step: interpolated in log2(tokens) between
        recorded batches, held at the ends (1 for uniform routing)."""
        if not self.points:
            return 1.0
        xs = [t for t, _, _ in self.points]
        ratios = [d / u for _, d, u in self.points]
        if tokens <= xs[0]:
            return ratios[0]
        if tokens >= xs[-1]:
            return ratios[-1]
        i = bisect.bisect_right(xs, tokens)
        t = (math.log2(tokens) - math.log2(xs[i - 1])) / (math.log2(xs[i]) - math.log2(xs[i - 1]))
        return ratios[i - 1] + t * (ratios[i] - ratios[i - 1])


UNIFORM = Routing()


def routing_for(profile, arch: str) -> Routing:
    """The routing recorded for `arch`'s dummy-weight runs in `profile` (key routing_<arch>), else uniform."""
    key = f"routing_{arch}"
    if key not in profile.values:
        return UNIFORM
    return Routing.from_profile(profile.values[key], profile.sources[key])
