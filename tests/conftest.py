import pytest

from ckplan.inputs.presets import load_spec


@pytest.fixture(autouse=True)
def _no_terminal_width_from_the_shell(monkeypatch):
    """A developer's COLUMNS must not change what a test sees; tests that want a width set it."""
    monkeypatch.delenv("COLUMNS", raising=False)


@pytest.fixture
def spec_of():
    """Load a preset with overrides: spec_of("gpt2", seq=512)."""

    def load(name, **overrides):
        return load_spec(name, overrides)

    return load


@pytest.fixture
def cli(capsys):
    """Run the command line in-process: cli("estimate", "gpt2") -> (exit code, stdout, stderr)."""
    from ckplan.cli import main

    def run(*argv):
        code = main(list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    return run
