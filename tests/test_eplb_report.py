"""`moeplex eplb report`: per-GPU load before and after balancing, drawn into a PNG."""

from __future__ import annotations

import json

import pytest
import torch

from moeplex.cli import main

pytest.importorskip("matplotlib")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_load(path, num_layers: int = 3, num_experts: int = 16) -> None:
    """A skewed [layers][experts] load: expert e gets about 1 / (e + 1) of the tokens, hot experts shuffled per layer."""
    gen = torch.Generator().manual_seed(0)
    counts = (1000 / torch.arange(1, num_experts + 1)).long()
    load = torch.stack([counts[torch.randperm(num_experts, generator=gen)] for _ in range(num_layers)])
    path.write_text(json.dumps({"logical_count": load.tolist()}))


def assert_png(path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC)
    assert len(data) > 20_000  # four panels with colour bars, not an empty canvas


def test_report_draws_balancer_plan(tmp_path, capsys):
    load, out = tmp_path / "load.json", tmp_path / "report.png"
    write_load(load)
    args = ["eplb", "report", "--load", str(load), "--out", str(out), "--num-gpus", "4", "--num-physical-experts", "20"]
    assert main(args) == 0
    assert_png(out)
    before, after = [float(x) for x in capsys.readouterr().out.split("balancedness ")[1].replace(" after", "").split(" before, ")]
    assert after > before


def test_report_draws_given_placement(tmp_path, capsys):
    load, placement, out = tmp_path / "load.json", tmp_path / "placement.json", tmp_path / "report.png"
    write_load(load)
    plan = ["eplb", "plan", "--load", str(load), "--num-physical-experts", "20", "--num-gpus", "4", "--balancer", "eplb-vec"]
    assert main([*plan, "--out", str(placement)]) == 0
    report = ["eplb", "report", "--load", str(load), "--placement", str(placement), "--num-gpus", "4"]
    assert main([*report, "--num-physical-experts", "20", "--out", str(out)]) == 0
    assert_png(out)
    assert f"wrote {out}" in capsys.readouterr().out


def test_report_reads_the_shape_and_placement_from_a_dump(tmp_path):
    load, out = tmp_path / "dump.json", tmp_path / "report.png"
    write_load(load)
    data = json.loads(load.read_text())
    data["shape"] = {"num_layers": 3, "num_logical": 16, "num_physical": 16, "num_groups": 1, "num_nodes": 1, "num_gpus": 4}
    data["placement"] = {"phy2log": [list(range(16))] * 3}
    load.write_text(json.dumps(data))
    assert main(["eplb", "report", "--load", str(load), "--out", str(out)]) == 0
    assert_png(out)


@pytest.mark.parametrize(
    "content, says",
    [
        ("{not json", "is not a JSON load file"),
        ('{"counts": [[1, 2]]}', "has no logical_count"),
        ('{"logical_count": [1, 2, 3, 4]}', "must be [layers][experts]"),
        ('{"logical_count": [[1, -2, 3, 4]]}', "non-negative"),
        ('{"logical_count": [[1, 2], [3]]}', "rectangular"),
    ],
)
def test_bad_load_file_is_refused_with_a_sentence(tmp_path, capsys, content, says):
    load, out = tmp_path / "load.json", tmp_path / "report.png"
    load.write_text(content)
    assert main(["eplb", "report", "--load", str(load), "--out", str(out), "--num-gpus", "2"]) == 2
    err = capsys.readouterr().err
    assert says in err and err.startswith("moeplex eplb: error:") and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_placement_of_another_shape_is_refused(tmp_path, capsys):
    load, placement, out = tmp_path / "load.json", tmp_path / "placement.json", tmp_path / "report.png"
    write_load(load)
    placement.write_text(json.dumps({"phy2log": [list(range(16))] * 2}))
    assert main(["eplb", "report", "--load", str(load), "--placement", str(placement), "--num-gpus", "4", "--out", str(out)]) == 2
    assert "this engine needs [3, 16]" in capsys.readouterr().err


def test_missing_matplotlib_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    load, out = tmp_path / "load.json", tmp_path / "report.png"
    write_load(load)
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert main(["eplb", "report", "--load", str(load), "--out", str(out), "--num-gpus", "4"]) == 2
    assert "pip install matplotlib" in capsys.readouterr().err


def recorded_dump(path) -> None:
    """A dump of an engine with 16 slots (no redundancy) over 4 GPUs, placement recorded."""
    write_load(path)
    data = json.loads(path.read_text())
    data["shape"] = {"num_layers": 3, "num_logical": 16, "num_physical": 16, "num_groups": 1, "num_nodes": 1, "num_gpus": 4}
    data["placement"] = {"phy2log": [list(range(16))] * 3}
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("gpus, slots", [(4, 20), (5, 20), (8, 16)], ids=["redundant", "redundant-more-gpus", "more-gpus"])
def test_report_compares_a_dump_with_a_plan_of_another_layout(tmp_path, capsys, gpus, slots):
    # the load is per logical expert, so it reads through any physical layout: extra slots, another GPU count
    dump, placement, out = tmp_path / "dump.json", tmp_path / "placement.json", tmp_path / "report.png"
    recorded_dump(dump)
    plan = ["eplb", "plan", "--load", str(dump), "--num-physical-experts", str(slots), "--num-gpus", str(gpus)]
    assert main([*plan, "--out", str(placement)]) == 0
    assert main(["eplb", "report", "--load", str(dump), "--placement", str(placement), "--out", str(out)]) == 0
    assert_png(out)
    planned = json.loads(placement.read_text())["balancedness"]  # of the plan over its own GPUs
    flags = ["--num-gpus", str(gpus), "--num-physical-experts", str(slots)]
    assert main(["eplb", "report", "--load", str(dump), *flags, "--out", str(out)]) == 0  # the balancer's own plan
    text = capsys.readouterr()
    assert "error" not in text.err
    for line in text.out.splitlines()[-2:]:
        before, after = [float(x) for x in line.split("balancedness ")[-1].replace(" after", "").split(" before, ")]
        assert after == pytest.approx(sum(planned) / len(planned), abs=1e-3)
        assert before == pytest.approx(0.612, abs=1e-3)  # the recorded engine's: 16 slots over 4 GPUs
