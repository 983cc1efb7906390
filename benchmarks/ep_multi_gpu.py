"""Expert parallelism over the GPUs of one machine: greedy tokens against one GPU, and dispatch + combine per layer.

    python benchmarks/ep_multi_gpu.py --gpus 2 --out benchmarks/results/ep_multi_gpu_h200x2.md
    python benchmarks/ep_multi_gpu.py --gpus 2 --parts decode       # one part alone: a call per part where the whole is too long
    TRITON_INTERPRET=1 python benchmarks/ep_multi_gpu.py --cpu --gpus 2 --parts decode   # a check of part 4

One process per GPU over NCCL; NVLink multicast stays off (NCCL_NVLS_ENABLE=0, NVSHMEM_DISABLE_NVLS=1).

1. Correctness. A DeepSeek-V3-shaped model cut small (hidden 2048, the smallest size DeepEP's
   low-latency kernels take; 16 routed experts, top-4; random weights written once) generates
   greedily with `--dp-size N --enable-dp-attention --tp-size N --ep-size N` and each dispatcher, against
   one GPU running the `local` dispatcher in the same dtype, with decode steps in CUDA graphs where the
   dispatcher and kernel are graph-safe (the default; the `graphs` column says whether the run captured
   them; `naive` in fp32 also runs eagerly, `--disable-cuda-graph`). DP attention keeps every request's
   attention on one GPU, so only the MoE layers' expert parallelism and the batch split differ. In
   fp32 (`naive`) tokens and log-probabilities must equal one GPU's in fp32; in bf16 (DeepEP moves bf16
   or fp8 rows) the typical step's log-probabilities may differ from the fp32 reference by at most
   --bf16-factor times what one GPU in bf16 differs by.
2. Dispatch + combine of one MoE layer at DeepSeek-V3 shapes (hidden 7168, 256 experts, top-8, uniform
   routing, identity experts): prefill-sized batches (4096 tokens per rank) for `naive` and
   `deepep-normal`, decode-sized ones (128 tokens per rank) for `naive` and `deepep-ll`, rows sent in
   bf16 or fp8. Median over iterations of the slowest rank; GB/s counts the bytes of the rows that leave
   or reach each rank (DeepEP's own convention: dispatched rows out, combined rows back), next to
   DeepEP's published figures (intranode normal mode ~150 GB/s over NVLink on H800; low-latency dispatch
   of 128 tokens in the 100-200 us range at EP8).
3. One whole MoE layer (dispatch, the experts' grouped GEMMs, combine) at DeepSeek-V3 shapes under a
   Zipf-skewed router, with the static placement and with EPLB over redundant expert slots: the time per
   layer (slowest rank) and the balancedness of the (token, expert) pairs each rank computes. EPLB
   places the experts from a calibration batch's recorded load and is measured on other batches drawn
   from the same law, as the engine rebalances from past steps.
4. A decode step over the ranks at DeepSeek-V3 shapes (dummy weights, a few layers), 1-256 tokens per rank:
   CUDA graphs vs eager, `tbo` vs `none` in graphs, `deepep-ll` + `deepgemm` vs `naive` + `triton`, each
   against one GPU at the same tokens per rank (ep_decode_steps.py says how a step is timed).

On a machine without GPUs, `--cpu` runs both parts on gloo ranks with the CPU plugins (a check of the
script, not a measurement worth keeping).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import attrs
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ep_decode_steps  # part 4, beside this file
from report import emit  # benchmarks/report.py, beside this file

from moeplex.conformance.dispatch_ranks import free_port
from moeplex.interfaces import ExpertOutput, ExpertWeights, MoEContext, StandardLayout
from moeplex.moe.adapters import LayoutAdapter
from moeplex.config import SPREAD, STATIC
from moeplex.moe.replicas import ReplicaSelector
from moeplex.registry import PluginError, lookup

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
TOP_LOGPROBS = 512  # the cut model's whole vocabulary
GENERATE_TIMEOUT_S = 300
FP32_LOGPROB_TOL = 1e-3
PROMPTS = ["256,11,12,13,14,15", "256,40,41", "256,90,91,92,93,94,95,96,97", "256,7",
           "256,300,301,302", "256,5,6", "256,120,121,122,123,124,125", "256,64,65,66,67"]
HIDDEN, EXPERTS, TOP_K = 7168, 256, 8
BATCHES = (("prefill", 4096, ("naive", "deepep-normal")), ("decode", 128, ("naive", "deepep-ll")))
INTERMEDIATE, GROUPS = 2048, 8  # DeepSeek-V3's expert intermediate size and expert groups


# --- 1. correctness ---------------------------------------------------------------------------------


def make_model(folder: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "moeplex.cli", "make-model", str(folder), "--arch", "deepseek_v3",
         "--set", "hidden_size=2048", "--set", "moe_intermediate_size=256", "--set", "intermediate_size=1024"],
        check=True, stdout=subprocess.DEVNULL,
    )


def generate(folder: Path, device: str, dtype: str, kernel: str, dispatcher: str, gpus: int, max_new: int,
             overlap: str = "none", graphs: bool = True):
    """(every prompt's greedy steps (token and the top log-probabilities), or None; the error that stopped the run,
    or None; whether decode steps replayed CUDA graphs)."""
    parallel = [] if gpus == 1 else [
        "--tp-size", str(gpus), "--ep-size", str(gpus), "--dp-size", str(gpus), "--enable-dp-attention",
        "--dist-init-addr", f"127.0.0.1:{free_port()}",
    ]
    command = [
        sys.executable, "-m", "moeplex.cli", "generate", "--model", str(folder),
        "--device", device, "--dtype", dtype, "--moe-kernel", kernel, "--dispatcher", dispatcher, *parallel,
        "--overlap", overlap, "--cuda-graph-max-bs", str(len(PROMPTS)), "--max-new-tokens", str(max_new), "--ignore-eos", "--logprobs", str(TOP_LOGPROBS), "--json",
        *(["--enable-multi-rank-cuda-graph"] if graphs else ["--disable-cuda-graph"]), "--input-ids", *PROMPTS,
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **NO_MULTICAST},
                              timeout=GENERATE_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:  # a collective that hangs (in a graph replay, say) fails its row only
        stderr = exc.stderr.decode() if isinstance(exc.stderr, bytes) else exc.stderr or ""
        return None, f"no result in {GENERATE_TIMEOUT_S} s", "captured CUDA graphs" in stderr
    captured = "captured CUDA graphs" in done.stderr  # the engine's start-up log line, on every rank that captures
    if done.returncode:
        return None, (done.stderr.strip().splitlines() or ["failed"])[-1], captured
    return [json.loads(line)["logprobs"] for line in done.stdout.splitlines()], None, captured


def compare(reference: list[list[dict]], got: list[list[dict]]) -> dict:
    """Tokens equal up to each prompt's first divergence, and per step that shares its prefix (up to and
    including the divergence) the largest difference of any token's log-probability: their median and max."""
    equal, steps = 0, []
    for want, have in zip(reference, got):
        for a, b in zip(want, have):
            la, lb = dict(map(tuple, a["top_logprobs"])), dict(map(tuple, b["top_logprobs"]))
            steps.append(max([0.0] + [abs(la[t] - lb[t]) for t in la.keys() & lb.keys() if math.isfinite(la[t] + lb[t])]))
            if a["token_id"] != b["token_id"]:
                break
            equal += 1
    total = sum(map(len, reference))
    return dict(equal=equal, total=total, identical=equal == total, median=statistics.median(steps), worst=max(steps))


