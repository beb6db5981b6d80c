"""Shell completion is on: the script prints, and MODEL completes to presets and files."""

from pathlib import Path

import pytest

from ckplan.cli import complete_model, main

ROOT = Path(__file__).resolve().parent.parent


def test_show_completion_prints_a_script(capsys, monkeypatch):
    # Typer guesses the shell from the parent processes unless told not to; with detection off,
    # `--show-completion` takes the shell by name, so the test holds however pytest was started.
    monkeypatch.setenv("_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION", "1")
    with pytest.raises(SystemExit) as done:  # Typer's completion options exit by themselves
        main(["--show-completion", "bash"])
    out, _ = capsys.readouterr()
    assert done.value.code in (0, None)
    assert "_ckplan_completion" in out and "complete " in out


def test_model_completes_to_presets_then_files(monkeypatch):
    assert complete_model("llama3") == ["llama3-405b", "llama3-70b", "llama3-8b"]
    monkeypatch.chdir(ROOT)
    assert "presets/gpt2.yaml" in complete_model("presets/gpt")
    assert "examples/" in complete_model("exam")
