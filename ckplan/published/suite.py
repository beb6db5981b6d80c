"""The whole public-runs suite: every run read, predicted, and summarised; and the accuracy
figures `estimate` and `plan` quote beside a step time."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ckplan.inputs.runs import run_files
from ckplan.published.accuracy import FAMILIES
from ckplan.published.predict import Prediction, predict, summarise
from ckplan.published.runs import MEMORY_METRICS, PublishedRun, runs_from_file


def suite_runs() -> list[PublishedRun]:
    runs = []
    for name, data in run_files():
        runs += runs_from_file(data, name)
    return runs


def selected(runs: Iterable[PublishedRun], only: str | None, split: str | None):
    """Runs whose name, file, GPU or framework contains `only` (case-insensitive), of `split`."""
    text = (only or "").lower()
    for run in runs:
        fields = (run.name, run.file, run.gpu, run.framework, run.source)
        if text and not any(text in field.lower() for field in fields):
            continue
        if split and run.split != split:
            continue
        yield run


def run_suite(only: str | None = None, split: str | None = None) -> list[Prediction]:
    return [predict(run) for run in selected(suite_runs(), only, split)]


def accuracy(predictions: list[Prediction], split: str = "test") -> dict[str, Any]:
    """Mean |step error| and run count per GPU family, and per family and framework, over the
    scored time runs of `split` (the held-out test split by default: runs the fitted constants
    never saw): what `estimate` and `plan` quote."""
    groups: dict[str, list[float]] = {}
    published: dict[str, set[str]] = {}  # the publishers' frameworks behind a framework key
    for prediction in predictions:
        run = prediction.run
        if not prediction.scored or run.published.metric in MEMORY_METRICS or run.split != split:
            continue
        family = FAMILIES.get(run.gpu, run.gpu)
        for key in (family, f"{family}/{prediction.spec.framework}"):
            groups.setdefault(key, []).append(abs(prediction.error))
        publisher = "in-house" if run.framework == "other" else run.framework  # Meta's, ...
        published.setdefault(f"{family}/{prediction.spec.framework}", set()).add(publisher)
    figures: dict[str, Any] = {}
    for key, errors in sorted(groups.items()):
        figures[key] = {"runs": len(errors), "mean_abs_error": round(sum(errors) / len(errors), 4)}
        if key in published:
            figures[key]["published_with"] = ", ".join(sorted(published[key]))
    return figures


__all__ = ["accuracy", "run_suite", "selected", "suite_runs", "summarise"]
