"""What every model shares: config access, the decoder-layer program, the forward step, weight targets."""

from __future__ import annotations

import abc
import os
from typing import Any, Generator

import attrs
import torch
from torch import nn

from ..executor import PairRows, StepState, add, run_layers
from ..forward_batch import ForwardBatch
from ..json_file import read_json_object
from ..kernels.norm import rms_norm
from ..kv_cache import KVPool
from ..moe.layer import MoELayer
from ..parallel import Group
from ..targets import Target, parameter_target
from .cpu_linear import CpuLinears
from .gpu_linear import GpuLinears
from .parallel_layers import Linear, MergedColumnLinear, RowLinear


@attrs.frozen
class MoESpec:
    """The MoE shape of a model, needed before the model is built (to set up plugins and placement)."""

    num_moe_layers: int
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int  # of one routed expert
    num_groups: int = 1  # expert groups (DeepSeek-V3 n_group), for hierarchical balancing


class ConfigError(ValueError):
    """config.json cannot describe a model: a required field is missing, null, or of the wrong type."""


class ModelConfig(dict):
    """config.json's fields. A required field (`config[key]`) that is missing or null, and any field whose
    type differs from the one the architecture's presets give it, is refused in a sentence naming the
    file and the field, so every model reads its config with plain indexing and no checks of its own."""

    def __init__(self, fields: dict, path: str, types: dict[str, Any] | None = None):
        super().__init__(fields)
        self.path = path
        self.types = types or {}  # key -> a value of the expected type (from the architecture's tiny preset)

    def __getitem__(self, key):
        if key not in self:
            raise ConfigError(f"{self.path} lacks {key!r}, which a {self.get('model_type')} model needs")
        value = super().__getitem__(key)
        if value is None and self.types.get(key) is not None:
            raise ConfigError(f"{self.path} gives {key!r} as null; it must be {_kind_name(self.types[key])}")
        return self._checked(key, value)

    def get(self, key, default=None):
        value = super().get(key, default)
        return value if value is None or key not in self else self._checked(key, value)

    def _checked(self, key: str, value):
        example = self.types.get(key)
        if example is not None and not key.endswith("_token_id") and not _same_kind(value, example):
            raise ConfigError(f"{self.path} gives {key!r} as {value!r}; it must be {_kind_name(example)}")
        return value

    def __reduce__(self):  # pickled to other processes as the fields it holds
        return ModelConfig, (dict(self), self.path, self.types)


