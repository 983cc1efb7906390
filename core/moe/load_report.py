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
    """One load per logical expert seen through two placements, each of its own physical layout: "after" may
    add redundant slots or spread over another number of GPUs than the engine that recorded the load."""

    load: torch.Tensor  # [L, E] float64, summed over steps
    before: Placement
    after: Placement
    gpus_before: int
    gpus_after: int

    def gpu_loads(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[L, GPUs] of each placement (the GPU counts may differ)."""
        return self.before.gpu_loads(self.load, self.gpus_before), self.after.gpu_loads(self.load, self.gpus_after)

    def balancedness_per_layer(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.before.balancedness(self.load, self.gpus_before), self.after.balancedness(self.load, self.gpus_after)

    def balancedness(self) -> tuple[float, float]:
        """Mean balancedness over the layers, before and after."""
        before, after = self.balancedness_per_layer()
        return float(before.mean()), float(after.mean())


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


def recorded_shape(data: dict, load: torch.Tensor) -> PlacementShape | None:
    """The shape the engine that recorded the load ran with (a dump's `shape`), None for a bare load file."""
    known = data.get("shape")
    if not isinstance(known, dict) or "num_gpus" not in known:
        return None
    return _shape(load, known["num_gpus"], known.get("num_physical"), known.get("num_groups"), known.get("num_nodes"))


def _shape(load: torch.Tensor, gpus: int, physical: int | None, groups: int | None, nodes: int | None) -> PlacementShape:
    num_layers, num_logical = load.shape
    return PlacementShape(num_layers, num_logical, physical or num_logical, groups or 1, nodes or 1, gpus)


def after_shape(recorded: PlacementShape | None, flags: ShapeFlags, load: torch.Tensor, placement: dict | None) -> PlacementShape:
    """The layout "after" is planned for: each flag given, else the placement file's own width and GPU count,
    else the recorded shape."""
    given = placement or {}
    width = len(given["phy2log"][0]) if given.get("phy2log") and isinstance(given["phy2log"][0], list) else None
    pick = lambda *values: next((v for v in values if v is not None), None)  # noqa: E731
    gpus = pick(flags.num_gpus, given.get("num_gpus"), recorded and recorded.num_gpus)
    if gpus is None:
        raise ValueError(
            "the load file records no placement shape: give --num-gpus "
            "(and --num-physical-experts, --num-nodes, --num-groups)"
        )
    return _shape(
        load,
        gpus,
        pick(flags.num_physical, width, recorded and recorded.num_physical),
        pick(flags.num_groups, recorded and recorded.num_groups),
        pick(flags.num_nodes, recorded and recorded.num_nodes),
    )


def before_placement(data: dict, shape: PlacementShape) -> Placement:
    """The placement recorded with the load, else experts laid out contiguously (replicas repeat from expert 0)."""
    if "placement" in data:
        phy2log = torch.tensor(data["placement"]["phy2log"], dtype=torch.int64)
        return shape.accept(Placement.from_phy2log(phy2log, shape.num_logical), "the load file")
    contiguous = torch.arange(shape.num_physical) % shape.num_logical
    static = Placement.from_phy2log(contiguous.expand(shape.num_layers, -1).clone(), shape.num_logical)
    return shape.accept(static, "the contiguous placement")


def read_placement(placement_path: str, num_logical: int) -> dict:
    data = read_json(placement_path, "placement")
    if "phy2log" not in data:
        raise ValueError(f"{placement_path} has no phy2log: a placement file holds phy2log [layers][slots]")
    try:
        phy2log = torch.tensor(data["phy2log"], dtype=torch.int64)
    except (TypeError, ValueError):
        phy2log = None
    if phy2log is None or phy2log.dim() != 2 or ((phy2log < 0) | (phy2log >= num_logical)).any():
        ids = f"0..{num_logical - 1}"
        raise ValueError(f"{placement_path}: phy2log must be [layers][slots] of logical expert ids in {ids}")
    return data


def build_report(load_path: str, placement_path: str | None, flags: ShapeFlags, balancer) -> LoadReport:
    """"Before": the placement and shape recorded with the load (else the contiguous layout of "after"'s shape);
    "after": the placement file, else the balancer's plan, in its own shape."""
    data, load = read_load(load_path)
    recorded = recorded_shape(data, load)
    given = read_placement(placement_path, load.shape[1]) if placement_path else None
    shape = after_shape(recorded, flags, load, given)
    if given is None:
        after = shape.plan(balancer, load)
    else:
        after = shape.accept(Placement.from_phy2log(torch.tensor(given["phy2log"]), shape.num_logical), placement_path)
    before_shape = recorded if recorded is not None else shape
    before = before_placement(data, before_shape)
    return LoadReport(load, before, after, before_shape.num_gpus, shape.num_gpus)


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
    load = report.load
    fig, axes = plt.subplots(2, 2, figsize=(13, 8), constrained_layout=True)
    heat = axes[0, 0].imshow(load.numpy(), aspect="auto", cmap="viridis", interpolation="nearest")
    axes[0, 0].set(title="tokens per logical expert", xlabel="logical expert", ylabel="MoE layer")
    fig.colorbar(heat, ax=axes[0, 0])
    gpu_before, gpu_after = report.gpu_loads()
    top = float(max(gpu_before.max(), gpu_after.max()))
    for ax, gpu, name in ((axes[0, 1], gpu_before, "before"), (axes[1, 0], gpu_after, "after")):
        image = ax.imshow(gpu.numpy(), aspect="auto", cmap="magma", vmin=0, vmax=top, interpolation="nearest")
        ax.set(title=f"tokens per GPU, {name} balancing", xlabel="GPU (EP rank)", ylabel="MoE layer")
        fig.colorbar(image, ax=ax)
    layers = range(load.shape[0])
    before, after = report.balancedness_per_layer()
    axes[1, 1].plot(layers, before.numpy(), "o-", label=f"before ({report.gpus_before} GPUs)")
    axes[1, 1].plot(layers, after.numpy(), "s-", label=f"after ({report.gpus_after} GPUs)")
    axes[1, 1].set(title="balancedness (mean / max GPU load)", xlabel="MoE layer", ylim=(0, 1.05))
    axes[1, 1].legend()
    fig.savefig(out, dpi=100)
    plt.close(fig)
