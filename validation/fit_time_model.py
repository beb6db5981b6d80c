"""Fit the time model's constants on the calibration split, and report them on the test split
they never saw (docs/validation.md, "The time model's fitted constants").

Two kinds of constant scale the rate a training step's GEMMs and attention kernels sustain
against the kernel benchmarks (MAMF, the attention kernels' published throughput):

- `sustained_fraction`, one per family of GPUs sharing a chip (A100 40/80 GB; the Hopper
  H100/H800/H200), written into the GPU presets;
- the code path's rate (`ckplan.hardware.code_path.KERNEL_RATES`), one per group of values of
  the `kernels` key (`RATE_GROUPS`) other than `fused` (the reference, 1.0): PyTorch's GEMMs
  and attention, eager and torch.compile alike, against Megatron's fused kernels. A group with
  fewer than MIN_RUNS_PER_CONSTANT calibration runs keeps 1.0.

The procedure is a deterministic profile search of the mean |log(predicted step / published
step)| over the calibration runs: starting from every constant at 1.0, ROUNDS rounds in which,
for each family, a golden-section search in [0.5, 1] picks its sustained_fraction, every
candidate fraction scored with the code paths' rates re-fitted to it (for each code path with
enough runs, a golden-section search of its rate in [0.5, 1] on that code path's runs). A code
path's runs scale with the product of their family's fraction and the path's rate, and a plain
coordinate descent, one constant at a time, stalls on that product's kinks. Test runs are
never read by the fit: the split is a field of each run, fixed before any fitting by a hash of
the run's name (docs/validation.md, "The split"). Runs on a GPU outside the families (the RTX
4090's, whose GPU file takes its GEMM and attention rates from one card's published kernel
benchmarks) are reported by `ckplan validate` but not fitted: no family's fraction scales
them, and one card's runs would move the code paths' rates of every family.

    python validation/fit_time_model.py            # fit and report
    python validation/fit_time_model.py --write    # and write them (presets, code_path.py)

With --write it also writes, from the refitted model, the held-out accuracy that `estimate
--gpu` and `plan` quote (ckplan/published/accuracy.py).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

from ckplan.errors import InputError
from ckplan.hardware import code_path as code_path_module
from ckplan.hardware import step_time as step_time_module
from ckplan.inputs.gpus import load_gpu
from ckplan.inputs.runs import run_files
from ckplan.published.accuracy import FAMILIES as GPU_FAMILIES
from ckplan.published.predict import predict, run_spec
from ckplan.published.runs import MEMORY_METRICS, runs_from_file

# The GPU presets of each family, as the accuracy line groups them (one sustained_fraction each).
FAMILIES: dict[str, tuple[str, ...]] = {}
for _preset, _family in GPU_FAMILIES.items():
    FAMILIES[_family] = (*FAMILIES.get(_family, ()), _preset)
PRESETS = Path(__file__).resolve().parents[1] / "presets" / "gpus"
ACCURACY_MODULE = Path(__file__).resolve().parents[1] / "ckplan" / "published" / "accuracy.py"
CODE_PATH_MODULE = Path(code_path_module.__file__)
MIN_RUNS_PER_CONSTANT = 6
ROUNDS = 2


def time_runs(split: str):
    """The split's time runs (scored or not)."""
    for name, data in run_files():
        for run in runs_from_file(data, name):
            if run.split == split and run.published.metric not in MEMORY_METRICS:
                yield run


def family_of(run) -> str | None:
    return GPU_FAMILIES.get(run.gpu)


def of_families(runs) -> list:
    """The runs on a GPU of a family the fit scales (module docstring)."""
    return [run for run in runs if family_of(run) is not None]


def rate_group_of(run) -> str | None:
    """The group of the run's code path (`RATE_GROUPS`; the code path as `predict` builds its
    model: the framework's default, Composer's fused modules, `compile`); None where it cannot
    be built (`predict` does not score it)."""
    try:
        return code_path_module.RATE_GROUPS[run_spec(run).kernels]
    except InputError:
        return None


def set_kernel_rates(rates: dict[str, float]) -> None:
    """Set the code paths' rates and drop the step-time caches that hold times computed with
    the previous ones."""
    code_path_module.KERNEL_RATES.update(rates)
    for module in (code_path_module, step_time_module):
        for value in vars(module).values():
            if hasattr(value, "cache_clear"):
                value.cache_clear()


def loss(runs, fractions: dict[str, float]) -> float:
    """Mean |log(predicted / published step)| of the scored runs, each family's GPUs at its
    sustained_fraction (1 for a family not in `fractions`)."""
    logs = []
    for run in runs:
        fraction = fractions.get(family_of(run), 1.0)
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


def _items(figures: dict) -> list[str]:
    return [f"{json.dumps(name)}: {json.dumps(value)}" for name, value in figures.items()]