def _same_kind(value, example) -> bool:
    if isinstance(example, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(example, bool)
    if isinstance(example, float):
        return isinstance(value, (int, float))
    return isinstance(value, type(example))


def _kind_name(example) -> str:
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string", list: "a list", dict: "an object"}
    return names.get(type(example), type(example).__name__)


def check_model_folder(folder: str) -> None:
    if not os.path.exists(folder):
        raise FileNotFoundError(f"the model folder {folder} does not exist")
    if not os.path.isdir(folder):
        raise NotADirectoryError(f"the model path {folder} is a file, not a Hugging Face model folder")


def read_config(folder: str) -> ModelConfig:
    """config.json as a ModelConfig; refused in one sentence when it is missing, not JSON, or not an object."""
    from . import architecture  # deferred: the package's modules import this one

    check_model_folder(folder)
    path = os.path.join(folder, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{folder} has no config.json")
    fields = read_json_object(path, "config.json")
    module = architecture(fields, path)
    return ModelConfig(fields, path, module.PRESETS["tiny"])


def rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """rope_theta and rope scaling, from either the old (rope_scaling) or the new (rope_parameters) keys."""
    params = dict(config.get("rope_scaling") or {})
    params.update(config.get("rope_parameters") or {})
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    params["rope_type"] = rope_type
    return params


class SiluMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), the intermediate split over `tp`; `program` lets a layer treat dense and MoE MLPs alike."""

    def __init__(self, hidden_size: int, intermediate_size: int, names=("gate_proj", "up_proj", "down_proj"), tp: Group = Group()):
        super().__init__()
        gate, up, down = names
        self.gate_up = MergedColumnLinear(hidden_size, {gate: (intermediate_size, tp), up: (intermediate_size, tp)},
                                          what="intermediate_size")
        self.down_name = down
        setattr(self, down, RowLinear(intermediate_size, hidden_size, tp, what="intermediate_size"))

    def forward(self, x: torch.Tensor, batch: ForwardBatch | None = None) -> torch.Tensor:
        gate, up = self.gate_up(x)
        return getattr(self, self.down_name)(nn.functional.silu(gate) * up)

    def program(self, x: torch.Tensor, state: StepState) -> Generator[str, None, torch.Tensor]:
        return self(x)
        yield  # a generator with no yield point


class RMSNorm(nn.Module):
    """weight * x / rms(x), computed in fp32 and rounded to x's dtype before the weight multiplies it.

    `fused`: one Triton kernel instead of the torch ops (set on CUDA by MoECausalLM.use_fused_kernels).
    """

    fused = False

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return rms_norm(x, self.weight, self.eps)[0]
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_norm(self, x: torch.Tensor | PairRows, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(s), s) for s = residual + x: the residual stream's update and its norm (one kernel when fused, which
        also sums an MoE's pair rows)."""
        if self.fused:
            if isinstance(x, PairRows):
                return rms_norm(x.rows, self.weight, self.eps, residual, pairs=x.top_k)
            return rms_norm(x, self.weight, self.eps, residual)
        total = add(residual, x)
        return self(total), total


class DecoderLayer(nn.Module):
    """Pre-norm attention then pre-norm MLP (dense or MoE), written once as a program with yield points.

    `fewer_launches`: the MLP output is left pending in the step state, and the next layer's input norm
    adds it to the residual stream in its kernel (set by MoECausalLM.use_fused_kernels).
    """

    fewer_launches = False

    def __init__(self, layer_id: int, self_attn: nn.Module, mlp: nn.Module, hidden_size: int, eps: float, mlp_name="mlp"):
        super().__init__()
        self.layer_id = layer_id
        self.mlp_name = mlp_name
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.self_attn = self_attn
        setattr(self, mlp_name, mlp)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)

    def program(self, state: StepState) -> Generator[str, None, None]:
        if state.pending is not None:  # the layer before left its MLP output for this norm to add
            normed, hidden = self.input_layernorm.add_norm(state.pending, state.hidden)
            state.pending = None
        else:
            hidden = state.hidden
            normed = self.input_layernorm(hidden)
        attn = self.self_attn(normed, state.batch, state.kv.layer(self.layer_id))
        normed, hidden = self.post_attention_layernorm.add_norm(attn, hidden)
        yield "attention"
        mlp = getattr(self, self.mlp_name)
        out = yield from mlp.program(normed, state)
        if self.fewer_launches:
            state.hidden, state.pending = hidden, out
        else:
            state.hidden = add(hidden, out)


def _parent(prefix: str) -> str:
    """'a.b.c' -> 'a.b.': the prefix of the module holding module 'a.b.c'."""
    return prefix.rpartition(".")[0] + "." if "." in prefix else ""


