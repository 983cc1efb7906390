"""The fixed costs of one dispatcher's dispatch + combine on one GPU: the inputs `moeplex plan` lacks for deepep-ll.

ep_multi_gpu_h200x2.md measures deepep-ll at EP2 (128 tokens per rank, identity experts) as one wall time from
an idle GPU; `moeplex plan` has a rate for the bytes that cross NVLink (the normal kernels' measured 128 GB/s) but
no measurement of what the low-latency kernels cost besides their bytes, nor of the host's share of bare calls.
This script measures both on ONE GPU (one EP rank: every pair stays local, so the kernels' time is their fixed
cost plus a local copy at HBM speed):

- GPU µs of dispatch and of combine, timed with CUDA events while the host runs ahead of a GPU held busy by a
  sleep kernel, so no launch gap enters (the kernels alone), less a plain copy of the pairs' rows timed the same
  way (over several ranks the model prices the bytes by themselves: the rest is the kernels' fixed cost);
- wall µs of dispatch + combine from an idle GPU, synchronized before and after (as ep_multi_gpu.py times a
  layer); wall less the kernels is the host's exposed share of bare calls.

Median of --runs rounds of --iters each, with the spread. Writes the profile entries `deepep_ll_kernel_us` and
`deepep_ll_call_host_us` (`moeplex plan profile-update` merges them; costs.deepep_ll_us reads them).

    python benchmarks/plan_dispatch.py --out OUT/plan_dispatch_h200.md --measured-out OUT/plan_dispatch_h200.json
    python benchmarks/plan_dispatch.py --device cpu --dispatcher local --hidden 256 --experts 16 --tokens 8   # CI-sized
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from report import emit, processor

from moeplex.interfaces import ExpertOutput, MoEContext, StandardLayout
from moeplex.registry import lookup


def identity(layout) -> ExpertOutput:
    """What identity experts hand back: the received rows (as ep_multi_gpu.py's IdentityExperts, bf16 payloads)."""
    if isinstance(layout, StandardLayout):
        return ExpertOutput(layout.hidden, weights_applied=True, summed=True)
    return ExpertOutput(layout.hidden, weights_applied=False, summed=False)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wall_us(layer, device: torch.device, iters: int) -> float:
    """Median wall µs of one dispatch + combine from an idle, synchronized GPU."""
    times = []
    for _ in range(iters):
        sync(device)
        start = time.perf_counter()
        layer()
        sync(device)
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def kernel_us(dispatcher, x, ids, weights, device: torch.device, iters: int) -> tuple[float, float]:
    """(dispatch, combine) GPU µs with the host ahead of the GPU: a sleep kernel holds the stream while the host
    queues the layer, so the events measure kernels back to back. CPU: wall time of each half."""
    dispatch, combine = [], []
    for _ in range(iters):
        if device.type == "cuda":
            sync(device)
            marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            torch.cuda._sleep(2_000_000)  # ~1 ms at H200 clocks: longer than the host needs to queue one layer
            marks[0].record()
            done = dispatcher.dispatch(x, ids, weights)
            marks[1].record()
            dispatcher.combine(identity(done.layout), done.handle)
            marks[2].record()
            sync(device)
            dispatch.append(marks[0].elapsed_time(marks[1]) * 1e3)
            combine.append(marks[1].elapsed_time(marks[2]) * 1e3)
        else:
            start = time.perf_counter()
            done = dispatcher.dispatch(x, ids, weights)
            middle = time.perf_counter()
            dispatcher.combine(identity(done.layout), done.handle)
            dispatch.append((middle - start) * 1e6)
            combine.append((time.perf_counter() - middle) * 1e6)
    return statistics.median(dispatch), statistics.median(combine)


def copy_us(rows: int, hidden: int, device: torch.device, iters: int) -> float:
    """GPU µs of one copy of `rows` bf16 rows at HBM speed (the host ahead, as kernel_us): what the one-rank
    kernels spend moving their pairs' bytes, all of them local. CPU: wall time."""
    src = torch.randn(rows, hidden, device=device).to(torch.bfloat16)
    dst = torch.empty_like(src)
    times = []
    for _ in range(iters):
        sync(device)
        if device.type == "cuda":
            marks = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            torch.cuda._sleep(1_000_000)
            marks[0].record()
            dst.copy_(src)
            marks[1].record()
            sync(device)
            times.append(marks[0].elapsed_time(marks[1]) * 1e3)
        else:
            start = time.perf_counter()
            dst.copy_(src)
            times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dispatcher", default="deepep-ll", help="a single-rank dispatcher (default: deepep-ll)")
    ap.add_argument("--hidden", type=int, default=7168, help="DeepSeek-V3's hidden size (default: 7168)")
    ap.add_argument("--experts", type=int, default=256, help="experts (default: 256)")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128, help="tokens per rank (default: 128, as ep_multi_gpu_h200x2.md)")
    ap.add_argument("--iters", type=int, default=20, help="layers per round (default: 20)")
    ap.add_argument("--runs", type=int, default=3, help="rounds; the table gives their median and spread (default: 3)")
    ap.add_argument("--out", help="also write the Markdown here")
    ap.add_argument("--measured-out", help="write the profile entries (moeplex plan profile-update) here")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":  # a bare "cuda" has no index, which set_device (and DeepEP's buffers) need
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        torch.cuda.set_device(device)
    gen = torch.Generator().manual_seed(0)  # uniform routing, as ep_multi_gpu.py
    ids = torch.rand(args.tokens, args.experts, generator=gen).argsort(dim=1)[:, : args.top_k].to(device)
    weights = torch.rand(args.tokens, args.top_k, generator=gen).to(device)
    x = torch.randn(args.tokens, args.hidden, generator=gen).to(device, torch.bfloat16)
    ctx = MoEContext(args.hidden, args.hidden, args.experts, args.top_k, torch.bfloat16, device, max_tokens_per_rank=args.tokens)
    dispatcher = lookup("dispatcher", args.dispatcher)(ctx)

    def layer():
        done = dispatcher.dispatch(x, ids, weights)
        return dispatcher.combine(identity(done.layout), done.handle)

    for _ in range(5):  # warm-up: buffers, JIT, first-call costs
        layer()
    rounds = []
    for _ in range(args.runs):
        d, c = kernel_us(dispatcher, x, ids, weights, device, args.iters)
        rounds.append((d, c, wall_us(layer, device, args.iters), copy_us(args.tokens * args.top_k, args.hidden, device, args.iters)))
    med = [statistics.median(r[i] for r in rounds) for i in range(4)]
    spread = [max(r[i] for r in rounds) - min(r[i] for r in rounds) for i in range(4)]
    host = max(med[2] - med[0] - med[1], 0.0)
    # each half moves every pair's row once, here all of them inside the GPU; over several ranks the local share
    # moves at HBM speed beside the remote one, which the model prices by itself: the fixed cost is the rest
    fixed = [max(med[i] - med[3], 0.0) for i in range(2)]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else processor()
    lines = [f"## {args.dispatcher} on one rank, {args.tokens} tokens, hidden {args.hidden}, top-{args.top_k} of {args.experts} "
             f"(bf16 rows, identity experts; {name}, torch {torch.__version__})", "",
             f"Median of {args.runs} rounds of {args.iters} layers (spread: max - min over the rounds).", "",
             "| part | µs | spread |", "|---|---:|---:|",
             f"| dispatch kernels (host ahead) | {med[0]:.1f} | {spread[0]:.1f} |",
             f"| combine kernels (host ahead) | {med[1]:.1f} | {spread[1]:.1f} |",
             f"| dispatch + combine, wall from an idle GPU | {med[2]:.1f} | {spread[2]:.1f} |",
             f"| ratio wall / kernels | {med[2] / max(med[0] + med[1], 1e-9):.2f}x | |",
             f"| host's exposed share (wall - kernels) | {host:.1f} | |",
             f"| copy of the {args.tokens * args.top_k} pairs' rows at HBM speed | {med[3]:.1f} | {spread[3]:.1f} |",
             f"| fixed cost besides the bytes (kernels - copy): dispatch, combine | {fixed[0]:.1f}, {fixed[1]:.1f} | |"]
    emit("\n".join(lines), args.out)
    if args.measured_out:
        command = (f"python benchmarks/plan_dispatch.py --dispatcher {args.dispatcher} --tokens {args.tokens} "
                   f"--hidden {args.hidden} --experts {args.experts} ({name}, one rank)")
        prefix = args.dispatcher.replace("-", "_")  # deepep-ll -> deepep_ll_kernel_us, the key the model reads
        entries = {
            f"{prefix}_kernel_us": {"value": [round(fixed[0], 2), round(fixed[1], 2)], "unit": "[dispatch µs, combine µs]",
                                    "source": f"{command}: kernels of one rank at {args.tokens} tokens (every pair local), "
                                              f"host ahead of the GPU ({med[0]:.1f}, {med[1]:.1f}), less a copy of the "
                                              f"pairs' rows ({med[3]:.1f}): the low-latency kernels' cost besides their bytes"},
            f"{prefix}_call_host_us": {"value": round(host, 2),
                                       "source": f"{command}: wall of dispatch + combine from an idle GPU less their kernels "
                                                 "(the host's exposed share of two bare low-latency calls)"},
        }
        with open(args.measured_out, "w") as f:
            json.dump(entries, f, indent=1, ensure_ascii=False)


if __name__ == "__main__":
    main()
