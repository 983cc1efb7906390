"""Expert load balancing on the engine side: record the load, ask the balancer, move the experts.

    MoELayer --record_load--> LoadRecorder(s) on the MoE runtime (device counts, no host sync)
    Engine.rebalance / every N steps --> load summed over the EP ranks --> Balancer --> Placement
        --> WeightMover (slots get their new experts, a few layers at a time) --> ReplicaSelector maps
        --> hook moeplex_placement_changed

With several ranks, dump and rebalance are collectives: every rank calls them between the same steps.
"""

from __future__ import annotations

import json
import time

import attrs
import torch
import torch.distributed as dist

from ..config import PER_STEP
from ..interfaces import Placement
from .recorder import LoadRecorder
from .weight_mover import WeightMover


@attrs.frozen
class PlacementShape:
    """The placement problem of one engine: what the balancer is asked to fill."""

    num_layers: int
    num_logical: int
    num_physical: int
    num_groups: int
    num_nodes: int
    num_gpus: int  # EP ranks

    def plan(self, balancer, load: torch.Tensor) -> Placement:
        """The balancer's placement of `load` ([L, E] or [steps, L, E]), checked against the contract."""
        if load.dim() not in (2, 3) or tuple(load.shape[-2:]) != (self.num_layers, self.num_logical):
            raise ValueError(
                f"an expert load of shape {list(load.shape)} does not fit this model: it needs "
                f"[{self.num_layers}, {self.num_logical}] (MoE layers, logical experts), optionally after a step axis"
            )
        placement = balancer.rebalance(load, self.num_physical, self.num_groups, self.num_nodes, self.num_gpus)
        return self.accept(placement, f"balancer {type(balancer).__name__}")

    def accept(self, placement: Placement, source: str) -> Placement:
        expected = (self.num_layers, self.num_physical)
        if tuple(placement.phy2log.shape) != expected or placement.num_logical != self.num_logical:
            raise ValueError(
                f"the placement from {source} has phy2log of shape {list(placement.phy2log.shape)} over "
                f"{placement.num_logical} experts; this engine needs {list(expected)} over {self.num_logical}"
            )
        placement.check(self.num_gpus)
        return placement

    def to_json(self) -> dict:
        return attrs.asdict(self)


def placement_record(placement: Placement, load: torch.Tensor | None, num_gpus: int) -> dict:
    """A placement file's content: phy2log and logcnt, and the balancedness per layer under `load`."""
    record = {"phy2log": placement.phy2log.tolist(), "logcnt": placement.logcnt.tolist()}
    if load is not None:
        record["balancedness"] = [round(b, 6) for b in placement.balancedness(load, num_gpus).tolist()]
    return record


def write_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f)
        f.write("\n")


def read_expert_location(path: str, shape: PlacementShape, balancer) -> Placement:
    """The start-up placement in `path`: its phy2log as it is, or the balancer's placement of its logical_count."""
    with open(path) as f:
        data = json.load(f)
    if "phy2log" in data:
        phy2log = torch.tensor(data["phy2log"], dtype=torch.int64)
        if phy2log.dim() != 2 or ((phy2log < 0) | (phy2log >= shape.num_logical)).any():
            raise ValueError(f"{path}: phy2log must be [layers][slots] of logical expert ids in 0..{shape.num_logical - 1}")
        return shape.accept(Placement.from_phy2log(phy2log, shape.num_logical), path)
    if "logical_count" in data:
        return shape.plan(balancer, torch.tensor(data["logical_count"], dtype=torch.float64))
    raise ValueError(f"{path} holds neither phy2log (a placement) nor logical_count (a recorded expert load)")


@attrs.frozen
class RebalanceReport:
    placement: Placement
    balancedness_before: tuple[float, ...]  # per layer, of the old placement under the balanced load
    balancedness_after: tuple[float, ...]
    layers_changed: tuple[int, ...]
    experts_copied: int  # by this rank, from its own slots
    experts_received: int  # by this rank, from other ranks
    seconds: float

    def summary(self) -> dict:
        mean = lambda values: round(sum(values) / len(values), 6) if values else None  # noqa: E731
        return {
            "balancedness_before": mean(self.balancedness_before),
            "balancedness_after": mean(self.balancedness_after),
            "layers_changed": list(self.layers_changed),
            "experts_copied": self.experts_copied,
            "experts_received": self.experts_received,
            "seconds": round(self.seconds, 4),
        }


