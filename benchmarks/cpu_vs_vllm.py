"""moeplex against vLLM's CPU build, offline, on the same checkpoints and workload (issue #22, target 6).

For each checkpoint the two engines run alternately (vLLM, moeplex, vLLM, ...; `--runs` each), each run a fresh
process: `vllm_cpu_reference.py` under vLLM's venv and `offline_throughput.py` here, both on
`mixed_workload(--num-requests)` (greedy, ignore_eos, every request its own output length). Prints per run the
tokens/s and the 1-minute load average at its start, then the medians, the ratio of the medians with the range
(lowest moeplex over highest vLLM, and the reverse), and how many requests the two engines decoded alike.

    python benchmarks/cpu_vs_vllm.py --vllm-python /tmp/vllm-bench/venv/bin/python \\
        --model qwen3=/tmp/cpubench/qwen3:fp32 --model dsv3=/tmp/cpubench/dsv3:bf16 --runs 3

vLLM runs eager with its default thread binding (its model on one OpenMP thread, its engine core on another
core); moeplex with `--threads` torch threads (default 1: see results/cpu_throughput.md).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from report import cpu_features, processor  # noqa: E402
VLLM_ROW = re.compile(r"^\| vllm-cpu \| \d+ \| \d+ \| [\d.]+ \| ([\d.]+) \|")


def run(command: list[str]) -> str:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


def moeplex_rate(model: str, dtype: str, args, ids: str) -> float:
    out = run([sys.executable, os.path.join(HERE, "offline_throughput.py"), "--model", model, "--num-requests",
               str(args.num_requests), "--skip-transformers", "--threads", str(args.threads), "--dtype", dtype,
               "--output-ids", ids])
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith(("| preset", "|---"))]
    return float(rows[-1].split("|")[2])


def vllm_rate(model: str, dtype: str, args, ids: str) -> float:
    out = run([args.vllm_python, os.path.join(HERE, "vllm_cpu_reference.py"), "--model", model, "--num-requests",
               str(args.num_requests), "--enforce-eager", "--dtype", dtype, "--output-ids", ids])
    for line in out.splitlines():
        match = VLLM_ROW.match(line)
        if match:
            return float(match.group(1))
    sys.exit(f"no result row from vLLM:\n{out[-2000:]}")


def outputs(path: str) -> list[list[int]]:
    with open(path) as f:
        return [json.loads(line)["output_ids"] for line in f]


def load() -> float:
    return os.getloadavg()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", required=True, help="python of the venv with vllm-cpu installed")
    parser.add_argument("--model", action="append", required=True, metavar="NAME=DIR:DTYPE",
                        help="a checkpoint to run, e.g. qwen3=/tmp/cpubench/qwen3:fp32 (repeatable)")
    parser.add_argument("--runs", type=int, default=3, help="runs of each engine per model (default: %(default)s)")
    parser.add_argument("--num-requests", type=int, default=48, help="requests of mixed_workload (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="moeplex's torch threads (default: %(default)s)")
    args = parser.parse_args()
    tmp = tempfile.mkdtemp(prefix="cpu-vs-vllm-")
    print(f"Processor: {processor().rsplit(',', 1)[0]} ({cpu_features()}); moeplex with {args.threads} torch "
          f"thread(s), vLLM with its default thread binding", flush=True)
    summary = ["| model | dtype | vLLM tok/s (median) | moeplex tok/s (median) | moeplex / vLLM | same output ids |",
               "|---|---|---|---|---|---|"]
    for spec in args.model:
        name, _, rest = spec.partition("=")
        folder, _, dtype = rest.rpartition(":")
        rates: dict[str, list[float]] = {"vllm": [], "moeplex": []}
        print(f"\n{name} ({folder}, {dtype}), {args.num_requests} requests\n\n| run | engine | load avg | tok/s |\n"
              "|---|---|---|---|", flush=True)
        for i in range(args.runs):
            for engine, measure in (("vllm", vllm_rate), ("moeplex", moeplex_rate)):
                at = load()
                rate = measure(folder, dtype, args, os.path.join(tmp, f"{name}-{engine}-{i}.jsonl"))
                rates[engine].append(rate)
                print(f"| {i + 1} | {engine} | {at:.1f} | {rate:.1f} |", flush=True)
        ours, theirs = outputs(os.path.join(tmp, f"{name}-moeplex-0.jsonl")), outputs(os.path.join(tmp, f"{name}-vllm-0.jsonl"))
        same = sum(a == b for a, b in zip(ours, theirs))
        v, m = rates["vllm"], rates["moeplex"]
        ratio = statistics.median(m) / statistics.median(v)
        cell = lambda r: f"{', '.join(f'{x:.1f}' for x in r)} ({statistics.median(r):.1f})"  # noqa: E731
        summary.append(f"| {name} | {dtype} | {cell(v)} | {cell(m)} | **{ratio:.2f}x** ({min(m) / max(v):.2f}-"
                       f"{max(m) / min(v):.2f}) | {same}/{len(ours)} requests |")
    print("\n" + "\n".join(summary))


if __name__ == "__main__":
    main()