def write_accuracy() -> None:
    """Rewrite ACCURACY in ckplan/published/accuracy.py from the test split, predicted afresh
    (a new process reads the presets just written)."""
    import subprocess

    code = (
        "from ckplan.published.suite import accuracy, run_suite; "
        "import json; print(json.dumps(accuracy(run_suite(split='test'))))"
    )
    figures = json.loads(
        subprocess.run(
            [sys.executable, "-c", code], check=True, capture_output=True, text=True
        ).stdout
    )
    text = ACCURACY_MODULE.read_text(encoding="utf-8")
    dictionary = r"^ACCURACY: [^\n{]*\{(?:[^{}]|\{[^{}]*\})*\}"
    # One entry a line; `ruff format` (run below, a dev dependency) splits the long ones.
    entries = "".join(
        f"    {json.dumps(key)}: {{{', '.join(_items(value))}}},\n"
        for key, value in figures.items()
    )
    line = f"ACCURACY: dict[str, dict[str, Any]] = {{\n{entries}}}"
    text = re.sub(dictionary, lambda _: line, text, count=1, flags=re.M)
    ACCURACY_MODULE.write_text(text, encoding="utf-8")
    subprocess.run([sys.executable, "-m", "ruff", "format", "-q", str(ACCURACY_MODULE)], check=True)


def fit(calibration) -> tuple[dict[str, float], dict[str, float], dict[str, int]]:
    """(sustained_fraction per family, rate per code path, calibration runs per code path) by
    the profile search of the module docstring, over the runs of the families."""
    calibration = of_families(calibration)
    by_family = {f: [r for r in calibration if r.gpu in p] for f, p in FAMILIES.items()}
    by_path: dict[str, list] = {}
    for run in calibration:
        group = rate_group_of(run)
        if group is not None:
            by_path.setdefault(group, []).append(run)
    fitted_paths = [
        k for k in sorted(by_path) if k != "fused" and len(by_path[k]) >= MIN_RUNS_PER_CONSTANT
    ]
    fractions = {family: 1.0 for family, runs in by_family.items() if runs}
    rates = {kernels: 1.0 for kernels in code_path_module.KERNEL_RATES}
    set_kernel_rates(rates)

    def fit_rates(candidate: dict[str, float]) -> dict[str, float]:
        # Each calibration run has one code path, so the rates are fitted one by one.
        fitted = dict(rates)
        for kernels in fitted_paths:

            def path_loss(x: float, k: str = kernels) -> float:
                set_kernel_rates({k: x})
                return loss(by_path[k], candidate)

            fitted[kernels] = golden_section(path_loss, 0.5, 1.0)
            set_kernel_rates(fitted)
        return fitted

    def profile_loss(family: str, x: float) -> float:
        # A code path's runs scale with the product of their family's fraction and the path's
        # rate: the rates are re-fitted at each candidate fraction, so the search moves along
        # that product instead of stalling where the mean |log error| has a kink.
        candidate = {**fractions, family: x}
        fit_rates(candidate)
        return loss(calibration, candidate)

    for _ in range(ROUNDS):
        for family in fractions:
            fractions[family] = golden_section(lambda x, f=family: profile_loss(f, x), 0.5, 1.0)
        rates = fit_rates(fractions)
    counts = {kernels: len(by_path.get(kernels, ())) for kernels in rates}
    return fractions, rates, counts


def write_rates(rates: dict[str, float], counts: dict[str, int]) -> None:
    text = CODE_PATH_MODULE.read_text(encoding="utf-8")
    runs = ", ".join(f"{k} {n}" for k, n in counts.items())
    values = ", ".join(f"{k!r}: {v}" for k, v in rates.items()).replace("'", '"')
    lines = f"# calibration runs: {runs}\nKERNEL_RATES: dict[str, float] = {{{values}}}\n"
    pattern = re.compile(r"^# calibration runs: .*\nKERNEL_RATES: .*\n", re.M)
    CODE_PATH_MODULE.write_text(pattern.sub(lambda _: lines, text, count=1), encoding="utf-8")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write the fitted values")
    args = parser.parse_args()
    calibration = of_families(run for run in time_runs("calibration") if predict(run).scored)
    presets = {family: load_gpu(names[0]).sustained_fraction for family, names in FAMILIES.items()}
    before = loss(calibration, presets)
    fractions, rates, counts = fit(calibration)
    after = loss(calibration, fractions)
    for family, presets in FAMILIES.items():
        runs = [run for run in calibration if run.gpu in presets]
        if family not in fractions:
            print(f"{family}: no calibration runs; sustained_fraction stays 1")
            continue
        print(f"{family}: sustained_fraction {fractions[family]} on {len(runs)} calibration runs")
        if args.write:
            for preset in presets:
                write(preset, fractions[family], len(runs))
    for kernels, rate in rates.items():
        why = "reference" if kernels == "fused" else (
            "fitted" if counts[kernels] >= MIN_RUNS_PER_CONSTANT
            else f"fewer than {MIN_RUNS_PER_CONSTANT} runs, kept"
        )  # fmt: skip
        print(f"kernels {kernels}: rate {rate} on {counts[kernels]} calibration runs ({why})")
    print(f"calibration mean |log error|: {before:.4f} with the committed constants -> {after:.4f}")
    if args.write:
        write_rates(rates, counts)
        write_accuracy()
        print(f"wrote the rates to {CODE_PATH_MODULE.name}, the held-out accuracy to "
              f"{ACCURACY_MODULE.name}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
