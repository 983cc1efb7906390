"""What penalties cost: decode tokens/s with every request using frequency, presence and repetition penalties and a
logit_bias, against the same requests with none, in one process on one engine.

    .venv/bin/python benchmarks/penalties.py --runs 3                      CPU, small Qwen3-MoE, fp32
    python benchmarks/penalties.py --device cuda --runs 3                   H200: Qwen3-30B-A3B shapes, dummy bf16 weights

Every request is greedy with ignore_eos and the same length, so both arms run the same number of steps; the clock
starts once every request has its first token (decode only). Runs alternate between the arms (none, penalties,
none, ...) so drift on a shared machine falls on both; the table gives medians, min-max and the ratio of medians.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile

import torch

from moeplex.config import EngineConfig
from moeplex.engine import Engine
from moeplex.models.make_model import write_checkpoint
from moeplex.sampling import SamplingParams

from timing import decode_rate
from report import emit, processor

PROMPT_LEN = 32
PENALIZED = dict(frequency_penalty=0.5, presence_penalty=0.5, repetition_penalty=1.1,
                 logit_bias={"11": 2.0, "13": -5.0, "17": 1.5})







def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--output-len", type=int, default=None, help="tokens per request (default: 32 CPU, 128 GPU)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--qwen-layers", type=int, default=48, help="GPU: Qwen3-30B-A3B decoder layers (default: all)")
    parser.add_argument("--preset", default="small", help="CPU: the make-model preset (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="CPU: torch threads (default: %(default)s)")
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args()
    cpu = args.device == "cpu"
    if cpu:
        torch.set_num_threads(args.threads)
    out_len = args.output_len or (32 if cpu else 128)
    batch_max = max(args.batches)
    settings = dict(device=args.device, show_progress=False, max_running_requests=batch_max,
                    max_total_tokens=batch_max * (PROMPT_LEN + out_len + 8) + 1024, disable_prefix_cache=True)
    if cpu:
        folder = write_checkpoint(tempfile.mkdtemp(), "qwen3_moe", args.preset, seed=0)
        settings.update(dtype="fp32")
        name = f"Qwen3-MoE {args.preset}, fp32"
    else:
        folder = write_checkpoint(tempfile.mkdtemp(), "qwen3_moe", "30b-a3b", config_only=True,
                                  overrides={"num_hidden_layers": args.qwen_layers})
        settings.update(dtype="bf16", load_format="dummy", moe_kernel="triton", cuda_graph_max_bs=batch_max)
        name = f"Qwen3-30B-A3B shapes ({args.qwen_layers} layers), bf16 dummy"
    engine = Engine(EngineConfig(model=folder, **settings))
    vocab = engine.vocab_size
    arms = {"none": SamplingParams(max_new_tokens=out_len, temperature=0.0, ignore_eos=True),
            "penalties": SamplingParams(max_new_tokens=out_len, temperature=0.0, ignore_eos=True, **PENALIZED)}
    lines = [f"{name}; {processor()}; prompts of {PROMPT_LEN} tokens, {out_len} new tokens each, greedy, ignore_eos; "
             f"penalties: {PENALIZED}", "",
             "| batch | none tok/s (median) | min-max | penalties tok/s (median) | min-max | penalties / none |",
             "|---:|---:|---:|---:|---:|---:|"]
    for batch in args.batches:
        rng = random.Random(batch)
        prompts = [[rng.randrange(vocab) for _ in range(PROMPT_LEN)] for _ in range(batch)]
        decode_rate(engine, prompts, arms["none"], args.device)  # warm-up (graphs, allocator) for both arms
        decode_rate(engine, prompts, arms["penalties"], args.device)
        rates = {arm: [] for arm in arms}
        for _ in range(args.runs):
            for arm, params in arms.items():
                rates[arm].append(decode_rate(engine, prompts, params, args.device)[0])
        none, pen = (statistics.median(rates[a]) for a in arms)
        lines.append(f"| {batch} | {none:.1f} | {min(rates['none']):.1f}-{max(rates['none']):.1f} | {pen:.1f} | "
                     f"{min(rates['penalties']):.1f}-{max(rates['penalties']):.1f} | {pen / none:.3f} |")
        print(lines[-1], flush=True)
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
