"""End-to-end checks and step timings on a GPU: CUDA graphs on and off, the overlap schedule on and off.

    python benchmarks/e2e_gpu.py --out benchmarks/results/e2e_h200.md [--profile DIR]

1. Correctness: greedy tokens of every architecture's tiny model on the GPU (fp32, torch kernel)
   equal the CPU run's; bf16 with the triton kernel is reported as the share of equal tokens.
2. Speed: `bench-one-batch`-style prefill and decode of real-shaped models with random weights
   made on the device (Qwen3-30B-A3B shapes; DeepSeek-V3 shapes cut to 4 layers), against the
   roofline measured in the same run: for decode, the weight and KV bytes a step must read over
   the copy bandwidth; for prefill, the matmul and attention FLOPs over the bf16 matmul rate.
   Decode runs with the captured CUDA graphs and the overlap schedule, then with each of them off
   on the same engine; the sequential rows say how long each step spent on the host outside the
   forward pass (what the overlap schedule can hide).
3. `--profile DIR`: one eager decode step at batch 1 and one 4k prefill per model under
   torch.profiler, the kernels sorted by GPU time, written to DIR. `--profile-graphed DIR`: graph-replayed
   decode steps at each --decode batch, per kernel GPU time per step and the gaps between kernels.
4. `--compare-fewer-launches`: after the decode rows, the graph-replayed decode again with the
   launch-cutting fusions off (`use_fused_kernels(True, fewer_launches=False)`: rope and the KV
   write, the router GEMV and its top-k, the residual add and the next norm as separate kernels;
   the triton MoE kernel's pair sort in three launches, the triton attention's split merge in a
   reduce kernel), graphs captured again: before/after in one process.

Issue 22's batch-1 decode check in one call (no correctness, no prefill):

    python benchmarks/e2e_gpu.py --skip-correctness --decode 1 8 32 --prefill --compare-fewer-launches
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import tempfile
import time

import torch

from report import emit  # benchmarks/report.py, beside this file

from moeplex.cli.bench_one_batch import measure
from moeplex.config import EngineConfig
from moeplex.cuda_graph import CudaGraphCapture, DecodeGraphs
from moeplex.engine import Engine
from moeplex.models.make_model import write_checkpoint
from moeplex.plugins.moe_kernels.triton_moe.align import ONE_LAUNCH_MAX_PAIRS
from moeplex.sampling import SamplingParams

PROMPTS = [[256] + list(range(1, 40)), [256, 5, 6, 7]]
DECODE_CONTEXT = 128  # prompt tokens before the timed decode steps


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


class Roofline:
    """What one step must read (decode) or compute (prefill) for this model."""

    def __init__(self, engine: Engine):
        model, config = engine.model, engine.model.hf_config
        self.moe = model.moe_layers()
        expert_ids = {id(p) for layer in self.moe for p in (layer.w13, layer.w2)}
        # the embedding table is read one row per token, not whole (unless lm_head shares it)
        embedding = model.model.embed_tokens.weight
        dense = [p for p in model.parameters() if id(p) not in expert_ids and (p is not embedding or model.tie_word_embeddings)]
        self.dense_bytes = sum(p.numel() * p.element_size() for p in dense)
        self.dense_params = sum(p.numel() for p in dense)
        self.kv_bytes_per_token = sum(buf[0].numel() * buf.element_size() for bufs in engine.kv.buffers for buf in bufs)
        self.layers = config["num_hidden_layers"]
        heads = config["num_attention_heads"]
        if "kv_lora_rank" in config:  # MLA prefill: per head nope + rope keys, v values
            self.qk_dim, self.v_dim = config["qk_nope_head_dim"] + config["qk_rope_head_dim"], config["v_head_dim"]
        else:
            self.qk_dim = self.v_dim = config.get("head_dim") or config["hidden_size"] // heads
        self.heads = heads

    def expert_bytes(self, batch: int) -> float:
        """Expected bytes of the distinct experts `batch` tokens hit under uniform routing."""
        total = 0.0
        for layer in self.moe:
            experts, top_k = layer.w13.shape[0], layer.gate.spec.top_k
            hit = experts * (1 - (1 - top_k / experts) ** batch)
            total += hit * (layer.w13[0].numel() + layer.w2[0].numel()) * layer.w13.element_size()
        return total

    def decode_bytes(self, batch: int, context: int) -> float:
        return self.dense_bytes + self.expert_bytes(batch) + batch * context * self.kv_bytes_per_token

    def prefill_flops(self, tokens: int) -> float:
        matmul = 2 * tokens * self.dense_params
        for layer in self.moe:
            matmul += 2 * tokens * layer.gate.spec.top_k * (layer.w13[0].numel() + layer.w2[0].numel())
        attention = 2 * tokens * tokens * self.heads * (self.qk_dim + self.v_dim) * self.layers / 2  # causal half
        return matmul + attention


def measure_with_host_time(engine: Engine, batch: int) -> tuple[dict, float]:
    """measure()'s row, and the median ms of a decode step spent on the host outside the forward pass
    (scheduling, batch building, sampling: what overlapping the CPU with the GPU could hide)."""
    forward, spent = engine.runner.forward, []

    def timed(forward_batch):
        torch.cuda.synchronize()  # the GPU is idle here already: the previous step read its tokens
        start = time.perf_counter()
        out = forward(forward_batch)
        torch.cuda.synchronize()
        spent.append(time.perf_counter() - start)
        return out

    engine.runner.forward = timed
    try:
        row = measure(engine, batch, DECODE_CONTEXT, 16)
    finally:
        engine.runner.forward = forward
    return row, row["decode_step_ms"] - statistics.median(spent[1:]) * 1e3


DECODE_MODES = (("on", "on"), ("on", "off"), ("off", "on"))  # (CUDA graphs, overlap schedule)


def decode_row(name: str, engine: Engine, roof: Roofline, copy_bs: float, batch: int, modes: tuple[str, str, str]) -> str:
    """One table row: decode at `batch` in `modes` (CUDA graphs, overlap schedule, fewer launches) as set now."""
    use_graphs, overlap, fewer = modes
    if overlap == "on":  # timing the forward pass alone would serialize the steps
        row, host = measure(engine, batch, DECODE_CONTEXT, 16), "-"
    else:
        row, host_ms = measure_with_host_time(engine, batch)
        host = f"{host_ms:.3f}"
    roof_ms = roof.decode_bytes(batch, DECODE_CONTEXT + 8) / copy_bs * 1e3
    line = (f"| {name} | decode | {batch} | {use_graphs} | {overlap} | {fewer} | {row['decode_step_ms']} | {host} | "
            f"{row['decode_tok_s']} | {roof_ms:.3f} | {row['decode_step_ms'] / roof_ms:.2f}x |")
    print(line, flush=True)
    return line


def decode_rows(name: str, engine: Engine, roof: Roofline, copy_bs: float, batches) -> list[str]:
    lines = []
    graphs = engine.runner.graphs
    for batch in batches:
        for use_graphs, overlap in DECODE_MODES:
            engine.runner.graphs = graphs if use_graphs == "on" else None
            engine.overlap_schedule = overlap == "on"
            lines.append(decode_row(name, engine, roof, copy_bs, batch, (use_graphs, overlap, "on")))
    engine.runner.graphs = graphs
    engine.overlap_schedule = True
    return lines


def launch_cuts(engine: Engine) -> dict[str, tuple]:
    """Each launch-cutting fusion by name: (objects that hold its switch, the attribute). The module classes
    that declare `fewer_launches` (rope + KV write, router GEMV in the top-k, residual add in the next norm),
    the triton attention's split merge, the triton MoE kernel's one-launch pair sort, and the projections that
    the start-up timing gave the Triton GEMV (one launch where cuBLAS may take a split-K GEMM and a reduce)."""
    cuts: dict[str, tuple] = {}
    for module in engine.model.modules():
        if hasattr(type(module), "fewer_launches"):
            cuts.setdefault(type(module).__name__, ([], "fewer_launches"))[0].append(module)
        if getattr(module, "gemv_choice", None) is not None or hasattr(module, "_measured_gemv_choice"):
            cuts.setdefault("GEMV projections", ([], "gemv_choice"))[0].append(module)
    if hasattr(engine.model.attention_backend, "merge_in_split_kernel"):
        cuts["attention split merge"] = ([engine.model.attention_backend], "merge_in_split_kernel")
    kernel = engine.model.moe_runtime.kernel
    if hasattr(kernel, "one_launch_align_pairs"):
        cuts["MoE one-launch pair sort"] = ([kernel], "one_launch_align_pairs")
    return cuts


def set_cut(holders: list, attribute: str, on: bool) -> None:
    for holder in holders:
        if attribute == "one_launch_align_pairs":
            setattr(holder, attribute, ONE_LAUNCH_MAX_PAIRS if on else 0)
        elif attribute == "gemv_choice":  # the measured choice is kept aside while the cut is off
            holder.gemv_choice = vars(holder).setdefault("_measured_gemv_choice", holder.gemv_choice) if on else None
        else:
            setattr(holder, attribute, on)


def recapture(engine: Engine) -> None:
    """Capture the decode graphs again (the captured ones hold the kernels chosen when they were captured)."""
    runner = engine.runner
    old = runner.graphs
    inputs, sizes = old.inputs, old.sizes
    # graphs that also return the hidden states (for a drafter, where DecodeGraphs offers it) are captured so again
    extra = {"with_hidden": old.with_hidden} if hasattr(old, "with_hidden") else {}
    runner.graphs = old = None  # the old graphs' memory goes back before the new ones are captured
    gc.collect()
    torch.cuda.empty_cache()
    with torch.inference_mode():
        runner.graphs = DecodeGraphs(engine.model, engine.kv, runner.strategy, inputs, sizes,
                                     CudaGraphCapture(engine.device), **extra)


def use_fewer_launches(engine: Engine, on: bool) -> dict:
    """Switch every launch-cutting fusion and capture the decode graphs again; returns the switches as they were."""
    before = {}
    for cut, (holders, attribute) in launch_cuts(engine).items():
        before[cut] = bool(getattr(holders[0], attribute))
        set_cut(holders, attribute, on)
    recapture(engine)
    return before


def ablation_rows(name: str, engine: Engine, batches, rounds: int = 3, only: str | None = None) -> list[str]:
    """Each launch cut switched on and off alone (the others as they are by default), graphs captured again: its
    effect on the graph-replayed, overlapped decode step, as the median of `rounds` alternations. `only`: the cuts
    whose name holds it."""
    if engine.runner.graphs is None:
        return []
    lines = []
    for cut, (holders, attribute) in launch_cuts(engine).items():
        if only and only not in cut:
            continue
        default = bool(getattr(holders[0], attribute))
        for batch in batches:
            on_ms, off_ms = [], []
            for _ in range(rounds):
                for state, sink in ((True, on_ms), (False, off_ms)):
                    set_cut(holders, attribute, state)
                    recapture(engine)
                    sink.append(measure(engine, batch, DECODE_CONTEXT, 16)["decode_step_ms"])
            set_cut(holders, attribute, default)
            on, off = statistics.median(on_ms), statistics.median(off_ms)
            lines.append(f"| {name} | {cut} | {batch} | {on:.3f} ({min(on_ms):.3f}-{max(on_ms):.3f}) | "
                         f"{off:.3f} ({min(off_ms):.3f}-{max(off_ms):.3f}) | {(off - on) / off:+.1%} |")
            print(lines[-1], flush=True)
    recapture(engine)
    return lines


def fewer_launches_off_rows(name: str, engine: Engine, roof: Roofline, copy_bs: float, batches) -> list[str]:
    """The graph-replayed, overlapped decode rows again with the launch-cutting fusions off (the 'before')."""
    if engine.runner.graphs is None:
        return []
    before = use_fewer_launches(engine, False)
    try:
        return [decode_row(name, engine, roof, copy_bs, batch, ("on", "on", "off")) for batch in batches]
    finally:
        for cut, (holders, attribute) in launch_cuts(engine).items():
            set_cut(holders, attribute, before[cut])
        recapture(engine)


def prefill_rows(name: str, engine: Engine, roof: Roofline, flops_s: float, lengths) -> list[str]:
    lines = []
    for length in lengths:
        measure(engine, 1, length, 1)  # first at this length: kernels compile, tile tables load
        row = measure(engine, 1, length, 1)
        roof_ms = roof.prefill_flops(length) / flops_s * 1e3
        lines.append(f"| {name} | prefill | {length} | - | - | on | {row['prefill_ms']} | - | {row['prefill_tok_s']} | "
                     f"{roof_ms:.3f} | {row['prefill_ms'] / roof_ms:.2f}x |")
        print(lines[-1], flush=True)
    return lines


def profile(name: str, engine: Engine, folder: str) -> None:
    """Kernel tables of one eager decode step (batch 1) and one 4k prefill."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    graphs, engine.runner.graphs = engine.runner.graphs, None
    engine.overlap_schedule = False  # each profiled step whole
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    rng = random.Random(0)
    for tag, length in (("decode_bs1", DECODE_CONTEXT), ("prefill_4096", 4096)):
        engine.add_request([rng.randrange(256) for _ in range(length)], params)
        engine.step()
        engine.step()
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            if tag.startswith("prefill"):
                while engine.has_work:
                    engine.step()
                engine.add_request([rng.randrange(256) for _ in range(length)], params)
            engine.step()
            torch.cuda.synchronize()
        while engine.has_work:
            engine.step()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=90)
        with open(os.path.join(folder, f"{name.split()[0]}_{tag}.txt"), "w") as f:
            f.write(table)
        print(f"--- {name} {tag}\n{table[:6000]}", flush=True)
    engine.runner.graphs = graphs
    engine.overlap_schedule = True


