"""Every cost term of `moeplex plan` against a hand-computed case, on a made-up profile with round numbers."""

import json
import math
from importlib import resources

import pytest
import torch

from moeplex.plan import costs, routing
from moeplex.plan.imbalance import ExpertLoad, balancedness
from moeplex.plan.profile import ExpertTable, Profile, load_profile
from moeplex.plan.shapes import load_config, model_shape

ROUND = dict(
    hbm_gbps=1000.0, matmul_bf16_tflops=100.0, matmul_fp8_tflops=200.0, kernel_floor_us=2.0, gpus_per_node=8, num_sms=100,
    nvlink_normal_gbps=100.0, nvlink_ll_gbps=50.0, deepep_normal_fixed_us=10.0, deepep_normal_sms=20,
    rdma_normal_gbps=[[16, 40], [64, 20]], rdma_ll_dispatch_gbps=[[8, 80], [32, 20]], rdma_ll_combine_gbps=[[8, 80], [32, 20]],
)


@pytest.fixture
def hw():
    return Profile("round", dict(ROUND), {k: "test" for k in ROUND}, {}, {})


def test_gemm_is_the_slower_of_flops_and_bytes_never_under_the_floor(hw):
    # compute-bound: 1000 tokens x 1000 x 1000: 2e9 FLOP / 100e12 = 20 µs; bytes 2e6 + 1000*2000*2 = 6e6 / 1e12 = 6 µs
    assert costs.gemm_us(hw, 1000, 1000, 1000) == pytest.approx(20.0)
    # bandwidth-bound: 1 token: 2e6 FLOP = 0.02 µs; bytes 2e6 + 4000 = 2.004e6 -> 2.004 µs
    assert costs.gemm_us(hw, 1, 1000, 1000) == pytest.approx(2.004)
    # fp8 weights: 1 byte + 4/128/128 of a scale per weight
    assert costs.gemm_us(hw, 1, 4000, 4000, "fp8") == pytest.approx((16e6 * (1 + 4 / 128 / 128) + 16_000) / 1e6)
    assert costs.gemm_us(hw, 1, 10, 10) == 2.0  # the floor
    assert costs.gemm_us(hw, 0, 1000, 1000) == 0.0


def test_attention_core(hw):
    # decode: 10 queries over 1000 keys each = 10,000 pairs x 1000 bytes = 1e7 B / 1e12 = 10 µs; FLOPs 1e4 x 1e5 = 1e9 -> 10 µs
    assert costs.attention_core_us(hw, 10, 10_000, 1000, 100_000, decode=True) == pytest.approx(10.0)
    assert costs.attention_core_us(hw, 10, 10_000, 2000, 100_000, decode=True) == pytest.approx(20.0)  # bytes win
    # prefill: FLOPs only
    assert costs.attention_core_us(hw, 10, 1e6, 2000, 100_000, decode=False) == pytest.approx(1000.0)
    assert costs.attention_core_us(hw, 0, 0, 1, 1, decode=True) == 0.0


def test_experts_hit_and_time():
    assert costs.experts_hit(1, 4) == pytest.approx(1.0)
    assert costs.experts_hit(2, 4) == pytest.approx(4 * (1 - 0.75**2))  # 1.75
    assert costs.experts_hit(0, 4) == 0.0
    table = ExpertTable(((1.0, 10.0), (100.0, 100.0)), "test")
    assert table.us_per_expert(10.0) == pytest.approx(10 ** 1.5)  # log-log midway
    assert table.us_per_expert(0.5) == 10.0  # held below the first point
    # past the last point: the last two points' log-log trend (slope 0.5 here): 100 x 2^0.5
    assert table.us_per_expert(200.0) == pytest.approx(100 * 2**0.5)
    # ... never faster than the best measured rate (here 0.9 µs per row), never slower than linear
    assert table.us_per_expert(200.0, min_us_per_row=0.9) == pytest.approx(180.0)
    steep = ExpertTable(((1.0, 1.0), (10.0, 100.0)), "test")  # slope 2: capped at linear
    assert steep.us_per_expert(20.0) == pytest.approx(200.0)
    # 2 pairs over 4 experts: 1.75 hit, 2/1.75 rows each
    expected = 1.75 * table.us_per_expert(2 / 1.75) * 0.5
    assert costs.experts_us(table, 0.5, 2, 4) == pytest.approx(expected)


def test_expert_table_from_measured_rows():
    table = ExpertTable.from_measured([[1, 3, 3, 30.0], [128, 256, 32, 640.0]], "test")
    assert table.rows == ((1.0, 10.0), (8.0, 20.0))


