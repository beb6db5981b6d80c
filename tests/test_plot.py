"""`--plot`: valid PNG and SVG files that show the chosen plan, the budget and the peak; the
memory timeline peaks at the plan's activation bytes; a one-line error without matplotlib.

The drawing tests need matplotlib (the `plot` extra). Without it they are skipped, visibly;
with CKPLAN_REQUIRE_PLOT=1 (CI sets it) a missing matplotlib fails them instead.
"""

import importlib.util
import json
import os
import xml.etree.ElementTree as ET

import pytest

from ckplan.plan import evaluate, parse_strategy
from ckplan.plan.timeline import memory_timeline
from ckplan.units import format_bytes_auto

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def matplotlib():
    if os.environ.get("CKPLAN_REQUIRE_PLOT") == "1":
        import matplotlib  # fails the test when the extra is missing

        return matplotlib
    return pytest.importorskip("matplotlib", reason="the plot extra (matplotlib) is missing")


def svg_text(path):
    root = ET.parse(path).getroot()  # parses: well-formed XML
    assert root.tag.endswith("svg")
    return " ".join(" ".join(node.itertext()) for node in root.iter() if node.tag.endswith("text"))


SWEEP = ["sweep", "llama3-70b", "--budget", "80GB", "--set", "tp=8", "--set", "pp=4"]
SWEEP += ["--set", "sp=true", "--set", "microbatches=16"]


def test_sweep_svg_shows_budget_frontier_and_best(matplotlib, cli, tmp_path):
    path = tmp_path / "sweep.svg"
    code, out, _ = cli(*SWEEP, "--plot", str(path), "--json")
    assert code == 0
    best = json.loads(out)["best"]
    text = svg_text(path)
    assert f"best: {best['strategy']}" in text
    assert "usable budget 72.51 GiB (80GB less 2.00 GiB reserve)" in text
    assert "Pareto frontier" in text
    assert format_bytes_auto(best["memory"]["total_bytes"]) in text


def test_sweep_png_when_nothing_fits(matplotlib, cli, tmp_path):
    path = tmp_path / "sweep.png"
    code, _, _ = cli("sweep", "llama3-70b", "--budget", "80GB", "--plot", str(path))
    assert code == 1  # does not fit, and the plot is still drawn
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000
    svg = tmp_path / "sweep.svg"
    cli("sweep", "llama3-70b", "--budget", "80GB", "--plot", str(svg))
    assert "nothing fits; smallest: " in svg_text(svg)


def test_estimate_timeline_marks_the_peak(matplotlib, cli, tmp_path, spec_of):
    path = tmp_path / "timeline.svg"
    argv = ["estimate", "llama3-8b", "--strategy", "uniform:4", "--budget", "80GB"]
    code, _, _ = cli(*argv, "--set", "zero=1", "--set", "dp=8", "--plot", str(path))
    assert code == 0
    spec = spec_of("llama3-8b", zero=1, dp=8)
    plan = evaluate(spec, parse_strategy("uniform:4", spec))
    text = svg_text(path)
    assert f"peak {format_bytes_auto(plan.activation_bytes)}" in text
    assert "activation budget" in text and "uniform:4" in text
    png = tmp_path / "timeline.png"
    assert cli("estimate", "gpt2", "--plot", str(png))[0] == 0
    assert png.read_bytes().startswith(PNG_SIGNATURE)


def test_bad_plot_names_write_nothing(cli, tmp_path):
    for name in ("plot.pdf", "missing/plot.png"):
        path = tmp_path / name
        code, out, err = cli("estimate", "gpt2", "--plot", str(path))
        assert code == 2 and out == "" and err.count("\n") == 1 and "--plot" in err
        assert not path.exists()


def test_without_matplotlib_one_line_naming_the_extra(cli, tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name)
    )
    path = tmp_path / "sweep.png"
    code, out, err = cli("sweep", "gpt2", "--budget", "40GB", "--plot", str(path))
    assert code == 2 and out == "" and not path.exists()
    assert err.count("\n") == 1 and "pip install 'ckplan[plot]'" in err


@pytest.mark.parametrize("layout", [{}, {"pp": 4, "microbatches": 8}, {"pp": 2, "tp": 2}])
@pytest.mark.parametrize(
    "name", ["none", "selective", "uniform:3", "sequential:2", "block:2", "revolve:2"]
)
def test_timeline_peak_is_the_plans_activation_bytes(spec_of, layout, name):
    spec = spec_of("gpt2", **layout)
    plan = evaluate(spec, parse_strategy(name, spec))
    timeline = memory_timeline(plan)
    assert timeline.peak_bytes == plan.activation_bytes
    assert len(timeline.labels) == len(plan.steps)
    assert timeline.labels[0].startswith("forward") and timeline.labels[-1].startswith("backward")
    assert timeline.during_bytes[timeline.peak_step] == plan.activation_bytes
