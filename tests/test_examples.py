"""The CI recipe in examples/: its models are valid and fit, and the very `ckplan check` command
the workflow runs (from the examples folder, where `models/` lives) prints a Markdown table."""

import shlex
from pathlib import Path

import yaml

from ckplan.cli import main

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def workflow():
    return yaml.safe_load((EXAMPLES / "github-actions" / "ckplan-capacity.yml").read_text())


def test_workflow_shape():
    data = workflow()
    trigger = data.get("on", data.get(True))  # YAML 1.1 reads a bare `on` as true
    assert "pull_request" in trigger
    assert data["permissions"]["pull-requests"] == "write"
    steps = data["jobs"]["capacity"]["steps"]
    runs = " ".join(step.get("run", "") for step in steps)
    assert (
        "--format markdown" in runs
        and "gh pr comment" in runs
        and "--body-file capacity.md" in runs
    )
    # installed from the repository, not a package index
    assert 'pip install "$CKPLAN_SOURCE"' in runs and data["env"]["CKPLAN_SOURCE"].startswith(
        "git+"
    )


def test_the_trigger_matches_the_files_checked():
    """The pull-request path filter names exactly the files the check command reads."""
    data = workflow()
    paths = data.get("on", data.get(True))["pull_request"]["paths"]
    steps = data["jobs"]["capacity"]["steps"]
    script = next(step["run"] for step in steps if "ckplan check" in step.get("run", ""))
    line = next(line for line in script.splitlines() if line.strip().startswith("ckplan check"))
    pattern = shlex.split(line)[2]
    assert pattern in paths


def test_the_workflows_check_command(capsys, monkeypatch):
    steps = workflow()["jobs"]["capacity"]["steps"]
    script = next(step["run"] for step in steps if "ckplan check" in step.get("run", ""))
    line = next(line for line in script.splitlines() if line.strip().startswith("ckplan check"))
    argv = shlex.split(line.split(">")[0])[1:]
    monkeypatch.chdir(EXAMPLES)
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    rows = [row for row in out.splitlines() if row.startswith("| models/")]
    assert len(rows) == 2 and all(" | yes | " in row for row in rows)
    assert "2 of 2 fit." in out
