"""Prefix cache: the same workloads with the cache and with --disable-prefix-cache, in one process.

    .venv/bin/python benchmarks/prefix_cache.py --runs 3                                  CPU, qwen3_moe tiny
    .venv/bin/python benchmarks/prefix_cache.py --presets small --runs 3                  CPU, qwen3_moe small
    python benchmarks/prefix_cache.py --device cuda --runs 3 --out benchmarks/results/prefix_cache_h200.md
                                     H200: Qwen3-30B-A3B shapes (--layers of its 48, dummy weights) and tiny, bf16

Workloads (every output greedy with ignore_eos, so every setting does the same work):
- shared-prefix: like SGLang's generated-shared-prefix: groups x prompts per group, each prompt a long
  system prompt of its group and a short question, all submitted at once;
- multi-turn: clients x rounds, each round's prompt the whole conversation so far plus a new user turn
  (the clients of one round run as one batch, rounds one after another);
- no-reuse: random prompts that share nothing: the cost of the cache when it never hits.
Sizes default to a 2-core CPU, or with --device cuda to an H200 (larger groups, prompts and batches); every
size flag overrides either.

For each it prints tokens per second (prompt + output tokens processed, over wall time) with the cache under
each --policies schedule policy (fcfs, lpm) and without the cache, the median of --runs runs with min-max,
the ratio to the run without, the hit rate (cached prompt tokens / prompt tokens), and the time to first
token (from submission; p50 and p99 over the requests of a run, the median of the runs).
Every setting has one engine; its cache is flushed before each run, so every run starts cold. On CPU the
engines live together and the runs alternate (drift in a shared machine's load hits every setting alike);
on a GPU the engines run one after another, each deleted before the next (real shapes would not fit twice).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import tempfile
import time

import attrs
import torch

from workload import multi_turn_openings, no_reuse_prompts, shared_prefix_prompts, tokens

from moeplex.config import SCHEDULE_POLICIES, EngineConfig
from moeplex.engine import Engine
from moeplex.models.make_model import WEIGHTED_PRESETS, write_checkpoint
from moeplex.sampling import SamplingParams
from timing import sync

SIZES = {  # flag -> (CPU default, GPU default)
    "groups": (4, 8), "prompts_per_group": (8, 16), "system_len": (1024, 2048), "question_len": (32, 64),
    "output_len": (32, 128), "clients": (8, 16), "rounds": (6, 4), "max_running": (16, 128),
    "step_tokens": (2048, 8192), "chunk": (512, 4096),
}
NO_CACHE = "none"  # the setting without the cache


@attrs.frozen
class Run:
    tokens_per_s: float
    seconds: float
    hit_rate: float
    ttft_ms: list[float]  # one per request


def shared_prefix(engine: Engine, args, rng: random.Random) -> list:
    prompts = shared_prefix_prompts(args.groups, args.prompts_per_group, args.system_len, args.question_len, rng)
    return [(prompts, engine.generate(prompts, params(args), progress=False))]


def multi_turn(engine: Engine, args, rng: random.Random) -> list:
    conversations = multi_turn_openings(args.clients, args.question_len + 1, rng)
    rounds = []
    for _ in range(args.rounds):
        done = engine.generate(conversations, params(args), progress=False)
        rounds.append((conversations, done))
        conversations = [c + r.output_ids + tokens(rng, args.question_len) for c, r in zip(conversations, done)]
    return rounds


def no_reuse(engine: Engine, args, rng: random.Random) -> list:
    prompts = no_reuse_prompts(args.groups * args.prompts_per_group, args.system_len + args.question_len, rng)
    return [(prompts, engine.generate(prompts, params(args), progress=False))]


WORKLOADS = {"shared-prefix": shared_prefix, "multi-turn": multi_turn, "no-reuse": no_reuse}


def params(args) -> SamplingParams:
    return SamplingParams(max_new_tokens=args.output_len, temperature=0.0, ignore_eos=True)



def kv_tokens(args) -> int:
    """Enough KV for every workload's requests at once without the cache, so both settings batch alike."""
    per_request = args.system_len + args.question_len + args.output_len
    conversation = args.rounds * (args.question_len + args.output_len) + 1
    return max(args.groups * args.prompts_per_group * per_request, args.clients * conversation) + 64 * 16