def correctness(args, dispatchers: list[str]) -> list[str]:
    """Every run against one rank in fp32 (`local`), with the whole distribution of every step. fp32
    over several ranks must give the same tokens and log-probabilities within float error. bf16 rounds,
    and a rounding that flips a router's near-tie changes that step's experts, so the largest difference
    says little; one GPU in bf16 shows the typical (median) step's difference, and a bf16 run over several
    ranks passes when its median is at most --bf16-factor times that one's."""
    device, kernel = ("cpu", "torch") if args.cpu else ("cuda", "triton")
    # (dtype, dispatcher, ranks, overlap, graphs): decode steps in graphs wherever the pair is graph-safe (the
    # default), and `naive` in fp32 once more eagerly, so the two forms meet the same criterion side by side
    runs = [("fp32", "naive", args.gpus, overlap, True) for overlap in ("none", "tbo")]
    runs += [] if args.cpu else [("fp32", "naive", args.gpus, "none", False)]  # on the CPU nothing is captured
    runs += [("bf16", "local", 1, "none", True)]
    runs += [("bf16", name, args.gpus, "none", True) for name in dispatchers]
    runs += [("bf16", name, args.gpus, overlap, True) for name in dispatchers if name != "naive" for overlap in ("sbo", "tbo")]
    lines = [
        f"### Greedy tokens with {args.gpus} ranks against one {'process' if args.cpu else 'GPU'}",
        "",
        f"DeepSeek-V3 cut small (hidden 2048, 16 experts, top-4, 3 layers, random weights), `--moe-kernel {kernel}`, "
        f"`--tp-size {args.gpus} --ep-size {args.gpus} --dp-size {args.gpus} --enable-dp-attention`, {len(PROMPTS)} "
        f"prompts x {args.max_new_tokens} tokens. Reference: one rank in fp32 with the `local` dispatcher. Tokens "
        "are compared up to each prompt's first divergence; per step that shares its prefix, |Δ| is the largest "
        "difference of any token's log-probability (the whole vocabulary), in nats. fp32 must give the same tokens "
        f"with every |Δ| within {FP32_LOGPROB_TOL}; a bf16 run over several ranks passes when its median |Δ| is at most "
        f"{args.bf16_factor}x the one-GPU bf16 run's (what rounding to bf16 costs alone; the max is where a rounding "
        "flipped a router's near-tie and another expert ran).",
        "",
        "| dtype | dispatcher | overlap | graphs | ranks | tokens before divergence | identical | median \\|Δ\\| | max \\|Δ\\| | pass |",
        "|---|---|---|---|---:|---:|---|---:|---:|---|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        make_model(folder)
        reference, error, _ = generate(folder, device, "fp32", kernel, "local", 1, args.max_new_tokens)
        if error:
            return lines + [f"| fp32 | local (reference) | none | | 1 | failed: {error} | | | | NO |"]
        floor = None
        for dtype, name, ranks, overlap, graphs in runs:
            got, error, captured = generate(folder, device, dtype, kernel, name, ranks, args.max_new_tokens, overlap,
                                            graphs)
            replayed = "yes" if captured else "no"
            if error:
                lines.append(f"| {dtype} | {name} | {overlap} | {replayed} | {ranks} | failed: {error} | | | | NO |")
                continue
            c = compare(reference, got)
            if ranks == 1:
                floor, verdict = c["median"], "(bf16 alone)"
            elif dtype == "fp32":
                verdict = "yes" if c["identical"] and c["worst"] <= FP32_LOGPROB_TOL else "NO"
            else:
                verdict = "yes" if floor is not None and c["median"] <= args.bf16_factor * floor else "NO"
            lines.append(f"| {dtype} | {name} | {overlap} | {replayed} | {ranks} | {c['equal']}/{c['total']} | "
                         f"{'yes' if c['identical'] else 'no'} "
                         f"| {c['median']:.4f} | {c['worst']:.4f} | {verdict} |")
            print(lines[-1], flush=True)
    return lines


# --- 2. dispatch + combine ----------------------------------------------------------------------------


class IdentityExperts:
    """What identity experts hand back: the received rows (zeros, allocated once per shape, where only an
    fp8 payload holds them, so the timing is the transfer's and not a fresh buffer's)."""

    def __init__(self):
        self.zeros: dict[tuple, torch.Tensor] = {}

    def __call__(self, layout) -> ExpertOutput:
        rows = layout.hidden
        if layout.fp8 is not None:
            key = (tuple(rows.shape), rows.device)
            if key not in self.zeros:
                self.zeros[key] = torch.zeros(rows.shape, dtype=torch.bfloat16, device=rows.device)
            rows = self.zeros[key]
        if isinstance(layout, StandardLayout):
            return ExpertOutput(rows, weights_applied=True, summed=True)
        return ExpertOutput(rows, weights_applied=False, summed=False)


def slowest_median(step, iters: int, warmup: int, device: torch.device) -> float:
    times = []
    for i in range(warmup + iters):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    value = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


def profile(step, path: Path, rank: int, steps: int = 5) -> None:
    """Rank 0's kernel and host-op table over a few steps (every rank runs them: they are collectives)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
        table += "\n" + prof.key_averages().table(sort_by="cpu_time_total", row_limit=25)
        path.write_text(f"{steps} steps\n{table}")


def wire_bytes(ids: torch.Tensor, rank: int, world: int, experts: int, hidden: int, fp8: bool) -> float:
    """Bytes of the rows leaving this rank for other ranks in dispatch, and coming back in combine."""
    dest = ids // (experts // world)
    remote = torch.nn.functional.one_hot(dest, world).amax(dim=1)
    remote[:, rank] = 0
    rows = int(remote.sum())
    dispatch_row = hidden + hidden // 128 * 4 if fp8 else 2 * hidden
    return rows * (dispatch_row + 2 * hidden)


def rank_main(rank: int, world: int, port: int, args, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **NO_MULTICAST)
    if args.cpu:
        device, backend, hidden, experts = torch.device("cpu"), "gloo", 1024, 64
        torch.set_num_threads(1)
    else:
        torch.cuda.set_device(rank)
        device, backend, hidden, experts = torch.device("cuda", rank), "nccl", HIDDEN, EXPERTS
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    rows = {"dispatch": [], "eplb": []}
    try:
        if "dispatch" in args.parts:
            for label, tokens, names in BATCHES:
                tokens = tokens // 8 if args.cpu else tokens
                gen = torch.Generator().manual_seed(rank)
                ids = torch.rand(tokens, experts, generator=gen).argsort(dim=1)[:, :TOP_K].to(device)
                weights = torch.rand(tokens, TOP_K, generator=gen).to(device)
                x = torch.randn(tokens, hidden, generator=gen).to(device, torch.bfloat16)
                for name in names:
                    for fp8 in (False, True):
                        rows["dispatch"].append(
                            measure(name, fp8, label, x, ids, weights, rank, world, hidden, experts, device, args)
                        )
        if "eplb" in args.parts:
            rows["eplb"] = eplb_rows(rank, world, device, args)
    finally:
        dist.barrier()
        dist.destroy_process_group()
    if rank == 0:
        Path(out_path).write_text(json.dumps(rows))


def measure(name, fp8, label, x, ids, weights, rank, world, hidden, experts, device, args) -> dict:
    row = dict(dispatcher=name, payload="fp8" if fp8 else "bf16", batch=label, tokens=x.shape[0])
    ctx = MoEContext(hidden, hidden, experts, TOP_K, torch.bfloat16, device, rank, world, dist.group.WORLD,
                     max_tokens_per_rank=x.shape[0], dispatch_fp8=fp8)
    try:
        cls = lookup("dispatcher", name)
        if fp8 and not cls.caps.fp8_payload:
            return {**row, "skipped": "sends no fp8 rows"}
        dispatcher = cls(ctx)
    except (PluginError, ValueError) as exc:
        return {**row, "skipped": str(exc)}

    identity = IdentityExperts()

    def layer():
        dispatched = dispatcher.dispatch(x, ids, weights)
        return dispatcher.combine(identity(dispatched.layout), dispatched.handle)

    seconds = slowest_median(layer, args.iters, args.warmup, device)
    if args.profile and device.type == "cuda":
        profile(layer, args.profile / f"{label}_{name}_{row['payload']}.txt", rank)
    moved = torch.tensor([wire_bytes(ids.cpu(), rank, world, experts, hidden, fp8)], device=device)
    dist.all_reduce(moved)
    return {**row, "us": seconds * 1e6, "gbps": moved.item() / world / seconds / 1e9}


# --- 3. one MoE layer under a Zipf-skewed router, EPLB on and off ---------------------------------------


def zipf_router(tokens: int, experts: int, skew: float, hot_order: torch.Tensor, seed: int) -> torch.Tensor:
    """[T, K] distinct expert ids per token from a Zipf law over the experts ranked by `hot_order`."""
    gen = torch.Generator().manual_seed(seed)
    probs = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** skew
    return hot_order[torch.multinomial(probs.expand(tokens, -1), TOP_K, replacement=False, generator=gen)]


def eplb_plans(args, experts: int, world: int, load: torch.Tensor):
    """(label, placement, replica selection) per row; the static placement is the reference."""
    def plan(name: str, slots: int):
        return lookup("balancer", name)().rebalance(load, slots, GROUPS, 1, world)

    yield "static", plan("static", experts), STATIC
    yield "eplb, no redundant", plan("eplb", experts), STATIC
    yield f"eplb, {args.redundant} redundant", plan("eplb", experts + args.redundant), SPREAD


@attrs.frozen
class EplbSetup:
    hidden: int
    intermediate: int
    experts: int
    tokens: int  # per rank
    dispatcher: str
    kernel: str

    @classmethod
    def of(cls, args) -> "EplbSetup":
        if args.cpu:
            return cls(256, 128, 64, 512, "naive", "torch")
        return cls(HIDDEN, INTERMEDIATE, EXPERTS, 4096, args.eplb_dispatcher, "triton")


def eplb_rows(rank: int, world: int, device: torch.device, args) -> list[dict]:
    setup = EplbSetup.of(args)
    hidden, inter, experts, tokens = setup.hidden, setup.intermediate, setup.experts, setup.tokens
    names = (setup.dispatcher, setup.kernel)
    hot_order = torch.randperm(experts, generator=torch.Generator().manual_seed(2))
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(tokens, hidden, generator=gen).to(device, torch.bfloat16)
    weights = torch.rand(tokens, TOP_K, generator=gen).to(device)
    rows = []
    for skew in args.skews:
        calibration = zipf_router(tokens * world * 4, experts, skew, hot_order, seed=1)
        load = torch.bincount(calibration.flatten(), minlength=experts).unsqueeze(0)
        logical = zipf_router(tokens, experts, skew, hot_order, seed=10 + rank).to(device)
        for label, placement, algorithm in eplb_plans(args, experts, world, load):
            physical = ReplicaSelector(placement, device, algorithm)(0, logical)
            row = dict(skew=skew, placement=label, slots=placement.num_physical)
            row.update(time_layer(physical, placement.num_physical, x, weights, (hidden, inter), names, rank, world,
                                  device, args))
            rows.append(row)
    return rows


def time_layer(physical, slots, x, weights, shape, names, rank, world, device, args) -> dict:
    """Median layer time of the slowest rank, and the (token, expert) pairs each rank computes."""
    hidden, inter = shape
    ctx = MoEContext(hidden, inter, slots, TOP_K, torch.bfloat16, device, rank, world, dist.group.WORLD,
                     max_tokens_per_rank=x.shape[0])
    dispatcher_cls, kernel_cls = lookup("dispatcher", names[0]), lookup("moe_kernel", names[1])
    dispatcher, kernel = dispatcher_cls(ctx), kernel_cls(ctx)
    adapter = LayoutAdapter(dispatcher_cls.caps.layouts, kernel_cls.caps.layouts, kernel_cls.caps.alignment)
    gen = torch.Generator(device).manual_seed(rank)
    local = ctx.num_local_experts
    w13 = torch.randn(local, 2 * inter, hidden, generator=gen, device=device, dtype=torch.bfloat16) / hidden**0.5
    w2 = torch.randn(local, hidden, inter, generator=gen, device=device, dtype=torch.bfloat16) / inter**0.5
    prepared = kernel.prepare_weights(ExpertWeights(w13, w2))

    def layer():
        dispatched = dispatcher.dispatch(x, physical, weights)
        layout, restore = adapter(dispatched.layout)
        return dispatcher.combine(restore(kernel.apply(layout, prepared)), dispatched.handle)

    seconds = slowest_median(layer, args.iters, args.warmup, device)
    pairs = torch.bincount(physical.flatten() // local, minlength=world).to(device, torch.float64)
    dist.all_reduce(pairs)
    del dispatcher, kernel, prepared, w13, w2
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"us": seconds * 1e6, "max_pairs": int(pairs.max()), "balancedness": (pairs.mean() / pairs.max()).item()}


def eplb_table(args, rows: list[dict]) -> list[str]:
    setup = EplbSetup.of(args)
    shape = f"hidden {setup.hidden}, {setup.experts} experts, intermediate {setup.intermediate}" + (" (CPU check)" if args.cpu else "")
    lines = [
        f"### One MoE layer under a Zipf-skewed router, EPLB on and off, {args.gpus} ranks",
        "",
        f"{shape}, top-{TOP_K}, {GROUPS} expert groups, {setup.tokens} tokens per rank, `{setup.dispatcher}` + `{setup.kernel}` in bf16; hot "
        "experts at random positions. EPLB places from a calibration batch (4x the tokens) and is measured on "
        "other batches of the same law. Max pairs: (token, expert) pairs on the busiest rank; balancedness: mean "
        f"over max of the ranks' pairs. Median of {args.iters} layers after {args.warmup}, slowest rank.",
        "",
        "| Zipf skew | placement | slots | max pairs | balancedness | layer µs | vs static |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    reference = {}
    for row in rows:
        base = reference.setdefault(row["skew"], row["us"])
        lines.append(f"| {row['skew']} | {row['placement']} | {row['slots']} | {row['max_pairs']} | "
                     f"{row['balancedness']:.3f} | {row['us']:.0f} | {base / row['us']:.2f}x |")
    return lines


def dispatch_table(args, rows: list[dict]) -> list[str]:
    shape = "hidden 1024, 64 experts (CPU check)" if args.cpu else f"hidden {HIDDEN}, {EXPERTS} experts"
    lines = [
        f"### Dispatch + combine per MoE layer, {args.gpus} ranks",
        "",
        f"{shape}, top-{TOP_K}, uniform routing, identity experts; median of {args.iters} layers after "
        f"{args.warmup}, slowest rank. GB/s: bytes of rows leaving this rank in dispatch and reaching it back in "
        "combine, per rank, over the layer time.",
        "",
        "| batch | tokens/rank | dispatcher | rows sent as | layer µs | GB/s per rank |",
        "|---|---:|---|---|---:|---:|",
    ]
    for row in rows:
        if "skipped" in row:
            lines.append(f"| {row['batch']} | {row['tokens']} | {row['dispatcher']} | {row['payload']} | "
                         f"skipped: {row['skipped']} | |")
        else:
            lines.append(f"| {row['batch']} | {row['tokens']} | {row['dispatcher']} | {row['payload']} | "
                         f"{row['us']:.0f} | {row['gbps']:.1f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpus", type=int, default=2, help="ranks, one per GPU (default: 2)")
    parser.add_argument("--parts", nargs="+", choices=("correctness", "dispatch", "eplb", "decode"),
                        default=["correctness", "dispatch", "eplb", "decode"], help="what to run (default: all four)")
    parser.add_argument("--decode-tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256],
                        help="decode tokens per rank of the decode part (default: 1 2 4 ... 256; --cpu: 1 2 3)")
    parser.add_argument("--decode-pairs", nargs="+", default=["naive:triton", "deepep-ll:deepgemm"],
                        help="dispatcher:kernel pairs of the decode part (default: naive:triton deepep-ll:deepgemm)")
    parser.add_argument("--decode-overlaps", nargs="+", default=["none", "tbo"],
                        help="overlap strategies of the decode part (default: none tbo)")
    parser.add_argument("--decode-layers", type=int, default=4,
                        help="DeepSeek-V3 layers in the decode part, the first dense (default: 4)")
    parser.add_argument("--skews", type=float, nargs="+", default=[0.8, 1.2], help="Zipf exponents of the EPLB part")
    parser.add_argument("--redundant", type=int, default=32, help="redundant expert slots in the EPLB part (default: 32)")
    parser.add_argument("--eplb-dispatcher", default="naive",
                        help="dispatcher of the EPLB part on GPUs (default: naive; deepep-normal holds at most 128 slots per rank)")
    parser.add_argument("--iters", type=int, default=20, help="timed layers per measurement (default: 20)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed layers first (default: 5)")
    parser.add_argument("--max-new-tokens", type=int, default=24, help="greedy tokens per prompt (default: 24)")
    parser.add_argument("--bf16-factor", type=float, default=2.0,
                        help="how many times one GPU's bf16 error a bf16 run over several ranks may show (default: 2)")
    parser.add_argument("--profile", type=Path, help="write rank 0's kernel table of every dispatch row to this folder")
    parser.add_argument("--dispatchers", nargs="+", help="dispatchers of the correctness part (default: all four)")
    parser.add_argument("--cpu", action="store_true", help="check the script on gloo ranks with CPU plugins")
    parser.add_argument("--out", type=Path, help="also write the Markdown to this file")
    args = parser.parse_args()
    if not args.cpu and torch.cuda.device_count() < args.gpus:
        parser.error(f"--gpus {args.gpus} needs that many CUDA devices; {torch.cuda.device_count()} visible")
    machine = "CPU (gloo)" if args.cpu else f"{args.gpus} x {torch.cuda.get_device_name(0)}"
    lines = [f"## Expert parallelism on {machine}", "", f"torch {torch.__version__}, {datetime.date.today()}.", ""]
    if "correctness" in args.parts:
        dispatchers = args.dispatchers or (["naive"] if args.cpu else ["naive", "deepep-normal", "deepep-ll", "deepep-auto"])
        lines += correctness(args, dispatchers) + [""]
    if {"dispatch", "eplb"} & set(args.parts):
        with tempfile.TemporaryDirectory() as tmp:
            out_path = os.path.join(tmp, "rows.json")
            mp.spawn(rank_main, args=(args.gpus, free_port(), args, out_path), nprocs=args.gpus)
            rows = json.loads(Path(out_path).read_text())
        if rows["dispatch"]:
            lines += dispatch_table(args, rows["dispatch"]) + [""]
        if rows["eplb"]:
            lines += eplb_table(args, rows["eplb"]) + [""]
    if "decode" in args.parts:
        lines += decode_part(args)
    emit("\n".join(lines), args.out)


def decode_part(args) -> list[str]:
    """Part 4: decode steps over the ranks against one GPU (ep_decode_steps.py)."""
    pairs = [tuple(pair.split(":", 1)) for pair in args.decode_pairs]
    if args.cpu:  # the CPU plugins, the tiny model, a few tokens: a check of the script
        pairs = [("naive", "torch")]
    tokens = (1, 2, 3) if args.cpu and args.decode_tokens == [1, 2, 4, 8, 16, 32, 64, 128, 256] else args.decode_tokens
    with tempfile.TemporaryDirectory() as tmp:
        folder = ep_decode_steps.make_model(tmp, args.decode_layers, args.cpu)
        setup = ep_decode_steps.DecodeSetup(folder, "cpu" if args.cpu else "cuda", "fp32" if args.cpu else "bf16",
                                            tuple(tokens), args.iters, args.warmup)
        rows = ep_decode_steps.measure(setup, args.gpus, pairs, args.decode_overlaps, f"127.0.0.1:{free_port()}")
    shape = ("DeepSeek-V3 tiny (CPU check)" if args.cpu else
             f"DeepSeek-V3 shapes, {args.decode_layers} layers (the first dense), dummy weights")
    return ep_decode_steps.table(setup, rows, shape)


if __name__ == "__main__":
    main()
