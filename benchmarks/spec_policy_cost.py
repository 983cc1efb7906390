"""Host microseconds of the adaptive draft policy's choice per step, without an engine (quieter than a step).

    .venv/bin/python benchmarks/spec_policy_cost.py [--out FILE]

AdaptivePolicy.choose for a batch of n decoding requests (n = 1, 8, 32), each with a record of a few verifies,
on a cost model where drafts pay at batch 1 and 8 and no draft can pay at 32 (the CPU's shape: a verify row costs
what a decode row does there), in three regimes: drafts that pay ("drafting"), records so poor that nothing does
("nothing pays", the adversary), and the choice before the drafter is asked (expect_offers). Best of 7 repeats
of 2000 calls each (other work only adds time). Run it against an older tree with PYTHONPATH to compare.
"""

from __future__ import annotations

import argparse
import timeit

from report import emit, processor

from moeplex.request import Request
from moeplex.sampling import SamplingParams
from moeplex.speculation.costs import StepCosts, grid_sizes
from moeplex.speculation.policy import AdaptivePolicy

STEPS = 3


def cpu_like(n: int) -> list[float]:
    """ms of [plain, verify x1..x4] for n requests, shaped like the CPU's measured tables: a verify row costs
    0.12 ms up to 8 requests and 0.25 ms beyond (where it costs more than the plain step's share of a request)."""
    plain = 1.9 + 0.06 * n
    per_row = 0.12 if n <= 8 else 0.25
    return [plain] + [plain + 0.05 + per_row * n * (k - 1) for k in range(1, STEPS + 2)]


def batch(policy: AdaptivePolicy, n: int, accepted: int) -> list[Request]:
    requests = []
    for i in range(n):
        r = Request(f"{n}-{accepted}-{i}", [1, 2, 3], SamplingParams(max_new_tokens=1000))
        r.output_ids.extend([5] * 4)
        for _ in range(4):
            policy.record(r, STEPS, accepted)
            policy.offered(r, True)
        requests.append(r)
    return requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args()
    lines = [f"{processor()}; AdaptivePolicy.choose, microseconds per call (best of 7 x 2000)", "",
             "| requests | regime | choice | us per call |", "|---:|---|---|---:|"]
    for n in (1, 8, 32):
        for regime, accepted, offers in (("drafting", STEPS, False), ("nothing pays", 0, False),
                                         ("before asking", STEPS, True)):
            policy = AdaptivePolicy(STEPS, StepCosts(grid_sizes(64), cpu_like))
            requests, rooms = batch(policy, n, accepted), [STEPS] * n
            choice = policy.choose(requests, rooms, expect_offers=offers)
            best = min(timeit.repeat(lambda: policy.choose(requests, rooms, expect_offers=offers), number=2000,
                                     repeat=7)) / 2000
            drafts = f"{sum(choice)} drafts" if any(choice) else "none"
            lines.append(f"| {n} | {regime} | {drafts} | {best * 1e6:.1f} |")
            print(lines[-1], flush=True)
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
