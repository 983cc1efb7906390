"""`moeplex eplb plan`: a placement file from a recorded expert load (for --init-expert-location);
`moeplex eplb report`: the load per GPU before and after balancing, drawn into a PNG."""

from __future__ import annotations

import sys

from ..moe.load_report import ShapeFlags, build_report, draw, read_load
from ..moe.rebalance import PlacementShape, placement_record, write_json
from ..registry import lookup


def add_parser(sub) -> None:
    p = sub.add_parser("eplb", help="plan expert placements from a recorded load, or draw a load report (see docs/eplb.md)")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    plan = actions.add_parser("plan", help="balance LOAD.json into PLACEMENT.json")
    plan.add_argument("--load", required=True, help="JSON with logical_count [layers][experts] or [steps][layers][experts]")
    plan.add_argument("--num-physical-experts", type=int, required=True, help="physical slots (experts + redundant)")
    plan.add_argument("--num-groups", type=int, default=1, help="expert groups (DeepSeek-V3 n_group; default: 1)")
    plan.add_argument("--num-nodes", type=int, default=1, help="nodes (default: 1)")
    plan.add_argument("--num-gpus", type=int, required=True, help="EP ranks")
    plan.add_argument("--balancer", default="eplb", help="balancer (default: eplb)")
    plan.add_argument("--out", required=True, help="placement file to write (phy2log, logcnt, balancedness)")
    plan.set_defaults(run=run_plan)
    add_report_parser(actions)


def add_report_parser(actions) -> None:
    report = actions.add_parser("report", help="draw the per-GPU load before and after balancing into a PNG (matplotlib)")
    report.add_argument("--load", required=True, help="load file or dump (logical_count; a dump also gives shape and placement)")
    report.add_argument("--placement", help="placement after balancing (JSON with phy2log); default: --balancer's plan")
    report.add_argument("--out", required=True, help="PNG file to write")
    report.add_argument("--balancer", default="eplb", help="balancer computing 'after' without --placement (default: eplb)")
    report.add_argument("--num-gpus", type=int, help="EP ranks (default: the dump's shape)")
    report.add_argument("--num-physical-experts", type=int, help="physical slots (default: the dump's, else experts)")
    report.add_argument("--num-nodes", type=int, help="nodes (default: the dump's, else 1)")
    report.add_argument("--num-groups", type=int, help="expert groups (default: the dump's, else 1)")
    report.set_defaults(run=run_report)


def run_plan(args) -> int:
    _, load = read_load(args.load)
    layers, experts = load.shape[-2:]
    shape = PlacementShape(layers, experts, args.num_physical_experts, args.num_groups, args.num_nodes, args.num_gpus)
    placement = shape.plan(lookup("balancer", args.balancer)(), load)
    record = {**placement_record(placement, load, args.num_gpus), "num_gpus": args.num_gpus}  # read by `eplb report`
    write_json(args.out, record)
    mean = sum(record["balancedness"]) / len(record["balancedness"])
    print(f"wrote {args.out}: {layers} layers, {args.num_physical_experts} slots, mean balancedness {mean:.3f}")
    return 0


def run_report(args) -> int:
    flags = ShapeFlags(args.num_gpus, args.num_physical_experts, args.num_nodes, args.num_groups)
    report = build_report(args.load, args.placement, flags, lookup("balancer", args.balancer)())
    try:
        draw(report, args.out)
    except ImportError as exc:
        print(f"moeplex eplb: error: {exc}", file=sys.stderr)
        return 2
    before, after = report.balancedness()
    print(f"wrote {args.out}: mean balancedness {before:.3f} before, {after:.3f} after")
    return 0
