"""vLLM's CPU build on benchmarks/prefix_cache.py's workloads, with its prefix caching on or off: the reference
for moeplex's prefix cache. Run it with the python of the vLLM venv (benchmarks/results/vllm_cpu_setup.md),
once per setting (vLLM fixes prefix caching when the engine starts):

    /tmp/vllm-bench/venv/bin/python benchmarks/vllm_prefix_cache.py --model DIR --prefix-caching on  --runs 3
    /tmp/vllm-bench/venv/bin/python benchmarks/vllm_prefix_cache.py --model DIR --prefix-caching off --runs 3

The prompts are the same token ids as benchmarks/prefix_cache.py's with the same flags and seed
(benchmarks/workload.py builds both): shared-prefix submitted in one generate call, multi-turn one call per
round over every client, no-reuse in one call; greedy, ignore_eos, --output-len tokens each. Each run starts
from an empty prefix cache (reset_prefix_cache). Prints one table row per workload: tokens/s (prompt + output
tokens over wall time), median (min-max) of --runs runs, and vLLM's own prefix-cache hit rate where it reports one.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vllm_cpu_reference import check_config  # noqa: E402
from workload import multi_turn_openings, no_reuse_prompts, shared_prefix_prompts, tokens  # noqa: E402


def run_workload(llm, name: str, args, params) -> tuple[int, float]:
    from vllm.inputs import TokensPrompt

    rng = random.Random(args.seed)

    def generate(prompts):
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    start = time.perf_counter()
    processed = 0
    if name == "multi-turn":
        conversations = multi_turn_openings(args.clients, args.question_len + 1, rng)
        for _ in range(args.rounds):
            answers = generate(conversations)
            processed += sum(map(len, conversations)) + sum(map(len, answers))
            conversations = [c + a + tokens(rng, args.question_len) for c, a in zip(conversations, answers)]
    else:
        if name == "shared-prefix":
            prompts = shared_prefix_prompts(args.groups, args.prompts_per_group, args.system_len, args.question_len, rng)
        else:
            prompts = no_reuse_prompts(args.groups * args.prompts_per_group, args.system_len + args.question_len, rng)
        answers = generate(prompts)
        processed = sum(map(len, prompts)) + sum(map(len, answers))
    return processed, time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, metavar="DIR", help="Hugging Face folder written by moeplex make-model")
    p.add_argument("--prefix-caching", choices=("on", "off"), required=True)
    p.add_argument("--workloads", nargs="+", default=["shared-prefix", "multi-turn", "no-reuse"])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--prompts-per-group", type=int, default=8)
    p.add_argument("--system-len", type=int, default=1024)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--max-num-seqs", type=int, default=16, help="as prefix_cache.py's --max-running (default: 16)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="as moeplex's step budget (default: 2048)")
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    folder = os.path.abspath(args.model)
    check_config(folder)

    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=folder, dtype="float32", skip_tokenizer_init=True, gpu_memory_utilization=0.3,
        kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30), max_model_len=4096, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=args.enforce_eager,
        enable_prefix_caching=args.prefix_caching == "on", seed=0,
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, detokenize=False)
    print(f"vllm {vllm.__version__}, fp32, prefix caching {args.prefix_caching}, "
          f"{'eager' if args.enforce_eager else 'compiled'}, {args.runs} runs", file=sys.stderr)
    print("| workload | vLLM prefix caching | tok/s |")
    print("|---|---|---|")
    for name in args.workloads:
        run_workload(llm, name, args, params)  # warm-up
        speeds = []
        for _ in range(args.runs):
            llm.reset_prefix_cache()
            processed, seconds = run_workload(llm, name, args, params)
            speeds.append(processed / seconds)
        print(f"| {name} | {args.prefix_caching} | {statistics.median(speeds):.0f} ({min(speeds):.0f}-{max(speeds):.0f}) |",
              flush=True)


if __name__ == "__main__":
    main()
