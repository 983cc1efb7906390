"""Tile configurations: tuned JSON tables per (device, dtype, E, N, K), nearest rows per expert, sane defaults.

A table lives in configs/ as `E=<experts>,N=<intermediate>,K=<hidden>,device=<name>,dtype=<dtype>.json`
(N is the intermediate size: w13 has 2N rows, w2 has N columns) and maps the rows one local expert
receives (routed pairs on this rank / local experts: what a tile's height must fit) to
{"gate_up": TILE, "down": TILE}, one tile per GEMM, where TILE is {"BLOCK_SIZE_M", "BLOCK_SIZE_N",
"BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages"} and optionally "USE_TMA" and "TAIL_SIZE_M"
(rows a tile holds past BLOCK_SIZE_M, run with it on the same weight tiles: kernel.py); an entry that
is one TILE serves both GEMMs.
The two GEMMs have transposed shapes (N=2I, K=H against N=H, K=I), so their best tiles differ; they
share BLOCK_SIZE_M and TAIL_SIZE_M because they share one alignment. benchmarks/tune_fused_moe.py writes the tables.

Tables are keyed by rows per expert, not by token count: the same 512 tokens give one expert 16 rows
when top-8 spreads over 256 experts and 128 rows when it lands on 32 local ones, and the tile that
streams weights for 16 rows is ~2x slower than the one that computes 128 (issue #22).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import attrs
import torch

CONFIG_DIR = Path(__file__).parent / "configs"
FP8_DTYPE = "fp8_w8a8"
INTERPRETER_DEVICE = "interpreter"

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@attrs.frozen
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3
    tma: bool = False  # weight tiles through a tensor descriptor (Hopper's copy engine) instead of pointers
    tail_m: int = 0  # sorted tiles hold block_m + tail_m rows and run only as tall as their rows need

    def __attrs_post_init__(self):
        if self.tail_m and not (16 <= self.tail_m <= self.block_m and self.tail_m & (self.tail_m - 1) == 0):
            raise ValueError(f"TAIL_SIZE_M must be 0 or a power of two from 16 to BLOCK_SIZE_M, not {self.tail_m}")

    @classmethod
    def from_json(cls, entry: dict) -> TileConfig:
        return cls(
            block_m=entry["BLOCK_SIZE_M"],
            block_n=entry["BLOCK_SIZE_N"],
            block_k=entry["BLOCK_SIZE_K"],
            group_m=entry["GROUP_SIZE_M"],
            num_warps=entry["num_warps"],
            num_stages=entry["num_stages"],
            tma=entry.get("USE_TMA", False),
            tail_m=entry.get("TAIL_SIZE_M", 0),
        )

    def to_json(self) -> dict:
        entry = {
            "BLOCK_SIZE_M": self.block_m,
            "BLOCK_SIZE_N": self.block_n,
            "BLOCK_SIZE_K": self.block_k,
            "GROUP_SIZE_M": self.group_m,
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
        }
        if self.tma:
            entry["USE_TMA"] = True
        if self.tail_m:
            entry["TAIL_SIZE_M"] = self.tail_m
        return entry


@attrs.frozen
class MoETiles:
    """The tiles of GEMM 1 (gate and up, SiLU fused) and GEMM 2 (down), over one alignment."""

    gate_up: TileConfig
    down: TileConfig

    def __attrs_post_init__(self):
        ours, theirs = (self.gate_up.block_m, self.gate_up.tail_m), (self.down.block_m, self.down.tail_m)
        if ours != theirs:
            raise ValueError(f"both GEMMs tile one alignment: BLOCK_M and TAIL_M {ours} != {theirs}")

    @classmethod
    def both(cls, config: TileConfig) -> MoETiles:
        return cls(config, config)

    @property
    def block_m(self) -> int:
        return self.gate_up.block_m

    @property
    def tail_m(self) -> int:
        return self.gate_up.tail_m

    @classmethod
    def from_json(cls, entry: dict) -> MoETiles:
        if "gate_up" not in entry:
            return cls.both(TileConfig.from_json(entry))
        return cls(TileConfig.from_json(entry["gate_up"]), TileConfig.from_json(entry["down"]))

    def to_json(self) -> dict:
        return {"gate_up": self.gate_up.to_json(), "down": self.down.to_json()}


def dtype_name(dtype: torch.dtype, fp8: bool) -> str:
    return FP8_DTYPE if fp8 else _DTYPE_NAMES[dtype]


def device_name(device: torch.device, interpreted: bool) -> str:
    if interpreted or device.type != "cuda":
        return INTERPRETER_DEVICE
    return torch.cuda.get_device_name(device).replace(" ", "_")


def table_file(device: str, dtype: str, num_experts: int, intermediate: int, hidden: int) -> str:
    return f"E={num_experts},N={intermediate},K={hidden},device={device},dtype={dtype}.json"


def read_table(path: Path) -> dict[float, MoETiles] | None:
    if not path.is_file():
        return None
    return {float(rows): MoETiles.from_json(entry) for rows, entry in json.loads(path.read_text()).items()}


def write_table(path: Path, table: dict[float, MoETiles]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({f"{rows:g}": table[rows].to_json() for rows in sorted(table)}, indent=2) + "\n")


def nearest(table: dict[float, MoETiles], rows_per_expert: float) -> MoETiles:
    """The entry nearest on a log scale (rows double between tuned points), ties to the larger."""
    target = math.log2(max(rows_per_expert, 1e-6))
    return table[min(table, key=lambda rows: (abs(math.log2(max(rows, 1e-6)) - target), -rows))]


def default_tiles(rows_per_expert: float, dtype: str, interpreted: bool) -> MoETiles:
    """What to run when no tuned table matches (pointer loads: tensor descriptors need Hopper)."""
    if interpreted:
        # The interpreter pays per program and per operation, not per element: few mid-sized tiles run fastest.
        return MoETiles.both(TileConfig(block_m=16, block_n=64, block_k=64))
    if dtype == "fp32":
        # 4-byte operands: small K tiles and two stages stay inside shared memory (fp32 serves tests, not speed).
        return MoETiles.both(TileConfig(block_m=32, block_n=64, block_k=32, group_m=8, num_warps=4, num_stages=2))
    if dtype == FP8_DTYPE:
        # A K tile must sit inside one 128-wide scale group.
        if rows_per_expert <= 16:
            return MoETiles.both(TileConfig(block_m=16, block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=4))
        return MoETiles.both(TileConfig(block_m=64, block_n=64, block_k=128, group_m=16, num_warps=4, num_stages=3))
    # bf16 / fp16, after the H200 tables: at most ~160 KB of shared memory, so an A100 runs them too.
    if rows_per_expert <= 16:  # decode: streaming the weights is the cost; small row tiles pad least
        return MoETiles.both(TileConfig(block_m=16, block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=3))
    if rows_per_expert <= 48:
        return MoETiles(TileConfig(64, 64, 128, group_m=8, num_warps=4, num_stages=3),
                        TileConfig(64, 128, 64, group_m=8, num_warps=4, num_stages=3))
    if rows_per_expert <= 96:  # a tail takes the experts just past 64 rows in the same pass over their weights
        return MoETiles(TileConfig(64, 64, 64, group_m=8, num_warps=4, num_stages=3, tail_m=32),
                        TileConfig(64, 128, 64, group_m=8, num_warps=4, num_stages=3, tail_m=32))
    # GEMM 1's tile holds a gate and an up accumulator, so half of GEMM 2's width makes the same 128x256.
    # Just past 128 rows per expert (DeepSeek-V3 at 4096 tokens), a 32-row tail beats a second tile by ~9%;
    # well past it, plain tiles win.
    tail_m = 32 if rows_per_expert <= 160 else 0
    return MoETiles(TileConfig(128, 128, 64, group_m=8, num_warps=8, num_stages=3, tail_m=tail_m),
                    TileConfig(128, 256, 64, group_m=8, num_warps=8, num_stages=3, tail_m=tail_m))


class TileTables:
    """The tables of one device, read once each and kept by the kernel instance that owns this."""

    def __init__(self, device: str, directory: Path = CONFIG_DIR):
        self.device = device
        self.directory = directory
        self._tables: dict[str, dict[int, MoETiles] | None] = {}

    def lookup(self, dtype: str, num_experts: int, intermediate: int, hidden: int) -> dict[int, MoETiles] | None:
        name = table_file(self.device, dtype, num_experts, intermediate, hidden)
        if name not in self._tables:
            self._tables[name] = read_table(self.directory / name)
        return self._tables[name]

    def pick(self, rows_per_expert: float, *, dtype: str, num_experts: int, intermediate: int, hidden: int) -> MoETiles:
        table = self.lookup(dtype, num_experts, intermediate, hidden)
        if table:
            return nearest(table, rows_per_expert)
        return default_tiles(rows_per_expert, dtype, self.device == INTERPRETER_DEVICE)
