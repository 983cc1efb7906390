"""The multi-rank benchmarks run end to end at toy sizes on CPU ranks (gloo), so a change cannot break them
unseen between GPU sessions. Their numbers here mean nothing; their correctness checks do."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
from workload import mixed_workload  # noqa: E402

pytestmark = pytest.mark.slow


def run(script: str, out: Path, *args: str, timeout: int = 600) -> str:
    """The Markdown the script writes to --out (its stdout also carries progress lines)."""
    return run_side_by_side([(script, out, *args)], timeout)[0]


def run_side_by_side(runs: list[tuple], timeout: int = 600) -> list[str]:
    """run() of each (script, out, *args) at once, each a process of its own: the Markdown of each, in order."""
    started = []
    for script, out, *args in runs:  # output to files: a full pipe would stop a script while another is waited for
        err = tempfile.TemporaryFile("w+")
        command = [sys.executable, script, *args, "--out", str(out)]
        started.append((subprocess.Popen(command, cwd=BENCHMARKS, stdout=subprocess.DEVNULL, stderr=err, text=True),
                        err, out))
    try:
        for process, err, _ in started:
            process.wait(timeout=timeout)
            err.seek(0)
            assert process.returncode == 0, err.read()[-3000:]
    finally:
        for process, err, _ in started:
            if process.poll() is None:
                process.kill()
                process.wait()
            err.close()
    return [out.read_text() for _, _, out in started]


def table_rows(text: str, first_cell: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in text.splitlines()
            if line.startswith(f"| {first_cell} ")]


@pytest.fixture(scope="module")
def ep_multi_gpu(tmp_path_factory):
    """ep_multi_gpu.py's parts, three runs side by side: the correctness part's `generate` processes run one after
    the other and mostly wait on one core, the other parts' gloo ranks use the rest. Part name -> its Markdown."""
    tmp, common = tmp_path_factory.mktemp("ep"), ("--cpu", "--gpus", "2", "--iters", "1", "--warmup", "1")
    parts = {
        "correctness": ("--max-new-tokens", "4", "--parts", "correctness"),
        "dispatch eplb": ("--skews", "1.2", "--parts", "dispatch", "eplb"),
        "decode": ("--parts", "decode", "--decode-tokens", "3"),  # part 4 with graphs whose capture calls the step
    }
    runs = [("ep_multi_gpu.py", tmp / f"{i}.md", *common, *args) for i, args in enumerate(parts.values())]
    return dict(zip(parts, run_side_by_side(runs)))


def test_ep_multi_gpu_on_cpu_ranks(ep_multi_gpu):
    out = ep_multi_gpu["correctness"] + ep_multi_gpu["dispatch eplb"]
    correctness = table_rows(out, "fp32") + table_rows(out, "bf16")
    assert [row[:5] for row in correctness] == [  # nothing is captured on the CPU: graphs "no"
        ["fp32", "naive", "none", "no", "2"], ["fp32", "naive", "tbo", "no", "2"], ["bf16", "local", "none", "no", "1"],
        ["bf16", "naive", "none", "no", "2"],
    ]
    assert all(row[-1] in ("yes", "(bf16 alone)") for row in correctness), out
    assert table_rows(out, "prefill") and table_rows(out, "decode"), out
    eplb = table_rows(out, "1.2")
    assert [row[1] for row in eplb] == ["static", "eplb, no redundant", "eplb, 32 redundant"]
    assert float(eplb[1][4]) > float(eplb[0][4]), "EPLB balances the ranks' pairs better than the static placement"


def test_ep_multi_gpu_decode_part_on_cpu_ranks(ep_multi_gpu):
    """Part 4 with graphs whose capture calls the step: 3 tokens per rank replay the size-3 graph, every rank."""
    out = ep_multi_gpu["decode"]
    rows = table_rows(out, "1") + table_rows(out, "2")
    assert [(row[0], row[1], row[2], row[3], row[4]) for row in rows] == [
        ("1", "local + torch", "none", "3", "3"), ("2", "naive + torch", "none", "3", "3"),
        ("2", "naive + torch", "tbo", "3", "3"),
    ], out
    assert all(float(row[5]) > 0 and float(row[6]) > 0 for row in rows), out
    assert rows[2][-1].endswith("x") and rows[1][-3].endswith("x"), out  # tbo speed-up; vs 1 rank