def profile_graphed(name: str, engine: Engine, folder: str, batches, steps: int = 8) -> None:
    """Kernel tables of graph-replayed decode steps under the overlap schedule (the served path): per kernel its
    launches and GPU microseconds per step, and the step's span against the kernels' busy time (the gaps between
    kernels are what a graphed step loses besides slow kernels). Written to DIR/<model>_graphed_bs<N>.md."""
    import json

    from torch.profiler import ProfilerActivity, profile as torch_profile

    tag = name.split()[0]
    for batch in batches:
        rng = random.Random(batch)
        params = SamplingParams(max_new_tokens=steps + 12, temperature=0.0, ignore_eos=True)
        for _ in range(batch):
            engine.add_request([rng.randrange(256) for _ in range(DECODE_CONTEXT)], params)
        for _ in range(6):  # prefill, then replays warm
            engine.step()
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:  # no CPU events: the host's pace unchanged
            for _ in range(steps):
                engine.step()
            torch.cuda.synchronize()
        while engine.has_work:
            engine.step()
        os.makedirs(folder, exist_ok=True)
        trace = os.path.join(folder, f"{tag}_graphed_bs{batch}.json")
        prof.export_chrome_trace(trace)
        with open(trace) as f:
            kernels = sorted((e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"), key=lambda e: e["ts"])
        if not kernels:
            print(f"--- {name} graphed bs{batch}: the profiler saw no kernels", flush=True)
            continue
        span = (kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]) / steps
        busy = sum(e["dur"] for e in kernels) / steps
        by_name: dict[str, list[float]] = {}
        for e in kernels:
            by_name.setdefault(e["name"], []).append(e["dur"])
        rows = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))
        lines = [f"### {name}, graph-replayed decode, batch {batch} ({steps} steps under the profiler)", "",
                 f"step span {span / 1e3:.3f} ms; kernels busy {busy / 1e3:.3f} ms ({busy / span:.0%}); "
                 f"gaps {(span - busy) / 1e3:.3f} ms; {len(kernels) / steps:.0f} kernels per step", "",
                 "| kernel | launches / step | us / step | share of busy | us / launch |", "|---|---:|---:|---:|---:|"]
        for kernel, durs in rows[:40]:
            lines.append(f"| `{kernel[:110]}` | {len(durs) / steps:.1f} | {sum(durs) / steps:.1f} | "
                         f"{sum(durs) / steps / busy:.1%} | {statistics.mean(durs):.2f} |")
        with open(os.path.join(folder, f"{tag}_graphed_bs{batch}.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
        print("\n".join(lines[:30]), flush=True)


def speed(name: str, folder: str, flops_s: float, copy_bs: float, args, prefill_lens, ablations: list[str]) -> list[str]:
    config = EngineConfig(model=folder, device="cuda", dtype="bf16", moe_kernel="triton", load_format="dummy",
                          show_progress=False, max_running_requests=max(args.decode),
                          cuda_graph_max_bs=max(args.decode),
                          max_batched_tokens=max(prefill_lens + [max(args.decode) * DECODE_CONTEXT]),
                          chunked_prefill_size=max(prefill_lens, default=max(args.decode) * DECODE_CONTEXT),
                          max_total_tokens=40000)
    engine = Engine(config)
    measure(engine, 1, 16, 2)
    roof = Roofline(engine)
    if args.profile:
        profile(name, engine, args.profile)
    if args.profile_graphed:
        profile_graphed(name, engine, args.profile_graphed, args.decode)
    lines = decode_rows(name, engine, roof, copy_bs, args.decode)
    if args.compare_fewer_launches:
        lines += fewer_launches_off_rows(name, engine, roof, copy_bs, args.decode)
    if args.ablate_launch_cuts:
        ablations.extend(ablation_rows(name, engine, args.decode, only=args.ablate_only))
    lines += prefill_rows(name, engine, roof, flops_s, prefill_lens)
    del engine
    torch.cuda.empty_cache()
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out")
    parser.add_argument("--decode", type=int, nargs="+", default=[1, 8, 32, 128, 256])
    parser.add_argument("--prefill", type=int, nargs="*", default=[4096, 16384],
                        help="prefill lengths to time (none: no prefill rows)")
    parser.add_argument("--skip-correctness", action="store_true")
    parser.add_argument("--only", choices=("qwen", "dsv3"), help="one model instead of both")
    parser.add_argument("--profile", metavar="DIR", help="write kernel tables of an eager decode step and a prefill here")
    parser.add_argument("--profile-graphed", metavar="DIR",
                        help="write kernel tables of graph-replayed decode steps (each --decode batch) here")
    parser.add_argument("--compare-fewer-launches", action="store_true",
                        help="also time graph-replayed decode with the launch-cutting fusions off (KV write in rope, "
                             "one-launch router, residual add in the next norm, one-launch MoE pair sort, attention splits "
                             "merged in the split kernel), graphs captured again")
    parser.add_argument("--ablate-launch-cuts", action="store_true",
                        help="also time graph-replayed decode with each launch cut alone switched off")
    parser.add_argument("--ablate-only", metavar="TEXT", help="with --ablate-launch-cuts: only the cuts whose name "
                        "holds TEXT (e.g. 'GEMV')")
    parser.add_argument("--router-warps", type=int, choices=(1, 2, 4, 8),
                        help="warps per program of the one-launch router (moeplex.kernels.router_gemv.NUM_WARPS)")
    args = parser.parse_args()
    if args.router_warps:
        from moeplex.kernels import router_gemv

        router_gemv.NUM_WARPS = args.router_warps
    ablations: list[str] = []
    lines = [f"## moeplex on {torch.cuda.get_device_name()} (torch {torch.__version__}, triton MoE kernel and attention)", ""]
    if not args.skip_correctness:
        lines += correctness() + [""]
    flops_s, copy_bs = peaks()
    lines += [f"Measured: bf16 matmul {flops_s / 1e12:.0f} TFLOP/s, device copy {copy_bs / 1e9:.0f} GB/s. "
              f"Decode after a {DECODE_CONTEXT}-token prompt, median of 16 steps.", "",
              "| model | phase | batch / tokens | CUDA graphs | overlap schedule | fewer launches | step ms "
              "| host ms outside forward | tok/s | roofline ms | ratio to roofline |",
              "|---|---|---:|---|---|---|---:|---:|---:|---:|---:|"]
    if args.only != "dsv3":
        qwen = write_checkpoint(tempfile.mkdtemp(), "qwen3_moe", "30b-a3b", config_only=True)
        lines += speed("Qwen3-30B-A3B shapes", qwen, flops_s, copy_bs, args, args.prefill, ablations)
    if args.only != "qwen":
        dsv3 = write_checkpoint(tempfile.mkdtemp(), "deepseek_v3", "v3", overrides={"num_hidden_layers": 4}, config_only=True)
        lines += speed("DeepSeek-V3 shapes, 4 layers", dsv3, flops_s, copy_bs, args, args.prefill[:1], ablations)
    if ablations:
        lines += ["", "Each launch cut alone switched on and off (the others as by default), graphs captured again, "
                  "median of 3 alternations (min-max):", "", "| model | cut | batch | cut on, ms | cut off, ms | saved by the cut |",
                  "|---|---|---:|---:|---:|---:|", *ablations]
    if args.compare_fewer_launches:
        lines += ["", "fewer launches: on = the defaults (KV write in the rope kernel, the router of <= 16 tokens in "
                  "one launch, each layer's residual add in the next layer's norm, the MoE pair sort of <= 256 pairs "
                  "in one launch, the Triton GEMV where the start-up timing chose it; decode attention's split merge "
                  "stays off); off = every one of them off, the same work in the kernels they replace."]
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
