"""Plain-text tables for `moeplex plan` (markdown, so they paste into docs and issues)."""

from __future__ import annotations

from .deployment import SPLIT_TERMS, Deployment, DeploymentPrediction, Workload
from .profile import Profile
from .shapes import ModelShape


def _layout(role) -> str:
    return (
        f"{role.gpus} GPUs, EP{role.ep}, {role.dispatcher}, {role.moe_kernel} {role.dtype}, "
        f"{role.redundant_experts} redundant ({role.balancer}), overlap {role.overlap}, graphs {'on' if role.graphs else 'off'}"
    )


def print_prediction(hw: Profile, shape: ModelShape, dep: Deployment, workload: Workload, pred: DeploymentPrediction) -> None:
    kind = "PD-disaggregated" if dep.disaggregated else "co-located"
    print(f"## {shape.arch}, {shape.layers} layers ({shape.moe_layers} MoE), profile {hw.name}, {kind}")
    print(f"workload: {workload.input_len}-token prompts, {workload.output_len}-token answers, Zipf({workload.zipf_skew}) expert load" if workload.recorded_load is None
          else f"workload: {workload.input_len}-token prompts, {workload.output_len}-token answers, recorded expert load")
    print(f"prefill: {_layout(dep.prefill)}; {dep.prefill_tokens_per_gpu} tokens/GPU/step")
    print(f"decode:  {_layout(dep.decode)}; {pred.decode.tokens_per_gpu:.0f} tokens/GPU/step")
    print()
    print("| role | step ms | tokens/s per node | balancedness |")
    print("|---|---:|---:|---:|")
    print(f"| prefill | {pred.prefill.step_us / 1e3:.2f} | {pred.prefill_tok_s_node:.0f} | {pred.prefill.balancedness:.3f} |")
    print(f"| decode | {pred.decode.step_us / 1e3:.2f} | {pred.decode_tok_s_node:.0f} | {pred.decode.balancedness:.3f} |")
    print()
    print(f"TTFT {pred.ttft_ms:.1f} ms, ITL {pred.itl_ms:.2f} ms (p99 {pred.itl_p99_ms:.2f} ms), {pred.requests_per_s:.2f} requests/s sustained")
    print()
    print("One MoE layer, µs per GPU (dense: the dense layers' time spread over the MoE layers; idle: waiting for the busiest rank's experts;")
    print("host: what the host's launches add to an eager step, or the gaps between a replayed graph's kernels):")
    print()
    print("| role | " + " | ".join(SPLIT_TERMS) + " |")
    print("|---|" + "---:|" * len(SPLIT_TERMS))
    for name, step in (("prefill", pred.prefill), ("decode", pred.decode)):
        print(f"| {name} | " + " | ".join(f"{step.split_us[t]:.0f}" for t in SPLIT_TERMS) + " |")
    for note in pred.prefill.notes + pred.decode.notes:
        print(f"- {note}")


def print_search(hw: Profile, args, best, priced: int) -> None:
    bounds = [f"ITL p99 <= {args.max_itl_ms} ms" if args.max_itl_ms else "", f"TTFT <= {args.max_ttft_ms} ms" if args.max_ttft_ms else ""]
    bounds = ", ".join(b for b in bounds if b) or "no latency bound"
    print(f"## layout search: {args.model} on {args.gpus} x {hw.name}, {args.input_len}-token prompts, {args.output_len}-token answers, {bounds}")
    print(f"{priced} layouts fit in memory and were priced; best by requests/s sustained:")
    print()
    print("| # | layout | requests/s | prefill tok/s/node | decode tok/s/node | TTFT ms | ITL ms | ITL p99 ms |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for i, c in enumerate(best, 1):
        p = c.prediction
        print(f"| {i} | {c.describe()} | {p.requests_per_s:.2f} | {p.prefill_tok_s_node:.0f} | {p.decode_tok_s_node:.0f} | {p.ttft_ms:.0f} | {p.itl_ms:.1f} | {p.itl_p99_ms:.1f} |")
    if not best:
        print("| - | no layout meets the bounds | | | | | | |")


def print_checks(rows) -> None:
    print("| group | case | measured / published | predicted | error | target | source |")
    print("|---|---|---:|---:|---:|---|---|")
    for case, predicted, error in rows:
        mark = "within" if abs(error) <= case.target else "outside"
        print(f"| {case.group} | {case.name} | {case.measured:g} {case.unit} | {predicted:.4g} | {error:+.1%} | {mark} ±{case.target:.0%} | {case.source} |")


def print_sources(hw: Profile) -> None:
    print(f"## hardware profile {hw.name}")
    for note in hw.notes:
        print(f"> {note}")
    print()
    print("| key | value | source |")
    print("|---|---|---|")
    for key, value in hw.values.items():
        print(f"| {key} | {value} | {hw.sources[key]} |")
    for key, table in hw.moe.items():
        print(f"| moe table {key} ({table.kernel} {table.dtype}, H={table.shape[0]}, I={table.shape[1]}) | {len(table.rows)} points | {table.source} |")
    print(f"| launches | {hw.launches} | {hw.sources['launches']} |")
