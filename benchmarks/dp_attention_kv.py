"""DP attention's KV claim, measured: DeepSeek-V3 (MLA) on two gloo ranks, tensor-parallel attention against DP
attention, under the same KV memory budget per rank.

    .venv/bin/python benchmarks/dp_attention_kv.py --runs 3

MLA caches one compressed latent per token (kv_lora_rank + qk_rope_head_dim values per layer), shared by every
head. Tensor-parallel attention splits the heads over the ranks, so every rank caches the whole latent of every
token: the two ranks hold the same tokens. DP attention gives each rank its own requests, so the same bytes per
rank hold different tokens and the two ranks hold twice as many. For each layout the table gives the KV tokens a
rank holds under the budget, the distinct tokens the pair holds, the largest decode batch of --context-token
sequences that fits, and the output tokens/s of that batch (prompts of --prompt-len tokens, the rest generated,
greedy with ignore_eos; the ranks load the model once, run one untimed batch, then time --runs batches between
two barriers, prefill included; median, min-max).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from moeplex.config import EngineConfig
from moeplex.engine import Engine
from moeplex.kv_cache import KVPool
from moeplex.models.make_model import write_checkpoint
from moeplex.parallel import ParallelConfig, init_parallel
from moeplex.ranks.launcher import launch
from moeplex.ranks.offline import assign_to_dp_groups
from moeplex.sampling import SamplingParams

from report import emit, processor

LAYOUTS = {
    "tp2 (TP attention)": dict(tp_size=2, ep_size=2),
    "tp2 dp2 (DP attention)": dict(tp_size=2, ep_size=2, dp_size=2, enable_dp_attention=True),
}


def kv_bytes_per_token(folder: str) -> int:
    """One rank's KV bytes per token: the full latent of every layer, whichever layout (MLA's heads share it)."""
    import json

    with open(f"{folder}/config.json") as f:
        config = json.load(f)
    width = config["kv_lora_rank"] + config["qk_rope_head_dim"]
    return KVPool.bytes_per_token([[(width,)]] * config["num_hidden_layers"], torch.float32)


def timed_batches(rank: int, config: EngineConfig, prompts, params, runs: int) -> list[float] | None:
    """On every rank: the engine once, a warm-up batch, then `runs` timed batches; rank 0 returns their seconds."""
    parallel = init_parallel(config.parallel, rank, torch.device("cpu"))
    engine = Engine(config, parallel=parallel)
    dp = config.parallel.dp_size if config.parallel.enable_dp_attention else 1
    owners = assign_to_dp_groups(prompts, dp)
    mine = [p for p, owner in zip(prompts, owners) if owner == parallel.dp_rank]
    seconds = []
    for run in range(runs + 1):
        dist.barrier()
        start = time.perf_counter()
        engine.generate(mine, params, progress=False)
        dist.barrier()
        if run:
            seconds.append(time.perf_counter() - start)
    return seconds if rank == 0 else None




def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small", help="DeepSeek-V3 make-model preset (default: %(default)s)")
    parser.add_argument("--budget-tokens", type=int, default=2048,
                        help="KV budget per rank, as tokens of one rank's latent (default: %(default)s)")
    parser.add_argument("--context-tokens", type=int, default=128, help="tokens per sequence (default: %(default)s)")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args()
    folder = write_checkpoint(tempfile.mkdtemp(), "deepseek_v3", args.preset, seed=0)
    per_token = kv_bytes_per_token(folder)
    budget = args.budget_tokens * per_token
    page = 16
    lines = [f"DeepSeek-V3 {args.preset} (MLA), fp32, 2 gloo ranks on {processor().split(',')[0]}; KV budget {budget / 2**20:.1f} MiB "
             f"per rank ({per_token} bytes per token per rank); sequences of {args.context_tokens} tokens "
             f"({args.prompt_len} prompt); `python benchmarks/dp_attention_kv.py --runs {args.runs}`", "",
             "| layout | KV tokens per rank | distinct tokens held | largest decode batch | output tok/s (median) | min-max |",
             "|---|---:|---:|---:|---:|---:|"]
    rates_of = {}
    tokens_per_rank = budget // per_token // page * page
    tp_batch = tokens_per_rank // args.context_tokens
    rows = [(name, layout, None) for name, layout in LAYOUTS.items()]
    # DP attention at TP attention's batch: what the layout alone changes, apart from the larger batch it fits
    rows.append(("tp2 dp2 at the TP layout's batch", LAYOUTS["tp2 dp2 (DP attention)"], tp_batch))
    for name, layout, fixed_batch in rows:
        groups = layout.get("dp_size", 1) if layout.get("enable_dp_attention") else 1
        distinct = tokens_per_rank * groups
        batch = fixed_batch or distinct // args.context_tokens
        parallel = ParallelConfig(**layout)
        config = EngineConfig(model=folder, dtype="fp32", show_progress=False, parallel=parallel, dispatcher="naive",
                              max_total_tokens=tokens_per_rank, page_size=page, max_running_requests=batch,
                              disable_prefix_cache=True, max_batched_tokens=batch * args.prompt_len)
        prompts = [[256] + [(7 * i + j) % 250 for j in range(args.prompt_len - 1)] for i in range(batch)]
        params = SamplingParams(max_new_tokens=args.context_tokens - args.prompt_len, temperature=0.0, ignore_eos=True)
        seconds = launch(timed_batches, parallel, config, prompts, params, args.runs)
        rates = [batch * params.max_new_tokens / s for s in seconds]
        rates_of[name] = rates
        lines.append(f"| {name} | {tokens_per_rank} | {distinct} | {batch} | {statistics.median(rates):.1f} | "
                     f"{min(rates):.1f}-{max(rates):.1f} |")
        print(lines[-1], flush=True)
    tp, dp, same = (statistics.median(r) for r in rates_of.values())
    lines += ["", f"DP attention / TP attention: {dp / tp:.2f}x output tokens/s at each layout's largest batch; "
              f"{same / tp:.2f}x at the same batch (the layout alone), so {dp / same:.2f}x from the batch it fits"]
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
