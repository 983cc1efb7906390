"""Mixtral gives transformers' logits: prefill, chunked prefill over scattered pages, batched decode."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from model_helpers import (
    check_batched_decode,
    check_chunked_prefill,
    check_prefill,
    load_ours,
    token_sequence,
    write_hf_checkpoint,
)
from moeplex.config import EngineConfig
from moeplex.models.mixtral import PRESETS, moe_spec
from moeplex.models.setup import build_model
from moeplex.moe.layer import MoELayer
from moeplex.selection import resolve

VARIANTS = {
    "tiny": {},
    # the checkpoint then has no lm_head.weight: the head reads the embedding
    "tied-embeddings": {"tie_word_embeddings": True},
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def models(request, tmp_path_factory):
    """(ours, transformers') on the same random checkpoint of each variant of the tiny preset."""
    config = {**PRESETS["tiny"], **VARIANTS[request.param]}
    folder = str(tmp_path_factory.mktemp(request.param))
    hf = write_hf_checkpoint(config, folder, seed=0)
    return load_ours(folder), hf


def test_prefill_matches_transformers(models):
    check_prefill(*models, token_sequence(20, seed=1))


def test_chunked_prefill_matches_transformers(models):
    check_chunked_prefill(*models, token_sequence(22, seed=2), chunk_ends=[5, 14, 22])


def test_batched_decode_matches_transformers(models):
    sequences = [token_sequence(n, seed=3 + n) for n in (7, 12, 19)]
    check_batched_decode(*models, sequences, decode_steps=3)


def test_every_layer_is_a_block_sparse_moe(models):
    ours, _ = models
    names = {name for name, _ in ours.named_modules()}
    for layer_id, layer in enumerate(ours.model.layers):
        assert isinstance(layer.block_sparse_moe, MoELayer)
        assert layer.block_sparse_moe.moe_index == layer_id
        assert f"model.layers.{layer_id}.block_sparse_moe.gate" in names
    assert ours.tie_word_embeddings == (ours.lm_head.weight is ours.model.embed_tokens.weight)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_moe_spec_matches_the_transformers_model(preset):
    fields = dict(PRESETS[preset])
    hf_config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_config)
    spec = moe_spec(PRESETS[preset])
    experts = hf.model.layers[0].mlp.experts
    assert spec.num_moe_layers == len(hf.model.layers)
    assert spec.num_experts == experts.down_proj.shape[0]
    assert spec.intermediate_size == experts.down_proj.shape[-1]
    assert spec.top_k == hf.model.layers[0].mlp.gate.top_k
    assert spec.hidden_size == hf_config.hidden_size
    assert hf.model.layers[0].self_attn.num_key_value_groups > 1  # GQA


def _build(tmp_path, config):
    (tmp_path / "config.json").write_text(json.dumps(config))
    engine = EngineConfig(model=str(tmp_path), dtype="fp32", show_progress=False)
    return build_model(str(tmp_path), engine, resolve(engine))


def test_refuses_a_sliding_window_that_would_bind(tmp_path):
    config = {**PRESETS["tiny"], "sliding_window": 16}
    with pytest.raises(ValueError, match="sliding_window"):
        _build(tmp_path, config)


def test_accepts_a_sliding_window_no_sequence_reaches(tmp_path):
    config = {**PRESETS["tiny"], "sliding_window": PRESETS["tiny"]["max_position_embeddings"]}
    model = _build(tmp_path, config)
    assert len(model.model.layers) == config["num_hidden_layers"]
