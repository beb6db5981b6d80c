"""Start-up: commands that need no NumPy, no optimal schedule, no time model, exports, plots,
profiles or HF configs do not import them (the timings are in `make bench`,
docs/performance.md)."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import sys
from ckplan.cli import main
main({argv!r})
loaded = [name for name in ("numpy", "ckplan.schedules.rotor", "oracles.brute_force",
          "ckplan.render.verify", "ckplan.simple.verify", "ckplan.hardware.step_time",
          "ckplan.exports", "ckplan.render.plot", "ckplan.model.profiles",
          "ckplan.inputs.hf_config", "ckplan.calibrate", "pydantic") if name in sys.modules]
sys.stderr.write("LOADED " + " ".join(loaded) + "\\n")
"""


def _loaded(argv: list[str]) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-c", PROBE.format(argv=argv)], capture_output=True, text=True
    )
    line = [row for row in result.stderr.splitlines() if row.startswith("LOADED")]
    assert line, result.stderr
    return line[0].split()[1:]


@pytest.mark.parametrize(
    "argv",
    [
        ["estimate", "llama3-8b"],
        ["estimate", "llama3-8b", "--json", "--strategy", "uniform:4"],
        ["presets"],
        ["estimate", "gpt2", "--strategy", "revolve:3", "--budget", "80GB"],
    ],
)
def test_no_numpy_and_no_dp_at_start_up(argv):
    assert _loaded(argv) == []


def test_the_dp_loads_numpy_when_it_runs():
    argv = ["estimate", "llama3-8b", "--strategy", "optimal", "--budget", "160GB", "--json"]
    assert "numpy" in _loaded(argv) and "ckplan.schedules.rotor" in _loaded(argv)


def test_the_time_model_loads_no_numpy_on_short_chains():
    """`--gpu` loads the time model; its array path (hardware/stage_table.py) only for chains of
    48 stages or more."""
    assert _loaded(["estimate", "llama3-8b", "--gpu", "h100-sxm", "--strategy", "full"]) == [
        "ckplan.hardware.step_time"
    ]


@pytest.mark.parametrize(
    "argv",
    [
        ["estimate", "llama3-8b", "--json"],
        ["sweep", "gpt2", "--budget", "8GB", "--json"],
        ["check", "gpt2", "--budget", "8GB", "--json"],
        ["schedule", "gpt2", "--strategy", "sqrt", "--json"],
    ],
)
def test_json_needs_no_rich(argv):
    """JSON for a CI job: no Rich console, table or text is imported to print it."""
    probe = (
        "import sys, io, contextlib\n"
        "from ckplan.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    main({argv!r})\n"
        "sys.stderr.write('RICH ' + ' '.join(m for m in sys.modules if m.startswith('rich')))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    line = [row for row in result.stderr.splitlines() if row.startswith("RICH")]
    assert line == ["RICH "], result.stderr[-500:]


def test_options_left_as_they_are_need_no_pydantic():
    """Typer builds a pydantic adapter per option on every run; ckplan/cli/coercion.py builds
    one only for a value that needs it, so a plain run imports no pydantic."""
    from typer import core

    if not getattr(core, "build_runtime_param", None):
        pytest.skip("this Typer coerces without pydantic adapters")
    assert "pydantic" not in _loaded(["estimate", "llama3-8b", "--json", "--seq", "4096"])
    assert "pydantic" not in _loaded(["estimate", "llama3-8b", "--set", "tp=2", "-q"])
