"""Part 4 of ep_multi_gpu.py: one decode step over EP ranks, CUDA graphs vs eager, `tbo` vs `none`, dispatchers.

Every rank runs DP attention over its own decode batch of N requests (N tokens per rank, each with a
cached prefix of PREFIX tokens) of DeepSeek-V3's shapes cut to a few layers, with dummy weights; the MoE
layers go through one dispatcher + kernel pair. A step is what the engine runs: the step agreement (one
small host collective from which every rank learns the padded size, Engine._agree) and then
ModelRunner.forward: a graph replay at the agreed size, or, with the engine's graphs set aside, the eager
step. Time: the slowest rank's median, with a device sync after every step. The reference is one GPU
(`local` + `triton`, graphs) at the same tokens per rank, measured in the same run; the target is a
multi-rank step within TARGET x of it.

With --cpu (a check of the script, not a measurement): the tiny model on gloo ranks; where the attention
backend is graph-safe (TRITON_INTERPRET=1 in the environment) the ranks get graphs whose capture calls
the step, so the agreed padding and the replay path still run.
"""

from __future__ import annotations

import gc
import statistics
import time

import attrs
import torch
import torch.distributed as dist

from moeplex.batch_builder import ScheduledSeq, build_forward_batch
from moeplex.config import EngineConfig
from moeplex.cuda_graph import DecodeGraphs, DecodeInputs, capture_sizes, max_pages_per_request
from moeplex.engine import Engine
from moeplex.models.make_model import write_checkpoint
from moeplex.parallel import ParallelConfig, init_parallel, rank_device
from moeplex.ranks.launcher import launch
from moeplex.registry import PluginError, lookup

PREFIX = 256  # cached tokens of every decoding request
PAGE = 16  # KV page size
TARGET = 1.3  # a multi-rank step within this factor of one GPU's at the same tokens per rank
REFERENCE = ("local", "triton")  # the one-GPU run (on the CPU check: `local` + `torch`)


@attrs.frozen
class DecodeSetup:
    folder: str
    device: str  # cuda or cpu
    dtype: str
    tokens: tuple[int, ...]  # decode tokens (requests) per rank
    iters: int
    warmup: int


def make_model(folder: str, layers: int, cpu: bool) -> str:
    if cpu:
        return write_checkpoint(folder, "deepseek_v3", "tiny", seed=0)
    overrides = {"num_hidden_layers": layers, "first_k_dense_replace": 1}
    return write_checkpoint(folder, "deepseek_v3", "v3", seed=0, overrides=overrides, config_only=True)


def engine_config(setup: DecodeSetup, device: str, dispatcher: str, kernel: str, overlap: str,
                  parallel: ParallelConfig) -> EngineConfig:
    largest = max(setup.tokens)
    cpu = setup.device == "cpu"
    return EngineConfig(
        model=setup.folder, device=device, dtype=setup.dtype, show_progress=False, dispatcher=dispatcher,
        moe_kernel=kernel, overlap=overlap, parallel=parallel, load_format="auto" if cpu else "dummy",
        attention_backend="auto" if not cpu else "triton" if _interpreted() else "torch",
        # every request's pages (PREFIX + its new token, in whole pages), and room to spare
        page_size=PAGE, max_total_tokens=largest * -(-(PREFIX + 1) // PAGE) * PAGE + 1024,
        max_running_requests=largest, max_batched_tokens=largest,
        chunked_prefill_size=largest, cuda_graph_max_bs=largest, max_dispatch_tokens_per_rank=largest,
        enable_multi_rank_cuda_graph=True,
    )


def _interpreted() -> bool:
    from moeplex.attention.triton_backend import INTERPRETED

    return INTERPRETED


def step_graphs(engine: Engine, world_size: int) -> None:
    """On the CPU: graphs whose capture calls the step (the replay path without a CUDA capture)."""
    kv, model = engine.kv, engine.model
    sizes = capture_sizes(engine.config.cuda_graph_max_bs)
    inputs = DecodeInputs.allocate(sizes[-1], max_pages_per_request(kv, PREFIX + 64), kv, engine.device)
    engine.runner.graphs = DecodeGraphs(model, kv, engine.runner.strategy, inputs, sizes, lambda step: step, world_size)


def decode_batch(engine: Engine, n: int):
    kv = engine.kv
    seqs = [ScheduledSeq([1], PREFIX, kv.allocate(kv.pages_for(PREFIX + 1))) for _ in range(n)]
    return build_forward_batch(seqs, kv, engine.device), [p for s in seqs for p in s.pages]


def time_steps(engine: Engine, batch, graphs: bool, setup: DecodeSetup, host_group) -> tuple[float, int | None]:
    """(the slowest rank's median seconds per step, the graph size replayed or None when eager)."""
    kept = engine.runner.graphs
    engine.runner.graphs = kept if graphs else None
    distributed = dist.is_initialized()
    times, size = [], None
    try:
        for i in range(setup.warmup + setup.iters):
            if distributed:
                dist.barrier(group=host_group)
            start = time.perf_counter()
            step = engine._agree(batch)  # the per-step collective every engine step runs
            size = engine.runner.graphs.size_for(step) if engine.runner.graphs is not None else None
            engine.runner.forward(step)
            if engine.device.type == "cuda":
                torch.cuda.synchronize(engine.device)
            if i >= setup.warmup:
                times.append(time.perf_counter() - start)
    finally:
        engine.runner.graphs = kept
    slowest = torch.tensor([statistics.median(times)], dtype=torch.float64)
    if distributed:
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=host_group)
    return float(slowest), size


