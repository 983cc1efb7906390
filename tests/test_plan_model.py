"""The deployment model of `moeplex plan`: how its terms add up into a step, a deployment and a search."""

import pytest

from moeplex.plan import costs
from moeplex.plan.deployment import Deployment, RoleLayout, Workload, predict, predict_step
from moeplex.plan.profile import load_profile
from moeplex.plan.search import search
from moeplex.plan.shapes import load_config, model_shape

LOCAL = RoleLayout(gpus=1, ep=1, dispatcher="local", moe_kernel="triton", dtype="bf16", balancer="static")


@pytest.fixture(scope="module")
def hw():
    return load_profile("h200")


@pytest.fixture(scope="module")
def v3():
    return model_shape(load_config("deepseek_v3:v3"))


def test_one_gpu_step_has_no_communication_and_grows_with_the_batch(hw, v3):
    small = predict_step(hw, v3, LOCAL, Workload(128, 32), "decode", 1)
    large = predict_step(hw, v3, LOCAL, Workload(128, 32), "decode", 256)
    assert small.split_us["dispatch"] == small.split_us["combine"] == small.split_us["idle"] == 0.0
    assert small.balancedness == 1.0
    assert large.step_us > small.step_us
    # batch 1 reads 8 experts: the measured table's 1-row point x 8 hit experts
    table, _ = hw.expert_table("triton", "bf16", 7168, 2048)
    hit = costs.experts_hit(8, 256)
    assert hit == pytest.approx(256 * (1 - (255 / 256) ** 8))
    assert small.split_us["experts"] == pytest.approx(hit * table.us_per_expert(8 / hit))


def test_step_is_the_sum_of_its_layers(hw, v3):
    wl = Workload(2000, 100, zipf_skew=0.0)
    lay = RoleLayout(gpus=16, ep=16, dispatcher="deepep-ll", redundant_experts=0, balancer="static")
    step = predict_step(hw, v3, lay, wl, "decode", 64)
    s = step.split_us
    moe_layer = s["attention"] + s["experts"] + s["idle"] + s["other"] + s["dispatch"] + s["combine"] + s["host"]
    outside = step.step_us - v3.moe_layers * moe_layer - v3.moe_layers * s["dense"]
    # a replayed graph's gaps: per MoE layer 7 + 6 small kernels, 2 projections, attention, o_proj, router, dispatch,
    # 3 expert launches, combine, 2 shared-expert GEMMs = 25; per dense layer 19; 9 outside
    assert s["host"] * v3.moe_layers == pytest.approx((58 * 25 + 3 * 19 + 9) * hw.graph_gap_us)
    # outside the layers: the lm_head over the batch's 64 requests and the step's few small kernels
    expected = costs.gemm_us(hw, 64, v3.hidden, v3.vocab) + hw.launches["deepseek_v3"]["outside"] * hw.kernel_floor_us
    assert outside == pytest.approx(expected)
    assert s["dispatch"] > 0 and s["combine"] > 0


def test_eplb_with_redundant_experts_beats_static_under_skew(hw, v3):
    wl = Workload(2000, 100, zipf_skew=1.0)
    static = predict_step(hw, v3, RoleLayout(gpus=32, ep=32, balancer="static"), wl, "prefill", 4096)
    eplb = predict_step(hw, v3, RoleLayout(gpus=32, ep=32, redundant_experts=32, balancer="eplb"), wl, "prefill", 4096)
    assert eplb.balancedness > static.balancedness
    assert eplb.split_us["idle"] < static.split_us["idle"]
    assert eplb.step_us < static.step_us


def test_tbo_takes_the_longer_stream_of_two_half_batches(hw, v3):
    wl = Workload(2000, 100, zipf_skew=0.0)
    base = RoleLayout(gpus=32, ep=32, dispatcher="deepep-ll", balancer="static")
    none = predict_step(hw, v3, base, wl, "decode", 256)
    tbo = predict_step(hw, v3, RoleLayout(**{**base.__dict__, "overlap": "tbo"}), wl, "decode", 256)
    assert tbo.notes and tbo.step_us < none.step_us  # transfers are a large share across nodes