def engine_for(folder: str, args, setting: str, dummy: bool) -> Engine:
    return Engine(EngineConfig(
        model=folder, device=args.device, dtype=args.dtype, show_progress=False, max_total_tokens=args.kv_tokens,
        page_size=16, max_running_requests=args.max_running, max_batched_tokens=args.step_tokens,
        chunked_prefill_size=args.chunk, disable_prefix_cache=setting == NO_CACHE,
        schedule_policy="fcfs" if setting == NO_CACHE else setting, load_format="dummy" if dummy else "auto",
        **({"cuda_graph_max_bs": args.max_running} if args.device.startswith("cuda") else {}),
    ))


def measure(engine: Engine, workload, args, seed: int) -> Run:
    """One run from a cold cache."""
    engine.reset_prefix_cache()
    sync(args.device)
    start = time.perf_counter()
    rounds = workload(engine, args, random.Random(seed))
    sync(args.device)
    seconds = time.perf_counter() - start
    prompt_tokens = sum(len(p) for prompts, _ in rounds for p in prompts)
    done = [r for _, requests in rounds for r in requests]
    processed = prompt_tokens + sum(len(r.output_ids) for r in done)
    ttft = [(r.first_token_time - r.arrival_time) * 1e3 for r in done]
    return Run(processed / seconds, seconds, sum(r.cached_tokens for r in done) / prompt_tokens, ttft)


def runs_of(folder: str, workload, args, dummy: bool) -> dict[str, list[Run]]:
    """--runs runs of every setting (each policy with the cache, then none), after a warm-up run per engine."""
    settings = [*args.policies, NO_CACHE]
    runs: dict[str, list[Run]] = {s: [] for s in settings}

    def warmed(setting: str) -> Engine:
        engine = engine_for(folder, args, setting, dummy)
        measure(engine, workload, args, seed=args.seed + 1)  # allocator, kernels, graphs; other prompts than timed
        return engine

    if args.device == "cpu":
        engines = {s: warmed(s) for s in settings}
        for _ in range(args.runs):
            for setting in settings:
                runs[setting].append(measure(engines[setting], workload, args, args.seed))
        return runs
    for setting in settings:
        engine = warmed(setting)
        runs[setting] = [measure(engine, workload, args, args.seed) for _ in range(args.runs)]
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    return runs


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(values: list[float], fmt: str = ".0f") -> str:
    return f"{format(statistics.median(values), fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def ttft(runs: list[Run], q: float) -> str:
    return f"{statistics.median(percentile(r.ttft_ms, q) for r in runs):.0f}"


