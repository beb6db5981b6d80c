"""ckplan's predictions beside what validation/device/measure_plans.py measured on a GPU.

    python validation/device/compare.py validation/device/results-h200-torch-2.11.json --gpu h200
    python validation/device/compare.py validation/device/results-h200-torch-2.11-expandable.json \
        --expandable

Prints a Markdown table (docs/validation.md, "Measured on a GPU"): per plan the measured
`max_memory_allocated`, ckplan's allocated peak and the error, the same for
`max_memory_reserved`, and the mean step time beside ckplan's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ckplan.hardware.step_time import step_time
from ckplan.inputs.gpus import load_gpu
from ckplan.inputs.presets import load_spec
from ckplan.plan.evaluate import evaluate
from ckplan.plan.strategies import parse_strategy

MODEL = Path(__file__).with_name("llama_like.yaml")
# measure_plans.py's plans as ckplan strategies and keys
PLANS = {
    "none": ("none", {}),
    "full": ("full", {}),
    "selective": ("selective", {}),
    "sac": ("sac", {}),
    "offload": ("offload", {}),
    "lora": ("none", {"training": "lora", "lora_rank": 16}),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results")
    parser.add_argument("--gpu", default="h200")
    parser.add_argument(
        "--expandable",
        action="store_true",
        help="the run set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
    )
    args = parser.parse_args()
    report = json.loads(Path(args.results).read_text(encoding="utf-8"))
    gpu = load_gpu(args.gpu)
    print(
        "| plan | allocated, measured | ckplan | error | reserved, measured | ckplan | error "
        "| step, measured | ckplan | error |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    gib = 2**30
    for measured in report["plans"]:
        strategy, keys = PLANS[measured["plan"]]
        spec = load_spec(str(MODEL), {**keys, "expandable_segments": args.expandable})
        plan = evaluate(spec, parse_strategy(strategy, spec), gpu=gpu)
        seconds = step_time(plan, gpu).step_seconds
        allocated, reserved = measured["max_memory_allocated"], measured["max_memory_reserved"]
        print(
            f"| {measured['plan']} | {allocated / gib:.3f} GiB | {plan.total_bytes / gib:.3f} GiB "
            f"| {plan.total_bytes / allocated - 1:+.1%} | {reserved / gib:.3f} GiB "
            f"| {plan.reserved_bytes / gib:.3f} GiB | {plan.reserved_bytes / reserved - 1:+.1%} "
            f"| {measured['step_seconds'] * 1e3:.1f} ms | {seconds * 1e3:.1f} ms "
            f"| {seconds / measured['step_seconds'] - 1:+.1%} |"
        )


if __name__ == "__main__":
    main()
