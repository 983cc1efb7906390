"""Reading Hugging Face safetensors checkpoints into a model, one named tensor at a time.

A model says which tensors it expects (`weight_targets()`: name -> Target). Each rank
reads only the tensors whose Target has a `copy` (its experts, its slices); a missing,
unexpected or mis-shaped tensor stops loading with an error that names it.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Iterable

import attrs
import torch
from safetensors import safe_open
from tqdm.auto import tqdm


class CheckpointError(ValueError):
    pass


@attrs.frozen
class Target:
    shape: tuple[int, ...]  # of the whole tensor in the checkpoint
    copy: Callable[[torch.Tensor], None] | None  # None: the tensor belongs to another rank
    select: tuple[int, int, int] | None = None  # (dim, start, length): read only this slice


def shard_of(param: torch.Tensor) -> tuple[int, int, int] | None:
    """(dim, rank, size) when `param` holds one tensor-parallel slice (set by the parallel layers)."""
    return getattr(param, "tp_shard", None)


def parameter_target(param: torch.Tensor) -> Target:
    def copy(tensor: torch.Tensor) -> None:
        param.data.copy_(tensor)

    shard = shard_of(param)
    if shard is None:
        return Target(tuple(param.shape), copy)
    dim, rank, size = shard
    full = list(param.shape)
    full[dim] *= size
    return Target(tuple(full), copy, (dim, rank * param.shape[dim], param.shape[dim]))


class CheckpointReader:
    """The tensors of a folder: model.safetensors, a sharded index, or every *.safetensors file."""

    def __init__(self, folder: str):
        self.folder = folder
        index = os.path.join(folder, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            self.files = {name: os.path.join(folder, file) for name, file in weight_map.items()}
        else:
            self.files = {}
            shards = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
            if not shards:
                raise CheckpointError(f"{folder} holds no .safetensors file")
            for shard in shards:
                path = os.path.join(folder, shard)
                with safe_open(path, framework="pt") as f:
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
            self._handles[path] = safe_open(path, framework="pt")
        return self._handles[path]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._open(name).get_slice(name).get_shape())

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


def _listing(names: Iterable[str], limit: int = 5) -> str:
    names = sorted(names)
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def load_checkpoint(model, folder: str, show_progress: bool = True) -> None:
    """Fill `model` from `folder`; the model provides weight_targets() and ignores_tensor(name)."""
    reader = CheckpointReader(folder)
    targets: dict[str, Target] = model.weight_targets()
    available = reader.names()
    missing = set(targets) - available
    if missing:
        raise CheckpointError(f"checkpoint {folder} lacks tensor(s) the model needs: {_listing(missing)}")
    extra = {name for name in available - set(targets) if not model.ignores_tensor(name)}
    if extra:
        raise CheckpointError(f"checkpoint {folder} has tensor(s) this model does not use: {_listing(extra)}")
    wanted = [(name, t) for name, t in sorted(targets.items()) if t.copy is not None]
    for name, target in tqdm(wanted, desc="loading weights", unit="tensor", disable=not show_progress, leave=False):
        shape = reader.shape(name)
        if shape != target.shape:
            raise CheckpointError(f"tensor {name} has shape {list(shape)}; the model expects {list(target.shape)}")
        tensor = reader.read(name, target.select)
        if not tensor.is_floating_point() or not torch.isfinite(tensor.float()).all():
            raise CheckpointError(f"tensor {name} holds non-finite or non-floating values")
        target.copy(tensor)
