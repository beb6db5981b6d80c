"""Fit the time model's one fitted constant per GPU family on the calibration split, and report
it on the test split it never saw (docs/validation.md, "The time model's fitted constants").

The constant is `sustained_fraction`: the share of the kernel benchmarks (MAMF, the attention
kernels' published throughput) that a training step's GEMMs and attention kernels sustain. One
value per family of GPUs sharing a chip (A100 40/80 GB; the Hopper H100/H800/H200), fitted by
golden-section search to minimise the mean |log(predicted step / published step)| of that
family's calibration runs. Test runs are never read by the fit: the split is a field of each
run, fixed before any fitting by a hash of the run's name (validation/runs/README.md).

    python validation/fit_time_model.py            # fit and report
    python validation/fit_time_model.py --write    # and write the fitted values into the presets

With --write it also writes, from the refitted model, the held-out accuracy that `estimate
--gpu` and `plan` quote (ckplan/published/accuracy.py).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

from ckplan.inputs.gpus import load_gpu
from ckplan.inputs.runs import run_files
from ckplan.published.accuracy import FAMILIES as GPU_FAMILIES
from ckplan.published.predict import predict
from ckplan.published.runs import MEMORY_METRICS, runs_from_file

# The GPU presets of each family, as the accuracy line groups them (one fitted constant each).
FAMILIES: dict[str, tuple[str, ...]] = {}
for _preset, _family in GPU_FAMILIES.items():
    FAMILIES[_family] = (*FAMILIES.get(_family, ()), _preset)
PRESETS = Path(__file__).resolve().parents[1] / "presets" / "gpus"
ACCURACY_MODULE = Path(__file__).resolve().parents[1] / "ckplan" / "published" / "accuracy.py"


def time_runs(split: str):
    for name, data in run_files():
        for run in runs_from_file(data, name):
            if run.split == split and run.published.metric not in MEMORY_METRICS:
                yield run


def loss(runs, fraction: float) -> float:
    logs = []
    for run in runs:
        gpu = load_gpu(run.gpu, {**run.gpu_settings, "sustained_fraction": fraction})
        prediction = predict(run, gpu)
        if prediction.scored:
            logs.append(abs(math.log(1 + prediction.error)))
    return sum(logs) / len(logs)


def golden_section(f, low: float, high: float, tolerance: float = 1e-3) -> float:
    ratio = (math.sqrt(5) - 1) / 2
    a, b = low, high
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = f(c), f(d)
    while b - a > tolerance:
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = f(d)
    return round((a + b) / 2, 3)


def write(preset: str, fraction: float, runs: int) -> None:
    path = PRESETS / f"{preset}.yaml"
    text = path.read_text(encoding="utf-8")
    line = (
        f"# fitted by validation/fit_time_model.py on {runs} calibration runs of its family "
        f"(docs/validation.md)\nsustained_fraction: {fraction}\n"
    )
    pattern = re.compile(r"^# fitted by validation/fit_time_model\.py.*\nsustained_fraction: .*\n",
                         re.M)  # fmt: skip
    text = pattern.sub(line, text) if pattern.search(text) else text.rstrip("\n") + "\n" + line
    path.write_text(text, encoding="utf-8")


def write_accuracy() -> None:
    """Rewrite ACCURACY in ckplan/published/accuracy.py from the test split, predicted afresh
    (a new process reads the presets just written)."""
    import subprocess

    code = (
        "from ckplan.published.suite import accuracy, run_suite; "
        "print(repr(accuracy(run_suite(split='test'))))"
    )
    figures = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout.strip()
    text = ACCURACY_MODULE.read_text(encoding="utf-8")
    dictionary = r"^ACCURACY: [^\n]*\{(?:[^{}]|\{[^{}]*\})*\}"
    line = f"ACCURACY: dict[str, dict[str, float]] = {figures}"
    text = re.sub(dictionary, lambda _: line, text, count=1, flags=re.M)
    ACCURACY_MODULE.write_text(text, encoding="utf-8")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write the fitted values")
    args = parser.parse_args()
    calibration = list(time_runs("calibration"))
    for family, presets in FAMILIES.items():
        runs = [run for run in calibration if run.gpu in presets]
        if not runs:
            print(f"{family}: no calibration runs; sustained_fraction stays 1")
            continue
        before = loss(runs, 1.0)
        fraction = golden_section(lambda x, runs=runs: loss(runs, x), 0.5, 1.0)
        after = loss(runs, fraction)
        print(
            f"{family}: sustained_fraction {fraction} on {len(runs)} calibration runs; "
            f"mean |log error| {before:.3f} at 1.0 -> {after:.3f}"
        )
        if args.write:
            for preset in presets:
                write(preset, fraction, len(runs))
    if args.write:
        write_accuracy()
        print(f"wrote the held-out accuracy to {ACCURACY_MODULE.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
