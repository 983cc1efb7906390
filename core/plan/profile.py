"""Hardware profiles: one JSON file per GPU, every number with its source; H100/H800 derived by ratios."""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

SHIPPED = ("h200", "h100", "h800")


@dataclass(frozen=True)
class ExpertTable:
    """A MoE kernel's measured time, read as µs per hit expert against rows per hit expert."""

    rows: tuple[tuple[float, float], ...]  # (rows per hit expert, µs per hit expert), rows ascending
    source: str
    kernel: str = "triton"
    dtype: str = "bf16"
    shape: tuple[int, int] = (7168, 2048)  # (hidden, expert intermediate) the table was measured at
    only_at_local_experts: int = 0  # a table of one untuned configuration: used at that local expert count only

    @classmethod
    def from_measured(cls, measured: list[list[float]], source: str, **kind) -> "ExpertTable":
        points: dict[float, float] = {}
        for _m, pairs, hit, us in measured:
            points[pairs / hit] = us / hit  # two M with the same rows per expert: the later row wins
        return cls(tuple(sorted(points.items())), source, **kind)

    def us_per_expert(self, rows: float, min_us_per_row: float = 0.0) -> float:
        """Log-log interpolation between measured rows; past the largest, the last two points' log-log trend.

        Past the table the kernel still gains efficiency as rows grow (slope below 1), so the trend continues,
        bounded by linear in rows (the last point's rate) and by `min_us_per_row` (the best rate measured for
        this kernel: profile.expert_table passes it).
        """
        xs = [r for r, _ in self.rows]
        if rows <= xs[0]:
            return self.rows[0][1]
        if rows >= xs[-1]:
            linear = self.rows[-1][1] * rows / xs[-1]
            if len(self.rows) < 2:
                return linear
            (x0, y0), (x1, y1) = self.rows[-2], self.rows[-1]
            trend = y1 * (rows / x1) ** (math.log(y1 / y0) / math.log(x1 / x0))
            return max(min(trend, linear), rows * min_us_per_row)
        i = bisect.bisect_right(xs, rows)
        (x0, y0), (x1, y1) = self.rows[i - 1], self.rows[i]
        t = (math.log(rows) - math.log(x0)) / (math.log(x1) - math.log(x0))
        return math.exp(math.log(y0) + t * (math.log(y1) - math.log(y0)))

    def best_tflops(self) -> float:
        """The highest FLOP rate any point of the table reached (3 GEMMs of hidden x intermediate per row)."""
        flops_per_row = 6.0 * self.shape[0] * self.shape[1]
        return max(r * flops_per_row / us for r, us in self.rows) / 1e6

    def scaled(self, factor_at) -> "ExpertTable":
        rows = tuple((r, us * factor_at(r, us)) for r, us in self.rows)
        return ExpertTable(rows, self.source + " (derived)", self.kernel, self.dtype, self.shape, self.only_at_local_experts)


@dataclass(frozen=True)
class Profile:
    name: str
    values: dict[str, float | list]
    sources: dict[str, str]
    moe: dict[str, ExpertTable]
    launches: dict[str, dict[str, int]]
    notes: list[str] = field(default_factory=list)

    def __getattr__(self, key: str):
        values = self.__dict__.get("values", {})
        if key in values:
            return values[key]
        raise AttributeError(key)

    def by_ep(self, key: str, ep: int) -> float:
        """A published per-EP-size figure, interpolated linearly in log2(EP) and held at the ends."""
        return self.interpolated(key, ep)

    def interpolated(self, key: str, x: float) -> float:
        """A table of [x, value] points, interpolated linearly in log2(x) and held at the ends."""
        points = self.values[key]
        xs = [p[0] for p in points]
        if x <= xs[0]:
            return points[0][1]
        if x >= xs[-1]:
            return points[-1][1]
        i = bisect.bisect_right(xs, x)
        (x0, y0), (x1, y1) = points[i - 1], points[i]
        t = (math.log2(x) - math.log2(x0)) / (math.log2(x1) - math.log2(x0))
        return y0 + t * (y1 - y0)

    def slowdown(self, key: str, tokens: float) -> float:
        """A measured factor over the roofline by token count (gemm_slowdown, attention_slowdown), 1 where not measured.

        The shipped profile has none: they come from benchmarks/plan_gemm.py --profile-out on a lent GPU.
        """
        points = self.values.get(key)
        if not points or tokens <= 0:
            return 1.0
        xs = [p[0] for p in points]
        if tokens <= xs[0]:
            return points[0][1]
        if tokens >= xs[-1]:
            return points[-1][1]
        i = bisect.bisect_right(xs, tokens)
        (x0, y0), (x1, y1) = points[i - 1], points[i]
        t = (math.log(tokens) - math.log(x0)) / (math.log(x1) - math.log(x0))
        return y0 + t * (y1 - y0)

    def expert_table(self, kernel: str, dtype: str, hidden: int, intermediate: int, local_experts: int = 0) -> tuple[ExpertTable, float]:
        """The table of `kernel` in `dtype` and the factor its times take for experts of this shape.

        A table measured at the same shape is used as it is; otherwise the nearest one is scaled by the
        ratio of expert weight sizes (an approximation, stated in docs/plan.md: small experts run
        further from the bandwidth than big ones).
        """
        tables = [t for t in self.moe.values() if t.kernel == kernel and t.dtype == dtype]
        exact = [t for t in tables if t.only_at_local_experts and t.only_at_local_experts == local_experts and t.shape == (hidden, intermediate)]
        tables = [t for t in tables if not t.only_at_local_experts]
        if exact and tables:
            # one point measured at exactly this expert count (e.g. without a tuned tile table): the general
            # table's curve, scaled to pass through it
            base, size = self.expert_table(kernel, dtype, hidden, intermediate)
            rows, us = exact[0].rows[-1]
            return base, size * us / (base.us_per_expert(rows) * size)
        if not tables:
            have = ", ".join(sorted(f"{t.kernel} {t.dtype}" for t in self.moe.values()))
            raise ValueError(f"profile {self.name} has no expert table for moe kernel {kernel} in {dtype}; it has: {have}")
        size = hidden * intermediate
        best = min(tables, key=lambda t: abs(math.log(t.shape[0] * t.shape[1] / size)))
        return best, size / (best.shape[0] * best.shape[1])

    def expert_rate_cap(self, kernel: str, dtype: str) -> float:
        """The best TFLOP/s any expert table of this kernel and dtype measured: what extrapolation may not beat."""
        return max(t.best_tflops() for t in self.moe.values() if t.kernel == kernel and t.dtype == dtype and not t.only_at_local_experts)


