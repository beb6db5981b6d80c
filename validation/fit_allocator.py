"""Fit the allocator slack (ckplan/model/allocator.py) on the GPU measurements, and report it on
the published reserved peaks it never saw (docs/memory.md, docs/validation.md).

The calibration set is every plan that validation/device/measure_plans.py ran on an H200 (none,
full, selective, sac, offload, LoRA; torch 2.11), once with PyTorch's default allocator and once
with expandable segments: twelve steps whose `max_memory_reserved` and `max_memory_allocated`
were both measured. The slack of a step is (reserved - loss cache) / allocated - 1, reserved and
allocated measured, so ckplan's own allocated error does not enter the fit; the loss cache is
what ckplan adds apart from the slack, the segments the model's eager loss (the fp32 upcast and
`F.cross_entropy`, measure_plans.py) leaves idle at its backward's peak with the default
allocator (ckplan.model.allocator `eager_loss_cached_bytes`, 2·b·s·V bytes: 500 MiB here) and
the bf16 logits' idle block with expandable segments (`expandable_eager_loss_idle_bytes`, the
same 500 MiB), as ckplan adds them (ckplan.model.loss `loss_cached_bytes`). The estimator,
chosen before fitting, is the median over the six plans of each allocator mode: the offload
plan's pinned copies make one outlier, and a median is not pulled by it. The published runs
that report a reserved peak (validation/runs/) are the test set: the fit never reads them.

    python validation/fit_allocator.py             # fit, the residuals, the published errors
    python validation/fit_allocator.py --check     # exit 1 when allocator.py's constants differ
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

DEVICE = Path(__file__).resolve().parent / "device"
# Each allocator mode's measurement (docs/validation.md, "Measured on a GPU").
MEASUREMENTS = {
    False: DEVICE / "results-h200-torch-2.11.json",
    True: DEVICE / "results-h200-torch-2.11-expandable.json",
}


def loss_cache_bytes(report: dict, expandable_segments: bool) -> int:
    """The loss's idle segments (default allocator) or idle block (expandable segments) in one
    measurement file's steps: measure_plans.py's model ends in bf16 logits upcast to fp32 and
    `F.cross_entropy` (no shifted copy), b·s·V logits."""
    from ckplan.model.allocator import eager_loss_cached_bytes, expandable_eager_loss_idle_bytes

    shape = report["shape"]
    logits = shape["batch"] * shape["seq"] * shape["vocab"]
    if expandable_segments:
        return expandable_eager_loss_idle_bytes(logits, 2)
    return eager_loss_cached_bytes(logits, 2)


def measured_slacks(path: Path, expandable_segments: bool = False) -> dict[str, float]:
    """(reserved - loss cache) / allocated - 1 of every plan in one measurement file."""
    report = json.loads(path.read_text(encoding="utf-8"))
    cache = loss_cache_bytes(report, expandable_segments)
    return {
        plan["plan"]: (plan["max_memory_reserved"] - cache) / plan["max_memory_allocated"] - 1
        for plan in report["plans"]
    }


def fitted_slack(expandable_segments: bool) -> float:
    """The median slack of the calibration plans of one allocator mode, to 4 decimals."""
    slacks = measured_slacks(MEASUREMENTS[expandable_segments], expandable_segments)
    return round(statistics.median(slacks.values()), 4)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with allocator.py")
    args = parser.parse_args()
    from ckplan.model import allocator

    status = 0
    for expandable, constant in (
        (False, allocator.ALLOCATOR_SLACK),
        (True, allocator.EXPANDABLE_SLACK),
    ):
        slack = fitted_slack(expandable)
        mode = "expandable segments" if expandable else "default allocator"
        print(f"{mode}: fitted slack {slack:.4f} (allocator.py has {constant:.4f})")
        for plan, measured in measured_slacks(MEASUREMENTS[expandable], expandable).items():
            print(f"  {plan:10s} measured {measured:+.4f}  residual {measured - slack:+.4f}")
        if slack != constant:
            status = 1
    if args.check:
        return status
    from ckplan.inputs.runs import run_files
    from ckplan.published.predict import predict
    from ckplan.published.runs import runs_from_file

    print("\npublished reserved peaks (never read by the fit):")
    errors = []
    for name, data in run_files():
        for run in runs_from_file(data, name):
            if run.published.metric != "memory_reserved_bytes":
                continue
            prediction = predict(run)
            if prediction.error is None:
                continue
            errors.append(prediction.error)
            print(f"  {run.name:72s} {run.split:12s} {prediction.error:+.1%}")
    if errors:
        mean_abs = sum(abs(error) for error in errors) / len(errors)
        mean = statistics.mean(errors)
        print(f"  {len(errors)} runs: mean |error| {mean_abs:.1%}, mean {mean:+.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