def test_ranks_reached():
    assert costs.ranks_reached(1, 1) == pytest.approx(0.5)  # 2 ranks, 1 expert: the other half the time
    assert costs.ranks_reached(1, 8) == pytest.approx(1 - 0.5**8)
    assert costs.ranks_reached(0, 8) == 0.0


def test_deepep_normal_intranode_and_internode(hw):
    # EP2 inside a node: 1000 tokens reach the other rank with p = 1 - 0.5^8; bf16 rows of 1000 values = 2000 B
    copies = 1000 * (1 - 0.5**8)
    d, c = costs.deepep_normal_us(hw, 1000, 1000, 8, 2, fp8_dispatch=False)
    assert d == pytest.approx(copies * 2000 / 1e5 + 10.0)
    assert c == pytest.approx(copies * 2000 / 1e5)
    # EP32 = 4 nodes: copies to the 3 other nodes; RDMA at the EP-interpolated published rate (log2 16..64 -> 30 GB/s at 32)
    copies = 1000 * 3 * (1 - 0.75**8)
    d, c = costs.deepep_normal_us(hw, 1000, 1000, 8, 32, fp8_dispatch=True)
    assert d == pytest.approx(copies * 1000 * (1 + 4 / 128) / 3e4 + 10.0)
    assert c == pytest.approx(copies * 2000 / 3e4)
    assert costs.deepep_normal_us(hw, 1000, 1000, 8, 1, False) == (0.0, 0.0)


def test_deepep_low_latency(hw):
    # EP4 in a node: 3/4 of the 10 x 8 pairs leave over NVLink at 50 GB/s, plus one kernel
    d, c = costs.deepep_ll_us(hw, 10, 1000, 8, 4, fp8_dispatch=False)
    assert d == pytest.approx(60 * 2000 / 5e4 + 2.0)
    assert c == pytest.approx(60 * 2000 / 5e4 + 2.0)
    # EP16 between nodes: every pair at the published rate, interpolated in log2(EP): 8 -> 80, 32 -> 20, so 16 -> 50
    d, c = costs.deepep_ll_us(hw, 10, 1000, 8, 16, fp8_dispatch=True)
    assert d == pytest.approx(80 * 1000 * (1 + 4 / 128) / 5e4)
    assert c == pytest.approx(80 * 2000 / 5e4)


def test_by_ep_holds_at_the_ends(hw):
    assert hw.by_ep("rdma_normal_gbps", 8) == 40
    assert hw.by_ep("rdma_normal_gbps", 128) == 20
    assert hw.by_ep("rdma_normal_gbps", 32) == pytest.approx(30)


def test_permute_sm_slowdown_and_overlap(hw):
    # 100 pairs over 2 experts padded by 64 each: 228 rows; 2 x (228 + 100) rows x 10 values x 2 B = 13,120 B
    assert costs.permute_us(hw, 100, 2, 10) == pytest.approx(13_120 / 1e6 + 4.0)
    assert costs.permute_us(hw, 0, 2, 10) == 0.0
    assert costs.sm_slowdown(hw, 20) == pytest.approx(100 / 80)
    assert costs.overlapped_layer_us(10, 3) == 20
    assert costs.overlapped_layer_us(3, 10) == 20


def test_balancedness_from_our_balancers():
    assert balancedness(ExpertLoad(16, 1.0), 100, 1, 16, "static") == 1.0
    # a uniform law over many pairs is balanced whatever the placement
    assert balancedness(ExpertLoad(16, 0.0), 100_000, 4, 16, "static") > 0.98
    # one expert carries half the load: static leaves its rank with >= half, EPLB with redundant slots splits it
    load = torch.ones(1, 16)
    load[0, 0] = 15.0
    skewed = ExpertLoad(16, recorded=load)
    static = balancedness(skewed, 100_000, 4, 16, "static")
    assert static == pytest.approx(0.25 / (0.5 + 3 / 30), rel=0.03)  # mean 1/4 of the load, max 1/2 + 3 cold experts
    assert balancedness(skewed, 100_000, 4, 20, "eplb") > static + 0.3
    with pytest.raises(ValueError, match="do not split"):
        balancedness(skewed, 100, 3, 16, "eplb")