def rows(model: str, name: str, runs: dict[str, list[Run]], policies: list[str]) -> list[str]:
    off = runs[NO_CACHE]
    lines = []
    for policy in policies:
        on = runs[policy]
        ratios = sorted(a.tokens_per_s / b.tokens_per_s for a, b in zip(on, off))
        lines.append(
            f"| {model} | {name} | {policy} | {summary([r.tokens_per_s for r in on])} | {summary([r.tokens_per_s for r in off])} "
            f"| {statistics.median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f}) | "
            f"{statistics.median(r.hit_rate for r in on):.0%} | {ttft(on, 0.5)} / {ttft(off, 0.5)} | {ttft(on, 0.99)} / {ttft(off, 0.99)} |"
        )
        print(lines[-1], flush=True)
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu, or cuda (an H200: bf16, triton MoE, CUDA graphs) (default: cpu)")
    p.add_argument("--arch", default="qwen3_moe", help="architecture of the checkpoints (default: qwen3_moe)")
    p.add_argument("--presets", nargs="+", default=None,
                   help=f"checkpoints, one after another: {' and '.join(WEIGHTED_PRESETS)} get random weights, any other preset "
                        "of --arch (30b-a3b) is its released shapes with dummy weights (default: tiny; with cuda: 30b-a3b tiny)")
    p.add_argument("--layers", type=int, default=16,
                   help="decoder layers of a released-shape preset such as 30b-a3b (48); tiny and small keep theirs (default: 16)")
    p.add_argument("--dtype", default=None, help="fp32, bf16 (default: fp32 on cpu, bf16 on cuda)")
    p.add_argument("--workloads", nargs="+", default=None, choices=list(WORKLOADS),
                   help="default: all three on cpu, shared-prefix on cuda")
    p.add_argument("--runs", type=int, default=3, help="runs per setting; the table gives median (min-max) (default: 3)")
    p.add_argument("--policies", nargs="+", default=["fcfs", "lpm"], choices=SCHEDULE_POLICIES,
                   help="schedule policies to run with the cache (default: fcfs lpm)")
    p.add_argument("--groups", type=int, help="shared-prefix: system prompts (default: 4 cpu, 8 cuda)")
    p.add_argument("--prompts-per-group", type=int, help="shared-prefix: prompts per system prompt (default: 8 cpu, 16 cuda)")
    p.add_argument("--system-len", type=int, help="shared-prefix: system prompt tokens (default: 1024 cpu, 2048 cuda)")
    p.add_argument("--question-len", type=int, help="question / user turn tokens (default: 32 cpu, 64 cuda)")
    p.add_argument("--output-len", type=int, help="tokens generated per request (default: 32 cpu, 128 cuda)")
    p.add_argument("--clients", type=int, help="multi-turn: conversations (default: 8 cpu, 16 cuda)")
    p.add_argument("--rounds", type=int, help="multi-turn: rounds per conversation (default: 6 cpu, 4 cuda)")
    p.add_argument("--max-running", type=int, help="requests decoding at once (default: 16 cpu, 128 cuda)")
    p.add_argument("--step-tokens", type=int, help="tokens per step, --max-batched-tokens (default: 2048 cpu, 8192 cuda)")
    p.add_argument("--chunk", type=int, help="prompt chunk, --chunked-prefill-size (default: 512 cpu, 4096 cuda)")
    p.add_argument("--kv-tokens", type=int, help="KV cache size in tokens (default: every request of a workload at once)")
    p.add_argument("--threads", type=int, default=None,
                   help="cpu: torch intra-op threads (default: torch's own); 1 is steadier on cores shared with other work")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="also write the table to this file")
    args = p.parse_args(argv)
    gpu = args.device.startswith("cuda")
    if not gpu and args.device != "cpu":
        p.error(f"--device {args.device!r}: cpu or cuda")
    if gpu and not torch.cuda.is_available():
        p.error("--device cuda: this machine has no CUDA device (torch.cuda.is_available() is False); use --device cpu")
    for name, defaults in SIZES.items():
        if getattr(args, name) is None:
            setattr(args, name, defaults[gpu])
        elif getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, not {getattr(args, name)}")
    if args.layers <= 0 or args.runs <= 0:
        p.error("--layers and --runs must be positive")
    args.presets = args.presets or (["30b-a3b", "tiny"] if gpu else ["tiny"])
    args.workloads = args.workloads or (["shared-prefix"] if gpu else list(WORKLOADS))
    args.dtype = args.dtype or ("bf16" if gpu else "fp32")
    args.kv_tokens = args.kv_tokens or kv_tokens(args)
    return args


def checkpoint(args, preset: str) -> tuple[str, str, bool]:
    """(folder, the table's name of the model, whether its weights are dummy)."""
    folder = os.path.join(tempfile.mkdtemp(prefix="moeplex-prefix-"), preset)
    if preset in WEIGHTED_PRESETS:
        return write_checkpoint(folder, args.arch, preset), f"{args.arch} {preset}", False
    write_checkpoint(folder, args.arch, preset, config_only=True, overrides={"num_hidden_layers": args.layers})
    return folder, f"{args.arch} {preset} shapes, {args.layers} layers", True


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads and args.device == "cpu":
        torch.set_num_threads(args.threads)
    where = (torch.cuda.get_device_name() if args.device.startswith("cuda")
             else f"{os.cpu_count()} CPU cores, {torch.get_num_threads()} torch threads")
    lines = [
        f"{where}, {args.dtype}, {args.runs} runs each; tokens/s = (prompt + output tokens) / wall time, median (min-max); "
        f"TTFT ms from submission, p50 / p99 over a run's requests (median of the runs), with cache / without",
        f"sizes: shared-prefix {args.groups} x {args.prompts_per_group} prompts of {args.system_len} + {args.question_len} tokens; "
        f"multi-turn {args.clients} x {args.rounds} rounds; {args.output_len} output tokens; up to {args.max_running} running, "
        f"{args.step_tokens}-token steps, {args.chunk}-token chunks, KV {args.kv_tokens} tokens",
        "",
        "| model | workload | policy | with cache tok/s | without tok/s | ratio | hit rate | TTFT p50 ms | TTFT p99 ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for preset in args.presets:
        folder, model, dummy = checkpoint(args, preset)
        for name in args.workloads:
            lines += rows(model, name, runs_of(folder, WORKLOADS[name], args, dummy), args.policies)
    text = "\n".join(lines)
    print("\n" + text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
