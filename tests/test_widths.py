"""Tables at any width: never wider than the console, never a cell cut with an ellipsis, the
names and numbers of the columns kept whole; COLUMNS sets the width when piped."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from ckplan.cli import main, output

BOX = set("┏┃┡│└┗┓┩┫┛╇━─┬┴┼╋┳┻┌┐┘├┤")
COMMANDS = [
    ["estimate", "llama3-8b"],
    ["estimate", "llama3-8b", "--gpu", "h100-sxm", "--strategy", "selective"],
    ["sweep", "llama3-8b", "--budget", "40GB"],
    ["sweep", "llama3-8b", "--budget", "40GB", "--gpu", "h100-sxm"],
    ["check", "presets/megatron-22b.yaml", "presets/megatron-175b.yaml", "--budget", "80GB"],
    ["check", "presets/megatron-22b.yaml", "--budget", "80GB"],
    ["check", "presets/megatron-22b.yaml", "--budget", "80GB", "--gpu", "a100-80gb"],
    ["schedule", "gpt2", "--strategy", "sqrt"],
    ["plan", "llama3-8b", "--gpus", "8", "--gpu", "h100-sxm", "--global-batch", "16"],
    ["presets"],
    ["gpus"],
    ["validate", "--only", "korthikanti"],
]


def _run(capsys, monkeypatch, argv: list[str], width: int) -> str:
    monkeypatch.setattr(output.stdout, "width", width)
    main(argv)
    return capsys.readouterr().out


def _table_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line and line[0] in BOX]


def _cells(text: str) -> set[str]:
    """Every cell's text of every table row (stripped)."""
    cells = set()
    for line in _table_lines(text):
        cells |= {cell.strip() for cell in re.split(r"[│┃]", line) if cell.strip()}
    return cells


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda argv: " ".join(argv[:3]))
@pytest.mark.parametrize("width", [60, 80])
def test_tables_fit_without_cutting(capsys, monkeypatch, argv, width):
    text = _run(capsys, monkeypatch, argv, width)
    assert "…" not in text
    too_wide = [line for line in _table_lines(text) if len(line) > width]
    assert not too_wide, too_wide[:3]
    # a table cropped at the edge loses its right border (Rich crops what it cannot fold)
    cropped = [line for line in _table_lines(text) if line.rstrip()[-1] not in BOX]
    assert not cropped, cropped[:3]


@pytest.mark.parametrize(
    ("argv", "column"),
    [
        (["sweep", "llama3-8b", "--budget", "40GB", "--gpu", "h100-sxm"], 0),
        (
            [
                "check",
                "presets/megatron-22b.yaml",
                "presets/megatron-175b.yaml",
                "--budget",
                "80GB",
            ],
            0,
        ),
    ],
)
def test_names_stay_whole(capsys, monkeypatch, argv, column):
    """The first column (strategies, model paths) at 80 columns holds what it holds at 200."""
    wide = _run(capsys, monkeypatch, argv, 200)
    narrow = _run(capsys, monkeypatch, argv, 80)

    def first_cells(text):
        return [
            re.split(r"[│┃]", line)[1].strip()
            for line in _table_lines(text)
            if line[0] in "│┃" and len(re.split(r"[│┃]", line)) > 2
        ]

    names = {name for name in first_cells(wide) if name}
    assert names and names <= set(first_cells(narrow))


def test_a_dropped_column_is_said(capsys, monkeypatch):
    text = _run(capsys, monkeypatch, ["sweep", "llama3-8b", "--budget", "40GB", "--gpu",
                                      "h100-sxm"], 80)  # fmt: skip
    assert "left out to fit 80 columns" in text
    assert "left out" not in _run(
        capsys, monkeypatch, ["sweep", "llama3-8b", "--budget", "40GB"], 200
    )


@pytest.mark.parametrize(("columns", "width"), [("80", 80), ("200", 200), ("", 140), ("x", 140)])
def test_columns_sets_the_piped_width(columns, width):
    environ = (
        {**os.environ, "COLUMNS": columns}
        if columns
        else {key: value for key, value in os.environ.items() if key != "COLUMNS"}
    )
    code = "from ckplan.cli import output; print(output.stdout.width)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=environ, check=True
    )
    assert int(result.stdout) == width


def test_json_does_not_change_with_width(capsys, monkeypatch):
    argv = ["sweep", "llama3-8b", "--budget", "40GB", "--json"]
    assert _run(capsys, monkeypatch, argv, 60) == _run(capsys, monkeypatch, argv, 200)
