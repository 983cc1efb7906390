"""A newcomer's mistakes: every refusal of the `moeplex` command is one sentence on stderr, a non-zero
exit and no traceback, whatever the command and whatever is wrong (flag, model folder, file)."""

from __future__ import annotations

import json
import os
import shutil
import socket

import pytest

from moeplex.cli import main


def refusal(capsys, *argv, code: int = 2) -> str:
    """Run the command; it must exit with `code` and say why in one line on stderr. That line is returned."""
    try:
        got = main(list(argv))
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped main() as a traceback")
    _, err = capsys.readouterr()
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("moeplex ") and not line.startswith("moeplex: ")]
    assert got == code and len(lines) == 1, err
    return lines[0]


@pytest.fixture
def copy_of(tiny_model_dir, tmp_path):
    """A writable copy of a tiny model folder, to break."""

    def copy(arch: str = "qwen3_moe") -> str:
        folder = tmp_path / f"{arch}-copy"
        shutil.copytree(tiny_model_dir(arch), folder)
        return str(folder)

    return copy


def write_config(folder: str, edit) -> None:
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    with open(path, "w") as f:
        f.write(edit(config))


def test_generate_refuses_a_prompt_longer_than_the_context(tiny_model_dir, capsys):
    # the tiny qwen3_moe has 4096 positions; serve answers this with a 400 from the same check
    ids = ",".join(["5"] * 5000)
    line = refusal(capsys, "generate", "--model", tiny_model_dir("qwen3_moe"), "--input-ids", ids, "--max-new-tokens", "4")
    assert "context is 4096 tokens" in line and "5000 in the prompt" in line


def test_a_model_folder_that_does_not_exist_says_so(tmp_path, capsys):
    line = refusal(capsys, "generate", "--model", str(tmp_path / "nope"), "--prompt", "hi")
    assert "does not exist" in line and "tokenizer" not in line


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda c: json.dumps({k: v for k, v in c.items() if k != "hidden_size"}), ["lacks 'hidden_size'"]),
        (lambda c: json.dumps({**c, "num_hidden_layers": "two"}), ["'num_hidden_layers'", "must be an integer"]),
        (lambda c: json.dumps({**c, "hidden_size": None}), ["'hidden_size' as null"]),
        (lambda c: json.dumps([c]), ["must hold a JSON object", "list"]),
        (lambda c: json.dumps(c)[:-20], ["not a JSON config.json file", "line 1"]),
    ],
    ids=["missing-key", "wrong-type", "null", "not-an-object", "broken-json"],
)
def test_a_bad_config_json_is_one_sentence_naming_the_file(copy_of, capsys, edit, words):
    folder = copy_of()
    write_config(folder, edit)
    line = refusal(capsys, "generate", "--model", folder, "--input-ids", "1,2", "--max-new-tokens", "1")
    assert os.path.join(folder, "config.json") in line
    assert all(w in line for w in words), line


def test_a_truncated_checkpoint_names_the_file_and_the_tensor(copy_of, capsys):
    folder = copy_of()
    path = os.path.join(folder, "model.safetensors")
    os.truncate(path, os.path.getsize(path) - 4096)  # the header is intact, the data is short
    line = refusal(capsys, "generate", "--model", folder, "--input-ids", "1,2", "--max-new-tokens", "1")
    assert path in line and "truncated: tensor model." in line


def test_a_checkpoint_with_a_broken_header_names_the_file(copy_of, capsys):
    folder = copy_of()
    path = os.path.join(folder, "model.safetensors")
    os.truncate(path, 50)
    line = refusal(capsys, "generate", "--model", folder, "--input-ids", "1,2", "--max-new-tokens", "1")
    assert path in line and "not a readable safetensors file" in line


def test_device_cuda_without_a_gpu_says_there_is_no_gpu(tiny_model_dir, monkeypatch, capsys):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    line = refusal(capsys, "generate", "--model", tiny_model_dir("qwen3_moe"), "--input-ids", "1,2", "--device", "cuda")
    assert "no GPU" in line and "triton" not in line


