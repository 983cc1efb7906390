"""The dense costs `moeplex plan` prices at the peak today: weight GEMMs of a model's layers and prefill attention.

For every GEMM shape of the model (attention projections, dense MLP, shared experts, lm_head) at several token
counts, and causal attention at several prompt lengths, the median of --runs timings and its spread, against
the matmul peak and copy rate measured in the same process. The ratio column is what a later profile can
carry as an efficiency table (docs/plan.md, "Measuring a profile").

    python benchmarks/plan_gemm.py --out OUT/plan_gemm_h200.md                         # H200, DeepSeek-V3 shapes
    python benchmarks/plan_gemm.py --device cpu --model deepseek_v3:small --tokens 8 32 --seq 64 --runs 3   # CI-sized
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from report import emit, processor

from moeplex.attention.torch_ref import flash_value_width, gpu_kernels
from moeplex.plan.costs import gemm_us
from moeplex.plan.profile import Profile
from moeplex.plan.shapes import load_config, model_shape


def timed_us(fn, device: str, repeats: int) -> float:
    fn()  # warm-up: kernel selection, allocation
    if device == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e3 / repeats
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) * 1e6 / repeats


def peaks(device: str, dtype: torch.dtype, size: int) -> tuple[float, float]:
    """(matmul TFLOP/s, copy GB/s) of this device in this process."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    us = timed_us(lambda: a @ a, device, 5)
    buf = torch.empty(64 * 2**20 if device == "cuda" else 2**22, device=device, dtype=torch.uint8)
    out = torch.empty_like(buf)
    copy_us = timed_us(lambda: out.copy_(buf), device, 10)
    return 2 * size**3 / us / 1e6, 2 * buf.numel() / copy_us / 1e3


def attention_dims(config: dict) -> tuple[int, int, int, int]:
    """(query heads, KV heads, query/key width, value width) of the model's prefill attention call.

    MLA prefill expands the latent per head: keys are nope + rope wide, values v_head_dim.
    """
    heads = config["num_attention_heads"]
    if "kv_lora_rank" in config:
        return heads, heads, config["qk_nope_head_dim"] + config["qk_rope_head_dim"], config["v_head_dim"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return heads, config["num_key_value_heads"], head_dim, head_dim


def median_spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="deepseek_v3:v3", help="config.json or ARCH:PRESET (default: deepseek_v3:v3)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 512, 4096, 16384], help="GEMM rows to time")
    ap.add_argument("--seq", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384], help="causal attention prompt lengths")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", help="also write the table here")
    ap.add_argument("--profile-out", help="write a profile JSON: the shipped h200.json plus gemm_slowdown and attention_slowdown from this run")
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    shape = model_shape(load_config(args.model))
    peak_tflops, copy_gbps = peaks(args.device, dtype, 8192 if args.device == "cuda" else 256)
    # the model's own prediction at the peaks of this run: the ratio is measured / predicted
    hw = Profile("run", {"hbm_gbps": copy_gbps, "matmul_bf16_tflops": peak_tflops, "matmul_fp8_tflops": 2 * peak_tflops, "kernel_floor_us": 0.0}, {}, {}, {})
    gemms = list(shape.attention_gemms) + [(shape.hidden, 2 * shape.dense_intermediate), (shape.dense_intermediate, shape.hidden)]
    if shape.shared_intermediate:
        gemms += [(shape.hidden, 2 * shape.shared_intermediate), (shape.shared_intermediate, shape.hidden)]
    gemms.append((shape.hidden, shape.vocab))
    lines = [
        f"## Dense GEMMs and prefill attention of {args.model} ({processor()}, torch {torch.__version__}, {dtype})",
        "",
        f"Measured in this run: matmul {peak_tflops:.3g} TFLOP/s, copy {copy_gbps:.0f} GB/s. `moeplex plan` prices these at max(FLOPs / matmul, bytes / copy);",
        "measured / model is the efficiency a profile would carry. Median (min-max) of the runs.",
        "",
        "| op | K | N | tokens | µs | model µs | measured / model |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    gemm_ratios: dict[int, list[float]] = {m: [] for m in args.tokens}
    attention_ratios: list[list[float]] = []
    for k, n in dict.fromkeys(gemms):
        w = torch.randn(k, n, device=args.device, dtype=dtype)
        for m in args.tokens:
            x = torch.randn(m, k, device=args.device, dtype=dtype)
            runs = [timed_us(lambda: x @ w, args.device, 10) for _ in range(args.runs)]
            model = gemm_us(hw, m, k, n, "bf16")
            gemm_ratios[m].append(statistics.median(runs) / model)
            lines.append(f"| gemm | {k} | {n} | {m} | {median_spread(runs)} | {model:.1f} | {statistics.median(runs) / model:.2f} |")
    heads, kv_heads, qk_dim, v_dim = attention_dims(load_config(args.model)) if args.device == "cuda" else (2, 1, 24, 16)  # toy on a CPU
    for s in args.seq:
        q = torch.randn(1, heads, s, qk_dim, device=args.device, dtype=dtype)
        k = torch.randn(1, kv_heads, s, qk_dim, device=args.device, dtype=dtype)
        v = torch.randn(1, kv_heads, s, v_dim, device=args.device, dtype=dtype)
        v = torch.nn.functional.pad(v, (0, flash_value_width(q, v) - v_dim))  # as _extend widens MLA's values
        # the call our extend path makes (core/attention/torch_ref.py): 4-D, causal, GQA where the heads differ
        # under the same kernel choice (GPU_SDPA: flash, memory-efficient or math, never cuDNN)
        call = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv_heads != heads)  # noqa: E731
        with gpu_kernels(torch.device(args.device)):
            runs = [timed_us(call, args.device, 5) for _ in range(args.runs)]
        flops = 2 * heads * (qk_dim + v_dim) * s * (s + 1) / 2
        model = flops / (peak_tflops * 1e6)
        attention_ratios.append([s, round(statistics.median(runs) / model, 3)])
        lines.append(f"| causal attention ({heads} heads / {kv_heads} KV heads, qk {qk_dim}, v {v_dim}) | - | - | {s} | {median_spread(runs)} | {model:.1f} | {statistics.median(runs) / model:.2f} |")
    emit("\n".join(lines), args.out)
    if args.profile_out:
        write_profile(args, {m: round(statistics.median(r), 3) for m, r in gemm_ratios.items()}, attention_ratios)


def write_profile(args, gemm: dict[int, float], attention: list[list[float]]) -> None:
    """The shipped H200 profile with the two measured slowdown tables added, each citing this run."""
    import json
    import sys
    from importlib import resources

    data = json.loads(resources.files("moeplex.plan").joinpath("profiles", "h200.json").read_text())
    command = "python benchmarks/plan_gemm.py " + " ".join(sys.argv[1:])
    stamp = time.strftime("%Y-%m-%d")
    data["name"] = "h200-measured"
    data["gemm_slowdown"] = {"value": sorted([m, f] for m, f in gemm.items()), "unit": "[tokens, measured / roofline, median over the model's GEMM shapes]", "source": f"{command} ({processor()}, {stamp})"}
    data["attention_slowdown"] = {"value": attention, "unit": "[prompt tokens, measured / FLOP roofline at this run's matmul peak]", "source": f"{command} ({processor()}, {stamp}); the model's own attention shape ({args.model})"}
    with open(args.profile_out, "w") as f:
        json.dump(data, f, indent=1, ensure_ascii=False)
    print(f"wrote {args.profile_out}: moeplex plan check --only own --profile {args.profile_out}")


if __name__ == "__main__":
    main()
