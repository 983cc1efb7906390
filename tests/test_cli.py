"""The `moeplex` command line: generate, make-model, plugins, and refusals."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import shutil

import pytest

from moeplex import registry
from moeplex.cli import main
from moeplex.interfaces import API_VERSION


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_json_with_logprobs(tiny_model_dir, capsys):
    folder = tiny_model_dir("deepseek_v3")
    code, out, _ = run(capsys, "generate", "--model", folder, "--prompt", "Hi", "Experts", "--max-new-tokens", "5",
                       "--ignore-eos", "--logprobs", "3", "--json")
    assert code == 0
    lines = [json.loads(line) for line in out.splitlines()]
    assert [r["index"] for r in lines] == [0, 1]
    for r in lines:
        assert len(r["output_ids"]) == 5 and r["finish_reason"] == "length" and isinstance(r["text"], str)
        assert len(r["logprobs"]) == 5 and all(len(step["top_logprobs"]) == 3 for step in r["logprobs"])
        # greedy: the chosen token is the most likely one
        assert all(step["token_id"] == step["top_logprobs"][0][0] for step in r["logprobs"])


def test_generate_without_a_tokenizer_takes_input_ids(tiny_model_dir, tmp_path, capsys):
    folder = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_model_dir("mixtral"), folder)
    os.remove(folder / "tokenizer.json")
    code, out, _ = run(capsys, "generate", "--model", str(folder), "--input-ids", "256,1,2,3", "--max-new-tokens", "4",
                       "--ignore-eos", "--json")
    result = json.loads(out)
    assert code == 0 and len(result["output_ids"]) == 4 and "text" not in result
    code, _, err = run(capsys, "generate", "--model", str(folder), "--prompt", "text", "--max-new-tokens", "4")
    assert code == 2 and "has no tokenizer.json" in err


def test_unknown_plugin_is_one_sentence_naming_the_installed(tiny_model_dir, capsys):
    code, _, err = run(capsys, "generate", "--model", tiny_model_dir("qwen3_moe"), "--input-ids", "1,2",
                       "--dispatcher", "warp-drive")
    assert code == 2
    assert err.strip().startswith("moeplex generate: error: No dispatcher named 'warp-drive' is installed")
    assert "local" in err and len(err.strip().splitlines()) == 1


def test_bad_input_ids_are_refused(tiny_model_dir, capsys):
    code, _, err = run(capsys, "generate", "--model", tiny_model_dir("qwen3_moe"), "--input-ids", "1,two")
    assert code == 2 and "comma-separated integers" in err


def test_plugins_table_names_the_api_version(capsys):
    code, out, _ = run(capsys, "plugins")
    assert code == 0 and out.splitlines()[0] == f"moeplex {md.version('moeplex')}, plugin API_VERSION {API_VERSION}"


def test_plugins_json_lists_every_kind_with_distribution_and_caps(capsys):
    code, out, _ = run(capsys, "plugins", "--json")
    listing = json.loads(out)
    assert code == 0 and set(listing) == {"api", *registry.KINDS}
    assert listing["api"]["api_version"] == API_VERSION and listing["api"]["moeplex"] == md.version("moeplex")
    assert {"dispatcher", "moe_kernel", "balancer", "overlap", "kv_transfer"} <= set(listing)
    local = next(p for p in listing["dispatcher"] if p["name"] == "local")
    assert local["distribution"] == "moeplex" and local["capabilities"]["layout"] == "standard"
    torch_kernel = next(p for p in listing["moe_kernel"] if p["name"] == "torch")
    assert "float32" in torch_kernel["capabilities"]["dtypes"]


def test_make_model_writes_a_loadable_sharded_checkpoint(tmp_path, capsys):
    code, out, _ = run(capsys, "make-model", str(tmp_path / "m"), "--arch", "qwen3_moe", "--seed", "3")
    assert code == 0 and "wrote" in out
    names = set(os.listdir(tmp_path / "m"))
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"} <= names
    with pytest.raises(SystemExit):
        main(["make-model", str(tmp_path / "x"), "--arch", "llama"])


def test_sharded_checkpoints_load(tmp_path):
    from moeplex.config import EngineConfig
    from moeplex.engine import Engine
    from moeplex.models.make_model import write_checkpoint
    from moeplex.sampling import SamplingParams

    whole = write_checkpoint(str(tmp_path / "whole"), "deepseek_v3", seed=5)
    sharded = write_checkpoint(str(tmp_path / "sharded"), "deepseek_v3", seed=5, max_shard_bytes=100_000)
    assert os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    outputs = [
        Engine(EngineConfig(model=f, show_progress=False, max_total_tokens=256)).generate([[256, 5, 6]], params)[0].output_ids
        for f in (whole, sharded)
    ]
    assert outputs[0] == outputs[1]


def test_default_model_is_written_once_into_the_cache(tmp_path, monkeypatch):
    from moeplex.models.make_model import default_model

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = default_model()
    stamp = os.path.getmtime(os.path.join(first, "model.safetensors"))
    assert first.startswith(str(tmp_path)) and default_model() == first
    assert os.path.getmtime(os.path.join(first, "model.safetensors")) == stamp
