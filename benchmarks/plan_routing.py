"""The routing of e2e_gpu.py's dummy-weight decode rows, recorded: distinct experts a decode step hits per MoE layer.

`moeplex plan` prices routed experts by the experts a step hits. Uniform routing of B tokens x top-k over E
experts hits E (1 - (1 - k/E)^B); the dummy (random) weights of e2e_gpu.py route otherwise (a random correction
bias, grouped top-k, decode tokens that greedy decoding makes alike). This script runs the same model folder,
prompts and sampling as e2e_gpu.py's decode rows (benchmarks/e2e_gpu.py -> moeplex.cli.bench_one_batch.measure:
`random.Random(batch)` prompts of 128 tokens below 256, greedy, 16 new tokens) with a hook on the expert load and
writes, per batch, the distinct experts of every decode step and MoE layer as JSON, with the profile entry
`routing_deepseek_v3` that `moeplex plan profile-update` merges into a profile (core/plan/routing.py reads it).

    python benchmarks/plan_routing.py --out routing_dsv3.json                 # on the H200: the measured run's model
    python benchmarks/plan_routing.py --device cpu --batches 32 --set moe_intermediate_size=64 \\
        --set intermediate_size=64 --out routing_cpu.json                     # a CPU stand-in (narrower MLPs)

On a CPU the MLP widths must shrink to fit: the router, its correction bias, the embeddings and attention keep
the measured run's exact dummy values (each tensor is drawn from its name and the seed), the MLPs are other
random draws of the same law. Decode runs eagerly (a hook sees no replayed graph); routing does not depend on it.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile

import pluggy
import torch

from moeplex.config import EngineConfig
from moeplex.engine import Engine
from moeplex.hooks import make_plugin_manager
from moeplex.models.make_model import write_checkpoint
from moeplex.sampling import SamplingParams

hookimpl = pluggy.HookimplMarker("moeplex")


class StepLoads:
    """Collects each MoE layer's per-expert counts of every forward step."""

    def __init__(self) -> None:
        self.steps: list[dict[int, list[int]]] = [{}]

    @hookimpl
    def moeplex_expert_load_recorded(self, layer_id, counts):
        self.steps[-1][layer_id] = counts.tolist()

    @hookimpl
    def moeplex_forward_done(self, batch, logits):
        self.steps.append({})


