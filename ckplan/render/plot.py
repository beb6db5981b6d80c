"""Plots (`--plot FILE.png|svg`): a sweep's memory against recompute overhead, and a plan's
memory timeline. matplotlib is the optional extra `ckplan[plot]`, imported only here and only
when a plot is asked for, with the Agg backend (no display needed). SVG text stays text
(`svg.fonttype: none`), so the labels can be searched and read in the file.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ckplan.errors import InputError
from ckplan.inputs.paths import check_output, write_atomic
from ckplan.plan import Plan
from ckplan.plan.search import SweepResult
from ckplan.plan.timeline import Timeline
from ckplan.quoting import quote
from ckplan.units import format_bytes_auto

FORMATS = (".png", ".svg")
GIB = 2**30
MISSING = "--plot needs matplotlib, the optional extra: pip install 'ckplan[plot]'"


class PlotError(InputError):
    """A plot that cannot be made: matplotlib missing, or an unsupported file name."""


def _budget_line(axes, budget_bytes: int, label: str) -> None:
    """A budget as a dashed horizontal line at its GiB, `label` above its right end."""
    axes.axhline(budget_bytes / GIB, color="#c0392b", linestyle="--", linewidth=1.2)
    axes.annotate(
        label,
        xy=(1.0, budget_bytes / GIB),
        xycoords=("axes fraction", "data"),
        xytext=(-4, 4),
        textcoords="offset points",
        ha="right",
        color="#c0392b",
        fontsize=9,
    )


def check_plot(path: str) -> Path:
    """Fail before any work (nothing written) when the plot cannot be made."""
    if Path(path).suffix.lower() not in FORMATS:
        raise PlotError(f"--plot {quote(path)}: expected a .png or .svg file name")
    target = check_output(path, "--plot")
    if importlib.util.find_spec("matplotlib") is None:
        raise PlotError(MISSING)
    return target


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams["svg.fonttype"] = "none"
    import matplotlib.pyplot as plt

    return plt


def _save(figure, path: Path) -> None:
    figure.tight_layout()
    kind = Path(path).suffix.lower().removeprefix(".")
    write_atomic(path, "--plot", lambda temporary: figure.savefig(temporary, dpi=120, format=kind))


def sweep_plot(result: SweepResult, budget_text: str, path: str) -> None:
    """Total memory per GPU against recompute overhead for every plan: the ones that fit, the
    Pareto frontier, the usable budget (budget less reserve) and the chosen plan, labelled."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(9, 5.5))
    usable = result.usable_bytes

    def point(candidate):
        return 100 * candidate.plan.overhead, candidate.plan.total_bytes / GIB

    fits = [point(c) for c in result.candidates if c.fits]
    over = [point(c) for c in result.candidates if not c.fits]
    if over:
        axes.scatter(*zip(*over, strict=True), s=12, color="#c9c9c9", label="does not fit")
    if fits:
        axes.scatter(*zip(*fits, strict=True), s=12, color="#7fbf7f", label="fits")
    frontier = sorted(point(c) for c in result.pareto)
    axes.plot(
        *zip(*frontier, strict=True),
        drawstyle="steps-post",
        color="#1f5fa8",
        marker="o",
        markersize=4,
        label="Pareto frontier",
    )
    _budget_line(
        axes,
        usable,
        f"usable budget {format_bytes_auto(usable)} ({budget_text} less "
        f"{format_bytes_auto(result.reserve_bytes)} reserve)",
    )
    chosen = result.best or result.smallest_written
    x, y = point(chosen)
    what = "best" if result.best else "nothing fits; smallest"
    axes.scatter([x], [y], s=140, marker="*", color="#d35400", zorder=5, label=what)
    axes.annotate(
        f"{what}: {chosen.plan.strategy}\n{format_bytes_auto(chosen.plan.total_bytes)}, "
        f"overhead {chosen.plan.overhead:.2%}",
        xy=(x, y),
        xytext=(12, 12),
        textcoords="offset points",
        fontsize=9,
        arrowprops={"arrowstyle": "-", "color": "#d35400"},
    )
    spec = result.spec
    axes.set_title(
        f"{spec.name}: {len(result.candidates)} plans, {len(fits)} fit "
        f"(budget {budget_text} per GPU)"
    )
    axes.set_xlabel("recompute overhead (% of forward + backward FLOPs)")
    axes.set_ylabel("total memory per GPU (GiB)")
    axes.grid(alpha=0.3)
    axes.legend(loc="upper right", bbox_to_anchor=(1.0, 0.92), fontsize=8)
    _save(figure, Path(path))
    plt.close(figure)


def timeline_plot(
    plan: Plan, timeline: Timeline, path: str, activation_budget: int | None = None
) -> None:
    """Live activation bytes through the replayed step, the peak marked."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(10, 5))
    steps = range(1, len(timeline.during_bytes) + 1)
    during = [b / GIB for b in timeline.during_bytes]
    after = [b / GIB for b in timeline.after_bytes]
    axes.step(steps, during, where="mid", color="#1f5fa8", label="live while the step runs")
    axes.step(steps, after, where="mid", color="#7fa7d8", linewidth=0.8, label="after the step")
    first_backward = next(
        (i for i, label in enumerate(timeline.labels, 1) if label.startswith("backward")),
        None,
    )
    if first_backward is not None:
        axes.axvspan(first_backward - 0.5, len(during) + 0.5, color="#f2f2f2", zorder=0)
        axes.text(
            first_backward,
            0,
            " backward pass",
            va="bottom",
            fontsize=8,
            color="#666666",
        )
    if timeline.waiting_bytes:
        axes.axhline(
            timeline.waiting_bytes / GIB,
            color="#999999",
            linestyle=":",
            label="held by the other micro-batches in flight",
        )
    if activation_budget is not None and activation_budget > 0:
        _budget_line(
            axes, activation_budget, f"activation budget {format_bytes_auto(activation_budget)}"
        )
    index = timeline.peak_step
    peak_x = index + 1 if index >= 0 else 0.5
    peak_label = timeline.labels[index] if index >= 0 else "initial state"
    axes.scatter([peak_x], [timeline.peak_bytes / GIB], s=80, color="#d35400", zorder=5)
    axes.annotate(
        f"peak {format_bytes_auto(timeline.peak_bytes)}\nstep {peak_x}: {peak_label}",
        xy=(peak_x, timeline.peak_bytes / GIB),
        xytext=(10, -28),
        textcoords="offset points",
        fontsize=9,
        color="#d35400",
    )
    spec = plan.spec
    axes.set_title(f"{spec.name}, plan {plan.strategy}: activation memory through one step")
    axes.set_xlabel(f"step of the schedule ({len(during)} steps)")
    axes.set_ylabel("live activations (GiB)")
    highest = max([*during, (activation_budget or 0) / GIB])
    axes.set_ylim(bottom=0, top=highest / 0.85)
    axes.grid(alpha=0.3)
    axes.legend(loc="upper left", fontsize=8)
    _save(figure, Path(path))
    plt.close(figure)