def test_model_shapes_of_our_three_architectures():
    v3 = model_shape(load_config("deepseek_v3:v3"))
    assert (v3.layers, v3.moe_layers, v3.experts, v3.top_k, v3.kv_bytes_per_token) == (61, 58, 256, 8, (512 + 64) * 2)
    qwen = model_shape(load_config("qwen3_moe:30b-a3b"))
    assert (qwen.moe_layers, qwen.experts, qwen.kv_bytes_per_token) == (48, 128, 2 * 4 * 128 * 2)
    mixtral = model_shape(load_config("mixtral:8x7b"))
    assert (mixtral.moe_layers, mixtral.experts, mixtral.expert_intermediate) == (32, 8, 14336)
    with pytest.raises(ValueError, match="neither"):
        load_config("no-such-model")


def test_shipped_profile_gives_a_source_for_every_number():
    data = json.loads(resources.files("moeplex.plan").joinpath("profiles", "h200.json").read_text())
    for key, entry in data.items():
        if isinstance(entry, dict) and "value" in entry:
            assert entry["source"].strip(), key
    for key, table in data["moe_tables"].items():
        if isinstance(table, dict):
            assert table["source"].strip(), key
    derived = json.loads(resources.files("moeplex.plan").joinpath("profiles", "derived.json").read_text())
    for name in ("h100", "h800"):
        assert all(entry["source"].strip() for entry in derived[name]["scale"].values())


def test_derived_profiles_scale_by_spec_ratios():
    h200, h100 = load_profile("h200"), load_profile("h100")
    assert h100.hbm_gbps == pytest.approx(h200.hbm_gbps * 0.6979)
    assert h100.matmul_bf16_tflops == h200.matmul_bf16_tflops
    base, derived = h200.moe["triton_bf16"], h100.moe["triton_bf16"]
    rows, us = base.rows[0]
    share = 190 / (190 + rows)  # the weight-read share of a 1-row expert
    assert derived.rows[0][1] == pytest.approx(us * (share / 0.6979 + (1 - share)))
    assert "approximation" in h100.notes[0]


def test_expert_table_picks_the_shape_it_was_measured_at():
    hw = load_profile("h200")
    table, factor = hw.expert_table("triton", "bf16", 2048, 768)
    assert table.shape == (2048, 768) and factor == 1.0
    table, factor = hw.expert_table("triton", "bf16", 4096, 14336)  # Mixtral: nearest table, scaled by expert size
    assert table.shape == (7168, 2048) and factor == pytest.approx(4096 * 14336 / (7168 * 2048))
    with pytest.raises(ValueError, match="no expert table"):
        hw.expert_table("deepgemm", "bf16", 7168, 2048)
    assert math.isfinite(table.us_per_expert(1e5))


def test_measured_slowdowns_scale_the_roofline(hw):
    hw.values["gemm_slowdown"] = [[10, 2.0], [1000, 1.0]]
    assert hw.slowdown("gemm_slowdown", 100) == pytest.approx(1.5)  # log-linear between the points
    assert costs.gemm_us(hw, 1000, 1000, 1000) == pytest.approx(20.0)  # 1.0 at 1000 tokens
    assert costs.gemm_us(hw, 10, 10_000, 1000) == pytest.approx(2 * (1e7 * 2 + 10 * 11_000 * 2) / 1e6)
    assert hw.slowdown("attention_slowdown", 100) == 1.0  # not measured: the roofline as it is


def test_expert_rate_cap_is_the_best_rate_measured():
    # 3 GEMMs of 10 x 20 per row = 1200 FLOP per row: 100 rows in 1 µs = 0.12 TFLOP/s; 10 rows in 1 µs = 0.012
    table = ExpertTable(((10.0, 1.0), (100.0, 1.0)), "test", shape=(10, 20))
    assert table.best_tflops() == pytest.approx(0.12)
    # experts_us turns it into a floor per row: 1200 / 0.12e6 = 0.01 µs per row
    pairs, local = 1e6, 1  # one expert with 1e6 rows: trend 1 µs (slope 0), floor 1e6 x 0.01 = 1e4 µs
    assert costs.experts_us(table, 1.0, pairs, local, best_tflops=0.12) == pytest.approx(1e4)


def test_router_runs_in_fp32_on_cuda_cores(hw):
    values = dict(ROUND, fp32_tflops=10.0)
    fp = Profile("round", values, {}, {}, {})
    # 1000 tokens x 1000 hidden x 100 experts: 2e8 FLOP / 10e12 = 20 µs; bytes 4e5 + 1000 x (2000 + 4000 + 400) = 6.8e6 -> 6.8 µs
    assert costs.router_us(fp, 1000, 1000, 100) == pytest.approx(20.0)
    assert costs.router_us(fp, 1, 10, 10) == 2.0  # the floor
    assert costs.router_us(fp, 0, 10, 10) == 0.0


