"""DeepSeek-V3 style fp8 checkpoints (weight + weight_scale_inv per 128x128 block) and fp8 experts.

The reference for an fp8 checkpoint is its dequantized twin: the same folder with every fp8 weight
replaced by fp8 * scale in fp32 and no quantization_config. Both load and run in fp32, so the
logits must agree to rounding, whether the experts are dequantized at load or kept in fp8.
"""

from __future__ import annotations

import json
import os
import shutil
import socket

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_helpers import new_pool, step
from moeplex.batch_builder import ScheduledSeq
from moeplex.cli import main
from moeplex.config import EngineConfig
from moeplex.engine import Engine
from moeplex.ranks.launcher import launch
from moeplex.models.loader import SCALE_SUFFIX
from moeplex.targets import CheckpointError
from moeplex.models.setup import load_model
from moeplex.ranks.offline import generate
from moeplex.parallel import ParallelConfig
from moeplex.quant import FP8, dequantize_blocks, quantize_blocks
from moeplex.registry import PluginError
from moeplex.sampling import SamplingParams
from moeplex.selection import resolve

import parallel_ranks

TOKENS = [256, 7, 42, 99, 3, 180, 64, 12, 250]
EXACT = 1e-5  # max |ours - reference| / max |reference|: the same fp32 weights, computed the same way
FP8_ACTIVATIONS = 5e-2  # the triton kernel also rounds activations to fp8 (w8a8)


def write_fp8(folder: str, *sets: str) -> str:
    args = ["make-model", folder, "--arch", "deepseek_v3", "--fp8", "--seed", "3"]
    assert main(args + [a for s in sets for a in ("--set", s)]) == 0
    return folder


def dequantized_twin(folder: str, out: str) -> str:
    """`folder` with every fp8 weight as fp32 fp8 * scale, no scales and no quantization_config."""
    os.makedirs(out)
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    plain = {
        name: tensor if name + SCALE_SUFFIX not in tensors else dequantize_blocks(tensor, tensors[name + SCALE_SUFFIX])
        for name, tensor in tensors.items()
        if not name.endswith(SCALE_SUFFIX)
    }
    save_file(plain, os.path.join(out, "model.safetensors"))
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    del config["quantization_config"]
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(fp8 folder, its dequantized twin): moe_intermediate_size 32, so gate and up share fp8 blocks."""
    root = tmp_path_factory.mktemp("fp8-tiny")
    fp8 = write_fp8(str(root / "fp8"))
    return fp8, dequantized_twin(fp8, str(root / "twin"))


@pytest.fixture(scope="module")
def aligned(tmp_path_factory):
    """(fp8 folder, twin) with moe_intermediate_size 128: the experts' blocks fit the stacked w13, kept in fp8."""
    root = tmp_path_factory.mktemp("fp8-aligned")
    fp8 = write_fp8(str(root / "fp8"), "moe_intermediate_size=128")
    return fp8, dequantized_twin(fp8, str(root / "twin"))


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def load(folder: str, **settings):
    config = EngineConfig(model=folder, dtype="fp32", show_progress=False, **settings)
    return load_model(folder, config, resolve(config))


def logits(model) -> torch.Tensor:
    kv = new_pool(model)
    return step(model, kv, [ScheduledSeq(TOKENS, 0, kv.allocate(kv.pages_for(len(TOKENS))))])


def assert_close(ours: torch.Tensor, reference: torch.Tensor, tolerance: float, what: str) -> None:
    error = ((ours - reference).abs().max() / reference.abs().max()).item()
    assert error <= tolerance, f"{what}: max relative error {error:.2e} > {tolerance:.0e}"


