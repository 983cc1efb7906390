"""The eager-step timeline of `moeplex plan` (core/plan/host.py, eager.py) against hand-walked cases."""

import pytest

from moeplex.plan.eager import LayerCosts, normal_dispatch_ops
from moeplex.plan.host import Op, eager_us, timeline_us


def test_long_kernels_hide_the_launches():
    # host 10 µs a launch; 3 kernels of 100 µs: the GPU starts at 10 and never waits again
    assert timeline_us([Op("a", 3, 300.0)], 10.0) == pytest.approx(310.0)


def test_short_kernels_leave_the_gpu_waiting_for_the_host():
    # 5 kernels of 1 µs, 10 µs a launch: the last is launched at 50 and ends at 51
    assert timeline_us([Op("a", 5, 5.0)], 10.0) == pytest.approx(51.0)


def test_a_sync_drains_the_gpu_before_the_next_launch():
    ops = [Op("long", 1, 100.0), Op("after sync", 2, 2.0, sync_before=True)]
    # without the sync the host launches at 20 and 30 while the GPU is busy until 110: done at 112
    assert timeline_us([Op("long", 1, 100.0), Op("no sync", 2, 2.0)], 10.0) == pytest.approx(112.0)
    # with it the host waits until 110, launches at 120 and 130: done at 131
    assert timeline_us(ops, 10.0) == pytest.approx(131.0)


def test_repeats_carry_the_host_ahead_into_the_next_layer():
    layer = [Op("k", 1, 50.0)]
    # one launch of 10 then 50 µs of GPU, three times: the host launches at 10, 20, 30; the GPU ends at 160
    assert timeline_us(layer, 10.0, repeats=3) == pytest.approx(160.0)
    assert eager_us(layer, 10.0, gpu=100.0, host=0.0) == (pytest.approx(150.0), pytest.approx(10.0))


def test_work_without_a_launch_of_its_own_runs_after_the_host_catches_up():
    assert timeline_us([Op("tbo layer", 0, 70.0, sync_before=True)], 10.0) == pytest.approx(70.0)


def test_deepep_normal_syncs_twice():
    layer = LayerCosts(0, 0, 0, 0, 0, experts=0.0, group=30.0, summing=20.0, dispatch=110.0, combine=40.0, normal_mode=True)
    launches = {"launches_before_wait": 2, "plan_launches": 3, "group_launches": 1, "sum_launches": 1, "combine_launches": 1}
    ops = normal_dispatch_ops(layer, launches, layout_us=10.0)
    assert [op.sync_before for op in ops][:3] == [False, True, True]
    # h = 5: layout launched at 5, 10 -> GPU done 15; wait; dispatch launched 20 -> 120; wait;
    # plan at 125, 130, 135 (no GPU time); grouping at 140 -> 170; summing at 145 -> 190; combine at 150 -> 230
    assert timeline_us(ops, 5.0) == pytest.approx(230.0)


class _Hw:
    deepep_normal_fixed_us = 10.0
    launches = {"deepep-normal": {"launches_before_wait": 2, "plan_launches": 3, "group_launches": 1, "sum_launches": 1, "combine_launches": 1}}


COUNTS = {"small_per_layer": 6, "small_before_attention": 2, "outside": 9}


def test_layer_ops_follow_the_code_order_with_one_sync_per_extend_layer():
    from moeplex.plan.eager import dense_layer_ops, layer_ops

    layer = LayerCosts(10.0, 20.0, 5.0, 2.0, 3.0, router=1.0, experts=30.0)
    ops = layer_ops(layer, COUNTS, _Hw(), decode=False)
    assert [op.name for op in ops][:3] == ["input norms, rope, cache writes", "attention projections", "attention kernel"]
    assert [op.sync_before for op in ops].count(True) == 1 and ops[2].sync_before
    # 2 small + 2 projections + attention + o_proj + 3 small + router + 3 expert launches (no transfers, no shared experts)
    assert sum(op.launches for op in ops) == 13
    assert not any(op.sync_before for op in layer_ops(layer, COUNTS, _Hw(), decode=True))  # decode reads no host list
    assert sum(op.launches for op in dense_layer_ops(layer.dense_layer(7.0), COUNTS, False)) == 2 + 2 + 1 + 1 + 3 + 2


def test_an_eager_tbo_layer_is_the_longer_of_the_overlapped_gpu_and_both_halves_launches():
    from moeplex.plan.eager import overlapped_layer_ops

    half = LayerCosts(10.0, 20.0, 5.0, 2.0, 3.0, router=1.0, experts=30.0)  # 13 launches a micro-batch
    (op,) = overlapped_layer_ops(half, layer_gpu=100.0, host_us=10.0, counts=COUNTS, hw=_Hw())
    assert op.sync_before and op.gpu_us == pytest.approx(2 * 13 * 10.0)  # host-bound: 260 µs
    (op,) = overlapped_layer_ops(half, layer_gpu=500.0, host_us=10.0, counts=COUNTS, hw=_Hw())
    assert op.gpu_us == pytest.approx(500.0)