def test_layouts_that_cannot_run_are_refused(hw, v3):
    with pytest.raises(ValueError, match="do not split"):
        predict_step(hw, v3, RoleLayout(gpus=72, ep=72), Workload(), "decode", 8)
    with pytest.raises(ValueError, match="local dispatcher"):
        predict_step(hw, v3, RoleLayout(gpus=8, ep=8, dispatcher="local"), Workload(), "decode", 8)
    with pytest.raises(ValueError, match="deepgemm takes fp8"):
        predict_step(hw, v3, RoleLayout(dtype="bf16"), Workload(), "decode", 8)


def test_deployment_rate_sets_the_decode_batch_and_queueing(hw, v3):
    dep = Deployment(RoleLayout(gpus=8, ep=8), RoleLayout(gpus=8, ep=8), 8192, 64, True)
    wl = Workload(1000, 100, zipf_skew=0.0)
    fixed = predict(hw, v3, dep, wl)
    assert fixed.requests_per_s > 0 and fixed.itl_p99_ms == fixed.itl_ms
    light = predict(hw, v3, dep, wl, rate=0.1 * fixed.requests_per_s)
    assert light.decode.tokens_per_gpu < 64 and light.ttft_ms > fixed.ttft_ms - 1e-9
    colocated = predict(hw, v3, Deployment(dep.prefill, dep.prefill, 8192, 64, False), wl)
    assert colocated.itl_p99_ms == pytest.approx(colocated.itl_ms + colocated.prefill.step_us / 1e3)


def test_search_respects_the_itl_bound(hw):
    qwen = model_shape(load_config("qwen3_moe:30b-a3b"))
    best, priced = search(hw, qwen, Workload(1000, 200, zipf_skew=0.0), 4, max_itl_ms=30, kernel="triton", dtype="bf16", top=3)
    assert priced > 0 and best
    assert all(c.prediction.itl_p99_ms <= 30 for c in best)
    rates = [c.prediction.requests_per_s for c in best]
    assert rates == sorted(rates, reverse=True)


def test_nothing_on_the_serving_path_imports_the_planner():
    """moeplex.plan is offline: only its own package and the `moeplex plan` sub-command import it."""
    import ast
    from pathlib import Path

    core = Path(__file__).resolve().parent.parent / "core"
    allowed = {core / "cli" / "plan.py"}
    offenders = []
    for path in sorted(core.rglob("*.py")):
        if path.is_relative_to(core / "plan") or path in allowed:
            continue
        package = ["moeplex", *path.relative_to(core).parent.parts]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                module = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module
                names = [module] + [f"{module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            if any(n == "moeplex.plan" or n.startswith("moeplex.plan.") for n in names if n):
                offenders.append(f"{path.relative_to(core)}:{node.lineno}")
    assert not offenders


def test_prefill_is_eager_and_turns_host_bound_when_launches_are_slow(hw):
    from moeplex.plan.profile import Profile

    qwen = model_shape(load_config("qwen3_moe:30b-a3b"))
    launches = {**hw.launches, "qwen3_moe": {**hw.launches["qwen3_moe"], "eager_host_us": 1000.0}}
    slow = Profile(hw.name, hw.values, hw.sources, hw.moe, launches)
    fast = predict_step(hw, qwen, LOCAL, Workload(128, 32, zipf_skew=0.0), "prefill", 128)
    step = predict_step(slow, qwen, LOCAL, Workload(128, 32, zipf_skew=0.0), "prefill", 128)
    # per layer 2 small + 2 projections + attention + o_proj + 3 small + router + 3 expert launches = 13; 9 outside
    host = (48 * 13 + 9) * 1000.0
    assert host < step.step_us < host + fast.step_us
    assert step.split_us["host"] > 0.9 * host / 48
