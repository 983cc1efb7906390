"""The adaptive draft policy on the host alone: one request at a time, drafts accepted at a fixed rate per position.

    .venv/bin/python benchmarks/spec_policy_sim.py --costs 12.31 13.75 15.91 18.75 20.33 --acceptance 0.8

Drives core/speculation/policy.py's AdaptivePolicy as the engine does at batch 1 (choose, offered, record), with a
cost table given in ms (plain step, then verify steps of 0 .. steps drafts: what an engine logs at start-up as
"speculative step costs of 1 requests") and draft k accepted with --acceptance given drafts 1..k-1 were (a Bernoulli
per position, seeded). Prints the plain and verify steps taken and the rate against plain decoding the table gives
(no breaks, no host time: what the policy's choices are worth under its own cost model). Session 13 used it to find
why nextn's adaptive policy verified 59 steps of 135 where the fixed policy verified 84 of 93 (spec_runs_s13.md).
"""

from __future__ import annotations

import argparse
import random

from moeplex.speculation.costs import StepCosts
from moeplex.speculation.policy import AdaptivePolicy


class Request:
    def __init__(self, rid: str):
        self.rid, self.output_ids = rid, [0]


def simulate(costs_ms: list[float], acceptance: float, requests: int, tokens: int, seed: int) -> tuple[int, int, float]:
    """(plain steps, verify steps, tokens per second against plain decoding's)."""
    table = [c / 1e3 for c in costs_ms]
    steps = len(table) - 2
    policy = AdaptivePolicy(steps, StepCosts([1], lambda n: table))
    rng = random.Random(seed)
    plain = verify = emitted = 0
    seconds = 0.0
    for i in range(requests):
        request = Request(f"r{i}")
        while len(request.output_ids) < tokens:
            count = policy.choose([request], [steps], expect_offers=True)[0]
            if count:
                verify += 1
                policy.offered(request, True)
                accepted = 0
                while accepted < count and rng.random() < acceptance:
                    accepted += 1
                policy.record(request, count, accepted)
                request.output_ids += [0] * (accepted + 1)
                seconds += table[count + 1]
            else:
                plain += 1
                request.output_ids.append(0)
                seconds += table[0]
        emitted += len(request.output_ids)
        policy.finished(request.rid)
    return plain, verify, emitted / seconds * table[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--costs", type=float, nargs="+", required=True,
                        help="ms: a plain step, then verify steps of 0, 1, ... drafts (their count sets the steps)")
    parser.add_argument("--acceptance", type=float, nargs="+", default=[0.0, 0.33, 0.6, 0.8])
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64, help="tokens per request (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print("| acceptance | plain steps | verify steps | rate against plain decoding |")
    print("|---:|---:|---:|---:|")
    for rate in args.acceptance:
        plain, verify, ratio = simulate(args.costs, rate, args.requests, args.tokens, args.seed)
        print(f"| {rate} | {plain} | {verify} | {ratio:.3f} |")


if __name__ == "__main__":
    main()