def test_make_model_writes_deepseek_v3_fp8_tensors(tiny):
    tensors = load_file(os.path.join(tiny[0], "model.safetensors"))
    scaled = {name.removesuffix(SCALE_SUFFIX) for name in tensors if name.endswith(SCALE_SUFFIX)}
    assert all(tensors[name].dtype == FP8 for name in scaled)
    assert {"model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.kv_b_proj.weight",
            "model.layers.1.mlp.experts.3.up_proj.weight", "model.layers.2.mlp.shared_experts.gate_proj.weight"} <= scaled
    plain = {"lm_head.weight", "model.embed_tokens.weight", "model.layers.1.mlp.gate.weight",
             "model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.1.input_layernorm.weight"}
    assert not plain & scaled and all(tensors[name].dtype == torch.float32 for name in plain)
    assert tensors["model.layers.1.self_attn.kv_b_proj.weight_scale_inv"].shape == (1, 1)


def test_fp8_checkpoint_equals_its_dequantized_twin(tiny):
    model = load(tiny[0])
    assert all(layer.w13.dtype == torch.float32 for layer in model.moe_layers()), "32-row experts are dequantized"
    assert_close(logits(model), logits(load(tiny[1])), EXACT, "fp8 checkpoint vs its dequantized twin")


def test_experts_kept_in_fp8_equal_the_dequantized_path(aligned):
    kept = load(aligned[0])
    layer = kept.moe_layers()[0]
    assert layer.w13.dtype == FP8 and layer.w13_scale.shape == (16, 2, 1) and layer.w2_scale.shape == (16, 1, 1)
    reference = logits(load(aligned[1]))
    assert_close(logits(kept), reference, EXACT, "torch kernel on fp8 experts")
    dequantized = load(aligned[0], moe_kernel="dense")  # a kernel that takes bf16 weights only
    assert dequantized.moe_layers()[0].w13.dtype == torch.float32
    assert_close(logits(dequantized), reference, EXACT, "experts dequantized at load")


@pytest.mark.slow
def test_tensor_parallel_loads_the_same(tmp_path):
    """TP 2 cuts the dense MLP inside a 128-block (rank 1 starts at row 192 of 384) and the experts on block
    edges (128 of 256 rows: kept in fp8, each rank reading its own scale blocks)."""
    fp8 = write_fp8(str(tmp_path / "fp8"), "moe_intermediate_size=256", "intermediate_size=384")
    twin = dequantized_twin(fp8, str(tmp_path / "twin"))
    prompts, params = [TOKENS, [256, 5, 6]], SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True, logprobs=5)
    parallel = ParallelConfig(tp_size=2, dist_init_addr=free_address(), timeout_s=120)
    ranks = launch(parallel_ranks.generate_every_model, parallel, parallel, [fp8], prompts, [params] * 2)[fp8]
    alone = generate(EngineConfig(model=twin, show_progress=False, max_total_tokens=1024, page_size=4), prompts, params)
    for ours, reference in zip(ranks, alone):
        assert ours["output_ids"] == reference["output_ids"]
        for step_ours, step_ref in zip(ours["logprobs"], reference["logprobs"]):
            for (token, a), (ref_token, b) in zip(step_ours["top_logprobs"], step_ref["top_logprobs"]):
                assert token == ref_token and abs(a - b) <= 1e-4 * max(1.0, abs(b))


def corrupt_scale_shape(folder):
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    tensors["model.layers.1.self_attn.o_proj.weight_scale_inv"] = torch.ones(2, 1)
    save_file(tensors, os.path.join(folder, "model.safetensors"))


def drop_scale(folder):
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    del tensors["model.layers.2.mlp.experts.5.down_proj.weight_scale_inv"]
    save_file(tensors, os.path.join(folder, "model.safetensors"))


def edit_config(**quantization):
    def edit(folder):
        path = os.path.join(folder, "config.json")
        with open(path) as f:
            config = json.load(f)
        config["quantization_config"].update(quantization)
        with open(path, "w") as f:
            json.dump(config, f)

    return edit


