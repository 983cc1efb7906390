"""`moeplex plan` end to end with the shipped profile (CI runs it)."""

import pytest

from moeplex.cli import main
from moeplex.plan.profile import load_profile


def test_predict_prints_throughput_latency_and_split(capsys):
    assert main(["plan", "predict", "--prefill-layout", "gpus=16,redundant_experts=0", "--decode-layout", "gpus=16,overlap=tbo", "--zipf-skew", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "tokens/s per node" in out and "TTFT" in out and "ITL" in out
    assert "| decode |" in out and "idle" in out


def test_predict_colocated_at_a_rate_with_the_derived_profile(capsys):
    args = ["plan", "predict", "--profile", "h100", "--model", "qwen3_moe:30b-a3b", "--colocated", "--rate", "5",
            "--prefill-layout", "gpus=1,moe_kernel=triton,dtype=bf16,balancer=static", "--prefill-tokens", "4096"]
    assert main(args) == 0
    assert "co-located" in capsys.readouterr().out


def test_search_answers_with_a_layout(capsys):
    args = ["plan", "search", "--model", "qwen3_moe:30b-a3b", "--gpus", "2", "--moe-kernel", "triton", "--dtype", "bf16",
            "--input-len", "1000", "--output-len", "200", "--max-itl-ms", "40", "--top", "2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "layout search" in out and "| 1 |" in out


def test_check_prints_errors_against_our_tables(capsys):
    assert main(["plan", "check", "--only", "own"]) == 0
    out = capsys.readouterr().out
    assert "e2e_h200.md" in out and "ep_multi_gpu_h200x2.md" in out and "%" in out


def test_sources_lists_every_number(capsys):
    assert main(["plan", "sources", "--profile", "h800"]) == 0
    out = capsys.readouterr().out
    assert "approximation" in out and "DeepEP" in out


@pytest.mark.parametrize("layout, message", [("gpus=8,nope=1", "KEY=VALUE"), ("gpus=8,graphs=maybe", "true or false"), ("gpus=7,ep=2", "must divide")])
def test_bad_layouts_are_one_sentence(capsys, layout, message):
    assert main(["plan", "predict", "--decode-layout", layout]) == 2
    assert message in capsys.readouterr().err


def test_plan_gemm_benchmark_runs_at_toy_size(tmp_path):
    """benchmarks/plan_gemm.py (the --profile step's new measurement) end to end on the CPU; its numbers mean nothing here."""
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parent.parent / "benchmarks"
    out = tmp_path / "gemm.md"
    profile = tmp_path / "measured.json"
    args = [sys.executable, "plan_gemm.py", "--device", "cpu", "--model", "deepseek_v3:tiny", "--tokens", "4", "16", "--seq", "16",
            "--runs", "1", "--out", str(out), "--profile-out", str(profile)]
    done = subprocess.run(args, cwd=bench, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    text = out.read_text()
    assert "| gemm |" in text and "| causal attention" in text
    measured = load_profile(str(profile))  # the file the --profile step writes is a profile the model reads
    assert [p[0] for p in measured.gemm_slowdown] == [4, 16] and "plan_gemm.py" in measured.sources["gemm_slowdown"]
    assert main(["plan", "check", "--only", "own", "--profile", str(profile)]) == 0


def test_plan_launch_benchmark_runs_at_toy_size(tmp_path):
    """benchmarks/plan_launch.py (the --profile step's launch costs) on the CPU: the eager part only."""
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parent.parent / "benchmarks"
    out = tmp_path / "launch.md"
    args = [sys.executable, "plan_launch.py", "--device", "cpu", "--kernels", "20", "--runs", "2", "--out", str(out)]
    done = subprocess.run(args, cwd=bench, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    text = out.read_text()
    assert "eager launch from Python" in text and "skipped: needs CUDA" in text
