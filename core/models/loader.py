"""Reading Hugging Face safetensors checkpoints into a model, one named tensor at a time.

A model says which tensors it expects (`weight_targets()`: name -> Target). Each rank
reads only the tensors whose Target has a `copy` (its experts, its slices); a missing,
unexpected or mis-shaped tensor stops loading with an error that names it.

DeepSeek-V3 style fp8 checkpoints (config.json's quantization_config: quant_method fp8,
weight_block_size [128, 128]) store each quantized weight `X.weight` [N, K] as float8_e4m3fn next
to `X.weight_scale_inv` [ceil(N/128), ceil(K/128)] fp32, the weight being fp8 * scale per block.
A Target that keeps fp8 (`copy_fp8`) gets values and scales as stored; any other gets the weight
dequantized, its tensor-parallel slice cut after dequantizing the whole blocks that cover it.
"""

from __future__ import annotations

import json
import os
from typing import Iterable

import torch
from safetensors import safe_open

from ..json_file import read_json_object
from ..progress import progress
from ..quant import BLOCK, dequantize_blocks, num_blocks
from ..targets import CheckpointError, Target

SCALE_SUFFIX = "_scale_inv"  # X.weight -> X.weight_scale_inv
FP8_DTYPE = "F8_E4M3"  # safetensors' name of float8_e4m3fn
FP8_QUANTIZATION_CONFIG = {  # config.json's quantization_config of a DeepSeek-V3 fp8 checkpoint
    "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK],
}


class CheckpointReader:
    """The tensors of a folder: model.safetensors, a sharded index, or every *.safetensors file."""

    def __init__(self, folder: str):
        self.folder = folder
        index = os.path.join(folder, "model.safetensors.index.json")
        if os.path.exists(index):
            weight_map = read_json_object(index, "safetensors index").get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index} has no weight_map object (tensor name -> file)")
            self.files = {name: os.path.join(folder, file) for name, file in weight_map.items()}
        else:
            self.files = {}
            shards = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
            if not shards:
                raise CheckpointError(f"{folder} holds no .safetensors file")
            for shard in shards:
                path = os.path.join(folder, shard)
                with open_safetensors(path) as f:
                    for name in f.keys():
                        self.files[name] = path
        self._handles: dict[str, object] = {}

    def names(self) -> set[str]:
        return set(self.files)

    def _open(self, name: str):
        path = self.files[name]
        if path not in self._handles:
            if not os.path.exists(path):
                raise CheckpointError(f"tensor {name} is listed in {path}, which does not exist")
            self._handles[path] = open_safetensors(path)
        return self._handles[path]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._open(name).get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """safetensors' dtype name, e.g. BF16, F32, F8_E4M3."""
        return self._open(name).get_slice(name).get_dtype()

    def read(self, name: str, select: tuple[int, int, int] | None = None) -> torch.Tensor:
        """The tensor, or only the slice `select` = (dim, start, length) of it (read from disk alone)."""
        try:
            if select is None:
                return self._open(name).get_tensor(name)
            dim, start, length = select
            index = (slice(None),) * dim + (slice(start, start + length),)
            return self._open(name).get_slice(name)[index]
        except Exception as exc:
            raise CheckpointError(f"tensor {name} in {self.files[name]} cannot be read: {exc}") from exc


def open_safetensors(path: str):
    """safe_open, with a file it cannot open (truncated, not safetensors) refused in a sentence naming it."""
    try:
        return safe_open(path, framework="pt")
    except Exception as exc:  # safetensors raises its own SafetensorError (an Exception) for every bad file
        raise CheckpointError(_diagnose_safetensors(path, exc)) from None


def _diagnose_safetensors(path: str, exc: Exception) -> str:
    """Why `path` does not open: its header, or the first tensor whose bytes lie past the end of the file."""
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            if size < 8 or header_len > size - 8:
                raise ValueError
            header = json.loads(f.read(header_len))
            ends = {name: info["data_offsets"][1] for name, info in header.items() if name != "__metadata__"}
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return f"{path} is not a readable safetensors file (truncated or corrupt header: {exc})"
    data_len = size - 8 - header_len
    for name, end in sorted(ends.items(), key=lambda item: item[1]):
        if end > data_len:
            return (
                f"{path} is truncated: tensor {name} needs bytes up to {end} of the data, but the file holds only "
                f"{data_len}"
            )
    return f"{path} is not a readable safetensors file ({exc})"


def _listing(names: Iterable[str], limit: int = 5) -> str:
    names = sorted(names)
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def is_fp8_checkpoint(hf_config: dict) -> bool:
    """Whether config.json declares DeepSeek-V3 style fp8 weights; a quantization moeplex cannot read is refused."""
    quant = hf_config.get("quantization_config")
    if not quant:
        return False
    method = quant.get("quant_method")
    if method != "fp8":
        raise CheckpointError(
            f"config.json's quantization_config.quant_method is {method!r}; moeplex reads fp8 (DeepSeek-V3 block) "
            "checkpoints only"
        )
    block = quant.get("weight_block_size")
    checks = (
        ("fmt", quant.get("fmt", "e4m3"), "e4m3"),
        ("activation_scheme", quant.get("activation_scheme", "dynamic"), "dynamic"),
        ("weight_block_size", list(block) if isinstance(block, (list, tuple)) else block, [BLOCK, BLOCK]),
    )
    for key, found, wanted in checks:
        if found != wanted:
            raise CheckpointError(
                f"config.json's quantization_config.{key} is {found!r}; moeplex reads fp8 checkpoints with "
                f"{key} {wanted!r} only"
            )
    return True


