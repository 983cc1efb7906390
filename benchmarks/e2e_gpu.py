"""End-to-end checks and step timings on a GPU (eager; no CUDA graphs yet).

    python benchmarks/e2e_gpu.py --out benchmarks/results/e2e_h200.md

1. Correctness: greedy tokens of every architecture's tiny model on the GPU (fp32, torch kernel)
   equal the CPU run's; bf16 with the triton kernel is reported as the share of equal tokens.
2. Speed: `bench-one-batch`-style prefill and decode of real-shaped models with random weights
   made on the device (Qwen3-30B-A3B shapes; DeepSeek-V3 shapes cut to 4 layers), against the
   roofline measured in the same run: weight bytes a decode step must read / copy bandwidth,
   prefill FLOPs / bf16 matmul rate.
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from moeplex.cli.bench_one_batch import measure
from moeplex.config import EngineConfig
from moeplex.engine import Engine
from moeplex.models.make_model import write_checkpoint
from moeplex.sampling import SamplingParams

PROMPTS = [[256] + list(range(1, 40)), [256, 5, 6, 7]]


def tokens(folder: str, device: str, dtype: str, kernel: str) -> list[list[int]]:
    config = EngineConfig(model=folder, device=device, dtype=dtype, moe_kernel=kernel, show_progress=False, max_total_tokens=2048)
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    return [r.output_ids for r in Engine(config).generate(PROMPTS, params)]


def correctness() -> list[str]:
    lines = ["| arch | GPU fp32 torch == CPU fp32 | GPU bf16 triton tokens equal to CPU fp32 |", "|---|---|---|"]
    for arch in ("deepseek_v3", "qwen3_moe", "mixtral"):
        folder = write_checkpoint(tempfile.mkdtemp(), arch, "tiny", seed=0)
        cpu = tokens(folder, "cpu", "fp32", "torch")
        gpu = tokens(folder, "cuda", "fp32", "torch")
        bf16 = tokens(folder, "cuda", "bf16", "triton")
        same = sum(a == b for x, y in zip(bf16, cpu) for a, b in zip(x, y)) / sum(len(x) for x in cpu)
        lines.append(f"| {arch} | {gpu == cpu} | {same:.0%} |")
        print(lines[-1], flush=True)
    return lines


def peaks() -> tuple[float, float]:
    """(bf16 matmul FLOP/s, device copy bytes/s), measured now."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    results = []
    for fn, work in ((lambda: a @ a, 2 * 8192**3), (lambda: dst.copy_(src), 2 * src.numel())):
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            fn()
        end.record()
        torch.cuda.synchronize()
        results.append(work * 10 / (start.elapsed_time(end) / 1e3))
    return results[0], results[1]


def step_bytes(engine: Engine, batch: int) -> float:
    """Weight bytes one decode step reads: everything but the experts, plus the experts the batch can hit."""
    moe = engine.model.moe_layers()
    expert_ids = {id(p) for layer in moe for p in (layer.w13, layer.w2)}
    dense = sum(p.numel() * p.element_size() for p in engine.model.parameters() if id(p) not in expert_ids)
    experts = 0
    for layer in moe:
        per_expert = (layer.w13[0].numel() + layer.w2[0].numel()) * layer.w13.element_size()
        experts += per_expert * min(layer.w13.shape[0], batch * layer.gate.spec.top_k)
    return dense + experts


def speed(name: str, folder: str, flops_s: float, copy_bs: float, decode_batches, prefill_lens) -> list[str]:
    config = EngineConfig(model=folder, device="cuda", dtype="bf16", moe_kernel="triton", load_format="dummy",
                          show_progress=False, max_running_requests=max(decode_batches),
                          max_batched_tokens=max(prefill_lens + [max(decode_batches) * 128]),
                          chunked_prefill_size=max(prefill_lens), max_total_tokens=40000)
    engine = Engine(config)
    measure(engine, 1, 16, 2)
    params = sum(p.numel() for p in engine.model.parameters())
    active = params - sum(l.w13.numel() + l.w2.numel() for l in engine.model.moe_layers()) * (1 - 8 / engine.model.moe_layers()[0].w13.shape[0])
    lines = []
    for batch in decode_batches:
        row = measure(engine, batch, 128, 16)
        roof_ms = step_bytes(engine, batch) / copy_bs * 1e3
        lines.append(f"| {name} | decode | {batch} | {row['decode_step_ms']} | {row['decode_tok_s']} | {roof_ms:.3f} | {row['decode_step_ms'] / roof_ms:.2f}x |")
        print(lines[-1], flush=True)
    for length in prefill_lens:
        row = measure(engine, 1, length, 1)
        roof_ms = 2 * active * length / flops_s * 1e3
        lines.append(f"| {name} | prefill | {length} | {row['prefill_ms']} | {row['prefill_tok_s']} | {roof_ms:.3f} | {row['prefill_ms'] / roof_ms:.2f}x |")
        print(lines[-1], flush=True)
    del engine
    torch.cuda.empty_cache()
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out")
    parser.add_argument("--decode", type=int, nargs="+", default=[1, 8, 32, 128, 256])
    parser.add_argument("--prefill", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--skip-correctness", action="store_true")
    args = parser.parse_args()
    lines = [f"## moeplex on {torch.cuda.get_device_name()} (eager, torch {torch.__version__})", ""]
    if not args.skip_correctness:
        lines += correctness() + [""]
    flops_s, copy_bs = peaks()
    lines += [f"Measured: bf16 matmul {flops_s / 1e12:.0f} TFLOP/s, device copy {copy_bs / 1e9:.0f} GB/s.", "",
              "| model | phase | batch / tokens | step ms | tok/s | roofline ms | ratio to roofline |", "|---|---|---:|---:|---:|---:|---:|"]
    qwen = write_checkpoint(tempfile.mkdtemp(), "qwen3_moe", "30b-a3b", config_only=True)
    lines += speed("Qwen3-30B-A3B shapes", qwen, flops_s, copy_bs, args.decode, args.prefill)
    dsv3 = write_checkpoint(tempfile.mkdtemp(), "deepseek_v3", "v3", overrides={"num_hidden_layers": 4}, config_only=True)
    lines += speed("DeepSeek-V3 shapes, 4 layers", dsv3, flops_s, copy_bs, args.decode, args.prefill[:1])
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
