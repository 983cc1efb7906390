"""`moeplex plan`: predict a deployment's tokens/s per node, TTFT and ITL from a hardware profile (docs/plan.md)."""

from __future__ import annotations

import dataclasses

ROLE_KEYS = "gpus, ep, dispatcher (local, deepep-normal, deepep-ll, deepep-auto), moe_kernel (triton, deepgemm), dtype (bf16, fp8), redundant_experts, balancer (static, eplb, eplb-vec), overlap (none, tbo), graphs (true/false)"


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="performance model of a PD + large-EP deployment: predict, search layouts, check against measurements (see docs/plan.md)")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    predict = actions.add_parser("predict", help="predict one deployment: tokens/s per node, TTFT, ITL and the per-layer time split")
    _common(predict)
    predict.add_argument("--prefill-layout", default="gpus=32,ep=32,redundant_experts=32,overlap=tbo", help=f"the prefill role as KEY=VALUE,... with keys {ROLE_KEYS} (default: %(default)s; unset keys take the RoleLayout defaults: deepep-auto, deepgemm, fp8, eplb)")
    predict.add_argument("--decode-layout", default="gpus=72,ep=72,redundant_experts=32,overlap=tbo", help="the decode role, same keys (default: %(default)s)")
    predict.add_argument("--colocated", action="store_true", help="one pool does prefill and decode (the prefill layout is used for both)")
    predict.add_argument("--decode-batch", type=int, default=128, help="decode tokens per GPU per step when --rate is not given (default: 128)")
    predict.add_argument("--rate", type=float, help="arrival rate in requests/s: the decode batch follows from it, and TTFT includes queueing")
    predict.set_defaults(run=run_predict)
    search = actions.add_parser("search", help="search PD splits, EP sizes, overlap, redundant experts and decode batches for the best layout")
    _common(search)
    search.add_argument("--gpus", type=int, required=True, help="GPUs to deploy on")
    search.add_argument("--max-itl-ms", type=float, help="bound on the p99 inter-token latency (ms)")
    search.add_argument("--max-ttft-ms", type=float, help="bound on the time to first token without queueing (ms)")
    search.add_argument("--moe-kernel", default="deepgemm", choices=("deepgemm", "triton"), help="MoE kernel of every candidate (default: deepgemm)")
    search.add_argument("--dtype", default="fp8", choices=("fp8", "bf16"), help="weights and dispatch payload (default: fp8)")
    search.add_argument("--top", type=int, default=5, help="layouts to print (default: 5)")
    search.add_argument("--prefill-tokens-grid", type=int, nargs="+", default=[4096, 16384], help="prefill tokens per GPU per step to try (default: 4096 16384)")
    search.set_defaults(run=run_search)
    check = actions.add_parser("check", help="the model against our measured tables and SGLang's and DeepSeek's published cluster numbers, with the error")
    check.add_argument("--only", choices=("own", "published"), help="one group of cases (default: both)")
    check.add_argument("--profile", default="h200", help="profile for our own H200 tables: h200 or a measured profile file (default: h200)")
    check.add_argument("--zipf-skew", type=float, default=1.0, help="skew of the synthetic expert load for the published cases (default: 1.0)")
    check.add_argument("--expert-load", help="a recorded DeepSeek-V3 expert load for the published cases instead of the synthetic one: logical_count [layers][experts], or a load_history of logical_expert_load (vLLM's recorder)")
    check.set_defaults(run=run_check)
    sources = actions.add_parser("sources", help="print every number of a hardware profile with its source")
    sources.add_argument("--profile", default="h200", help="h200, h100, h800 or a profile JSON file (default: h200)")
    sources.set_defaults(run=run_sources)
    update = actions.add_parser("profile-update", help="lay the measured entries of benchmarks/plan_profile.sh's outputs over a profile and write the result (each number keeps its source)")
    update.add_argument("measured", nargs="+", help="JSON files of profile entries ({KEY: {value, source}}; moe_tables by name), laid over the base in this order")
    update.add_argument("--base", default="h200", help="the profile they update: h200 or a profile JSON file (default: h200)")
    update.add_argument("--out", required=True, help="the profile JSON to write (read it with --profile FILE; copy it over core/plan/profiles/h200.json in a reviewed commit)")
    update.set_defaults(run=run_profile_update)