class ExpertBalancing:
    """An engine's expert-load recordings and rebalancing.

    `recorder` serves start / stop / dump; with --enable-eplb, `window` keeps the last steps'
    load for rebalancing, which runs when asked and, with --eplb-rebalance-num-iterations N,
    after every N-th forward step.
    """

    def __init__(self, runtime, layers, balancer, config, parallel, hooks):
        self.runtime = runtime
        self.shape: PlacementShape = runtime.placement_shape
        self.balancer = balancer
        self.hooks = hooks
        self.ep = parallel.ep
        self.writes_files = parallel.rank == 0
        self.default_mode = config.expert_distribution_recorder_mode
        self.recorder = self._new_recorder(config.expert_distribution_recorder_buffer_size)
        self.window = self._new_recorder(config.eplb_window_size) if config.enable_eplb else None
        if self.window is not None:
            self.window.start(PER_STEP)
        runtime.recorders = [r for r in (self.recorder, self.window) if r is not None]
        ranks_per_node = parallel.config.ranks_per_node
        self.mover = WeightMover(layers, self.ep, ranks_per_node, config.eplb_rebalance_layers_per_chunk)
        self.rebalance_every = config.eplb_rebalance_num_iterations
        self.steps = 0

    def _new_recorder(self, steps: int) -> LoadRecorder:
        return LoadRecorder(self.shape.num_layers, self.shape.num_logical, self.runtime.ctx.device, steps)

    # --- recording ------------------------------------------------------------------------------
    def start_recording(self, mode: str | None = None) -> None:
        self.recorder.start(mode or self.default_mode)

    def stop_recording(self) -> None:
        self.recorder.stop()

    def dump_recording(self, path: str | None = None) -> dict:
        """The recorded load summed over the EP ranks, with the placement in force; rank 0 writes it to `path`."""
        if not self.recorder.started:
            raise ValueError("no expert-load recording to dump: start one first")
        load = self._summed(self.recorder.counts())
        data = {
            "mode": self.recorder.mode,
            "steps": self.recorder.steps,
            "recording": self.recorder.recording,
            "shape": self.shape.to_json(),
            "logical_count": load.tolist(),
            "placement": placement_record(self.runtime.placement, load, self.shape.num_gpus),
        }
        if path and self.writes_files:
            write_json(path, data)
        return data

    def after_forward(self) -> None:
        """Close the step in every recorder; rebalance when the step count says so."""
        for recorder in self.runtime.recorders:
            recorder.end_step()
        self.steps += 1
        if self.rebalance_every and self.steps % self.rebalance_every == 0:
            self.rebalance()

    # --- rebalancing ----------------------------------------------------------------------------
    def rebalance(self, load: torch.Tensor | None = None) -> RebalanceReport:
        """Place the experts for `load` (default: the recorded load, summed over the EP ranks) and move them.

        An explicit `load` ([L, E] or [steps, L, E]) must be the same on every rank.
        """
        started = time.perf_counter()
        load = self._summed(self._recorded_load()) if load is None else load.cpu()
        if not load.any():
            raise ValueError("the expert load to balance is all zero: record some steps first")
        old = self.runtime.placement
        new = self._agreed(self.shape.plan(self.balancer, load))
        moved = self.mover.move(old, new)
        self.runtime.apply_placement(new)
        if moved.layers_changed:
            self.hooks.hook.moeplex_placement_changed(placement=new)
        gpus = self.shape.num_gpus
        return RebalanceReport(
            placement=new,
            balancedness_before=tuple(old.balancedness(load, gpus).tolist()),
            balancedness_after=tuple(new.balancedness(load, gpus).tolist()),
            layers_changed=moved.layers_changed,
            experts_copied=moved.copied,
            experts_received=moved.received,
            seconds=time.perf_counter() - started,
        )

    def _recorded_load(self) -> torch.Tensor:
        if self.window is not None:
            return self.window.total()
        if self.recorder.started:
            return self.recorder.total()
        raise ValueError(
            "no expert load is recorded: start a recording (POST /start_expert_distribution_record) "
            "or start the engine with --enable-eplb"
        )

    def _summed(self, counts: torch.Tensor) -> torch.Tensor:
        """Counts summed over the EP ranks (each counted the tokens it routed), on the host."""
        return self.ep.all_reduce(counts.clone()).cpu()

    def _agreed(self, placement: Placement) -> Placement:
        """EP rank 0's placement on every rank, so all of them move the same experts."""
        if self.ep.size == 1:
            return placement
        phy2log = placement.phy2log.to(self.runtime.ctx.device)
        dist.broadcast(phy2log, src=dist.get_global_rank(self.ep.group, 0), group=self.ep.group)
        return Placement.from_phy2log(phy2log.cpu(), self.shape.num_logical)