def test_small_kernels_are_bandwidth_bound_at_prefill_sizes(hw):
    # 4 kernels each reading and writing [1000, 1000] bf16: 4e6 B / 1e12 B/s = 4 µs each
    assert costs.small_kernels_us(hw, 4, 1000, 1000) == pytest.approx(16.0)
    assert costs.small_kernels_us(hw, 4, 1, 1000) == pytest.approx(8.0)  # decode: the 2 µs floor each
    assert costs.small_kernels_us(hw, 0, 1000, 1000) == 0.0


def test_prefill_attention_at_the_published_flash_rate(hw):
    values = dict(ROUND, attention_prefill_tflops=[[1024, 25.0], [4096, 50.0]])
    fa = Profile("round", values, {}, {}, {})
    # 1e6 pairs x 1e5 FLOP = 1e11 FLOP; at 2048 tokens the rate is midway in log2: 37.5 TFLOP/s -> 2666.7 µs
    assert costs.attention_core_us(fa, 2048, 1e6, 1, 100_000, decode=False, seq_len=2048) == pytest.approx(1e11 / 37.5e6)
    assert costs.attention_core_us(fa, 8192, 1e6, 1, 100_000, decode=False, seq_len=8192) == pytest.approx(2000.0)  # held
    # a measured slowdown table (the --profile step) wins over the published rate
    measured = Profile("round", dict(values, attention_slowdown=[[1, 3.0]]), {}, {}, {})
    assert costs.attention_core_us(measured, 2048, 1e6, 1, 100_000, decode=False, seq_len=2048) == pytest.approx(3000.0)


def test_permute_parts_add_up(hw):
    group, summing = costs.permute_parts_us(hw, 1000, 2, 1000)
    # padded rows 1000 + 2 x 64 = 1128; grouping writes and reads 2128 rows of 2000 B = 4.256 µs, + floor
    assert group == pytest.approx(2128 * 2000 / 1e6 + 2.0)
    assert group + summing == pytest.approx(costs.permute_us(hw, 1000, 2, 1000))


def test_a_one_point_table_at_its_expert_count_rescales_the_general_curve():
    from moeplex.plan.profile import _from_json

    rows = [[1, 1, 1, 10.0], [100, 100, 1, 100.0]]  # general: 10 µs at 1 row, 100 µs at 100 rows
    data = {"name": "t", "launches": {"source": "test"}, "moe_tables": {
        "general": {"kernel": "triton", "dtype": "bf16", "shape": [10, 20], "rows": rows, "source": "test"},
        "untuned": {"kernel": "triton", "dtype": "bf16", "shape": [10, 20], "local_experts": 4, "only_at_local_experts": True,
                    "rows": [[100, 100, 1, 150.0]], "source": "test"}}}
    hw = _from_json(data)
    table, factor = hw.expert_table("triton", "bf16", 10, 20, local_experts=4)
    assert factor == pytest.approx(1.5)  # passes through 150 µs at 100 rows
    assert table.us_per_expert(1) * factor == pytest.approx(15.0)
    table, factor = hw.expert_table("triton", "bf16", 10, 20, local_experts=8)  # any other count: the general table
    assert factor == 1.0 and table.source == "test"
    assert hw.expert_rate_cap("triton", "bf16") == pytest.approx(100 * 1200 / 100.0 / 1e6)  # the untuned point is not a cap


def test_uniform_distinct_experts():
    assert routing.uniform_distinct(256, 8, 1) == pytest.approx(8.0)
    assert routing.uniform_distinct(4, 2, 2) == pytest.approx(4 * (1 - 0.5**2))  # 3 of 4
    assert routing.uniform_distinct(256, 8, 0) == 0.0


def test_tiles_of_a_histogram():
    hist = [(1, 3.0), (17, 1.0), (40, 0.5)]  # 3 experts with 1 row, 1 with 17, half a step's expert with 40
    assert routing.tiles(hist, 16) == pytest.approx(3 + 2 + 0.5 * 3)
    assert routing.tiles(hist, math.inf) == pytest.approx(4.5)  # one tile per hit expert: the distinct experts


def test_uniform_histogram_is_the_binomial():
    hist = dict(routing.uniform_histogram(4, 2, 2))  # each expert's rows ~ Binomial(2, 1/2)
    assert hist[1] == pytest.approx(4 * 0.5) and hist[2] == pytest.approx(4 * 0.25)
    assert sum(hist.values()) == pytest.approx(routing.uniform_distinct(4, 2, 2))


