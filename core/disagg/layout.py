"""The KV layout a prefill and a decode server must share, and the one sentence that refuses a mismatch."""

from __future__ import annotations

import hashlib
import os

import attrs


def checkpoint_identity(folder: str) -> str:
    """The checkpoint by its contents: config.json and the names and sizes of its safetensors files."""
    digest = hashlib.sha256()
    with open(os.path.join(folder, "config.json"), "rb") as f:
        digest.update(f.read())
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            digest.update(f"{name}:{os.path.getsize(os.path.join(folder, name))}".encode())
    return digest.hexdigest()[:16]


@attrs.frozen
class KVLayout:
    """One rank's KV cache as the other role sees it: the same checkpoint, pages and per-token shapes are needed."""

    checkpoint: str
    num_layers: int
    token_shapes: tuple[tuple[tuple[int, ...], ...], ...]  # per layer, the per-token shape of each cached quantity
    dtype: str
    page_size: int
    attn_tp_size: int
    dp_size: int

    @classmethod
    def of(cls, engine) -> "KVLayout":
        shapes = tuple(tuple(tuple(s) for s in layer) for layer in engine.model.kv_shapes())
        config = engine.config
        return cls(
            checkpoint_identity(config.model), len(shapes), shapes, config.dtype, config.page_size,
            config.parallel.attn_tp_size, config.parallel.dp_size,
        )

    def to_json(self) -> dict:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, value: dict) -> "KVLayout":
        shapes = tuple(tuple(tuple(s) for s in layer) for layer in value["token_shapes"])
        return cls(**{**value, "token_shapes": shapes})

    def mismatch(self, prefill: "KVLayout", prefill_name: str) -> str | None:
        """Why this decode layout cannot take KV pages from `prefill`, in one sentence naming both; None if it can."""
        for what, theirs, ours in (
            ("checkpoint", prefill.checkpoint, self.checkpoint),
            ("layer count", prefill.num_layers, self.num_layers),
            ("KV dtype", prefill.dtype, self.dtype),
            ("page size", prefill.page_size, self.page_size),
            ("per-token KV shape per rank", _shape_text(prefill), _shape_text(self)),
        ):
            if theirs != ours:
                return f"the prefill server {prefill_name} has {what} {theirs} but this decode server has {ours}"
        if self.attn_tp_size > prefill.attn_tp_size:
            return (
                f"the prefill server {prefill_name} has attention TP size {prefill.attn_tp_size} but this decode server "
                f"has {self.attn_tp_size}; a decode rank needs a prefill rank to send it pages"
            )
        return None


def _shape_text(layout: KVLayout) -> str:
    distinct = sorted(set(layout.token_shapes))
    return "; ".join(" + ".join("x".join(map(str, s)) for s in layer) for layer in distinct)