def _read_config(folder: str) -> dict:
    path = os.path.join(folder, "config.json")
    return read_json_object(path, "config.json") if os.path.exists(path) else {}


def load_checkpoint(model, folder: str, show_progress: bool = True) -> None:
    """Fill `model` from `folder`; the model provides weight_targets() and ignores_tensor(name)."""
    reader = CheckpointReader(folder)
    fp8 = is_fp8_checkpoint(_read_config(folder))
    targets: dict[str, Target] = model.weight_targets()
    available = reader.names()
    scales = {name for name in available if name.endswith(SCALE_SUFFIX)}
    if scales and not fp8:
        raise CheckpointError(
            f"checkpoint {folder} holds fp8 block scales ({_listing(scales)}) but its config.json declares no "
            "quantization_config"
        )
    orphans = {name for name in scales if name.removesuffix(SCALE_SUFFIX) not in available}
    if orphans:
        raise CheckpointError(f"checkpoint {folder} has block scales without their weight: {_listing(orphans)}")
    available -= scales
    missing = set(targets) - available
    if missing:
        raise CheckpointError(f"checkpoint {folder} lacks tensor(s) the model needs: {_listing(missing)}")
    extra = {name for name in available - set(targets) if not model.ignores_tensor(name)}
    if extra:
        raise CheckpointError(f"checkpoint {folder} has tensor(s) this model does not use: {_listing(extra)}")
    wanted = [(name, t) for name, t in sorted(targets.items()) if t.copy is not None]
    for name, target in progress(wanted, desc="loading weights", unit="tensor", enabled=show_progress):
        shape = reader.shape(name)
        if shape != target.shape:
            raise CheckpointError(f"tensor {name} has shape {list(shape)}; the model expects {list(target.shape)}")
        if name + SCALE_SUFFIX in scales:
            _load_fp8(reader, name, target)
            continue
        if reader.dtype(name) == FP8_DTYPE:
            raise CheckpointError(f"tensor {name} is stored in fp8 but the checkpoint has no {name}{SCALE_SUFFIX} for it")
        tensor = reader.read(name, target.select)
        _check_finite(name, tensor)
        target.copy(tensor)


def _check_finite(name: str, tensor: torch.Tensor) -> None:
    if not tensor.is_floating_point() or not torch.isfinite(tensor.float()).all():
        raise CheckpointError(f"tensor {name} holds non-finite or non-floating values")


def _load_fp8(reader: CheckpointReader, name: str, target: Target) -> None:
    """Give `target` the fp8 weight `name`: as stored when it keeps fp8 and its slice is block-aligned, else dequantized."""
    scale = name + SCALE_SUFFIX
    if reader.dtype(name) != FP8_DTYPE:
        raise CheckpointError(
            f"tensor {name} has block scales ({scale}) but is stored as {reader.dtype(name)}, not {FP8_DTYPE}"
        )
    if len(target.shape) != 2:
        raise CheckpointError(f"tensor {name} has block scales but is not a matrix (shape {list(target.shape)})")
    expected = tuple(num_blocks(size) for size in target.shape)
    if reader.shape(scale) != expected:
        raise CheckpointError(
            f"tensor {scale} has shape {list(reader.shape(scale))}; weight {name} of shape {list(target.shape)} needs "
            f"{list(expected)} (one scale per {BLOCK}x{BLOCK} block)"
        )
    select = target.select
    if target.copy_fp8 is not None and _block_aligned(select, target.shape):
        values = reader.read(name, select)
        scales = reader.read(scale, None if select is None else (select[0], select[1] // BLOCK, num_blocks(select[2])))
        _check_finite(name, values)
        _check_finite(scale, scales)
        target.copy_fp8(values, scales.float())
        return
    tensor = _dequantized(reader, name, scale, select, target.shape)
    _check_finite(name, tensor)
    target.copy(tensor)


def _block_aligned(select: tuple[int, int, int] | None, shape: tuple[int, ...]) -> bool:
    if select is None:
        return True
    dim, start, length = select
    return start % BLOCK == 0 and (length % BLOCK == 0 or start + length == shape[dim])


def _dequantized(reader: CheckpointReader, name: str, scale: str, select, shape: tuple[int, ...]) -> torch.Tensor:
    """fp32 weight * scale; a slice may start or end inside a block, so the covering blocks are dequantized, then cut."""
    if select is None:
        return dequantize_blocks(reader.read(name), reader.read(scale))
    dim, start, length = select
    first, end = start // BLOCK, num_blocks(start + length)
    rows = min(end * BLOCK, shape[dim]) - first * BLOCK
    values = reader.read(name, (dim, first * BLOCK, rows))
    scales = reader.read(scale, (dim, first, end - first))
    return dequantize_blocks(values, scales).narrow(dim, start - first * BLOCK, length)