def test_recorded_routing_scales_by_tiles_interpolated_in_log2_tokens_uniform_outside():
    assert routing.UNIFORM.scale(32, 16) == 1.0
    # 4 experts, top-2, 2 tokens: uniform runs 3 tiles of 16 rows (distinct experts); a run that sent both tokens
    # to the same two experts ran 2
    two = routing.RecordedBatch(2, 4, 2, ((2, 2.0),))
    assert two.distinct() == 2.0 and two.tile_ratio(16) == pytest.approx(2 / 3)
    # at 1-row tiles the same run costs as many tiles as uniform routing (4 pairs either way)
    assert two.tile_ratio(1) == pytest.approx(1.0)
    eight = routing.RecordedBatch(8, 4, 2, ((4, 4.0),))  # uniform at 8 tokens hits ~all 4: ratio ~1
    recorded = routing.Routing((eight, two), "test")  # sorted by tokens
    r2, r8 = two.tile_ratio(16), eight.tile_ratio(16)
    assert recorded.scale(2, 16) == pytest.approx(r2) and recorded.scale(8, 16) == pytest.approx(r8)
    assert recorded.scale(4, 16) == pytest.approx((r2 + r8) / 2)  # log2 midway
    assert recorded.scale(1, 16) == 1.0 and recorded.scale(64, 16) == 1.0  # outside the record: uniform


def test_routing_and_block_m_from_the_profile(hw):
    assert routing.routing_for(hw, "deepseek_v3") is routing.UNIFORM
    assert routing.block_m(hw, "triton", 8) == math.inf
    values = {**ROUND, "routing_deepseek_v3": {"experts": 4, "top_k": 2, "batches": [[2, [[2, 2.0]]]]},
              "triton_block_m": [[1, 16], [16, 32], [32, 64]]}
    profile = Profile("r", values, {**{k: "test" for k in values}, "routing_deepseek_v3": "run X"}, {}, {})
    recorded = routing.routing_for(profile, "deepseek_v3")
    assert recorded.scale(2, 16) == pytest.approx(2 / 3) and recorded.source == "run X"
    assert routing.block_m(profile, "triton", 8) == 32  # 8 rows: nearest the entry at 16 rows (log2: 1 against 3)
    assert routing.block_m(profile, "triton", 4) == 32  # 4 rows: a tie between 1 and 16 goes to 16, as the kernel picks
    assert routing.block_m(profile, "triton", 2) == 16
    assert routing.block_m(profile, "triton", 500) == 64


def test_experts_time_scales_with_the_routing():
    table = ExpertTable(((1.0, 10.0), (100.0, 100.0)), "test")
    assert costs.experts_us(table, 1.0, 2, 4, routing_scale=0.5) == pytest.approx(0.5 * costs.experts_us(table, 1.0, 2, 4))


def test_low_latency_fixed_cost_is_the_measured_one_rank_kernels(hw):
    assert costs.ll_fixed_us(hw) == (2.0, 2.0)  # unmeasured: one kernel each
    values = {**ROUND, "deepep_ll_kernel_us": [20.0, 30.0]}
    measured = Profile("m", values, {k: "test" for k in values}, {}, {})
    d, c = costs.deepep_ll_us(measured, 10, 1000, 8, 4, fp8_dispatch=False)
    assert d == pytest.approx(60 * 2000 / 5e4 + 20.0)
    assert c == pytest.approx(60 * 2000 / 5e4 + 30.0)


def test_recorded_loads_in_both_formats(tmp_path):
    from moeplex.plan.imbalance import read_expert_load

    ours = tmp_path / "ours.json"
    ours.write_text(json.dumps({"logical_count": [[[1, 2], [3, 4]], [[1, 0], [0, 1]]]}))  # [steps][layers][experts]
    assert read_expert_load(str(ours)).tolist() == [[2.0, 2.0], [3.0, 5.0]]
    history = tmp_path / "history.json"
    history.write_text(json.dumps({"load_history": [{"logical_expert_load": [[1, 2], [3, 4]]}, {"logical_expert_load": [[1, 0], [0, 1]]}]}))
    assert read_expert_load(str(history)).tolist() == [[2.0, 2.0], [3.0, 5.0]]
    history.write_text(json.dumps({"load_history": []}))
    with pytest.raises(ValueError, match="empty"):
        read_expert_load(str(history))