class MoECausalLM(nn.Module, abc.ABC):
    """embed -> decoder layers (run by the overlap strategy) -> norm -> lm_head on each request's last token.

    Subclasses build `self.model.embed_tokens`, `self.model.layers`, `self.model.norm`, `self.lm_head`
    (Hugging Face names, so parameter names are checkpoint names) and define `kv_shapes()`.
    """

    expert_names = ("gate_proj", "up_proj", "down_proj")  # checkpoint names of an expert's projections

    @abc.abstractmethod
    def kv_shapes(self) -> list[list[tuple[int, ...]]]:
        """Per layer, the per-token shapes of what its attention caches."""

    def mtp_kv_shapes(self) -> list[list[tuple[int, ...]]]:
        """Per MTP layer built, the per-token shapes of its KV (none for models without MTP layers)."""
        return []

    def build_stack(self, config: dict, layers: list[DecoderLayer]) -> None:
        """embed_tokens, the layers, the final norm and lm_head, under their checkpoint names."""
        self.tie_word_embeddings = bool(config.get("tie_word_embeddings", False))
        hidden, vocab = config["hidden_size"], config["vocab_size"]
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(vocab, hidden)
        self.model.layers = nn.ModuleList(layers)
        self.model.norm = RMSNorm(hidden, config["rms_norm_eps"])
        self.lm_head = Linear(hidden, vocab, bias=False)
        self.mtp_layers = nn.ModuleList()  # multi-token-prediction layers, built on request (DeepSeek-V3: models/mtp.py)
        self.requires_grad_(False)

    def set_attention_backend(self, backend) -> None:
        """Every layer's attention computes with `backend` (an AttentionBackend) from now on."""
        self.attention_backend = backend
        for layer in (*self.model.layers, *self.mtp_layers):
            layer.self_attn.backend = backend

    def use_fused_kernels(self, on: bool, fewer_launches: bool | None = None) -> None:
        """Every module that offers a fused Triton path (it declares `fused`) takes it, or the torch ops.

        `fewer_launches` (default: `on`): the fusions that only cut kernel launches, which is what a
        small decode batch pays for (a module declares `fewer_launches`): the KV-cache write in the rope
        kernel, the router GEMV in the top-k kernel, the residual add in the next layer's norm. Off, they
        run as the separate fused kernels they merge (a before/after switch for benchmarks).
        """
        merge = on if fewer_launches is None else on and fewer_launches
        for module in self.modules():
            if hasattr(type(module), "fused"):
                module.fused = on
            if hasattr(type(module), "fewer_launches"):
                module.fewer_launches = merge

    def layers_program(self, state: StepState) -> Generator[str, None, None]:
        for layer in self.model.layers:
            yield from layer.program(state)

    def forward(self, batch: ForwardBatch, kv: KVPool, strategy, logits_at: torch.Tensor | None = None,
                return_hidden: bool = False):
        """fp32 logits [B, vocab] of each request's last new token (or of the token rows `logits_at`); with
        `return_hidden`, also every token's hidden state before the final norm ([T, H], what MTP drafters read)."""
        hidden = run_layers(self, batch, kv, strategy)
        rows = batch.last_token_index if logits_at is None else logits_at
        logits = self.lm_head(self.model.norm(hidden[rows])).float()
        return (logits, hidden) if return_hidden else logits

    def moe_layers(self) -> list[MoELayer]:
        return [m for m in self.modules() if isinstance(m, MoELayer)]

    def weight_targets(self) -> dict[str, Target]:
        targets: dict[str, Target] = {}
        covered = set()  # parameters whose module names the checkpoint tensors itself
        for prefix, module in self.named_modules():
            if isinstance(module, MoELayer):
                targets.update(module.expert_targets(prefix + ".experts", self.expert_names))
            elif isinstance(module, MergedColumnLinear):
                targets.update(module.checkpoint_targets(_parent(prefix)))
            else:
                continue
            covered.update(f"{prefix}.{name}" for name, _ in module.named_parameters(recurse=False))
        for name, param in self.named_parameters():
            if name not in covered:
                targets[name] = parameter_target(param)
        if getattr(self, "tie_word_embeddings", False):
            targets.pop("lm_head.weight", None)
        return targets

    def fp8_weight_names(self) -> set[str]:
        """Checkpoint names of the weights a DeepSeek-V3 style fp8 checkpoint stores in fp8: every linear
        projection, experts included, but lm_head; embeddings, norms and routers stay in floating point."""
        names = {f"{prefix}.weight" for prefix, module in self.named_modules() if isinstance(module, (nn.Linear, RowLinear))}
        for prefix, module in self.named_modules():
            if isinstance(module, MergedColumnLinear):
                names.update(module.part_names(_parent(prefix)))
            if isinstance(module, MoELayer):
                names.update(module.expert_targets(prefix + ".experts", self.expert_names))
        return names - {"lm_head.weight"}

    def ignores_tensor(self, name: str) -> bool:
        if getattr(self, "tie_word_embeddings", False) and name == "lm_head.weight":
            return True  # some exporters store the tied head anyway
        return name.endswith("rotary_emb.inv_freq")

    def finish_loading(self) -> None:
        if getattr(self, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
        for layer in self.moe_layers():
            layer.finish_loading()
        CpuLinears().pack(self)  # on a CPU: oneDNN's packed weights where they were measured faster
        GpuLinears().choose(self)  # on a GPU: the Triton GEMV at a few rows where it was measured faster