def test_overlap_on_cpu_ranks(tmp_path):
    out = run("overlap.py", tmp_path / "overlap.md", "--ranks", "2", "--preset", "tiny", "--decode", "4", "--prefill", "32", "--repeats", "1")
    rows = table_rows(out, "2")
    assert [(row[1], row[2]) for row in rows] == [("naive", "decode"), ("naive", "prefill")], out
    assert all(float(cell) > 0 for row in rows for cell in row[4:7]), out


def test_pd_transfer_on_cpu(tmp_path):
    out = run("pd.py", tmp_path / "pd.md", "transfer", "--backends", "loopback", "zmq", "--pages", "4", "16", "--runs", "1",
              "--layers", "1", timeout=300)
    rows = table_rows(out, "loopback") + table_rows(out, "zmq")
    assert [(row[0], row[1]) for row in rows] == [("loopback", "4"), ("loopback", "16"), ("zmq", "4"), ("zmq", "16")], out
    assert all(float(row[3].split()[0]) > 0 and float(row[5]) > 0 for row in rows), out


def test_launch_budget_of_a_qwen3_decode_layer(tmp_path):
    """Issue 22's launch cuts, counted: a Qwen3-MoE layer of a batch-1 decode step launches 9 kernels with them,
    16 without (benchmarks/results/e2e_h200.md lists them; the 10th, the MoE's top-k sum, went into the next
    layer's norm since)."""
    out = run("launch_budget.py", tmp_path / "budget.md", "--batch", "1", "--arch", "qwen3_moe")
    per_layer = {(row[1], row[2]): int(row[3]) for row in table_rows(out, "qwen3_moe")}
    assert per_layer == {("1", "off"): 16, ("1", "on"): 9}, out


def test_serving_against_offline_on_cpu(tmp_path):
    """Served and offline do the same work (every served request gets the tokens it asked for, or the script fails);
    --control times a second offline process beside the first (the A/A control)."""
    out = run("serving.py", tmp_path / "serving.md", "--num-requests", "6", "--concurrency", "3", "--runs", "2",
              "--prompt-range", "16", "32", "--output-range", "4", "8", "--threads", "1", "--max-total-tokens", "4096",
              "--control", timeout=300)
    control = next(line for line in out.splitlines() if line.startswith("second offline process / offline"))
    assert float(control.split(": ")[1].split()[0]) > 0, out
    runs = [row for row in table_rows(out, "1") + table_rows(out, "2") if len(row) > 4]
    assert [(row[0], row[1], row[2]) for row in runs] == [("1", "3", "6/6"), ("2", "3", "6/6")], out
    kinds = [row for row in table_rows(out, "1") + table_rows(out, "2") if len(row) == 4]
    assert len(kinds) == 2 and all("decode" in row[2] and "decode" in row[3] for row in kinds), out
    assert all(float(row[12]) > 0 and float(row[-1]) > 0 for row in runs), out
    summary = table_rows(out, "3")
    assert len(summary) == 1 and float(summary[0][3].split()[0]) > 0, out


