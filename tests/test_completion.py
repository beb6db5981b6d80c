"""Shell completion is on: the script prints, and MODEL completes to presets and files."""

from pathlib import Path

import pytest
import typer.completion

from ckplan.cli import complete_model, main

ROOT = Path(__file__).resolve().parent.parent


def test_show_completion_prints_a_script(capsys, monkeypatch):
    # Typer guesses the shell from the processes above this one, which fails where pytest runs
    # detached from any shell; the guess is fixed to the shell named here.
    monkeypatch.setattr(typer.completion, "_get_shell_name", lambda: "bash")
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
