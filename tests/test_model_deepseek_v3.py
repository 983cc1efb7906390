"""DeepSeek-V3 gives transformers' DeepseekV3ForCausalLM logits: prefill, chunked prefill, batched decode.

Also: the KV cache holds the compressed latent + rope key, grouped routing really masks groups,
YaRN matches transformers, and a wrong checkpoint fails loading naming the tensor.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moeplex.batch_builder import ScheduledSeq, build_forward_batch
from moeplex.config import EngineConfig
from moeplex.forward_batch import ForwardMode
from moeplex.kv_cache import KVPool
from moeplex.models.deepseek_v3 import PRESETS, moe_spec
from moeplex.targets import CheckpointError
from moeplex.models.mla import mla_rope_parameters, softmax_scale
from moeplex.models.rope import RotaryEmbedding, inv_freq_and_scale
from moeplex.models.setup import load_model
from moeplex.registry import lookup
from moeplex.selection import resolve

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf  # noqa: E402

TOLERANCE = 1e-4  # max |ours - transformers| / max |transformers|, fp32
PAGE_SIZE = 4
VARIANTS = {
    "tiny": PRESETS["tiny"],
    # the other attention layout: q_proj instead of the q LoRA, half-split rope, projection biases
    "q-proj": {**PRESETS["tiny"], "q_lora_rank": None, "rope_interleave": False, "attention_bias": True},
}


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours - reference).abs().max() / reference.abs().max()).item()


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that logits and routing are far from flat; norms around 1; non-zero router bias."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else 0.08 * noise)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.05 * torch.randn(buffer.shape, generator=gen))


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request, tmp_path_factory):
    """(folder, transformers model) of a random-weight checkpoint written by transformers."""
    config = transformers.DeepseekV3Config.from_dict(VARIANTS[request.param], attn_implementation="eager")
    reference = hf.DeepseekV3ForCausalLM(config).eval()
    randomize(reference, seed=0)
    folder = str(tmp_path_factory.mktemp(request.param))
    reference.save_pretrained(folder)
    return folder, reference


def load(folder: str):
    cfg = EngineConfig(model=folder, dtype="fp32", show_progress=False)
    return load_model(folder, cfg, resolve(cfg))


@pytest.fixture(scope="module")
def model(checkpoint):
    return load(checkpoint[0])


def new_pool(model) -> KVPool:
    return KVPool(num_pages=64, page_size=PAGE_SIZE, layer_shapes=model.kv_shapes(), dtype=torch.float32, device="cpu")


def scattered_pages(kv: KVPool, count: int) -> list[int]:
    """`count` pages that are neither contiguous nor in order, taken after other requests came and went."""
    kv.release(kv.allocate(3))
    taken = kv.allocate(2 * count)
    kv.release(taken[1::2])
    return taken[0::2][::-1]


def run(model, kv: KVPool, seqs: list[ScheduledSeq]):
    batch = build_forward_batch(seqs, kv, "cpu")
    with torch.no_grad():
        logits = model(batch, kv, lookup("overlap", "none")(), logits_at=torch.arange(batch.num_tokens))
    return logits, batch


def reference_logits(reference, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return reference(torch.tensor([tokens]), use_cache=False).logits[0].float()


def prompt(length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [256] + torch.randint(0, 256, (length - 1,), generator=gen).tolist()


def test_prefill_matches_transformers(checkpoint, model):
    tokens = prompt(20, seed=1)
    kv = new_pool(model)
    logits, _ = run(model, kv, [ScheduledSeq(tokens, 0, kv.allocate(kv.pages_for(20)))])
    assert relative_error(logits, reference_logits(checkpoint[1], tokens)) <= TOLERANCE


def test_chunked_prefill_through_scattered_pages(checkpoint, model):
    tokens = prompt(20, seed=2)
    expected = reference_logits(checkpoint[1], tokens)
    kv = new_pool(model)
    pages = scattered_pages(kv, kv.pages_for(len(tokens)))
    for start, end in ((0, 7), (7, 13), (13, 20)):
        logits, batch = run(model, kv, [ScheduledSeq(tokens[start:end], start, pages)])
        assert batch.prefix_lens == (start,)
        assert relative_error(logits, expected[start:end]) <= TOLERANCE


def test_batched_decode_matches_transformers(checkpoint, model):
    sequences = [prompt(n, seed=10 + n) for n in (5, 9, 14)]
    steps = 3
    kv = new_pool(model)
    pages = [scattered_pages(kv, kv.pages_for(len(s) + steps)) for s in sequences]
    logits, _ = run(model, kv, [ScheduledSeq(s, 0, p) for s, p in zip(sequences, pages)])
    last = torch.tensor([len(s) for s in sequences]).cumsum(0) - 1
    for _ in range(steps):
        for seq, next_token in zip(sequences, logits[last].argmax(-1).tolist()):
            seq.append(next_token)
        logits, batch = run(model, kv, [ScheduledSeq(s[-1:], len(s) - 1, p) for s, p in zip(sequences, pages)])
        assert batch.mode == ForwardMode.DECODE
        expected = torch.stack([reference_logits(checkpoint[1], s)[-1] for s in sequences])
        assert relative_error(logits, expected) <= TOLERANCE
        last = torch.arange(len(sequences))


def test_cache_holds_latent_and_rope_key(checkpoint, model):
    """Each layer caches kv_a_layernorm(latent) ++ rotated rope key per token, as transformers' cache does."""
    config = PRESETS["tiny"]
    width = config["kv_lora_rank"] + config["qk_rope_head_dim"]
    assert model.kv_shapes() == [[(width,)]] * config["num_hidden_layers"]
    tokens = prompt(11, seed=3)
    kv = new_pool(model)
    _, batch = run(model, kv, [ScheduledSeq(tokens, 0, scattered_pages(kv, kv.pages_for(11)))])
    cache = transformers.DynamicCache(config=checkpoint[1].config)
    with torch.no_grad():
        checkpoint[1](torch.tensor([tokens]), cache=cache, use_cache=True)
    for layer, (buffer,) in enumerate(kv.buffers):
        expected = torch.cat((cache.layers[layer].keys[0, 0], cache.layers[layer].values[0, 0]), dim=-1)
        assert relative_error(buffer[batch.kv_indices], expected) <= TOLERANCE


