"""Progress bars where people wait: loading, random or dummy weights, generation. On stderr for a person
at a terminal; never in logs or pipes, and off with --json (the run's show_progress)."""

from __future__ import annotations

import pytest

from moeplex.cli import main


@pytest.fixture
def terminal(monkeypatch):
    monkeypatch.setattr("moeplex.progress.stderr_is_tty", lambda: True)


def stderr_of(capsys, *argv) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().err


def test_no_bar_when_stderr_is_not_a_terminal(tiny_model_dir, capsys):
    err = stderr_of(capsys, "generate", "--model", tiny_model_dir("qwen3_moe"), "--input-ids", "1,2", "--max-new-tokens", "2")
    assert "loading weights" not in err and "generating" not in err and "%|" not in err


def test_loading_and_generation_show_bars_at_a_terminal(tiny_model_dir, terminal, capsys):
    err = stderr_of(capsys, "generate", "--model", tiny_model_dir("qwen3_moe"), "--input-ids", "1,2", "--max-new-tokens", "3",
                    "--ignore-eos")
    assert "loading weights" in err and "generating" in err and "/3 [" in err  # tokens, not requests


def test_dummy_weights_show_a_bar(tiny_model_dir, terminal, capsys):
    err = stderr_of(capsys, "generate", "--model", tiny_model_dir("qwen3_moe"), "--load-format", "dummy",
                    "--input-ids", "1,2", "--max-new-tokens", "1")
    assert "making dummy weights" in err


def test_make_model_shows_a_bar(tmp_path, terminal, capsys):
    err = stderr_of(capsys, "make-model", str(tmp_path / "m"), "--arch", "qwen3_moe")
    assert "making random weights" in err


def test_json_output_draws_no_bar(tiny_model_dir, terminal, capsys):
    err = stderr_of(capsys, "generate", "--model", tiny_model_dir("qwen3_moe"), "--input-ids", "1,2", "--max-new-tokens", "2",
                    "--json")
    assert "%|" not in err
