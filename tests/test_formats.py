"""`--format table|json|csv|markdown`: the CSV holds the JSON's exact figures, the Markdown is a
well-formed table, `--json` is an alias, and the writers take any columns; the progress bar
stays off the output."""

import csv
import io
import json

import pytest

from ckplan.plan import evaluate, parse_strategy
from ckplan.render import progress as progress_module
from ckplan.render.row_models import plan_columns
from ckplan.render.rows import Column, RowTable, to_csv, to_markdown


def markdown_rows(text):
    lines = [line for line in text.splitlines() if line.startswith("|")]
    cells = [[c.strip() for c in line.strip("|").split(" | ")] for line in lines]
    assert len({len(row) for row in cells}) == 1  # every row as wide as the header
    assert all(set(c) <= set(":-") for c in cells[1])  # the alignment row
    return cells[0], cells[2:]


SWEEP = ["sweep", "gpt2", "--budget", "7GB", "--batch", "8"]


def test_sweep_csv_holds_the_json_figures(cli):
    _, out, _ = cli(*SWEEP, "--json")
    data = json.loads(out)
    code, out, err = cli(*SWEEP, "--format", "csv")
    assert code == 0 and err == ""
    rows = list(csv.DictReader(io.StringIO(out)))
    assert [r["strategy"] for r in rows] == [p["strategy"] for p in data["pareto"]]
    for row, plan in zip(rows, data["pareto"], strict=True):
        assert int(row["total_bytes"]) == plan["memory"]["total_bytes"]
        assert int(row["activation_bytes"]) == plan["memory"]["activation_bytes"]
        assert int(row["recompute_flops"]) == plan["flops"]["recompute"]
        assert float(row["overhead"]) == plan["overhead"]
        assert row["fits"] == ("true" if plan["fits"] else "false")
        assert row["best"] == ("true" if plan["strategy"] == data["best"]["strategy"] else "false")
    code, out, _ = cli(*SWEEP, "--format", "csv", "--all")
    assert len(list(csv.DictReader(io.StringIO(out)))) == len(data["plans"])


def test_sweep_markdown_marks_the_best(cli):
    code, out, _ = cli(*SWEEP, "--format", "markdown")
    assert code == 0
    header, rows = markdown_rows(out)
    assert header[0] == "plan" and "of usable budget" in header
    best = [row for row in rows if row[-1] == "**best**"]
    assert len(best) == 1 and best[0][0] == "sqrt"
    assert "Best plan that fits: sqrt" in out


def test_check_markdown_for_a_pr_comment(cli):
    argv = ["check", "presets/megatron-22b.yaml", "llama3-70b", "--budget", "80GB"]
    code, out, _ = cli(*argv, "--format", "markdown")
    assert code == 1
    header, rows = markdown_rows(out)
    assert header[:3] == ["model", "fits", "plan"]
    assert [row[1] for row in rows] == ["yes", "no"]
    assert "model states alone" in rows[1][-1]
    assert "1 of 2 fit." in out and out.startswith("**Capacity check**")
    code, out, _ = cli(*argv, "-f", "csv")
    parsed = list(csv.DictReader(io.StringIO(out)))
    assert [r["fits"] for r in parsed] == ["true", "false"]
    assert int(parsed[1]["headroom_bytes"]) < 0


def test_estimate_formats(cli, spec_of):
    spec = spec_of("llama3-8b")
    plan = evaluate(spec, parse_strategy("selective", spec))
    code, out, _ = cli("estimate", "llama3-8b", "-s", "selective", "-f", "csv")
    assert code == 0
    (row,) = csv.DictReader(io.StringIO(out))
    assert int(row["activation_bytes"]) == plan.activation_bytes
    assert int(row["per_layer_activation_bytes"]) == plan.per_layer_activation_bytes
    assert "fits" not in row  # no budget given
    code, out, _ = cli("estimate", "llama3-8b", "-f", "markdown", "--budget", "80GB")
    assert code == 1  # 8B unsharded needs more than 80 GB
    header, rows = markdown_rows(out)
    assert "fits" in header and rows[0][header.index("fits")] == "no"


def test_json_alias_and_bad_formats(cli):
    assert cli(*SWEEP, "--json")[1] == cli(*SWEEP, "--format", "json")[1]
    code, out, err = cli(*SWEEP, "--format", "xml")
    assert code == 2 and out == "" and "--format 'xml'" in err
    code, out, err = cli(*SWEEP, "--format", "csv", "--json")
    assert code == 2 and out == "" and "disagree" in err


def test_writers_take_any_columns(spec_of):
    """A view that grows (time columns, the plan command's layouts) adds Columns; the writers
    are unchanged."""
    spec = spec_of("gpt2")
    plans = [evaluate(spec, parse_strategy(n, spec)) for n in ("none", "uniform:3")]
    seconds = Column("step_seconds", "step", lambda p: 1.25, lambda p: "1.25 s")
    table = RowTable([*plan_columns(lambda p: p), seconds], plans, title="t", notes=["n"])
    rows = list(csv.DictReader(io.StringIO(to_csv(table))))
    assert [r["step_seconds"] for r in rows] == ["1.25", "1.25"]
    assert [int(r["total_bytes"]) for r in rows] == [p.total_bytes for p in plans]
    header, body = markdown_rows(to_markdown(table))
    assert header[-1] == "step" and body[1][-1] == "1.25 s"
    pipe = RowTable([Column("a", "a|b", lambda r: r, lambda r: "x|y")], [1])
    assert markdown_rows(to_markdown(pipe))[1] == [["x\\|y"]]


def test_progress_is_off_the_output(cli, monkeypatch):
    """Not a terminal (as under pytest and in CI): no bar, stderr stays empty."""
    code, _, err = cli("check", "presets/*.yaml", "--budget", "80GB", "-f", "csv")
    assert code == 1 and err == ""
    bar = progress_module.Progress("x", enabled=False)
    bar(1, 2)
    assert bar._bar is None
    monkeypatch.setattr(progress_module, "DELAY", 3600.0)
    bar = progress_module.Progress("x", enabled=True)
    bar(1, 2)
    assert bar._bar is None  # under a second of work: nothing drawn
    monkeypatch.setattr(progress_module, "DELAY", 0.0)
    bar = progress_module.Progress("x", enabled=True)
    bar(1, 2)
    assert bar._bar is not None
    bar.close()
    assert bar._bar is None


@pytest.mark.parametrize("command", [["sweep", "gpt2", "--budget", "7GB"], ["check", "gpt2"]])
def test_quiet_is_accepted(cli, command):
    argv = [*command, "--quiet"] if command[0] == "sweep" else [*command, "-b", "7GB", "-q"]
    assert cli(*argv)[0] in (0, 1)
