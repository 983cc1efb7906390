"""Qwen3-MoE gives transformers' logits: prefill, chunked prefill over scattered pages, batched decode."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from model_helpers import (
    TOLERANCE,
    check_batched_decode,
    check_chunked_prefill,
    check_prefill,
    load_ours,
    randomize,
    reference_logits,
    relative_error,
    token_sequence,
    write_hf_checkpoint,
)
from moeplex.config import EngineConfig
from moeplex.models.base import SiluMLP
from moeplex.models.qwen3_moe import PRESETS, moe_spec
from moeplex.models.setup import build_model
from moeplex.moe.layer import MoELayer
from moeplex.selection import resolve

VARIANTS = {
    "tiny": {},
    "no-norm-topk": {"norm_topk_prob": False},
    "attention-bias": {"attention_bias": True},
    # the long-context setting of the released models (moeplex.models.rope implements YaRN)
    "yarn": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}},
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def models(request, tmp_path_factory):
    """(ours, transformers') on the same random checkpoint of each variant of the tiny preset.

    transformers writes the expert count as num_local_experts, so loading its folder also covers
    that spelling (the presets, like the Hub configs, say num_experts).
    """
    config = {**PRESETS["tiny"], **VARIANTS[request.param]}
    folder = str(tmp_path_factory.mktemp(request.param))
    hf = write_hf_checkpoint(config, folder, seed=0)
    return load_ours(folder), hf


def test_prefill_matches_transformers(models):
    check_prefill(*models, token_sequence(20, seed=1))


def test_chunked_prefill_matches_transformers(models):
    check_chunked_prefill(*models, token_sequence(21, seed=2), chunk_ends=[7, 13, 21])


def test_batched_decode_matches_transformers(models):
    sequences = [token_sequence(n, seed=3 + n) for n in (6, 13, 18)]
    check_batched_decode(*models, sequences, decode_steps=3)


def test_dense_and_moe_layers_follow_mlp_only_layers(models):
    ours, _ = models
    config = PRESETS["tiny"]
    kinds = [type(layer.mlp) for layer in ours.model.layers]
    assert config["mlp_only_layers"] == [1]
    assert kinds == [MoELayer, SiluMLP, MoELayer]
    dense = ours.model.layers[1].mlp
    assert dense.gate_up.sizes == [config["intermediate_size"]] * 2
    assert [layer.moe_index for layer in ours.moe_layers()] == [0, 1]
    assert all(layer.w2.shape[-1] == config["moe_intermediate_size"] for layer in ours.moe_layers())


def test_norm_topk_prob_is_visible_at_this_tolerance():
    """The two routing normalisations give logits far apart, so the comparisons above tell them apart."""
    logits = []
    for norm in (True, False):
        fields = {**PRESETS["tiny"], "norm_topk_prob": norm}
        hf_config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
        randomize(model, seed=0)
        logits.append(reference_logits(model.eval(), token_sequence(12, seed=7)))
    assert relative_error(logits[1], logits[0]) > 100 * TOLERANCE


@pytest.mark.parametrize("preset", list(PRESETS))
def test_moe_spec_matches_the_transformers_model(preset):
    fields = dict(PRESETS[preset])
    hf_config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_config)
    moe_blocks = [layer.mlp for layer in hf.model.layers if hasattr(layer.mlp, "experts")]
    spec = moe_spec(PRESETS[preset])
    assert 0 < spec.num_moe_layers == len(moe_blocks) <= hf_config.num_hidden_layers
    if preset in ("tiny", "small"):  # the test presets keep a dense layer so that path is exercised
        assert spec.num_moe_layers < hf_config.num_hidden_layers
    assert spec.num_experts == moe_blocks[0].experts.down_proj.shape[0]
    assert spec.intermediate_size == moe_blocks[0].experts.down_proj.shape[-1]
    assert spec.top_k == moe_blocks[0].gate.top_k
    assert spec.hidden_size == hf_config.hidden_size
    assert hf.model.layers[0].self_attn.num_key_value_groups > 1  # GQA


def _build(tmp_path, config):
    (tmp_path / "config.json").write_text(json.dumps(config))
    engine = EngineConfig(model=str(tmp_path), dtype="fp32", show_progress=False)
    return build_model(str(tmp_path), engine, resolve(engine))


def test_refuses_a_sliding_window_that_would_bind(tmp_path):
    config = {**PRESETS["tiny"], "use_sliding_window": True, "sliding_window": 16}
    with pytest.raises(ValueError, match="sliding_window"):
        _build(tmp_path, config)


def test_accepts_a_sliding_window_transformers_ignores(tmp_path):
    # transformers applies sliding_window only when use_sliding_window is set
    config = {**PRESETS["tiny"], "use_sliding_window": False, "sliding_window": 16}
    model = _build(tmp_path, config)
    assert len(model.model.layers) == config["num_hidden_layers"]

