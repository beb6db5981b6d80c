"""How close the time model came on published runs it was not fitted to, by GPU family and
framework: the line `estimate --gpu` and `plan` print under a step time.

ACCURACY is written by `validation/fit_time_model.py --write` from the test split of the public
runs (validation/runs/), and tests/test_published.py holds it equal to what the suite computes,
so that the quoted figure is never older than the model. Reading it costs no prediction at
start-up.
"""

from __future__ import annotations

from typing import Any

# written by validation/fit_time_model.py --write; do not edit by hand
ACCURACY: dict[str, dict[str, Any]] = {
    "A100": {"runs": 13, "mean_abs_error": 0.0767},
    "A100/deepspeed": {"runs": 2, "mean_abs_error": 0.0567, "published_with": "deepspeed"},
    "A100/hf": {"runs": 2, "mean_abs_error": 0.1479, "published_with": "hf"},
    "A100/megatron": {
        "runs": 9,
        "mean_abs_error": 0.0654,
        "published_with": "megatron, megatron-deepspeed",
    },
    "H100": {"runs": 30, "mean_abs_error": 0.1133},
    "H100/hf": {"runs": 5, "mean_abs_error": 0.2216, "published_with": "composer"},
    "H100/megatron": {"runs": 10, "mean_abs_error": 0.1154, "published_with": "megatron, nemo"},
    "H100/torchtitan": {
        "runs": 15,
        "mean_abs_error": 0.0759,
        "published_with": "in-house, torchtitan",
    },
    "rtx-4090": {"runs": 3, "mean_abs_error": 0.0433},
    "rtx-4090/hf": {"runs": 3, "mean_abs_error": 0.0433, "published_with": "hf"},
}
# Fewer held-out runs than this for a framework on a family: quote the whole family instead.
FEWEST_RUNS = 3
FAMILIES = {
    "a100-40gb": "A100",
    "a100-80gb": "A100",
    "h100-sxm": "H100",
    "h100-pcie": "H100",
    "h800": "H100",
    "h200": "H100",
}


# How far ckplan's reserved peak fell below the reserved peaks of published LoRA and QLoRA
# fine-tunes under FSDP1, |predicted / published - 1| at the least and the most (Answer.AI's
# fsdp_qlora benchmarks on two 24 GB GPUs, validation/runs/memory-answerai-fsdp-qlora.yaml):
# their allocated peaks are ckplan's within 2 %, but the caching allocator's fragmentation
# around recomputed eager layers, FSDP1's unshard-stream pool and what the start-up leaves
# cached are not modelled (docs/fine-tuning.md). tests/test_published.py holds these figures
# equal to what the suite gives.
FSDP1_FINETUNE_RESERVED = {"runs": 15, "least": 0.08, "most": 0.36}


def reserved_note(
    framework: str, training: str, zero: int, dp: int, expandable: bool, fsdp_version: int = 1
) -> str:
    """A caveat beside a reserved peak ckplan is known to place low (`FSDP1_FINETUNE_RESERVED`):
    a fine-tune sharded by FSDP1 (`fsdp_version` 1) under `hf` with PyTorch's default
    allocator; else ""."""
    if framework != "hf" or training == "full" or zero < 3 or dp < 2 or expandable:
        return ""
    if fsdp_version != 1:
        return ""
    figures = FSDP1_FINETUNE_RESERVED
    return (
        f"; {figures['least']:.0%}-{figures['most']:.0%} below the measured peak on "
        f"{figures['runs']} published FSDP1 fine-tunes (docs/fine-tuning.md)"
    )


def family_of(gpu_name: str) -> str | None:
    return FAMILIES.get(gpu_name)


def accuracy_note(gpu_name: str, framework: str) -> str:
    """One line: the mean |step error| on held-out published runs nearest this GPU and framework."""
    # a GPU of no fitted family is quoted on its own runs (the RTX 4090's), where it has some
    family = family_of(gpu_name) or (gpu_name if gpu_name in ACCURACY else None)
    if family is None:
        return (
            f"no published training runs on {gpu_name} are checked yet: the step time is the "
            "model's alone (ckplan validate)"
        )
    for key, what in (
        (f"{family}/{framework}", f"{family} GPUs with {framework}"),
        (family, f"{family} GPUs"),
    ):
        figures = ACCURACY.get(key)
        if figures and figures["runs"] >= FEWEST_RUNS:
            # the publishers' frameworks where they are not the one modelled (llm-foundry's
            # Composer runs FSDP as `hf` does)
            publishers = figures.get("published_with", framework)
            if publishers != framework:
                what += f" (published with {publishers})"
            runs, error = int(figures["runs"]), figures["mean_abs_error"]
            return (
                f"on {runs} held-out published runs on {what}, predicted steps were within "
                f"{error:.0%} on average (ckplan validate --split test)"
            )
    return f"too few held-out published runs on {family} GPUs to quote an error (ckplan validate)"


__all__ = [
    "ACCURACY",
    "FAMILIES",
    "FSDP1_FINETUNE_RESERVED",
    "accuracy_note",
    "family_of",
    "reserved_note",
]
