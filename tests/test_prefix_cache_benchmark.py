"""benchmarks/prefix_cache.py: its flags, its device defaults, and its CPU path end to end at toy sizes (the GPU
path is the same code with other defaults and one engine at a time; it runs on the H200)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import prefix_cache  # noqa: E402

TOY = ["--runs", "1", "--groups", "2", "--prompts-per-group", "3", "--system-len", "64", "--question-len", "8",
       "--output-len", "4", "--clients", "2", "--rounds", "2", "--threads", "1"]


def test_cpu_run_prints_and_writes_the_table(tmp_path):
    out = tmp_path / "table.md"
    done = subprocess.run([sys.executable, "prefix_cache.py", *TOY, "--workloads", "shared-prefix", "no-reuse",
                           "--policies", "lpm", "--out", str(out)], cwd=BENCHMARKS, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.read_text().splitlines()
            if line.startswith("| qwen3_moe tiny ")]
    assert [(r[1], r[2]) for r in rows] == [("shared-prefix", "lpm"), ("no-reuse", "lpm")]
    shared, fresh = rows
    # lpm holds back the siblings of each group's first prompt: 2 x 2 of 6 prompts reuse 64 of their 72 tokens
    assert shared[6] == f"{4 * 64 / (6 * 72):.0%}" and fresh[6] == "0%"
    assert all(float(r[5].split("x")[0]) > 0 and " / " in r[7] and " / " in r[8] for r in rows)
    assert out.read_text() in done.stdout


def test_cpu_defaults_are_the_2_core_sizes():
    args = prefix_cache.parse_args([])
    assert (args.presets, args.workloads, args.dtype) == (["tiny"], list(prefix_cache.WORKLOADS), "fp32")
    assert (args.groups, args.system_len, args.output_len, args.max_running) == (4, 1024, 32, 16)
    assert args.kv_tokens >= 4 * 8 * (1024 + 32 + 32)


def test_cuda_defaults_are_the_h200_sizes(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = prefix_cache.parse_args(["--device", "cuda", "--layers", "8", "--output-len", "64"])
    assert (args.presets, args.workloads, args.dtype, args.layers) == (["30b-a3b", "tiny"], ["shared-prefix"], "bf16", 8)
    assert (args.groups, args.prompts_per_group, args.system_len, args.max_running, args.output_len) == (8, 16, 2048, 128, 64)
    assert args.kv_tokens >= 8 * 16 * (2048 + 64 + 64)


@pytest.mark.parametrize("argv,message", [
    (["--device", "tpu"], "cpu or cuda"),
    (["--groups", "0"], "--groups must be positive"),
    (["--layers", "0"], "must be positive"),
    (["--workloads", "chat"], "invalid choice"),
])
def test_bad_flags_are_refused_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit):
        prefix_cache.parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_without_a_gpu_is_refused(capsys):
    with pytest.raises(SystemExit):
        prefix_cache.parse_args(["--device", "cuda"])
    assert "no CUDA device" in capsys.readouterr().err


def test_a_released_shape_is_cut_to_layers_with_dummy_weights():
    args = prefix_cache.parse_args(["--layers", "3"])
    folder, name, dummy = prefix_cache.checkpoint(args, "30b-a3b")
    config = json.loads((Path(folder) / "config.json").read_text())
    assert dummy and config["num_hidden_layers"] == 3 and config["num_experts"] == 128 and "3 layers" in name
    assert not list(Path(folder).glob("*.safetensors"))


def test_the_profile_splits_a_run_and_times_the_scheduler_alone():
    done = subprocess.run([sys.executable, "prefix_cache_profile.py", *TOY, "--policies", "lpm"], cwd=BENCHMARKS,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    split = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith(("| lpm |", "| none |"))]
    assert [row[0].strip() for row in split] == ["lpm", "none", "lpm", "none"]  # the run's split, then the scheduler
    run_lpm, run_none, host_lpm, host_none = split
    assert float(run_lpm[1]) > 0 and run_lpm[5].strip() == f"{4 * 64 / (6 * 72):.0%}" and run_none[5].strip() == "0%"
    assert int(host_lpm[2]) > 0 and host_lpm[4].strip().startswith(("+", "-")) and host_none[4].strip() == "-"


@pytest.mark.gpu
def test_cuda_run_of_both_models_at_toy_sizes(tmp_path):
    """The H200 path end to end: Qwen3-30B-A3B shapes cut to one layer (dummy weights) and tiny, bf16, one engine
    at a time, CUDA graphs and the overlap schedule."""
    out = tmp_path / "table.md"
    toy = TOY[: TOY.index("--threads")]
    done = subprocess.run([sys.executable, "prefix_cache.py", "--device", "cuda", "--layers", "1", "--policies", "lpm", *toy,
                           "--max-running", "8", "--out", str(out)], cwd=BENCHMARKS, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.read_text().splitlines() if line.startswith("| qwen3_moe")]
    assert [(r[0], r[1]) for r in rows] == [("qwen3_moe 30b-a3b shapes, 1 layers", "shared-prefix"), ("qwen3_moe tiny", "shared-prefix")]
    assert all(r[6] == f"{4 * 64 / (6 * 72):.0%}" for r in rows), out.read_text()  # lpm: as on CPU
