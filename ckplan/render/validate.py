"""The validate view: each published run, its published figure and ckplan's, and the error per
split, GPU and framework."""

from __future__ import annotations

from typing import Any

from ckplan import __version__

# `predictions` are ckplan.published.predict.Prediction (the CLI passes them; not imported here
# so that the JSON path needs no more than this module).


def _figure(metric: str, value: float | None) -> str:
    if value is None:
        return ""
    if metric == "mfu":
        return f"{value:.1%}"
    if metric.endswith("_bytes"):
        return f"{value / 2**30:.2f} GiB"
    if metric == "step_seconds":
        return f"{value:.3g} s"
    return f"{value:,.4g}"


def run_dict(prediction: Any) -> dict[str, Any]:
    run = prediction.run
    return {
        "name": run.name,
        "source": f"{run.source}; {run.where}" if run.where else run.source,
        "file": run.file,
        "gpu": run.gpu,
        "gpus": run.gpus,
        "framework": run.framework,
        "metric": run.published.metric,
        "convention": run.published.convention,
        "published": run.published.value,
        "predicted": prediction.predicted,
        "error": prediction.error,
        "published_mfu": prediction.published_mfu,
        "predicted_mfu": prediction.predicted_mfu,
        "mfu_points": prediction.mfu_points,
        "fits": prediction.fits,
        "split": run.split,
        "status": prediction.status,
        "assumptions": list(run.assumptions),
    }


def validate_dict(predictions: list[Any], summary: dict[str, Any]) -> dict[str, Any]:
    return {
        "ckplan_version": __version__,
        "runs": [run_dict(prediction) for prediction in predictions],
        "summary": summary,
    }


def validate_view(predictions: list[Any], summary: dict[str, Any]):
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    from ckplan.render.fit import declare

    runs = Table(title="Published runs: the published figure beside ckplan's", title_justify="left")
    declare(runs, "MFU pts", "split", "framework", "GPUs", "metric")
    for column, justify in (
        ("run", "left"),
        ("GPUs", "right"),
        ("framework", "left"),
        ("split", "left"),
        ("metric", "left"),
        ("published", "right"),
        ("ckplan", "right"),
        ("step error", "right"),
        ("MFU pts", "right"),
    ):
        runs.add_column(column, justify=justify, overflow="fold")
    for prediction in predictions:
        run = prediction.run
        if not prediction.scored:
            runs.add_row(run.name, f"{run.gpus:,} {run.gpu}", run.framework, run.split,
                         run.published.metric, _figure(run.published.metric, run.published.value),
                         Text(prediction.status, style="yellow"), "", "")  # fmt: skip
            continue
        error = prediction.error
        style = "green" if abs(error) <= 0.10 else "yellow" if abs(error) <= 0.25 else "red"
        points = prediction.mfu_points
        runs.add_row(
            run.name,
            f"{run.gpus:,} {run.gpu}",
            run.framework,
            run.split,
            run.published.metric.replace("_", " "),
            _figure(run.published.metric, run.published.value),
            _figure(run.published.metric, prediction.predicted),
            Text(f"{error:+.1%}", style=style),
            "" if points is None else f"{points:+.1f}",
        )
    return Group(runs, _summary_table(summary), Text(_explanation(summary)))


def _summary_table(summary: dict[str, Any]):
    from rich.table import Table

    table = Table(title="Step-time error (predicted / published - 1)", title_justify="left")
    for column in ("group", "runs", "mean |error|", "max |error|", "mean error", "mean |MFU| pts"):
        table.add_column(column, justify="left" if column == "group" else "right")
    time = summary["time"]
    rows = [("all", time["all"])]
    for kind in ("split", "gpu", "framework"):
        rows += [(f"{kind} {name}", stats) for name, stats in time.get(kind, {}).items()]
    for name, stats in rows:
        if not stats.get("runs"):
            continue
        points = stats.get("mean_abs_mfu_points")
        table.add_row(
            name,
            str(stats["runs"]),
            f"{stats['mean_abs_error']:.1%}",
            f"{stats['max_abs_error']:.1%}",
            f"{stats['mean_error']:+.1%}",
            "" if points is None else f"{points:.1f}",
        )
    memory = summary["memory"]["all"]
    if memory.get("runs"):
        table.add_row(
            "peak memory",
            str(memory["runs"]),
            f"{memory['mean_abs_error']:.1%}",
            f"{memory['max_abs_error']:.1%}",
            f"{memory['mean_error']:+.1%}",
            "",
        )
    return table


def _explanation(summary: dict[str, Any]) -> str:
    skipped = summary.get("not_scored", 0)
    text = (
        "A throughput, TFLOP/s or MFU figure is compared as the step time it implies, in the "
        "publisher's own FLOP convention; positive errors are ckplan slower. The time model's "
        "fitted constants (a sustained fraction per GPU family, a rate for PyTorch's kernels "
        "against Megatron's fused ones) were fitted on the calibration split only "
        "(docs/validation.md)."
    )
    if skipped:
        text += f" {skipped} runs not scored: their status says why."
    return text


__all__ = ["run_dict", "validate_dict", "validate_view"]
