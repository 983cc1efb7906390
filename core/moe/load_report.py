"""The expert-load report: the load per layer and logical expert, the load per GPU before and after balancing,
and the balancedness per layer, drawn into one PNG (`moeplex eplb report`, scripts/plot_expert_load.py).

"Before" is the placement recorded with the load (a dump's `placement`), else experts laid out contiguously
(the static placement). "After" is a given placement file (phy2log), else the balancer's placement of the load.
"""

from __future__ import annotations

import attrs
import torch

from ..interfaces import Placement
from ..json_file import read_json_object
from .rebalance import PlacementShape

INSTALL_HINT = "the load report needs matplotlib: install it with `pip install matplotlib` (or `pip install -e .[test]`)"


@attrs.frozen
class ShapeFlags:
    """Placement-shape flags given on the command line; None takes the load file's value."""

    num_gpus: int | None = None
    num_physical: int | None = None
    num_nodes: int | None = None
    num_groups: int | None = None


@attrs.frozen
class LoadReport:
    load: torch.Tensor  # [L, E] float64, summed over steps
    before: Placement
    after: Placement
    num_gpus: int

    def balancedness(self) -> tuple[float, float]:
        """Mean balancedness over the layers, before and after."""
        return tuple(float(p.balancedness(self.load, self.num_gpus).mean()) for p in (self.before, self.after))


def read_json(path: str, what: str) -> dict:
    return read_json_object(path, what)


def read_load(path: str) -> tuple[dict, torch.Tensor]:
    """The file's content and its logical_count as an [L, E] float64 tensor (steps summed)."""
    data = read_json(path, "load")
    if "logical_count" not in data:
        raise ValueError(f"{path} has no logical_count: a load file holds {{\"logical_count\": [[...]]}} [layers][experts]")
    try:
        load = torch.tensor(data["logical_count"], dtype=torch.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{path}: logical_count must be a rectangular array of numbers") from None
    if load.dim() not in (2, 3) or load.numel() == 0:
        shape = list(load.shape)
        raise ValueError(f"{path}: logical_count must be [layers][experts] or [steps][layers][experts], got shape {shape}")
    if not torch.isfinite(load).all() or (load < 0).any():
        raise ValueError(f"{path}: logical_count must hold finite, non-negative token counts")
    return data, load.sum(0) if load.dim() == 3 else load


def placement_shape(data: dict, flags: ShapeFlags, load: torch.Tensor) -> PlacementShape:
    """The load file's recorded shape, with every flag given overriding it."""
    known = data.get("shape", {})
    pick = lambda flag, key, default=None: flag if flag is not None else known.get(key, default)  # noqa: E731
    gpus = pick(flags.num_gpus, "num_gpus")
    if gpus is None:
        raise ValueError(
            "the load file records no placement shape: give --num-gpus "
            "(and --num-physical-experts, --num-nodes, --num-groups)"
        )
    return PlacementShape(
        num_layers=load.shape[0],
        num_logical=load.shape[1],
        num_physical=pick(flags.num_physical, "num_physical", load.shape[1]),
        num_groups=pick(flags.num_groups, "num_groups", 1),
        num_nodes=pick(flags.num_nodes, "num_nodes", 1),
        num_gpus=gpus,
    )


def before_placement(data: dict, shape: PlacementShape) -> Placement:
    """The placement recorded with the load, else experts laid out contiguously (replicas repeat from expert 0)."""
    if "placement" in data:
        phy2log = torch.tensor(data["placement"]["phy2log"], dtype=torch.int64)
        return shape.accept(Placement.from_phy2log(phy2log, shape.num_logical), "the load file")
    contiguous = torch.arange(shape.num_physical) % shape.num_logical
    static = Placement.from_phy2log(contiguous.expand(shape.num_layers, -1).clone(), shape.num_logical)
    return shape.accept(static, "the contiguous placement")


def after_placement(placement_path: str | None, shape: PlacementShape, balancer, load: torch.Tensor) -> Placement:
    """The placement in `placement_path` (phy2log), else `balancer`'s placement of `load`."""
    if placement_path is None:
        return shape.plan(balancer, load)
    data = read_json(placement_path, "placement")
    if "phy2log" not in data:
        raise ValueError(f"{placement_path} has no phy2log: a placement file holds phy2log [layers][slots]")
    phy2log = torch.tensor(data["phy2log"], dtype=torch.int64)
    if phy2log.dim() != 2 or ((phy2log < 0) | (phy2log >= shape.num_logical)).any():
        ids = f"0..{shape.num_logical - 1}"
        raise ValueError(f"{placement_path}: phy2log must be [layers][slots] of logical expert ids in {ids}")
    return shape.accept(Placement.from_phy2log(phy2log, shape.num_logical), placement_path)


def build_report(load_path: str, placement_path: str | None, flags: ShapeFlags, balancer) -> LoadReport:
    data, load = read_load(load_path)
    shape = placement_shape(data, flags, load)
    before = before_placement(data, shape)
    return LoadReport(load, before, after_placement(placement_path, shape, balancer, load), shape.num_gpus)


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend; ImportError carries the install hint."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError(INSTALL_HINT) from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def draw(report: LoadReport, out: str) -> None:
    """Write the four panels of `report` into the PNG `out`."""
    plt = pyplot()
    load, gpus = report.load, report.num_gpus
    fig, axes = plt.subplots(2, 2, figsize=(13, 8), constrained_layout=True)
    heat = axes[0, 0].imshow(load.numpy(), aspect="auto", cmap="viridis", interpolation="nearest")
    axes[0, 0].set(title="tokens per logical expert", xlabel="logical expert", ylabel="MoE layer")
    fig.colorbar(heat, ax=axes[0, 0])
    gpu_before, gpu_after = report.before.gpu_loads(load, gpus), report.after.gpu_loads(load, gpus)
    top = float(max(gpu_before.max(), gpu_after.max()))
    for ax, gpu, name in ((axes[0, 1], gpu_before, "before"), (axes[1, 0], gpu_after, "after")):
        image = ax.imshow(gpu.numpy(), aspect="auto", cmap="magma", vmin=0, vmax=top, interpolation="nearest")
        ax.set(title=f"tokens per GPU, {name} balancing", xlabel="GPU (EP rank)", ylabel="MoE layer")
        fig.colorbar(image, ax=ax)
    layers = range(load.shape[0])
    axes[1, 1].plot(layers, report.before.balancedness(load, gpus).numpy(), "o-", label="before")
    axes[1, 1].plot(layers, report.after.balancedness(load, gpus).numpy(), "s-", label="after")
    axes[1, 1].set(title="balancedness (mean / max GPU load)", xlabel="MoE layer", ylim=(0, 1.05))
    axes[1, 1].legend()
    fig.savefig(out, dpi=100)
    plt.close(fig)