def test_routing_masks_groups_like_transformers(checkpoint, model):
    """Our router picks transformers' experts, and group masking changes the pick for some tokens."""
    captured = {}
    gates = {i: layer.mlp.gate for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")}
    hooks = [
        gate.register_forward_hook(lambda module, args, out, i=i: captured.update({i: (args[0], out)}))
        for i, gate in gates.items()
    ]
    kv = new_pool(model)
    run(model, kv, [ScheduledSeq(prompt(20, seed=4), 0, kv.allocate(5))])
    for hook in hooks:
        hook.remove()
    top_k = PRESETS["tiny"]["num_experts_per_tok"]
    masked_tokens = 0
    for i, (hidden, (ids, weights)) in captured.items():
        _, hf_weights, hf_ids = checkpoint[1].model.layers[i].mlp.gate(hidden)
        ids, order = ids.sort(-1)
        hf_ids, hf_order = hf_ids.sort(-1)
        assert torch.equal(ids, hf_ids)
        assert torch.allclose(weights.gather(1, order), hf_weights.gather(1, hf_order), rtol=1e-6, atol=1e-7)
        gate = gates[i]
        choice = torch.sigmoid(hidden.float() @ gate.weight.T) + gate.e_score_correction_bias
        ungrouped = choice.topk(top_k, dim=-1).indices.sort(-1).values
        masked_tokens += int((ungrouped != ids).any(-1).sum())
    assert masked_tokens > 0


def _rewritten_checkpoint(folder: str, target: str, edit) -> str:
    os.makedirs(target)
    shutil.copy(os.path.join(folder, "config.json"), target)
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(target, "model.safetensors"))
    return target


BROKEN = {
    "missing": ("model.layers.1.mlp.experts.3.up_proj.weight", lambda t, n: t.pop(n)),
    "extra": ("model.layers.0.self_attn.k_proj.weight", lambda t, n: t.update({n: torch.zeros(4, 64)})),
    "mis-shaped": (
        "model.layers.2.self_attn.kv_b_proj.weight",
        lambda t, n: t.update({n: torch.zeros(t[n].shape[0] + 1, t[n].shape[1])}),
    ),
}


@pytest.mark.parametrize("fault", list(BROKEN))
def test_broken_checkpoint_names_the_tensor(checkpoint, tmp_path, fault):
    name, edit = BROKEN[fault]
    folder = _rewritten_checkpoint(checkpoint[0], str(tmp_path / fault), lambda t: edit(t, name))
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        load(folder)


def test_mtp_layer_tensors_are_ignored(checkpoint, tmp_path):
    layers = PRESETS["tiny"]["num_hidden_layers"]
    mtp = {
        f"model.layers.{layers}.eh_proj.weight": torch.ones(64, 128),
        f"model.layers.{layers}.enorm.weight": torch.ones(64),
    }
    folder = _rewritten_checkpoint(checkpoint[0], str(tmp_path / "mtp"), lambda t: t.update(mtp))
    reloaded = load(folder)
    assert not reloaded.ignores_tensor(f"model.layers.{layers - 1}.input_layernorm.weight")
    kv = new_pool(reloaded)
    tokens = prompt(6, seed=5)
    logits, _ = run(reloaded, kv, [ScheduledSeq(tokens, 0, kv.allocate(2))])
    assert relative_error(logits, reference_logits(checkpoint[1], tokens)) <= TOLERANCE


