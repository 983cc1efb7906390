"""What the two device-side parts of a speculative step cost, against the host paths they replace (issue 32).

- draft: the ngram drafter at a steady batch, each request's history growing by `--accepted` tokens a step. The
  reference is the host drafter (`propose`: a numpy suffix match per request, drafts as lists); the device path is
  `propose_on_device` with the step's tokens still pending on the device (DeviceTokens), the drafts left there.
- accept: greedy acceptance of one verify step of `--steps` drafts per request over a `--vocab` wide vocabulary. The
  reference is the host rule (one argmax read back, accept_greedy per request); the device path is accept.py
  (every row drawn, the drafts kept on the [requests, steps + 1] grid), left on the device.

For each, "host ms" is what the calling thread spends (on a GPU the device path only enqueues: this is what the
overlap schedule would hide or save), "wall ms" waits for the device as well. Each of `--runs` runs times
`--iters` steps after `--warmup`; the table gives the median over runs and the spread (max - min).

    python benchmarks/spec_device_parts.py --device cuda --batches 1 8 32 64 --runs 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from moeplex.interfaces import DeviceTokens, DraftRequest, DrafterContext  # noqa: E402
from moeplex.plugins.drafters.ngram import NgramDrafter  # noqa: E402
from moeplex.request import Request  # noqa: E402
from moeplex.sampling import SamplingParams  # noqa: E402
from moeplex.speculation.verify import accept_greedy, accept_on_device  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, iters: int, warmup: int) -> tuple[float, float]:
    """(host ms, wall ms) per call, averaged over `iters` calls."""
    for _ in range(warmup):
        fn()
    sync(device)
    host, start = 0.0, time.perf_counter()
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        host += time.perf_counter() - t0
    sync(device)
    return 1e3 * host / iters, 1e3 * (time.perf_counter() - start) / iters


class NgramSteps:
    """A steady batch for the ngram drafter: repetitive histories (a phrase of 40 tokens with a mutation every
    13th token), each step adding `accepted` tokens per request; the device drafter sees them as pending."""

    def __init__(self, batch: int, history: int, steps: int, accepted: int, device: torch.device, on_device: bool):
        gen = torch.Generator().manual_seed(batch)
        phrase = torch.randint(0, 1000, (40,), generator=gen).tolist()
        self.ids = [[phrase[i % 40] if i % 13 else 1000 + r for i in range(history)] for r in range(batch)]
        self.phrase, self.accepted, self.device, self.on_device = phrase, accepted, device, on_device
        self.phrase_dev = torch.tensor(phrase, device=device)
        self.lengths = torch.full((batch,), history, device=device)
        self.steps = torch.arange(accepted, device=device)
        self.counts = torch.full((batch,), accepted, device=device)
        self.drafter = NgramDrafter(steps)
        self.drafter.bind(DrafterContext(model=None, kv=None, config=None, device=device))

    def __call__(self):
        requests = [DraftRequest(str(r), ids, len(ids) - 1) for r, ids in enumerate(self.ids)]
        new = [[self.phrase[(len(ids) + j) % 40] for j in range(self.accepted)] for ids in self.ids]
        if self.on_device:  # the step's tokens, made on the device as an acceptance would leave them
            tokens = self.phrase_dev[(self.lengths[:, None] + self.steps[None, :]) % 40]
            self.drafter.propose_on_device(requests, DeviceTokens(tokens, self.counts))
            self.lengths += self.accepted
        else:
            self.drafter.propose([DraftRequest(r.rid, r.token_ids + n, len(r.token_ids) + len(n) - 1)
                                  for r, n in zip(requests, new)])
        for ids, n in zip(self.ids, new):
            ids += n


class AcceptStep:
    """One greedy verify step: logits whose argmax agrees with the drafts for a random run of each request."""

    def __init__(self, batch: int, steps: int, vocab: int, device: torch.device, on_device: bool):
        gen = torch.Generator().manual_seed(batch)
        self.drafts = [torch.randint(0, vocab, (steps,), generator=gen).tolist() for _ in range(batch)]
        logits = torch.randn(batch * (steps + 1), vocab, generator=gen)
        for r, draft in enumerate(self.drafts):
            for k in range(int(torch.randint(0, steps + 1, (1,), generator=gen))):
                logits[r * (steps + 1) + k, draft[k]] += 10.0
        self.logits = logits.to(device)
        self.requests = [Request(str(r), [1], SamplingParams(temperature=0.0)) for r in range(batch)]
        self.starts = [r * (steps + 1) for r in range(batch)]
        self.on_device = on_device

    def __call__(self):
        if self.on_device:  # left on the device, as the next step's input would read it (read one step later)
            return accept_on_device(self.logits, self.requests, self.drafts, self.starts)
        best = torch.argmax(self.logits, dim=-1)
        finite = torch.isfinite(self.logits.gather(-1, best[:, None])[:, 0])
        both = torch.stack([best, finite.to(best.dtype)]).tolist()
        width = len(self.drafts[0]) + 1
        return [accept_greedy(d, both[0][s : s + width], both[1][s : s + width]) for d, s in zip(self.drafts, self.starts)]


def measure(make, device, args) -> tuple[list[float], list[float]]:
    host, wall = [], []
    for _ in range(args.runs):
        h, w = timed(make(), device, args.iters, args.warmup)
        host.append(h)
        wall.append(w)
    return host, wall


def cell(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({max(values) - min(values):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--steps", type=int, default=3, help="drafts per request (default: %(default)s)")
    parser.add_argument("--history", type=int, default=1024, help="tokens per request's history (default: %(default)s)")
    parser.add_argument("--accepted", type=int, default=2, help="tokens each step adds per request (default: %(default)s)")
    parser.add_argument("--vocab", type=int, default=32000, help="verify logits' width (default: %(default)s)")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="CPU: torch threads (default: %(default)s)")
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    lines = [f"device {args.device}, {args.steps} drafts, history {args.history} tokens (+{args.accepted} a step), "
             f"vocab {args.vocab}; {args.runs} runs x {args.iters} steps, median (spread) ms per step", "",
             "| part | batch | host path: host ms | host path: wall ms | device path: host ms | device path: wall ms "
             "| wall ratio (host / device) |", "|---|---|---|---|---|---|---|"]
    for batch in args.batches:
        parts = {
            "draft": (lambda on: lambda: NgramSteps(batch, args.history, args.steps, args.accepted, device, on)),
            "accept": (lambda on: lambda: AcceptStep(batch, args.steps, args.vocab, device, on)),
        }
        for part, make in parts.items():
            ref_host, ref_wall = measure(make(False), device, args)
            dev_host, dev_wall = measure(make(True), device, args)
            ratio = statistics.median(ref_wall) / statistics.median(dev_wall)
            lines.append(f"| {part} | {batch} | {cell(ref_host)} | {cell(ref_wall)} | {cell(dev_host)} | {cell(dev_wall)} "
                         f"| {ratio:.2f}x |")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