def test_offline_host_profile_on_cpu(tmp_path):
    """Offline and a served rank 0 run the same workload to the same ids; every phase is measured on both sides."""
    out = run("offline_host_profile.py", tmp_path / "host.md", "--num-requests", "6", "--concurrency", "3", "--runs", "1",
              timeout=300)
    assert "identical offline and served: yes" in out, out
    steps = table_rows(out, "steps")[0]
    # the same batches, but for a served client's new request that may reach the leader a round later
    assert int(steps[1]) > 0 and abs(int(steps[1]) - int(steps[2])) <= max(2, int(steps[1]) // 20), out
    assert float(table_rows(out, "forward")[0][1].split()[0]) > 0 and table_rows(out, "**host, all but the forward**"), out


def test_dp_attention_kv_on_cpu_ranks(tmp_path):
    out = run("dp_attention_kv.py", tmp_path / "dp.md", "--preset", "tiny", "--runs", "1", "--budget-tokens", "128",
              "--context-tokens", "32")
    tp, dp = table_rows(out, "tp2 (TP attention)")[0], table_rows(out, "tp2 dp2 (DP attention)")[0]
    assert tp[1] == dp[1] == "128" and int(dp[2]) == 2 * int(tp[2]) and int(dp[3]) == 2 * int(tp[3])  # MLA stored once


def test_penalties_benchmark_on_cpu(tmp_path):
    out = run("penalties.py", tmp_path / "pen.md", "--preset", "tiny", "--runs", "1", "--batches", "2",
              "--output-len", "4", "--threads", "1")
    assert table_rows(out, "2")


def test_structured_outputs_benchmark(tmp_path):
    # the H200 command's path on tiny shapes: config only, random weights made at load, fewer layers
    out = run("structured_outputs.py", tmp_path / "so.md", "--runs", "1", "--batches", "1", "2", "--output-len", "6",
              "--tokenizer-vocab", "1024", "--schemas", "3", "--dummy-weights", "--qwen-layers", "2")
    assert "dummy weights" in out and "2 layers" in out, out
    rows = table_rows(out, "1") + table_rows(out, "2")
    assert len(rows) == 2 and all(row[-2].endswith("%") for row in rows), out
    assert table_rows(out, "cold") and table_rows(out, "cached"), out


def test_spec_host_profile_splits_a_step_by_phase(tmp_path):
    out = run("spec_host_profile.py", tmp_path / "host.md", "--runs", "1", "--batches", "2", "--output-len", "6",
              "--drafters", "none", "ngram/fixed", "--json", str(tmp_path / "host.json"))
    rows = table_rows(out, "tiny DeepSeek-V3, fp32")
    assert [row[2] for row in rows] == ["none", "ngram (fixed)"], out
    assert all(float(row[3]) > float(row[4]) > 0 for row in rows), out  # step > host > 0
    merged = run("spec_host_profile.py", tmp_path / "merged.md", "--merge", str(tmp_path / "host.json"))
    assert len(table_rows(merged, "tiny DeepSeek-V3, fp32")) == 2, merged


def test_speculative_interleaved_rounds(tmp_path):
    """Every engine once per round, steady batches timed by CPU time (how the CPU table is taken); the ratio is the
    rounds' median (the script also checks that no token changed)."""
    out = run("speculative.py", tmp_path / "spec.md", "--interleave", "--runs", "2", "--batches", "2", "--output-len", "6",
              "--drafters", "ngram", "test-adversary", "--steady", "--waves", "2", "--clock", "cpu")
    rows = table_rows(out, "tiny DeepSeek-V3 + MTP, fp32")
    assert [row[2] for row in rows] == ["none", "ngram", "adversary"], out
    assert rows[0][5] == "1.00x" and all(row[5].endswith("x") and "-" in row[6] for row in rows), out
    # the decode-only steps' rate and ratio (admissions left out): a rate, and none's own ratio 1.00x
    assert rows[0][-1] == "1.00x" and all(float(row[-2]) > 0 and row[-1].endswith("x") for row in rows), out


def test_spec_cpu_best_of_rounds(tmp_path):
    """The CPU 'never worse' table by each engine's best CPU time (the script checks that no token changed)."""
    out = run("spec_cpu_best.py", tmp_path / "best.md", "--runs", "2", "--rounds", "1", "--batches", "2")
    rows = table_rows(out, "2")
    assert [row[1] for row in rows] == ["ngram", "adversary"], out
    assert all(len(row[2].split(", ")) == 2 and 0.5 < float(row[3]) < 2.0 for row in rows), out


def test_spec_admit_rows_counts_the_steps_of_a_run_by_the_prompts_that_fit_beside(tmp_path):
    """Where no prompt fits beside a verify step's grid, admissions end the run (synchronous mixed steps); where two
    fit, the run goes on through them. The script checks that no token changes."""
    out = run("spec_admit_rows.py", tmp_path / "rows.md", "--batches", "8", "--rows", "40", "256", "--output-len", "16")
    rows = table_rows(out, "8")
    assert [(row[1], row[3]) for row in rows] == [("40", "0"), ("256", "2")], out
    (sync_none, ends_none), (sync_two, ends_two) = [(int(row[-2]), int(row[-1])) for row in rows]
    assert sync_two < sync_none and ends_two == 1 < ends_none, out


def test_spec_device_parts_against_the_host_paths(tmp_path):
    out = run("spec_device_parts.py", tmp_path / "parts.md", "--batches", "1", "3", "--iters", "2", "--warmup", "1",
              "--runs", "2", "--history", "64", "--vocab", "256")
    rows = table_rows(out, "draft") + table_rows(out, "accept")
    assert [(row[0], row[1]) for row in rows] == [("draft", "1"), ("draft", "3"), ("accept", "1"), ("accept", "3")], out
    assert all(row[-1].endswith("x") and float(row[5].split()[0]) > 0 for row in rows), out


def test_spec_serving_against_the_same_server_without_speculation(tmp_path):
    """Both servers serve every request its tokens (or the script fails); the summary has the ratio per level."""
    out = run("spec_serving.py", tmp_path / "serve.md", "--concurrency", "2", "--num-requests", "4", "--output-len", "8",
              "--output-spread", "0.5", "--runs", "1", "--threads", "1", "--max-total-tokens", "4096",
              "--max-running-requests", "4", timeout=300)
    rows = [row for row in table_rows(out, "1") if len(row) == 12]
    assert sorted(row[2] for row in rows) == ["ngram", "none"] and all(row[3] == "4/4" for row in rows), out
    # the step mix: every level ran a prompt step and decoded (the ngram server verified or stepped plainly)
    mixes = [row for row in table_rows(out, "1") if len(row) == 11]
    assert sorted(row[2] for row in mixes) == ["ngram", "none"] and all(row[3] != "0" for row in mixes), out
    summary = table_rows(out, "2")
    assert len(summary) == 1 and float(summary[0][3].split()[0]) > 0, out


def test_overlap_breaks_counts_both_ways_of_ending_a_run(tmp_path):
    """Both ways run the workload to the end under the given costs; with breaks dearer than many idle steps the
    run that goes on breaks the schedule no more often than the one that ends at once."""
    out = run("overlap_breaks.py", tmp_path / "breaks.md", "--requests", "4", "--max-running", "2", "--output-len",
              "16", "--break-ms", "5", timeout=300)
    ends, keeps = table_rows(out, "ends_at_once"), table_rows(out, "keeps_run")
    assert len(ends) == len(keeps) == 1, out
    breaks = [int(row[2]) + int(row[3]) for row in ends + keeps]
    assert breaks[1] <= breaks[0] and float(ends[0][5]) > 0 and "verify_overlap" in ends[0][1], out


def test_moe_small_m_under_the_triton_interpreter(tmp_path):
    """The decode-size MoE sweep (issue #31 target 1) checks each candidate against the torch kernel before timing:
    a candidate must come out in the table, not as WRONG or skipped, and --write-configs writes the plugin's table."""
    out = tmp_path / "moe.md"
    done = subprocess.run([sys.executable, "moe_small_m.py", "--device", "cpu", "--tokens", "1", "--runs", "1",
                           "--candidates", "n64", "--out", str(out), "--write-configs", str(tmp_path / "configs")],
                          cwd=BENCHMARKS, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "WRONG" not in done.stdout and "skipped" not in done.stdout, done.stdout
    assert [row[1] for row in table_rows(out.read_text(), "1")[:2]] == ["table", "n64"], out.read_text()
    assert list((tmp_path / "configs").glob("E=16,N=32,K=64,device=interpreter,dtype=fp16.json"))


def test_moe_grouping_stages_under_the_triton_interpreter():
    """The library path's stage table (issue #31 target 5) runs end to end: one row with every stage timed."""
    done = subprocess.run([sys.executable, "moe_grouping.py", "--device", "cpu", "--shape", "tiny", "--tokens", "16",
                           "--routing", "global", "--runs", "1"],
                          cwd=BENCHMARKS, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| global | 16 |")]
    assert len(rows) == 1 and len(rows[0].split("|")) == 16, done.stdout


def test_mixed_steps_cut_prompt_pieces_into_graphed_steps(tmp_path):
    """With the rows of a 256-row graph, the serving workload's prompts (32-256 tokens, 64 at a time) ride mixed
    steps, cut where they do not fit, rather than taking steps of their own (41-45 of them before the cut), offline
    and served alike; every output token is counted."""
    out = run("mixed_steps.py", tmp_path / "steps.md", "--mixed-rows", "256", "--delays", "2")
    rows = table_rows(out, "offline") + table_rows(out, "served,")
    assert len(rows) == 2, out
    for row in rows:
        steps, decode, mixed, prompt, tokens = map(int, row[1:])
        assert steps == decode + mixed + prompt and prompt <= 2, out
        assert tokens == sum(n for _, n in mixed_workload(256)), out


def test_pack_copy_times_both_packs_idle_and_busy(tmp_path):
    """Both packs, with the cores idle and busy, each a row of positive times and torch's row a ratio."""
    out = run("pack_copy.py", tmp_path / "pack.md", "--calls", "20", "--runs", "1", "--threads", "2")
    rows = table_rows(out, "idle") + table_rows(out, "busy")
    assert [(r[0], r[1]) for r in rows] == [("idle", "torch.cat"), ("idle", "numpy"), ("busy", "torch.cat"),
                                            ("busy", "numpy")], out
    assert all(float(cell.split()[0]) > 0 for r in rows for cell in r[2:6]), out
    assert float(rows[0][6].split()[0]) > 0 and float(rows[2][6].split()[0]) > 0, out


def test_front_end_ceiling_serves_every_request_against_the_stand_in(tmp_path):
    """The front end against the stand-in engine: every request streams its tokens, against an ideal from the same
    workload's offline schedule (the stand-in's steps with everything submitted at once)."""
    from front_end_ceiling import offline_steps

    assert offline_steps([([1], 3), ([1], 1), ([1], 2)], 2) == 3  # 3 and 1 run; 2 joins at step 2 and ends at step 3
    assert offline_steps([([1], 4)] * 4, 4) == 4
    out = run("front_end_ceiling.py", tmp_path / "fe.md", "--num-requests", "24", "--concurrency", "8", "--runs", "1",
              "--step-ms", "5")
    row = table_rows(out, "1")[0]
    assert row[1] == "8" and float(row[2]) > 0 and 0 < float(row[4]) <= 1.2, out
    assert float(row[10]) > 0, out  # the front end's CPU a token


def test_gemv_small_m_under_the_triton_interpreter(tmp_path):
    """The projections' sweep (issue #31 target 1) checks every tiling against F.linear before timing it and writes
    a row per projection and row count."""
    out = tmp_path / "gemv.md"
    done = subprocess.run([sys.executable, "gemv_small_m.py", "--device", "cpu", "--quick", "--runs", "1", "--rows", "1",
                           "3", "--out", str(out)], cwd=BENCHMARKS, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in out.read_text().splitlines() if line.startswith("| tiny")]
    assert [row.split(" | ")[3] for row in rows] == ["1", "3", "1", "3"], out.read_text()


def test_router_warps_under_the_triton_interpreter(tmp_path):
    """The router's warps sweep (results/router_warps_h100.md) writes a row per model and token count, every warp
    count timed, the default marked where it is one of them."""
    out = tmp_path / "warps.md"
    done = subprocess.run([sys.executable, "router_warps.py", "--device", "cpu", "--quick", "--out", str(out)],
                          cwd=BENCHMARKS, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split(" | ") for line in out.read_text().splitlines() if line.startswith("| Qwen3") or
            line.startswith("| DeepSeek")]
    assert [(row[0].strip("| "), row[1]) for row in rows] == [
        ("Qwen3-30B-A3B", "1"), ("Qwen3-30B-A3B", "2"), ("DeepSeek-V3", "1"), ("DeepSeek-V3", "2")], out.read_text()
    assert all(float(cell.strip("*| ").split()[0]) > 0 for row in rows for cell in row[2:4]), out.read_text()
    assert "(default)" in rows[0][2], out.read_text()  # one token: one warp
