"""Offline throughput on CPU: moeplex against transformers' batched generate, same model, same process.

    python benchmarks/offline_throughput.py --arch qwen3_moe --presets tiny small

For each preset it writes a random checkpoint, runs the mixed-length workload (64 requests,
prompts 32-256 tokens, 16-256 new greedy tokens) through moeplex and through transformers
(one left-padded batch generating the longest output, counting only the tokens each request
asked for), and prints a Markdown table with tokens/s, the ratio, and the scheduler's CPU time
per decode step outside the model forward.

    python benchmarks/offline_throughput.py --model DIR --num-requests 48 --skip-transformers --output-ids ids.jsonl

runs an existing checkpoint folder instead (e.g. one written with `moeplex make-model --set ...`), and
writes every request's prompt and greedy output ids as JSON lines (the format of
benchmarks/vllm_cpu_reference.py's --output-ids, for comparing the two engines or two builds).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workload import mixed_workload  # noqa: E402

from moeplex.config import EngineConfig  # noqa: E402
from moeplex.engine import Engine  # noqa: E402
from moeplex.forward_batch import ForwardMode  # noqa: E402
from moeplex.models.make_model import write_checkpoint  # noqa: E402
from moeplex.sampling import SamplingParams  # noqa: E402


class StepTimer:
    """Wraps the runner's forward to split each decode step into model time and everything else."""

    def __init__(self, engine: Engine):
        self.engine, self.forward = engine, engine.runner.forward
        self.model_s = self.outside_s = 0.0
        self.decode_steps = 0
        engine.runner.forward = self._forward
        self._in_forward = 0.0

    def _forward(self, batch):
        start = time.perf_counter()
        logits = self.forward(batch)
        self._in_forward = time.perf_counter() - start
        self._mode = batch.mode
        return logits

    def step(self):
        self._mode, start = None, time.perf_counter()
        finished = self.engine.step()
        if self._mode == ForwardMode.DECODE:
            self.decode_steps += 1
            self.outside_s += time.perf_counter() - start - self._in_forward
            self.model_s += self._in_forward
        return finished


def run_moeplex(folder: str, work, dtype: str) -> dict:
    engine = Engine(EngineConfig(model=folder, dtype=dtype, show_progress=False, max_running_requests=64, max_batched_tokens=4096, chunked_prefill_size=1024))
    engine.generate([work[0][0]], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
    timer = StepTimer(engine)
    # as Engine.generate admits them: the text is decoded once, when each request finishes
    requests = [engine.add_request(p, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True), stream_text=False)
                for p, n in work]
    start = time.perf_counter()
    while engine.has_work:
        timer.step()
    elapsed = time.perf_counter() - start
    return {
        "seconds": elapsed,
        "tokens": sum(n for _, n in work),
        "sched_ms_per_decode_step": 1e3 * timer.outside_s / max(timer.decode_steps, 1),
        "model_ms_per_decode_step": 1e3 * timer.model_s / max(timer.decode_steps, 1),
        "output_ids": [list(r.output_ids) for r in requests],
    }


def run_transformers(folder: str, work, dtype: str) -> dict:
    import transformers

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype).eval()
    model.generation_config.eos_token_id = None
    longest = max(len(p) for p, _ in work)
    ids = torch.full((len(work), longest), 258, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, (prompt, _) in enumerate(work):  # left padding, as decoder-only batched generation needs
        ids[i, longest - len(prompt) :] = torch.tensor(prompt)
        mask[i, longest - len(prompt) :] = 1
    new = max(n for _, n in work)
    with torch.no_grad():
        model.generate(ids[:1, -8:], max_new_tokens=2, do_sample=False, pad_token_id=258)  # warm-up
        start = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=258)
        elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "tokens": sum(n for _, n in work)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="qwen3_moe", choices=("deepseek_v3", "qwen3_moe", "mixtral"))
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"])
    parser.add_argument("--model", metavar="DIR", help="run this checkpoint folder instead of writing --presets")
    parser.add_argument("--output-ids", metavar="FILE", help="write each request's prompt and output ids as JSON lines")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--skip-transformers", action="store_true", help="time moeplex only")
    parser.add_argument("--keep-model", metavar="DIR", help="write the checkpoints under DIR/<arch>-<preset> and keep them")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads for both engines")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    work = mixed_workload(args.num_requests)
    rows = []
    for preset in [os.path.basename(os.path.normpath(args.model))] if args.model else args.presets:
        folder = args.model or (os.path.join(args.keep_model, f"{args.arch}-{preset}") if args.keep_model else tempfile.mkdtemp())
        if not os.path.exists(os.path.join(folder, "model.safetensors")):
            write_checkpoint(folder, args.arch, preset, seed=0)
        ours = run_moeplex(folder, work, args.dtype)
        if args.output_ids:
            with open(args.output_ids, "w") as f:
                for i, ((prompt, n), ids) in enumerate(zip(work, ours["output_ids"])):
                    f.write(json.dumps({"index": i, "prompt_ids": prompt, "max_new_tokens": n, "output_ids": ids}) + "\n")
        theirs = None if args.skip_transformers else run_transformers(folder, work, args.dtype)
        rows.append((preset, ours, theirs))
    arch = json.load(open(os.path.join(args.model, "config.json")))["model_type"] if args.model else args.arch
    print(f"\n{arch}, {args.num_requests} requests, prompts 32-256, outputs 16-256 greedy, {args.dtype}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| preset | moeplex tok/s | transformers tok/s | ratio | sched ms / decode step | model ms / decode step |")
    print("|---|---|---|---|---|---|")
    for preset, ours, theirs in rows:
        tps = ours["tokens"] / ours["seconds"]
        hf = theirs["tokens"] / theirs["seconds"] if theirs else float("nan")
        print(f"| {preset} | {tps:.1f} | {hf:.1f} | {tps / hf:.2f}x | {ours['sched_ms_per_decode_step']:.2f} | "
              f"{ours['model_ms_per_decode_step']:.2f} |")


if __name__ == "__main__":
    main()
