"""Writing random-weight checkpoints in the Hugging Face format, with a byte-level tokenizer.

The tensors written are exactly the names and shapes the model expects (its weight
targets), so a folder written here loads in moeplex and in transformers alike.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from ..config import EngineConfig
from ..progress import progress
from ..quant import quantize_blocks
from . import architecture
from .loader import FP8_QUANTIZATION_CONFIG, SCALE_SUFFIX
from .random_weights import named_random_tensor
from .synthetic_mtp import CONFIG_KEY, synthetic_tensor

BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
ARCHES = ("deepseek_v3", "qwen3_moe", "mixtral")
WEIGHTED_PRESETS = ("tiny", "small")  # the others are released shapes: gigabytes of random weights, config only


def byte_level_tokenizer() -> Tokenizer:
    """256 byte tokens (ids 0-255, no merges) plus bos 256, eos 257, pad 258."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_to_char = sorted(alphabet, key=lambda ch: _byte_of(ch))
    tokenizer = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(byte_to_char)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([BOS, EOS, PAD])
    return tokenizer


def _byte_of(char: str) -> int:
    """GPT-2 byte-level mapping, inverted: printable bytes map to themselves, the rest to 256+."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    code = ord(char)
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]


def write_tokenizer(folder: str) -> None:
    byte_level_tokenizer().save(os.path.join(folder, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": True,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 4096,
    }
    _write_json(folder, "tokenizer_config.json", config)


def _write_json(folder: str, name: str, data: dict) -> None:
    with open(os.path.join(folder, name), "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")


def write_checkpoint(
    folder: str,
    arch: str,
    preset: str = "tiny",
    seed: int = 0,
    max_shard_bytes: int | None = None,
    overrides: dict | None = None,
    config_only: bool = False,
    fp8: bool = False,
    show_progress: bool = False,
    mtp: int = 0,
    mtp_acceptance: float | None = None,
    synthetic_map: bool = False,
) -> str:
    """Write config, generation config, tokenizer and random safetensors weights of `arch`/`preset` to `folder`.

    `overrides` replace config fields (e.g. num_hidden_layers); `config_only` writes no weights,
    for folders run with --load-format dummy; `fp8` writes a DeepSeek-V3 style fp8 checkpoint (every
    linear projection but lm_head in float8_e4m3fn with `weight_scale_inv` block scales); `mtp` writes
    that many multi-token-prediction layers (deepseek_v3; config.json's num_nextn_predict_layers says how
    many the folder holds, 0 without them); `mtp_acceptance` makes the weights synthetic instead of random: a
    target close to a fixed next-token map and an MTP layer whose drafts it accepts at that rate per position
    (synthetic_mtp.py; config.json records it, so --load-format dummy makes the same weights); `synthetic_map`
    makes the target so without an MTP layer, for any architecture (a model that copies what follows a fixed
    next-token map: what prompt-lookup drafting measures on a copy workload).
    """
    from ..selection import resolve  # deferred: selection reads the plugin registry
    from .setup import build_model

    if arch not in ARCHES:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHES)}")
    module = architecture({"model_type": arch})
    if preset not in module.PRESETS:
        raise ValueError(f"unknown preset {preset!r}; {arch} presets: {', '.join(module.PRESETS)}")
    if not config_only and preset not in WEIGHTED_PRESETS:
        raise ValueError(
            f"the {preset} preset has the released {arch} shapes, far too large to fill with random weights; "
            "add --config-only and run the folder with --load-format dummy"
        )
    config = {**module.PRESETS[preset], **(overrides or {})}
    check_overrides(config, overrides or {}, module.PRESETS["tiny"])
    if mtp < 0 or (mtp and not getattr(module, "HAS_MTP", False)):
        raise ValueError(f"--mtp {mtp}: multi-token-prediction layers exist for deepseek_v3 only, 0 or more")
    if getattr(module, "HAS_MTP", False):
        config["num_nextn_predict_layers"] = mtp
    if mtp_acceptance is not None:
        if not mtp or not 0.0 <= mtp_acceptance <= 1.0:
            raise ValueError(f"--mtp-acceptance {mtp_acceptance}: a rate in 0..1, with --mtp 1 or more (deepseek_v3)")
    if mtp_acceptance is not None or synthetic_map:
        config[CONFIG_KEY] = {"acceptance": 1.0 if mtp_acceptance is None else mtp_acceptance}
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise NotADirectoryError(f"{folder} is a file; make-model writes a folder there")
    os.makedirs(folder, exist_ok=True)
    if fp8:
        config["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
    # the random weights come from a plain model: config.json says fp8 only once the weights are written
    _write_json(folder, "config.json", config if config_only else _plain(config))
    _write_json(folder, "generation_config.json", {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]})
    write_tokenizer(folder)
    if config_only:
        return folder
    engine_config = EngineConfig(model=folder, show_progress=False)
    model = build_model(folder, engine_config, resolve(engine_config), mtp=mtp > 0)
    targets = progress(model.weight_targets().items(), desc="making random weights", unit="tensor", enabled=show_progress)
    if CONFIG_KEY in config:
        tensors = {name: synthetic_tensor(name, t.shape, seed, config).contiguous() for name, t in targets}
    else:
        tensors = {name: named_random_tensor(name, t.shape, seed).contiguous() for name, t in targets}
    if fp8:
        tensors = quantize_tensors(tensors, model.fp8_weight_names())
    _save_shards(folder, tensors, max_shard_bytes)
    _write_json(folder, "config.json", config)
    return folder


def check_overrides(config: dict, overrides: dict, types: dict) -> None:
    """Each overridden field of the type config.json needs (refused before anything is written)."""
    from .base import ModelConfig

    checked = ModelConfig(config, "--set", types)
    for key in overrides:
        checked.get(key)


def _plain(config: dict) -> dict:
    return {key: value for key, value in config.items() if key != "quantization_config"}


def quantize_tensors(tensors: dict[str, torch.Tensor], names: set[str]) -> dict[str, torch.Tensor]:
    """The tensors with each one in `names` as fp8 values plus `{name}_scale_inv`, one fp32 scale per 128x128 block."""
    out = {}
    for name, tensor in tensors.items():
        if name in names:
            values, scale = quantize_blocks(tensor)
            out[name], out[name + SCALE_SUFFIX] = values.contiguous(), scale.contiguous()
        else:
            out[name] = tensor
    return out


def _save_shards(folder: str, tensors: dict[str, torch.Tensor], max_shard_bytes: int | None) -> None:
    shards, current, size = [], {}, 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if current and max_shard_bytes and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensor
        size += nbytes
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(folder, file), metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    _write_json(folder, "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})


def cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "moeplex", "models")


def default_model(arch: str = "deepseek_v3", preset: str = "tiny", seed: int = 0) -> str:
    """The embedded default model: written once into the user's cache directory, then reused."""
    folder = os.path.join(cache_dir(), f"{arch}-{preset}-seed{seed}")
    if os.path.exists(os.path.join(folder, "config.json")):
        return folder
    os.makedirs(cache_dir(), exist_ok=True)
    staging = tempfile.mkdtemp(dir=cache_dir(), prefix=".writing-")
    write_checkpoint(staging, arch, preset, seed)
    try:
        os.rename(staging, folder)  # atomic: a concurrent writer's complete copy wins
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    return folder