def rank_rows(rank: int, parallel_config: ParallelConfig, setup: DecodeSetup, runs: tuple) -> list[dict] | None:
    """Every (dispatcher, kernel, overlap) run on this rank: eager and graphs per tokens per rank."""
    device = rank_device(setup.device, rank, parallel_config)
    parallel = init_parallel(parallel_config, rank, torch.device(device))
    rows = []
    for dispatcher, kernel, overlap in runs:
        head = dict(ranks=parallel_config.world_size, dispatcher=dispatcher, kernel=kernel, overlap=overlap)
        try:  # refusals are the same on every rank: a plugin missing, a pair that cannot work
            config = engine_config(setup, device, dispatcher, kernel, overlap, parallel_config)
            engine = Engine(config, parallel=parallel)
        except (PluginError, ValueError, ImportError) as exc:
            rows.append({**head, "skipped": str(exc).splitlines()[0]})
            if rank == 0:
                print(f"decode step: {rows[-1]}", flush=True)
            continue
        if engine.runner.graphs is None and setup.device == "cpu" and engine.model.attention_backend.graph_safe:
            step_graphs(engine, parallel_config.world_size)
        for n in setup.tokens:
            batch, pages = decode_batch(engine, n)
            row = {**head, "tokens": n}
            row["eager_s"], _ = time_steps(engine, batch, False, setup, parallel.world.host_group)
            if engine.runner.graphs is not None:
                row["graphs_s"], row["graph_size"] = time_steps(engine, batch, True, setup, parallel.world.host_group)
            engine.kv.release(pages)
            rows.append(row)
            if rank == 0:  # as it comes: a run cut short (a hang in a collective) still shows what it measured
                print(f"decode step: {row}", flush=True)
        del engine
        gc.collect()
        if setup.device == "cuda":
            torch.cuda.empty_cache()
    return rows if rank == 0 else None


def measure(setup: DecodeSetup, ranks: int, pairs: list[tuple[str, str]], strategies: list[str],
            address: str) -> list[dict]:
    """The one-rank reference, then every pair x strategy over `ranks` DP-attention + EP ranks."""
    pair = REFERENCE if setup.device == "cuda" else ("local", "torch")
    reference = launch(rank_rows, ParallelConfig(), ParallelConfig(), setup, ((*pair, "none"),), device=setup.device)
    gc.collect()
    if setup.device == "cuda":
        torch.cuda.empty_cache()
    parallel = ParallelConfig(tp_size=ranks, ep_size=ranks, dp_size=ranks, enable_dp_attention=True,
                              dist_init_addr=address, timeout_s=900)
    runs = tuple((d, k, s) for d, k in pairs for s in strategies)
    return reference + launch(rank_rows, parallel, parallel, setup, runs, device=setup.device)


def _ms(seconds) -> str:
    return f"{seconds * 1e3:.2f}" if isinstance(seconds, float) else "-"


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if isinstance(a, float) and isinstance(b, float) else "-"


def table(setup: DecodeSetup, rows: list[dict], shape: str) -> list[str]:
    one_pair = next((f"{r['dispatcher']} + {r['kernel']}" for r in rows if r["ranks"] == 1), "one rank")
    one_gpu = {r["tokens"]: r.get("graphs_s", r.get("eager_s")) for r in rows if r["ranks"] == 1 and "tokens" in r}
    none_in_graphs = {(r["dispatcher"], r["kernel"], r["tokens"]): r.get("graphs_s") for r in rows
               if r["ranks"] > 1 and r.get("overlap") == "none" and "tokens" in r}
    lines = [
        "### Decode step over EP ranks: CUDA graphs vs eager, `tbo` vs `none`",
        "",
        f"{shape}, {setup.dtype}, DP attention + EP, every request with {PREFIX} cached tokens; a step = the step "
        f"agreement + the forward (graph replay at the agreed padded size, or eager); slowest rank's median of "
        f"{setup.iters} steps after {setup.warmup}, device sync after each. vs 1 rank: the multi-rank step over one "
        f"rank's (`{one_pair}`, graphs where captured) at the same tokens per rank; target "
        f"<= {TARGET}x. tbo speed-up: the none step in graphs over the tbo step in graphs, same pair.",
        "",
        "| ranks | dispatcher + kernel | overlap | tokens/rank | graph size | eager ms | graphs ms | graphs speed-up "
        "| vs 1 rank | within target | tbo speed-up |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        pair = f"{r['dispatcher']} + {r['kernel']}"
        if "skipped" in r:
            lines.append(f"| {r['ranks']} | {pair} | {r['overlap']} | | | skipped: {r['skipped']} | | | | | |")
            continue
        best = r.get("graphs_s", r["eager_s"])
        versus = one_gpu.get(r["tokens"]) if r["ranks"] > 1 else None
        within = "-" if versus is None else ("yes" if best <= TARGET * versus else "NO")
        tbo = _ratio(none_in_graphs.get((r["dispatcher"], r["kernel"], r["tokens"])), r.get("graphs_s")) \
            if r["overlap"] == "tbo" else "-"
        lines.append(
            f"| {r['ranks']} | {pair} | {r['overlap']} | {r['tokens']} | {r.get('graph_size') or '-'} | "
            f"{_ms(r['eager_s'])} | {_ms(r.get('graphs_s'))} | {_ratio(r['eager_s'], r.get('graphs_s'))} | "
            f"{_ratio(best, versus)} | {within} | {tbo} |"
        )
    return lines
