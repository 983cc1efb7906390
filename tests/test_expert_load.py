"""Expert load: the recorder counts what the router chose, costs no host sync, and dumps files that restart an engine."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os

import pytest
import torch

from moeplex.cli import build_parser
from moeplex.cli.flags import engine_config as config_from_flags
from moeplex.config import EngineConfig
from moeplex.engine import Engine
from moeplex.interfaces import Placement
from moeplex.models.base import MoESpec
from moeplex.models.setup import placement_shape
from moeplex.moe.rebalance import placement_record, write_json
from moeplex.config import PER_STEP, STAT
from moeplex.moe.recorder import LoadRecorder
from moeplex.config import SPREAD, STATIC
from moeplex.moe.replicas import ReplicaSelector
from moeplex.parallel import Group, ParallelConfig, ParallelState
from moeplex.registry import lookup
from moeplex.sampling import SamplingParams

PROMPTS = [[256, 1, 2, 3, 4], [256] + list(range(40, 60)), [256, 9, 8]]
PARAMS = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "plot_expert_load.py")


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir("deepseek_v3")


def engine_config(folder: str, **changes) -> EngineConfig:
    return EngineConfig(model=folder, show_progress=False, max_total_tokens=1024, page_size=4, **changes)


@pytest.fixture(scope="module")
def engine(folder):
    return Engine(engine_config(folder, balancer="eplb", ep_num_redundant_experts=4))


class RouterChoices:
    """Every MoE layer's router output, step by step, captured by forward hooks: the reference count."""

    def __init__(self, model):
        self.ids: dict[int, list[torch.Tensor]] = {}
        self.handles = [layer.gate.register_forward_hook(self._hook(layer.moe_index)) for layer in model.moe_layers()]

    def _hook(self, moe_index: int):
        def capture(module, inputs, output):
            self.ids.setdefault(moe_index, []).append(output[0].clone())

        return capture

    def per_step(self, num_experts: int) -> torch.Tensor:
        """[steps, L, E]"""
        count = lambda ids: torch.bincount(ids.flatten(), minlength=num_experts)  # noqa: E731
        layers = [torch.stack([count(ids) for ids in steps]) for _, steps in sorted(self.ids.items())]
        return torch.stack(layers, dim=1)

    def remove(self):
        for handle in self.handles:
            handle.remove()


# --- recording ----------------------------------------------------------------------------------


def test_recorder_counts_what_the_router_chose(engine, tmp_path):
    choices = RouterChoices(engine.model)
    engine.start_recording(PER_STEP)
    engine.generate(PROMPTS, PARAMS)
    engine.stop_recording()
    choices.remove()
    expected = choices.per_step(num_experts=16)
    assert expected.shape == (engine.balancing.recorder.steps, 2, 16) and expected.sum() > 0
    assert torch.equal(engine.balancing.recorder.counts(), expected)
    dump = engine.dump_recording(str(tmp_path / "dump.json"))
    with open(tmp_path / "dump.json") as f:
        assert json.load(f)["logical_count"] == dump["logical_count"] == expected.tolist()

    engine.start_recording(STAT)
    choices = RouterChoices(engine.model)
    engine.generate(PROMPTS[:1], PARAMS)
    engine.stop_recording()
    choices.remove()
    engine.generate(PROMPTS[1:], PARAMS)  # after stop: not counted
    assert torch.equal(engine.balancing.recorder.counts(), choices.per_step(num_experts=16).sum(0))


def test_a_per_step_recording_keeps_the_newest_steps():
    recorder = LoadRecorder(num_layers=1, num_experts=4, device=torch.device("cpu"), window=2)
    recorder.record(0, torch.tensor([[0, 1]]))  # not started: nothing counted
    recorder.start(PER_STEP)
    for step in range(3):
        recorder.record(0, torch.tensor([[step, -1], [step, 3]]))  # -1 is padding
        recorder.end_step()
    assert recorder.counts().tolist() == [[[0, 2, 0, 1]], [[0, 0, 2, 1]]]
    assert recorder.total().tolist() == [[0, 2, 2, 2]]
    recorder.stop()
    recorder.record(0, torch.tensor([[0, 0]]))
    assert recorder.total().tolist() == [[0, 2, 2, 2]]


class HostSync(AssertionError):
    pass


def _refuse(*args, **kwargs):
    raise HostSync("a host sync on the recording path")


HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero")


def test_recording_and_replica_choice_need_no_host_sync(engine):
    runtime, recorder = engine.model.moe_runtime, engine.balancing.recorder
    recorder.start(PER_STEP)
    ids = torch.tensor([[0, 1, 5, 15], [0, 2, 3, -1]])
    with pytest.MonkeyPatch.context() as patch:
        for name in HOST_READS:  # every way a tensor's value reaches the host raises
            patch.setattr(torch.Tensor, name, _refuse)
        with pytest.raises(HostSync):
            bool(torch.ones(1))  # the patch is in force
        for step in range(3):
            for layer in range(2):
                runtime.record_load(layer, ids)
                runtime.replicas(layer, ids)
            recorder.end_step()
    assert recorder.total()[:, :4].tolist() == [[6, 3, 3, 3], [6, 3, 3, 3]]
    recorder.stop()


# --- replica choice -----------------------------------------------------------------------------