def _read_json(name_or_path: str) -> dict:
    path = Path(name_or_path)
    if path.suffix == ".json" and path.exists():
        return json.loads(path.read_text())
    return json.loads(resources.files("moeplex.plan").joinpath("profiles", f"{name_or_path}.json").read_text())


def _from_json(data: dict) -> Profile:
    values, sources = {}, {}
    for key, entry in data.items():
        if isinstance(entry, dict) and "value" in entry:
            values[key], sources[key] = entry["value"], entry["source"]
    tables = {
        key: ExpertTable.from_measured(
            t["rows"], t["source"], kernel=t["kernel"], dtype=t["dtype"], shape=tuple(t["shape"]),
            only_at_local_experts=t["local_experts"] if t.get("only_at_local_experts") else 0,
        )
        for key, t in data["moe_tables"].items()
        if isinstance(t, dict)
    }
    launches = {k: v for k, v in data["launches"].items() if isinstance(v, dict)}
    sources["launches"] = data["launches"]["source"]
    return Profile(data["name"], values, sources, tables, launches)


def _derive(base: Profile, name: str, spec: dict, description: str) -> Profile:
    values, sources = dict(base.values), dict(base.sources)
    for key, entry in spec["scale"].items():
        values[key] = base.values[key] * entry["value"]
        sources[key] = f"{base.sources[key]}; x{entry['value']} for {name}: {entry['source']}"
    mem, flop = spec["moe_tables_scale"]["bytes"], spec["moe_tables_scale"]["flops"]
    moe = {key: table.scaled(_mixed_factor(mem, flop)) for key, table in base.moe.items()}
    return Profile(name, values, sources, moe, base.launches, [description])


def _mixed_factor(mem_ratio: float, flop_ratio: float):
    """Time scale of an expert-table point: the part under the ridge (few rows) is bandwidth, above it compute.

    The ridge of DeepSeek-V3 experts on the H200 is ~190 rows (fused_moe_h200_deepseek-v3-ep8_bf16.md): the
    share of time that is weight reads falls from 1 at 1 row toward 0 well above the ridge.
    """
    ridge_rows = 190.0

    def factor(rows: float, _us: float) -> float:
        mem_share = ridge_rows / (ridge_rows + rows)
        return mem_share / mem_ratio + (1 - mem_share) / flop_ratio

    return factor


def load_profile(name_or_path: str = "h200") -> Profile:
    """A shipped profile by name (h200, h100, h800) or a profile JSON file written by the --profile step."""
    if name_or_path in ("h100", "h800"):
        derived = _read_json("derived")
        spec = derived[name_or_path]
        return _derive(load_profile(spec["base"]), name_or_path, spec, derived["description"])
    try:
        return _from_json(_read_json(name_or_path))
    except FileNotFoundError:
        raise ValueError(f"no hardware profile {name_or_path!r}: give a JSON file or one of {', '.join(SHIPPED)}") from None