def _common(p) -> None:
    p.add_argument("--model", default="deepseek_v3:v3", help="a config.json (or its folder), or ARCH:PRESET of our architectures (default: deepseek_v3:v3)")
    p.add_argument("--profile", default="h200", help="h200 (measured), h100 or h800 (derived by spec ratios), or a profile JSON file (default: h200)")
    p.add_argument("--input-len", type=int, default=2000, help="prompt tokens (default: 2000)")
    p.add_argument("--output-len", type=int, default=500, help="answer tokens (default: 500)")
    p.add_argument("--prefill-tokens", type=int, default=16384, help="prefill tokens per GPU per step (default: 16384)")
    p.add_argument("--zipf-skew", type=float, default=1.0, help="skew of the synthetic Zipf expert load EPLB balances (default: 1.0)")
    p.add_argument("--expert-load", help="a recorded expert load JSON instead of the synthetic one: logical_count [layers][experts] (as `moeplex eplb` reads), or a load_history of logical_expert_load (vLLM's recorder)")


def _inputs(args):
    from ..plan.deployment import Workload
    from ..plan.profile import load_profile
    from ..plan.shapes import load_config, model_shape

    recorded = None
    if args.expert_load:
        from ..plan.imbalance import read_expert_load

        recorded = read_expert_load(args.expert_load)
    workload = Workload(args.input_len, args.output_len, args.zipf_skew, recorded)
    return load_profile(args.profile), model_shape(load_config(args.model)), workload


def parse_layout(text: str):
    """KEY=VALUE,... into a RoleLayout; ep defaults to the role's GPUs and the local dispatcher to EP 1."""
    from ..plan.deployment import RoleLayout

    fields = {f.name: f.type for f in dataclasses.fields(RoleLayout)}
    values: dict = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in fields:
            raise ValueError(f"layout item {item!r}: expected KEY=VALUE with KEY one of {', '.join(fields)}")
        kind = fields[key]
        if kind in (int, "int"):
            values[key] = int(value)
        elif kind in (bool, "bool"):
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"layout item {item!r}: {key} takes true or false")
            values[key] = value.lower() in ("true", "1")
        else:
            values[key] = value
    if "gpus" in values and "ep" not in values:
        values["ep"] = values["gpus"]
    if values.get("ep") == 1 and "dispatcher" not in values:
        values["dispatcher"] = "local"
    return RoleLayout(**values)


def run_predict(args) -> int:
    from ..plan.deployment import Deployment, predict
    from ..plan.report import print_prediction

    hw, shape, workload = _inputs(args)
    prefill = parse_layout(args.prefill_layout)
    decode = prefill if args.colocated else parse_layout(args.decode_layout)
    dep = Deployment(prefill, decode, args.prefill_tokens, args.decode_batch, not args.colocated)
    print_prediction(hw, shape, dep, workload, predict(hw, shape, dep, workload, args.rate))
    return 0


def run_search(args) -> int:
    from ..plan.report import print_search
    from ..plan.search import search

    hw, shape, workload = _inputs(args)
    tokens = tuple(args.prefill_tokens_grid)
    best, priced = search(hw, shape, workload, args.gpus, args.max_itl_ms, args.max_ttft_ms, args.moe_kernel, args.dtype, tokens, args.top)
    print_search(hw, args, best, priced)
    return 0 if best else 1


def run_check(args) -> int:
    from ..plan.checks import own_cases, published_cases, run_cases
    from ..plan.report import print_checks

    cases = []
    if args.only in (None, "own"):
        cases += own_cases(args.profile)
    if args.only in (None, "published"):
        recorded = None
        if args.expert_load:
            from ..plan.imbalance import read_expert_load

            recorded = read_expert_load(args.expert_load)
        cases += published_cases(args.zipf_skew, recorded)
    print_checks(run_cases(cases))
    return 0


def run_sources(args) -> int:
    from ..plan.profile import load_profile
    from ..plan.report import print_sources

    print_sources(load_profile(args.profile))
    return 0


def run_profile_update(args) -> int:
    from ..plan.profile import load_profile
    from ..plan.profile_update import merge, short, write

    data, changes = merge(args.base, args.measured)
    write(data, args.out)
    load_profile(args.out)  # what was written is a profile the model reads
    print(f"wrote {args.out} ({len(changes)} entries changed over {args.base}):")
    print("| entry | before | after | source |")
    print("|---|---|---|---|")
    for key, old, new, source in changes:
        print(f"| {key} | {short(old)} | {short(new)} | {source} |")
    return 0