def test_ctrl_c_during_generate_exits_130_with_one_line(tiny_model_dir, monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("moeplex.cli.generate.generate", interrupted)
    line = refusal(capsys, "generate", "--model", tiny_model_dir("qwen3_moe"), "--input-ids", "1,2", code=130)
    assert line == "moeplex generate: interrupted"


def test_make_model_refuses_a_bad_set_value_before_writing(tmp_path, capsys):
    out = tmp_path / "m"
    line = refusal(capsys, "make-model", str(out), "--arch", "qwen3_moe", "--set", "num_hidden_layers=abc")
    assert "--set" in line and "'num_hidden_layers'" in line and "integer" in line
    assert not out.exists()


def test_make_model_refuses_an_output_path_that_is_a_file(tmp_path, capsys):
    out = tmp_path / "a-file"
    out.write_text("")
    line = refusal(capsys, "make-model", str(out), "--arch", "qwen3_moe")
    assert str(out) in line and "is a file" in line


def test_make_model_refuses_weights_for_a_full_size_preset(tmp_path, capsys):
    line = refusal(capsys, "make-model", str(tmp_path / "big"), "--arch", "qwen3_moe", "--preset", "30b-a3b")
    assert "--config-only" in line and not (tmp_path / "big").exists()


def test_eplb_plan_refuses_a_file_without_load_counts(tmp_path, capsys):
    load = tmp_path / "load.json"
    load.write_text(json.dumps({"counts": [[1, 2]]}))
    line = refusal(capsys, "eplb", "plan", "--load", str(load), "--num-physical-experts", "4", "--num-gpus", "2",
                   "--out", str(tmp_path / "plan.json"))
    assert "has no logical_count" in line


def test_serve_on_a_taken_port_refuses_before_loading_the_model(tiny_model_dir, monkeypatch, capsys):
    monkeypatch.setattr("moeplex.cli.serve.serve", lambda *a, **k: pytest.fail("the model was loaded"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = refusal(capsys, "serve", "--model", tiny_model_dir("qwen3_moe"), "--port", str(port))
    assert f"127.0.0.1:{port}" in line and "already in use" in line


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--tp-size", "3"], ["intermediate size", "3 ranks"]),
        (["--tp-size", "3", "--ep-size", "3", "--dispatcher", "naive"], ["8 physical slots", "3 EP ranks"]),
        (["--tp-size", "2", "--ep-size", "2"], ["--ep-size is 2"]),
    ],
    ids=["intermediate-over-tp", "experts-over-ep", "one-rank-dispatcher"],
)
def test_an_impossible_layout_is_refused_before_any_rank_starts(tiny_model_dir, monkeypatch, capsys, flags, words):
    monkeypatch.setattr("moeplex.ranks.offline.launch", lambda *a, **k: pytest.fail("rank processes were started"))
    line = refusal(capsys, "generate", "--model", tiny_model_dir("qwen3_moe"), "--input-ids", "1,2", *flags)
    assert all(w in line for w in words), line


def test_generate_on_the_embedded_default_says_once_that_its_text_is_meaningless(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert main(["generate", "--prompt", "Hi", "--max-new-tokens", "2"]) == 0
    out, err = capsys.readouterr()
    assert err.count("random weights") == 1 and "meaningless" in err and "random" not in out
    assert main(["generate", "--model", os.path.join(tmp_path, "moeplex", "models", "deepseek_v3-tiny-seed0"),
                 "--prompt", "Hi", "--max-new-tokens", "2"]) == 0
    assert "random weights" not in capsys.readouterr().err  # a model the user chose gets no such note


@pytest.mark.parametrize("name", ["tokenizer.json", "generation_config.json"])
def test_a_broken_json_file_of_the_model_is_named(copy_of, capsys, name):
    folder = copy_of()
    with open(os.path.join(folder, name), "w") as f:
        f.write('{"broken": ')
    line = refusal(capsys, "generate", "--model", folder, "--input-ids", "1,2", "--max-new-tokens", "1")
    assert os.path.join(folder, name) in line


def test_serve_refuses_an_impossible_layout_before_any_rank_starts(tiny_model_dir, monkeypatch, capsys):
    monkeypatch.setattr("moeplex.cli.serve.serve", lambda *a, **k: pytest.fail("rank processes were started"))
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    line = refusal(capsys, "serve", "--model", tiny_model_dir("qwen3_moe"), "--port", str(port), "--tp-size", "3")
    assert "intermediate size" in line


def test_a_checked_config_travels_to_other_processes_as_it_is(tiny_model_dir):
    import pickle

    from moeplex.models.base import read_config

    config = read_config(tiny_model_dir("qwen3_moe"))
    copy = pickle.loads(pickle.dumps(config))
    assert copy == config and copy.path == config.path and copy["hidden_size"] == config["hidden_size"]
    assert json.loads(json.dumps(copy)) == dict(config)


@pytest.mark.parametrize("breakage", ["truncated-checkpoint", "config-missing-key"])
def test_serve_refuses_a_bad_model_folder_before_any_rank_starts(copy_of, monkeypatch, capsys, breakage):
    # a rank that fails at start-up used to leave serve waiting; the launching process now reads what it can first
    monkeypatch.setattr("moeplex.cli.serve.serve", lambda *a, **k: pytest.fail("rank processes were started"))
    folder = copy_of()
    if breakage == "truncated-checkpoint":
        path = os.path.join(folder, "model.safetensors")
        os.truncate(path, os.path.getsize(path) - 4096)
    else:
        write_config(folder, lambda c: json.dumps({k: v for k, v in c.items() if k != "num_hidden_layers"}))
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    line = refusal(capsys, "serve", "--model", folder, "--port", str(port))
    assert ("truncated: tensor" in line) if breakage == "truncated-checkpoint" else ("lacks 'num_hidden_layers'" in line)