def uniform_distinct(experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts of `tokens` tokens each choosing top_k distinct experts uniformly."""
    return experts * (1 - (1 - top_k / experts) ** tokens)


def record(engine: Engine, loads: StepLoads, batch: int, input_len: int, output_len: int) -> list[dict[int, list[int]]]:
    """The decode steps' loads of one batch, prompts and sampling as bench_one_batch.measure makes them."""
    rng = random.Random(batch)
    vocab = min(engine.vocab_size, 256)
    params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request([rng.randrange(vocab) for _ in range(input_len)], params)
    loads.steps = [{}]
    while engine.has_work:
        engine.step()
    # decode steps: every request's one token (prefill steps, chunked or not, route more)
    return [s for s in loads.steps if s and sum(next(iter(s.values()))) == batch * engine_top_k(engine)]


def engine_top_k(engine: Engine) -> int:
    return engine.model.hf_config["num_experts_per_tok"]


def histogram(counts: list[list[int]]) -> list[list[float]]:
    """[[rows, mean experts with that many rows]] over the recorded (step, layer) count vectors."""
    seen: dict[int, int] = {}
    for vector in counts:
        for rows in vector:
            if rows:
                seen[rows] = seen.get(rows, 0) + 1
    return [[rows, round(n / len(counts), 4)] for rows, n in sorted(seen.items())]


def merge_records(paths: list[str]) -> dict:
    """Records of separate runs of the same model and command as one: their batches together, their sources joined."""
    records = []
    for path in paths:
        with open(path) as f:
            records.append(json.load(f))
    merged = dict(records[0], batches={})
    for record in records:
        if (record["experts"], record["top_k"], record["overrides"]) != (merged["experts"], merged["top_k"], merged["overrides"]):
            raise SystemExit(f"records of different models cannot be merged: {paths}")
        merged["batches"].update(record["batches"])
    merged["source"] = "; ".join(dict.fromkeys(record["source"] for record in records))
    merged["batches"] = dict(sorted(merged["batches"].items(), key=lambda item: int(item[0])))
    return merged


def profile_entry(result: dict, steps: int) -> dict:
    """The entry `moeplex plan profile-update` merges (core/plan/routing.py reads it)."""
    return {
        "value": {"experts": result["experts"], "top_k": result["top_k"],
                  "batches": [[int(b), histogram(r["counts"])] for b, r in result["batches"].items()]},
        "unit": "per decode batch: [tokens, [[rows, mean experts that received that many pairs per step and MoE layer]]]",
        "source": f"{result['source']}: e2e_gpu.py's dummy-weight decode rows (same folder, seed, prompts and greedy "
                  f"sampling), {steps} decode steps per batch",
    }


def router_only(config: dict, batches, steps: int, seed: int = 0) -> dict:
    """Each MoE layer's router alone (moeplex's Router with the run's dummy gate weight and correction bias, from
    their names and the seed) on independent unit-RMS inputs scaled by the layer's dummy post-attention norm weight:
    what the bias and grouped top-k do without the model making tokens alike. Cheap at any batch."""
    from moeplex.models.deepseek_v3 import is_moe_layer, router_spec
    from moeplex.models.random_weights import named_random_tensor
    from moeplex.moe.router import Router

    hidden = config["hidden_size"]
    layers = [i for i in range(config["num_hidden_layers"]) if is_moe_layer(config, i)]
    routers, norms = [], []
    for i in layers:
        router = Router(hidden, router_spec(config))
        prefix = f"model.layers.{i}"
        router.weight.data.copy_(named_random_tensor(f"{prefix}.mlp.gate.weight", tuple(router.weight.shape), seed))
        router.e_score_correction_bias.data.copy_(named_random_tensor(f"{prefix}.mlp.gate.e_score_correction_bias", (config["n_routed_experts"],), seed))
        routers.append(router)
        norms.append(named_random_tensor(f"{prefix}.post_attention_layernorm.weight", (hidden,), seed))
    gen = torch.Generator().manual_seed(seed + 1)
    out = {}
    for batch in batches:
        counts = []
        for _ in range(steps):
            for router, norm in zip(routers, norms):
                ids, _ = router(torch.randn(batch, hidden, generator=gen) * norm)
                counts.append(torch.bincount(ids.flatten(), minlength=config["n_routed_experts"]).tolist())
        out[batch] = counts
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--preset", default="v3", help="deepseek_v3 preset (v3: the released shapes)")
    parser.add_argument("--layers", type=int, default=4, help="num_hidden_layers, as e2e_gpu.py (4)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128, 256])
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens (e2e_gpu.py DECODE_CONTEXT)")
    parser.add_argument("--output-len", type=int, default=16, help="new tokens per request (e2e_gpu.py: 16)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=INT",
                        help="config.json override (a CPU run narrows moe_intermediate_size and intermediate_size)")
    parser.add_argument("--chunk", type=int, help="prefill tokens per step (default: the whole batch, as e2e_gpu.py; a CPU run "
                        "chunks to keep activations small: routing is per token)")
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--router-only", action="store_true",
                        help="no model run: each MoE layer's dummy router alone on independent unit-RMS inputs (CPU, seconds)")
    parser.add_argument("--from-record", metavar="JSON", nargs="+",
                        help="no run: write --out from earlier records of the same model (their batches together) and the entry again")
    args = parser.parse_args()
    if args.from_record:
        result = merge_records(args.from_record)
        steps = len(next(iter(result["batches"].values()))["distinct"])
        result[f"routing_{result.get('model_type', 'deepseek_v3')}"] = profile_entry(result, steps)
        with open(args.out, "w") as f:
            json.dump(result, f)
        return
    overrides = {"num_hidden_layers": args.layers}
    overrides.update({k: int(v) for k, v in (item.split("=", 1) for item in args.set)})
    if args.router_only:
        from moeplex.models.deepseek_v3 import PRESETS

        config = {**PRESETS[args.preset], **overrides}
        counts = router_only(config, args.batches, args.output_len - 1)
        experts, top_k = config["n_routed_experts"], config["num_experts_per_tok"]
        result = {"source": f"python benchmarks/plan_routing.py --router-only --preset {args.preset} --layers {args.layers} "
                            "(the dummy routers alone on independent unit-RMS inputs, CPU)",
                  "device": "cpu", "experts": experts, "top_k": top_k, "overrides": overrides, "model_type": "deepseek_v3",
                  "batches": {}}
        print("| batch | steps | distinct experts per step (mean over steps and MoE layers) | uniform | ratio |")
        print("|---:|---:|---:|---:|---:|")
        for batch, vectors in counts.items():
            distinct = [sum(1 for c in v if c) for v in vectors]
            mean, uniform = statistics.mean(distinct), uniform_distinct(experts, top_k, batch)
            result["batches"][str(batch)] = {"distinct": distinct, "mean_distinct": mean, "uniform_distinct": uniform, "counts": vectors}
            print(f"| {batch} | {len(vectors)} | {mean:.1f} | {uniform:.1f} | {mean / uniform:.3f} |", flush=True)
        result["routing_deepseek_v3"] = profile_entry(result, args.output_len - 1)
        with open(args.out, "w") as f:
            json.dump(result, f)
        return
    folder = write_checkpoint(tempfile.mkdtemp(), "deepseek_v3", args.preset, overrides=overrides, config_only=True)
    cuda = args.device.startswith("cuda")
    largest = max(args.batches)
    chunk = args.chunk or largest * args.input_len
    config = EngineConfig(model=folder, device=args.device, dtype="bf16", load_format="dummy",
                          show_progress=False, max_running_requests=largest, disable_cuda_graph=True,
                          max_batched_tokens=max(chunk, largest), chunked_prefill_size=chunk,
                          max_total_tokens=largest * (args.input_len + args.output_len + 16))
    loads = StepLoads()
    hooks = make_plugin_manager()
    hooks.register(loads)
    engine = Engine(config, hooks=hooks)
    hf = engine.model.hf_config
    experts, top_k = hf["n_routed_experts"], hf["num_experts_per_tok"]
    result = {
        "source": " ".join([f"python benchmarks/plan_routing.py --device {args.device} --preset {args.preset} --layers {args.layers}"]
                           + [f"--set {s}" for s in args.set]) + f" ({torch.cuda.get_device_name() if cuda else 'CPU'}; seed 0 dummy weights)",
        "device": torch.cuda.get_device_name() if cuda else "cpu", "experts": experts, "top_k": top_k,
        "overrides": overrides, "model_type": hf["model_type"], "batches": {},
    }
    print("| batch | decode steps | distinct experts per step (mean over steps and MoE layers) | uniform | ratio |")
    print("|---:|---:|---:|---:|---:|")
    for batch in args.batches:
        steps = record(engine, loads, batch, args.input_len, args.output_len)
        distinct = [sum(1 for c in counts if c) for step in steps for counts in step.values()]
        mean = statistics.mean(distinct)
        uniform = uniform_distinct(experts, top_k, batch)
        result["batches"][str(batch)] = {"distinct": distinct, "mean_distinct": mean, "uniform_distinct": uniform,
                                         "counts": [counts for step in steps for counts in step.values()]}
        print(f"| {batch} | {len(steps)} | {mean:.1f} | {uniform:.1f} | {mean / uniform:.3f} |", flush=True)
    result[f"routing_{hf['model_type']}"] = profile_entry(result, args.output_len - 1)
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