def test_presets_round_trip_through_transformers():
    for preset in PRESETS.values():
        saved = transformers.DeepseekV3Config.from_dict(preset).to_dict()
        for key in ("rope_parameters", "n_group", "topk_group", "q_lora_rank", "first_k_dense_replace", "vocab_size"):
            assert saved[key] == preset[key], key
        json.dumps(preset)  # a config.json must be plain JSON
        spec = moe_spec(preset)
        assert spec.num_moe_layers == preset["num_hidden_layers"] - preset["first_k_dense_replace"]
        assert 1 < preset["n_group"] and preset["topk_group"] < preset["n_group"]


def test_unsupported_routing_is_refused():
    with pytest.raises(ValueError, match="scoring_func"):
        moe_spec({**PRESETS["tiny"], "scoring_func": "softmax"})


V3_YARN = PRESETS["tiny"]["rope_parameters"]
ROPES = {
    "default": {"rope_type": "default", "rope_theta": 1e6},
    "deepseek-v3": V3_YARN,
    "mscale-ratio": {**V3_YARN, "mscale": 1.0, "mscale_all_dim": 0.707},
    "qwen-style": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 32768},
    "explicit": {**V3_YARN, "attention_factor": 1.5, "truncate": False, "beta_fast": 16, "beta_slow": 2},
    "factor-from-lengths": {**V3_YARN, "factor": None},  # factor = max_position_embeddings / original
}


def _configs(rope: dict, dim: int):
    ours = {**PRESETS["tiny"], "qk_rope_head_dim": dim, "rope_parameters": dict(rope)}
    theirs = transformers.DeepseekV3Config.from_dict({**ours, "rope_parameters": dict(rope)})
    return ours, theirs


@pytest.mark.parametrize("rope", list(ROPES))
@pytest.mark.parametrize("dim", [8, 64])
def test_rope_frequencies_match_transformers(rope, dim):
    ours, theirs = _configs(ROPES[rope], dim)
    if rope == "default":
        expected_freq, expected_factor = hf.DeepseekV3RotaryEmbedding.compute_default_rope_parameters(theirs)
    else:
        expected_freq, expected_factor = ROPE_INIT_FUNCTIONS["yarn"](theirs)
    inv_freq, factor = inv_freq_and_scale(dim, mla_rope_parameters(ours))
    assert torch.allclose(inv_freq, expected_freq, rtol=1e-6, atol=0)
    assert factor == pytest.approx(expected_factor, rel=1e-12)


@pytest.mark.parametrize("rope", ["default", "deepseek-v3", "qwen-style"])
@pytest.mark.parametrize("interleaved", [True, False])
def test_rotary_embedding_matches_transformers(rope, interleaved):
    ours, theirs = _configs(ROPES[rope], 16)
    positions = torch.tensor([0, 1, 7, 300, 5000, 100000])
    gen = torch.Generator().manual_seed(6)
    q, k = torch.randn(6, 3, 16, generator=gen), torch.randn(6, 1, 16, generator=gen)
    cos, sin = hf.DeepseekV3RotaryEmbedding(theirs)(q, positions[None])
    apply = hf.apply_rotary_pos_emb_interleave if interleaved else hf.apply_rotary_pos_emb
    q_ref, k_ref = apply(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    q_out, k_out = RotaryEmbedding(16, mla_rope_parameters(ours), interleaved)(positions, q, k)
    assert torch.allclose(q_out, q_ref[0].transpose(0, 1), atol=1e-6)
    assert torch.allclose(k_out, k_ref[0].transpose(0, 1), atol=1e-6)


@pytest.mark.parametrize("rope", ["default", "deepseek-v3", "mscale-ratio", "qwen-style"])
def test_softmax_scale_matches_transformers(rope):
    ours, theirs = _configs(ROPES[rope], 8)
    head_dim = ours["qk_nope_head_dim"] + ours["qk_rope_head_dim"]
    assert softmax_scale(ours) == pytest.approx(hf.yarn_apply_mscale(theirs.rope_parameters, head_dim**-0.5), rel=1e-12)


def test_unknown_rope_type_is_refused():
    with pytest.raises(ValueError, match="supported: default, yarn"):
        RotaryEmbedding(8, {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
