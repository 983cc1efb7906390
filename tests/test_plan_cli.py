"""`moeplex plan` end to end with the shipped profile (CI runs it)."""

import json
import os

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


def test_profile_step_runs_every_measurement_and_merges_them_at_toy_size(tmp_path):
    """benchmarks/plan_profile.sh in its CPU mode: every step the lead's one-GPU call runs (routing record,
    one-rank dispatch, dense GEMMs and attention, launch costs), merged by `plan profile-update` into a profile
    that `plan check` reads. The numbers mean nothing on a CPU; the commands and files are what is tested."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "plan_profile.sh"
    done = subprocess.run(["bash", str(script), str(tmp_path), "300", "cpu"], capture_output=True, text=True, timeout=400,
                          env={**os.environ, "PYTHON": sys.executable})
    steps = (tmp_path / "steps.txt").read_text()
    assert done.returncode == 0 and steps.count("rc 0") == 6, steps + done.stderr[-2000:]
    gemm = (tmp_path / "plan_gemm_h200.md").read_text()
    assert "| gemm |" in gemm and "| causal attention" in gemm
    launch = (tmp_path / "plan_launch_h200.md").read_text()
    assert "eager launch from Python" in launch and "skipped: needs CUDA" in launch
    measured = load_profile(str(tmp_path / "h200_measured.json"))
    # each merged number keeps the command that measured it
    assert [p[0] for p in measured.gemm_slowdown] == [4, 16] and "plan_gemm.py" in measured.sources["gemm_slowdown"]
    assert [b[0] for b in measured.routing_deepseek_v3["batches"]] == [1, 8]
    assert "plan_routing.py --device cpu --preset tiny" in measured.sources["routing_deepseek_v3"]
    assert "plan_dispatch.py" in measured.sources["local_kernel_us"]
    assert measured.hbm_gbps == load_profile("h200").hbm_gbps  # what no step measured stays as shipped
    update = (tmp_path / "profile_update.md").read_text()
    assert "| routing_deepseek_v3 | {" in update and "| gemm_slowdown | - |" in update
    assert "DeepSeek-V3 4 layers decode b=32" in (tmp_path / "plan_check_measured.md").read_text()


def test_profile_update_refuses_an_entry_without_a_source(tmp_path, capsys):
    fragment = tmp_path / "m.json"
    fragment.write_text(json.dumps({"graph_gap_us": {"value": 1.0, "source": ""}}))
    assert main(["plan", "profile-update", str(fragment), "--out", str(tmp_path / "p.json")]) == 2
    assert "has no source" in capsys.readouterr().err
    fragment.write_text(json.dumps({"graph_gap_us": {"value": 1.0, "source": "run X"}, "details": {"rows": [1, 2]}}))
    assert main(["plan", "profile-update", str(fragment), "--out", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    assert "| graph_gap_us | 1.37 | 1.0 | run X |" in out and "1 entries changed" in out
    assert load_profile(str(tmp_path / "p.json")).graph_gap_us == 1.0


def test_check_takes_a_recorded_load_for_the_published_cases(tmp_path, capsys):
    flat = tmp_path / "flat.json"  # no hot experts at all: EPLB can only even out a batch's noise
    flat.write_text(json.dumps({"load_history": [{"logical_expert_load": [[100] * 256]}]}))
    assert main(["plan", "check", "--only", "published", "--expert-load", str(flat)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if "EPLB gain" in line]
    gains = [float(row.split("|")[4]) for row in rows]
    assert len(gains) == 2 and all(0.95 < g < 1.1 for g in gains)


def test_routing_records_merge_into_one_profile_entry(tmp_path):
    """plan_routing.py --from-record: two runs' batches as one entry; the histogram counts experts per (step, layer)."""
    import subprocess
    import sys
    from pathlib import Path

    def record(batch, counts):
        return {"source": f"run {batch}", "experts": 4, "top_k": 2, "overrides": {}, "model_type": "deepseek_v3",
                "batches": {str(batch): {"distinct": [sum(1 for c in v if c) for v in counts], "counts": counts}}}

    (tmp_path / "a.json").write_text(json.dumps(record(1, [[1, 1, 0, 0], [0, 1, 1, 0]])))
    (tmp_path / "b.json").write_text(json.dumps(record(2, [[2, 2, 0, 0], [1, 1, 1, 1]])))
    bench = Path(__file__).resolve().parent.parent / "benchmarks"
    out = tmp_path / "merged.json"
    done = subprocess.run([sys.executable, "plan_routing.py", "--from-record", str(tmp_path / "b.json"), str(tmp_path / "a.json"),
                           "--out", str(out)], cwd=bench, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    entry = json.loads(out.read_text())["routing_deepseek_v3"]
    # batch 2: one step with two experts of 2 rows, one with four of 1 row -> per step 2 experts x 1 row, 1 x 2 rows
    assert entry["value"]["batches"] == [[1, [[1, 2.0]]], [2, [[1, 2.0], [2, 1.0]]]]
    assert "run 2" in entry["source"] and "run 1" in entry["source"]


def test_routing_of_the_routers_alone(tmp_path):
    """plan_routing.py --router-only: the dummy routers on random inputs, a record and an entry like a run's."""
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parent.parent / "benchmarks"
    out = tmp_path / "routers.json"
    done = subprocess.run([sys.executable, "plan_routing.py", "--router-only", "--preset", "tiny", "--batches", "1", "4",
                           "--output-len", "3", "--out", str(out)], cwd=bench, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads(out.read_text())
    top_k = record["top_k"]
    assert [len(record["batches"][b]["counts"]) for b in ("1", "4")] == [2 * 3, 2 * 3]  # 2 steps x 3 MoE layers
    assert all(sum(v) == 4 * top_k for v in record["batches"]["4"]["counts"])  # every token's top-k counted
    assert record["batches"]["1"]["mean_distinct"] == top_k
    assert [b[0] for b in record["routing_deepseek_v3"]["value"]["batches"]] == [1, 4]
