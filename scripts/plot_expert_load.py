"""Draw an expert-load dump: the load per layer and logical expert, and the load per GPU before and after balancing.

    python scripts/plot_expert_load.py DUMP.json --out report.png [--placement PLACEMENT.json] [--balancer eplb]

DUMP.json is what `Engine.dump_recording` (POST /dump_expert_distribution_record) writes: logical_count
[layers][experts] or [steps][layers][experts], the placement in force ("before") and the placement shape.
"After" is PLACEMENT.json when given (phy2log [layers][slots]), else the balancer's placement of the load.
A bare load file ({"logical_count": ...}) works too, with the shape given by the flags.
Needs matplotlib (`pip install matplotlib`).
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from moeplex.interfaces import Placement  # noqa: E402
from moeplex.moe.rebalance import PlacementShape  # noqa: E402
from moeplex.registry import lookup  # noqa: E402


def read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def placement_shape(data: dict, args: argparse.Namespace, load: torch.Tensor) -> PlacementShape:
    """The dump's shape, with any flag given overriding it."""
    known = data.get("shape", {})
    pick = lambda flag, key, default=None: flag if flag is not None else known.get(key, default)  # noqa: E731
    gpus = pick(args.num_gpus, "num_gpus")
    if gpus is None:
        raise SystemExit(
            "the file has no placement shape: give --num-gpus (and --num-physical-experts, --num-nodes, --num-groups)"
        )
    return PlacementShape(
        num_layers=load.shape[0],
        num_logical=load.shape[1],
        num_physical=pick(args.num_physical_experts, "num_physical", load.shape[1]),
        num_groups=pick(args.num_groups, "num_groups", 1),
        num_nodes=pick(args.num_nodes, "num_nodes", 1),
        num_gpus=gpus,
    )


def before_placement(data: dict, shape: PlacementShape) -> Placement:
    """The placement recorded with the load, else experts laid out contiguously (replicas repeat from expert 0)."""
    if "placement" in data:
        return Placement.from_phy2log(torch.tensor(data["placement"]["phy2log"]), shape.num_logical)
    contiguous = torch.arange(shape.num_physical) % shape.num_logical
    return Placement.from_phy2log(contiguous.expand(shape.num_layers, -1).clone(), shape.num_logical)


def after_placement(args: argparse.Namespace, shape: PlacementShape, load: torch.Tensor) -> Placement:
    if args.placement:
        phy2log = torch.tensor(read_json(args.placement)["phy2log"])
        return shape.accept(Placement.from_phy2log(phy2log, shape.num_logical), args.placement)
    return shape.plan(lookup("balancer", args.balancer)(), load)


def draw(load: torch.Tensor, before: Placement, after: Placement, num_gpus: int, out: str) -> None:
    fig, axes = plt.subplots(2, 2, figsize=(13, 8), constrained_layout=True)
    heat = axes[0, 0].imshow(load.numpy(), aspect="auto", cmap="viridis", interpolation="nearest")
    axes[0, 0].set(title="tokens per logical expert", xlabel="logical expert", ylabel="MoE layer")
    fig.colorbar(heat, ax=axes[0, 0])
    gpu_before, gpu_after = before.gpu_loads(load, num_gpus), after.gpu_loads(load, num_gpus)
    top = float(max(gpu_before.max(), gpu_after.max()))
    for ax, gpu, name in ((axes[0, 1], gpu_before, "before"), (axes[1, 0], gpu_after, "after")):
        image = ax.imshow(gpu.numpy(), aspect="auto", cmap="magma", vmin=0, vmax=top, interpolation="nearest")
        ax.set(title=f"tokens per GPU, {name} balancing", xlabel="GPU (EP rank)", ylabel="MoE layer")
        fig.colorbar(image, ax=ax)
    layers = range(load.shape[0])
    axes[1, 1].plot(layers, before.balancedness(load, num_gpus).numpy(), "o-", label="before")
    axes[1, 1].plot(layers, after.balancedness(load, num_gpus).numpy(), "s-", label="after")
    axes[1, 1].set(title="balancedness (mean / max GPU load)", xlabel="MoE layer", ylim=(0, 1.05))
    axes[1, 1].legend()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dump", help="expert-load dump or load file (JSON with logical_count)")
    parser.add_argument("--out", required=True, help="PNG file to write")
    parser.add_argument("--placement", help="placement after balancing (JSON with phy2log); default: --balancer's")
    parser.add_argument("--balancer", default="eplb", help="balancer computing 'after' without --placement (default: eplb)")
    parser.add_argument("--num-gpus", type=int, help="EP ranks (default: the dump's)")
    parser.add_argument("--num-physical-experts", type=int, help="physical slots (default: the dump's)")
    parser.add_argument("--num-nodes", type=int, help="nodes (default: the dump's)")
    parser.add_argument("--num-groups", type=int, help="expert groups (default: the dump's)")
    args = parser.parse_args(argv)
    data = read_json(args.dump)
    load = torch.tensor(data["logical_count"], dtype=torch.float64)
    load = load.sum(0) if load.dim() == 3 else load
    shape = placement_shape(data, args, load)
    before, after = before_placement(data, shape), after_placement(args, shape, load)
    draw(load, before, after, shape.num_gpus, args.out)
    print(
        f"wrote {args.out}: balancedness {before.balancedness(load, shape.num_gpus).mean():.3f} before, "
        f"{after.balancedness(load, shape.num_gpus).mean():.3f} after"
    )


if __name__ == "__main__":
    main()
