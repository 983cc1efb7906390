"""moeplex at two commits on the same machine, alternating runs of offline_throughput.py (3 per model).

    git worktree add /tmp/before 694742b && (cd /tmp/before && bash scripts/setup.sh)
    python benchmarks/cpu_before_after.py /tmp/before . [THREADS]

The checkpoints are those of results/cpu_throughput.md (/tmp/cpubench/{qwen3,mixtral,dsv3}); each tree runs with its
own venv (TREE/.venv). Prints every run with the load average, then a row per model with the medians and the ratio.
"""

import os
import statistics
import subprocess
import sys

models = [("qwen3", "/tmp/cpubench/qwen3", "fp32"), ("mixtral", "/tmp/cpubench/mixtral", "fp32"), ("dsv3", "/tmp/cpubench/dsv3", "bf16")]
trees = {"before": os.path.abspath(sys.argv[1]), "after": os.path.abspath(sys.argv[2])}
threads = sys.argv[3] if len(sys.argv) > 3 else "1"
for name, folder, dtype in models:
    rates = {k: [] for k in trees}
    for run in range(3):
        for label, tree in trees.items():
            out = subprocess.run([f"{tree}/.venv/bin/python", f"{tree}/benchmarks/offline_throughput.py", "--model", folder,
                                  "--num-requests", "48", "--skip-transformers", "--threads", threads, "--dtype", dtype],
                                 capture_output=True, text=True, check=True).stdout
            rows = [l for l in out.splitlines() if l.startswith("| ") and not l.startswith(("| preset", "|---"))]
            rates[label].append(float(rows[-1].split("|")[2]))
            print(name, label, run + 1, rates[label][-1], f"load {os.getloadavg()[0]:.1f}", flush=True)
    b, a = rates["before"], rates["after"]
    print(f"| {name} | {dtype} | {', '.join(map(str, b))} ({statistics.median(b)}) | {', '.join(map(str, a))} ({statistics.median(a)}) | {statistics.median(a)/statistics.median(b):.2f}x |", flush=True)