def test_spread_shares_the_replicas_and_static_uses_the_first():
    phy2log = torch.tensor([[0, 1, 2, 0, 0, 1]])  # expert 0 in slots 0, 3, 4; expert 1 in 1, 5
    placement = Placement.from_phy2log(phy2log, num_logical=3)
    ids = torch.tensor([[0, 1]] * 6)
    spread = ReplicaSelector(placement, torch.device("cpu"), SPREAD, max_replicas=4)(0, ids)
    assert torch.equal(phy2log[0][spread], ids)
    assert torch.bincount(spread[:, 0], minlength=6).tolist() == [2, 0, 0, 2, 2, 0]
    assert torch.bincount(spread[:, 1], minlength=6).tolist() == [0, 3, 0, 0, 0, 3]
    static = ReplicaSelector(placement, torch.device("cpu"), STATIC)(0, torch.tensor([[0, 1], [-1, 2]]))
    assert static.tolist() == [[0, 1], [-1, 2]]


# --- placement files ----------------------------------------------------------------------------


def test_a_dump_restarts_an_engine_with_the_balanced_placement(engine, folder, tmp_path):
    engine.start_recording()
    before = [r.output_ids for r in engine.generate(PROMPTS, PARAMS)]
    dump = engine.dump_recording(str(tmp_path / "dump.json"))
    load = torch.tensor(dump["logical_count"])
    location = str(tmp_path / "dump.json")
    restarted = Engine(engine_config(folder, balancer="eplb", ep_num_redundant_experts=4, init_expert_location=location))
    expected = lookup("balancer", "eplb")().rebalance(load, 20, 4, 1, 1)
    assert torch.equal(restarted.model.moe_runtime.placement.phy2log, expected.phy2log)
    assert not torch.equal(expected.phy2log, engine.model.moe_runtime.placement.phy2log)
    assert [r.output_ids for r in restarted.generate(PROMPTS, PARAMS)] == before

    report = restarted.rebalance(load=torch.flip(load, dims=[1]))
    write_json(str(tmp_path / "placement.json"), placement_record(report.placement, None, 1))
    again = Engine(engine_config(folder, ep_num_redundant_experts=4, init_expert_location=str(tmp_path / "placement.json")))
    assert torch.equal(again.model.moe_runtime.placement.phy2log, report.placement.phy2log)
    assert [r.output_ids for r in again.generate(PROMPTS, PARAMS)] == before


@pytest.mark.parametrize(
    "content,message",
    [
        ({"phy2log": [[0] * 20]}, "needs \\[2, 20\\]"),
        ({"phy2log": [list(range(16)) + [16, 0, 0, 0]] * 2}, "logical expert ids in 0..15"),
        ({"logical_count": [[1] * 8] * 2}, "does not fit this model"),
        ({"experts": []}, "neither phy2log"),
    ],
)
def test_a_wrong_location_file_is_refused(folder, tmp_path, content, message):
    path = str(tmp_path / "location.json")
    write_json(path, content)
    with pytest.raises(ValueError, match=message):
        Engine(engine_config(folder, ep_num_redundant_experts=4, init_expert_location=path))


def test_redundant_slots_must_divide_over_the_ep_ranks():
    spec = MoESpec(num_moe_layers=2, num_experts=16, top_k=4, hidden_size=64, intermediate_size=32, num_groups=4)
    parallel = ParallelState(ParallelConfig(tp_size=2, ep_size=2), rank=0, world=Group(0, 2, None))
    config = EngineConfig(model="unused", ep_num_redundant_experts=3)
    with pytest.raises(ValueError, match="19 physical slots, which do not divide over 2 EP ranks"):
        placement_shape(spec, config, parallel)
    assert placement_shape(spec, EngineConfig(model="unused", ep_num_redundant_experts=4), parallel).num_physical == 20


# --- flags and the plot -------------------------------------------------------------------------


def test_flags_make_the_config(tiny_model_dir):
    args = build_parser().parse_args(
        f"generate --input-ids 1 --model {tiny_model_dir('deepseek_v3')} --ep-num-redundant-experts 4 --ep-dispatch-algorithm static "
        "--init-expert-location p.json --expert-distribution-recorder-mode per-step "
        "--expert-distribution-recorder-buffer-size 7 --enable-eplb --eplb-window-size 9 "
        "--eplb-rebalance-num-iterations 5 --eplb-rebalance-layers-per-chunk 2".split()
    )
    assert args.init_expert_location == "p.json"  # read at start-up, so left out of the config built here
    config = config_from_flags(argparse.Namespace(**{**vars(args), "init_expert_location": None}))
    assert (config.ep_num_redundant_experts, config.ep_dispatch_algorithm) == (4, "static")
    assert (config.expert_distribution_recorder_mode, config.expert_distribution_recorder_buffer_size) == ("per-step", 7)
    assert (config.enable_eplb, config.eplb_window_size, config.eplb_rebalance_num_iterations) == (True, 9, 5)
    assert config.eplb_rebalance_layers_per_chunk == 2
    with pytest.raises(ValueError, match="needs --enable-eplb"):
        EngineConfig(model="m", eplb_rebalance_num_iterations=5)


def test_the_plot_script_draws_a_dump(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot script needs matplotlib (pip install matplotlib)")
    spec = importlib.util.spec_from_file_location("plot_expert_load", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    load = torch.arange(2 * 16).reshape(2, 16) % 7 + 1
    write_json(str(tmp_path / "load.json"), {"logical_count": load.tolist()})
    script.main([str(tmp_path / "load.json"), "--out", str(tmp_path / "report.png"), "--num-gpus", "4",
                 "--num-physical-experts", "20", "--num-groups", "4"])
    with open(tmp_path / "report.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
