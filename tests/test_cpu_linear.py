"""Dense projections on CPU: oneDNN's packed weight is taken exactly where the load-time measurement found it
faster, per row count, and gives F.linear's result; nothing is packed where F.linear wins or memory is short."""

import pytest
import torch
import torch.nn.functional as F

from moeplex.kernels.cpu import MeasuredChoices, onednn_runs
from moeplex.models import cpu_linear
from moeplex.models.parallel_layers import Linear, MergedColumnLinear, RowLinear
from moeplex.parallel import Group

pytestmark = pytest.mark.skipif(not onednn_runs(torch.float32), reason="this torch was built without oneDNN")


def measure_with(monkeypatch, packed_faster_at: set[int], tmp_path):
    """The measurement's clock: oneDNN's linear costs 1 and F.linear 2 at the row counts given, the reverse elsewhere."""
    now = [0.0]

    def timed(cost_when_faster, cost_else, call):
        def run(x, *args):
            now[0] += cost_when_faster if x.shape[0] in packed_faster_at else cost_else
            return call(x, *args)
        return run

    monkeypatch.setattr(cpu_linear, "measuring_clock", lambda: lambda: now[0])
    monkeypatch.setattr(cpu_linear, "plain_linear", timed(2.0, 1.0, cpu_linear.plain_linear))
    monkeypatch.setattr(cpu_linear, "packed_linear", timed(1.0, 2.0, cpu_linear.packed_linear))
    store = MeasuredChoices(str(tmp_path / f"choices-{len(packed_faster_at)}.json"))  # nothing measured yet
    monkeypatch.setattr(cpu_linear, "measured_choice", store.get)
    return store


def layers() -> torch.nn.Module:
    model = torch.nn.Module()
    model.a = Linear(24, 40)
    model.b = RowLinear(40, 24)
    model.c = MergedColumnLinear(24, {"q": (16, Group()), "k": (8, Group())})
    gen = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen))
    return model


def test_packed_where_measured_faster_and_equal_to_f_linear(monkeypatch, tmp_path):
    model = layers()
    store = measure_with(monkeypatch, {32, 512}, tmp_path)
    assert cpu_linear.CpuLinears().pack(model) == 3
    assert len(store.known) == 3  # one measurement per weight shape
    monkeypatch.undo()
    assert model.a.onednn_weight.faster == (False, True, True)
    for rows in (1, 5, 40, 700):
        x = torch.randn(rows, 24)
        assert model.a.onednn_weight.wins(rows) == (rows >= 6)  # nearest measured row count, in log scale
        expect = F.linear(x, model.a.weight, model.a.bias)
        torch.testing.assert_close(model.a(x), expect, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model.b(expect), F.linear(expect, model.b.weight), rtol=1e-4, atol=1e-4)
        q, k = model.c(x)
        torch.testing.assert_close(torch.cat([q, k], -1), F.linear(x, model.c.weight), rtol=1e-5, atol=1e-5)


def test_nothing_packed_where_f_linear_wins_or_memory_is_short(monkeypatch, tmp_path):
    layer = Linear(24, 40)
    measure_with(monkeypatch, set(), tmp_path)
    assert cpu_linear.CpuLinears().pack(layer) == 0 and layer.onednn_weight is None
    measure_with(monkeypatch, {1, 32, 512}, tmp_path)
    monkeypatch.setattr(cpu_linear, "packed_copy_fits", lambda nbytes: False)
    assert cpu_linear.CpuLinears().pack(layer) == 0 and layer.onednn_weight is None
