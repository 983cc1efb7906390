"""Launch costs `moeplex plan` prices: a replayed CUDA graph's time per node beyond its kernel, and an eager launch's host time.

A graph of `--kernels` kernels is replayed; its time per node minus the kernels' own device time (from the
profiler) is the gap between consecutive graph nodes. Two kinds of kernel: a tiny one (one block, ~1 µs), and a
copy of `--copy-mib` MiB that fills every SM, as a model step's memory-bound kernels do. A full-grid kernel must
drain before the next one's blocks start, and that drain and fill is part of the gap a real step pays (a graph of
tiny kernels hides it), so --profile-out writes the full-grid gap as `graph_gap_us` (a candidate: a real step's
kernels of different grids gap longer still, docs/plan.md). The tiny kernels launched
eagerly from Python give the host's cost of one bare launch (a floor under the profile's `eager_host_us`, which
is a whole model's eager launch with its module overhead). Median (min-max) of --runs.

    python benchmarks/plan_launch.py --out OUT/plan_launch_h200.md --profile-in OUT/h200_measured.json --profile-out OUT/h200_measured.json
    python benchmarks/plan_launch.py --device cpu --kernels 50 --runs 2      # CI-sized: the eager part only
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from report import emit, processor


def eager_us(x: torch.Tensor, kernels: int) -> float:
    """Host µs per launch of `kernels` tiny kernels issued back to back (the GPU work of each is shorter)."""
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(kernels):
        x.add_(1)
    sync()
    return (time.perf_counter() - start) * 1e6 / kernels


def graph_us(kernel, kernels: int) -> tuple[float, float | None]:
    """(µs per node of a replayed graph of `kernels` calls of `kernel`, their own device µs per kernel or None)."""
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        kernel()  # warm-up outside the capture
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(kernels):
                kernel()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    per_node = start.elapsed_time(end) * 1e3 / kernels
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    # the replay holds only our kernels: every device-side event is one of them
    device = [e.device_time for e in prof.events() if e.device_type.name == "CUDA"]
    if len(device) < kernels // 2:  # the profiler did not see the graph's kernels: no gap can be read
        return per_node, None
    return per_node, sum(device) / len(device)


def graph_rows(lines: list[str], name: str, kernel, args) -> list[float]:
    """Append the replayed graph's rows for one kind of kernel; its gaps between nodes (empty where not read)."""
    try:
        graphs = [graph_us(kernel, args.kernels) for _ in range(args.runs)]
    except RuntimeError as err:  # a profiler without CUPTI, say: the table still says what was measured
        lines.append(f"| replayed graph of {name}s | failed: {str(err).splitlines()[0][:120]} |")
        return []
    lines.append(f"| replayed graph of {name}s, time per node | {spread([g[0] for g in graphs])} |")
    if not all(g[1] is not None for g in graphs):
        lines.append(f"| replayed graph of {name}s, gap between nodes | not read: the profiler saw no kernels of the replay |")
        return []
    lines.append(f"| replayed graph of {name}s, the kernel itself (profiler) | {spread([g[1] for g in graphs])} |")
    gaps = [g[0] - g[1] for g in graphs]
    lines.append(f"| replayed graph of {name}s, gap between nodes | {spread(gaps)} |")
    return gaps


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--kernels", type=int, default=2000, help="graph nodes (kernels) per timed run")
    ap.add_argument("--copy-mib", type=float, default=4.0, help="bytes each full-grid copy kernel reads, MiB")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", help="also write the table here")
    ap.add_argument("--profile-in", help="a profile JSON to copy (default: the shipped h200.json)")
    ap.add_argument("--profile-out", help="write the profile with this run's graph_gap_us")
    args = ap.parse_args()
    x = torch.zeros(1, device=args.device)
    eager_us(x, 10)  # first launches: allocation, kernel loading
    eager = [eager_us(x, args.kernels) for _ in range(args.runs)]
    lines = [
        f"## Launch costs ({processor()}, torch {torch.__version__})",
        "",
        f"Command: `python benchmarks/plan_launch.py {' '.join(sys.argv[1:])}`; {args.kernels} kernels a run, median (min-max) of {args.runs} runs.",
        "",
        "| measurement | µs per launch |",
        "|---|---:|",
        f"| eager launch from Python, host (bare `add_`) | {spread(eager)} |",
    ]
    gaps: list[float] = []
    if args.device == "cuda":
        src = torch.zeros(int(args.copy_mib * 2**18), device=args.device)
        dst = torch.empty_like(src)
        graph_rows(lines, "tiny kernel", lambda: x.add_(1), args)
        gaps = graph_rows(lines, f"full-grid copy of {args.copy_mib:g} MiB", lambda: dst.copy_(src), args)
    else:
        lines.append("| replayed graph | skipped: needs CUDA |")
    emit("\n".join(lines), args.out)
    if args.profile_out and gaps:
        write_profile(args, statistics.median(gaps))


def write_profile(args, gap: float) -> None:
    from importlib import resources

    if args.profile_in:
        with open(args.profile_in) as f:
            data = json.load(f)
    else:
        data = json.loads(resources.files("moeplex.plan").joinpath("profiles", "h200.json").read_text())
    command = "python benchmarks/plan_launch.py " + " ".join(sys.argv[1:])
    data["graph_gap_us"] = {"value": round(gap, 3), "source": f"{command} ({processor()}, {time.strftime('%Y-%m-%d')}): replayed graph of full-grid copy kernels ({args.copy_mib:g} MiB each), time per node less the kernel's own device time"}
    with open(args.profile_out, "w") as f:
        json.dump(data, f, indent=1, ensure_ascii=False)
    print(f"wrote {args.profile_out}")


if __name__ == "__main__":
    main()