@pytest.mark.parametrize("corrupt,message", [
    (corrupt_scale_shape, r"model\.layers\.1\.self_attn\.o_proj\.weight_scale_inv has shape \[2, 1\].*needs \[1, 1\]"),
    (drop_scale, r"model\.layers\.2\.mlp\.experts\.5\.down_proj\.weight is stored in fp8 .* no .*weight_scale_inv"),
    (edit_config(quant_method="awq"), r"quantization_config\.quant_method is 'awq'"),
    (edit_config(weight_block_size=[64, 64]), r"quantization_config\.weight_block_size is \[64, 64\]"),
])
def test_a_broken_fp8_checkpoint_names_what_is_wrong(tiny, tmp_path, corrupt, message):
    folder = shutil.copytree(tiny[0], tmp_path / "broken")
    corrupt(str(folder))
    with pytest.raises(CheckpointError, match=message):
        load(str(folder))


# --- --quantize-experts fp8: plain expert weights quantized at load ------------------------------


def quantized_in_place(model):
    """`model` with every expert weight replaced by dequantize(quantize(w)) over the stacked gate and up rows."""
    for layer in model.moe_layers():
        for weight in (layer.w13, layer.w2):
            weight.data.copy_(dequantize_blocks(*quantize_blocks(weight.data)))
        layer.finish_loading()
    return model


def test_quantize_experts_with_the_torch_kernel(tiny_model_dir):
    folder = tiny_model_dir("deepseek_v3")
    model = load(folder, quantize_experts="fp8")
    assert all(layer.w13.dtype == FP8 for layer in model.moe_layers())
    assert_close(logits(model), logits(quantized_in_place(load(folder))), EXACT, "quantized at load")


def test_quantize_experts_with_the_triton_kernel(tiny_model_dir):
    folder = tiny_model_dir("deepseek_v3")
    reference = logits(load(folder, quantize_experts="fp8"))
    triton = logits(load(folder, quantize_experts="fp8", moe_kernel="triton"))
    assert_close(triton, reference, FP8_ACTIVATIONS, "triton (w8a8) vs torch on the same fp8 experts")


def test_quantize_experts_is_refused_for_a_kernel_without_fp8_weights(tiny_model_dir):
    refusal = r"--quantize-experts fp8 needs .* moe_kernel 'dense' takes bf16 only; kernels that do: .*torch"
    with pytest.raises(PluginError, match=refusal):
        load(tiny_model_dir("deepseek_v3"), quantize_experts="fp8", moe_kernel="dense")


def test_dummy_weights_fill_fp8_experts(tiny_model_dir):
    model = load(tiny_model_dir("deepseek_v3"), load_format="dummy", quantize_experts="fp8")
    layer = model.moe_layers()[0]
    assert layer.w13.dtype == FP8 and (layer.w13_scale > 0).all() and (layer.w2_scale > 0).all()
    assert torch.isfinite(logits(model)).all()


def test_rebalancing_moves_fp8_experts_with_their_scales(aligned):
    config = EngineConfig(model=aligned[0], show_progress=False, max_total_tokens=256, page_size=4, balancer="eplb",
                          ep_num_redundant_experts=4)
    engine = Engine(config)
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    before = [r.output_ids for r in engine.generate([TOKENS], params, progress=False)]
    layers = engine.model.moe_layers()
    runtime = engine.model.moe_runtime

    held = [  # per layer: logical expert -> its fp8 w13, w2 and their scales
        {expert: [t.data[slot].clone() for t in layer.expert_tensors()] for slot, expert in enumerate(phy2log.tolist())}
        for layer, phy2log in zip(layers, runtime.placement.phy2log)
    ]
    skewed = torch.ones(len(layers), 16)
    skewed[:, 3], skewed[:, 11] = 1000, 500
    assert engine.rebalance(load=skewed).layers_changed
    for i, layer in enumerate(layers):
        for slot, expert in enumerate(runtime.placement.phy2log[i].tolist()):
            tensors = [t.data[slot] for t in layer.expert_tensors()]
            assert len(tensors) == 4 and all(torch.equal(a, b) for a, b in zip(tensors, held[i][expert]))
    assert [r.output_ids for r in engine.generate([TOKENS], params, progress=False)] == before
