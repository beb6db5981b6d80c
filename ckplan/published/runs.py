"""A published training run as a record: the model, its layout, how it was trained, and the
figure its publisher reported.

The suite ships with ckplan (validation/runs/*.yaml, installed as `ckplan.run_data`); each file
is one publication with its source, each run its full configuration and every assumption made
where the source is silent. `run_from_mapping` checks a run the way `spec_from_mapping` checks
a model: one-line `RunError`s naming the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ckplan.errors import InputError
from ckplan.model.flops import FLOP_CONVENTIONS
from ckplan.quoting import quote


class RunError(InputError):
    """An invalid published run; the message is one line and names the key."""


# What a publisher reports, and whether a larger value means a faster step.
TIME_METRICS = {
    "step_seconds": "seconds per iteration",
    "tokens_per_second_per_gpu": "tokens per second per GPU",
    "tflops_per_gpu": "TFLOP/s per GPU, in the publisher's FLOP convention",
    "mfu": "model FLOPs utilisation, in the publisher's FLOP convention and peak",
    "samples_per_second": "sequences per second, the whole job",
}
MEMORY_METRICS = {
    "memory_allocated_bytes": "torch.cuda.max_memory_allocated",
    "memory_reserved_bytes": "torch.cuda.max_memory_reserved",
    "memory_active_bytes": "the allocator's active bytes",
    "nvidia_smi_bytes": "memory in use as nvidia-smi shows it",
}
METRICS = {**TIME_METRICS, **MEMORY_METRICS}
SPLITS = ("calibration", "test")
RECOMPUTE = {
    "none": "none",
    "full": "full",
    "selective": "selective",
}
LAYOUT_KEYS = (
    "tp",
    "pp",
    "cp",
    "dp",
    "sp",
    "virtual_stages",
    "microbatch_group_size",
    "pipeline_schedule",
    "ep",
    "etp",
    "zero",
    "first_stage_layers",
    "last_stage_layers",
    "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
    "pipeline_layout",
)


@dataclass(frozen=True)
class Published:
    """The figure as published: its metric, its value, and how the publisher counts FLOPs."""

    metric: str
    value: float
    flop_convention: str = ""  # the publisher's own words
    convention: str | None = None  # ckplan's name for it (model.flops.FLOP_CONVENTIONS)
    peak_flops: float | None = None  # the peak an MFU is relative to, when not the GPU's


@dataclass(frozen=True)
class PublishedRun:
    name: str
    source: str
    where: str
    gpu: str
    gpus: int
    framework: str
    model: str | Mapping[str, Any]
    seq: int
    micro_batch: int
    global_batch: int
    layout: Mapping[str, Any]
    recompute: str
    published: Published
    split: str
    precision: str = "bf16"
    attention_kernel: str = ""
    compile: bool = False
    framework_version: str = ""
    url: str = ""
    settings: Mapping[str, Any] = field(default_factory=dict)  # other model keys the run sets
    gpu_settings: Mapping[str, Any] = field(default_factory=dict)  # GPU keys that differ
    # how it was trained beyond the layout (training, lora, weight_format, optimizer, loss,
    # offload, distribute_checkpoints), as published; ckplan scores a run only where it models these
    training: Mapping[str, Any] = field(default_factory=dict)
    assumptions: tuple[str, ...] = ()
    file: str = ""

    @property
    def is_memory(self) -> bool:
        return self.published.metric in MEMORY_METRICS


TRAINING_KEYS = (
    "training",
    "lora",
    "weight_format",
    "optimizer",
    "loss",
    "offload",
    "distribute_checkpoints",
)
_RUN_KEYS = {
    "name",
    "where",
    "gpu",
    "gpus",
    "framework",
    "framework_version",
    "model",
    "seq",
    "micro_batch",
    "global_batch",
    "layout",
    "recompute",
    "precision",
    "attention_kernel",
    "compile",
    "published",
    "assumptions",
    "split",
    "settings",
    "gpu_settings",
    *TRAINING_KEYS,  # fine-tuning and memory runs: recorded, modelled where ckplan has the key
}


def runs_from_file(data: Any, origin: str) -> list[PublishedRun]:
    """The runs of one publication's file (a mapping with source, url and runs)."""
    if not isinstance(data, Mapping):
        raise RunError(f"{origin}: expected a mapping with source, url and runs")
    source = _text(data, "source", origin)
    url = str(data.get("url", ""))
    runs = data.get("runs")
    if not isinstance(runs, list) or not runs:
        raise RunError(f"{origin}: key 'runs' expects a list of runs")
    return [
        run_from_mapping(run, f"{origin}: runs[{i}]", source, url, file=origin)
        for i, run in enumerate(runs)
    ]


def run_from_mapping(
    mapping: Any, origin: str, source: str = "", url: str = "", file: str = ""
) -> PublishedRun:
    if not isinstance(mapping, Mapping):
        raise RunError(f"{origin}: expected a mapping")
    unknown = [key for key in mapping if key not in _RUN_KEYS]
    if unknown:
        raise RunError(f"{origin}: unknown key {quote(unknown[0])}")
    name = _text(mapping, "name", origin)
    where = f"{origin} ({name})"
    model = mapping.get("model")
    if not isinstance(model, str | Mapping):
        raise RunError(f"{where}: key 'model' expects a preset name or a mapping of model keys")
    layout = mapping.get("layout", {})
    if not isinstance(layout, Mapping) or any(key not in LAYOUT_KEYS for key in layout):
        raise RunError(f"{where}: key 'layout' expects a mapping of {', '.join(LAYOUT_KEYS)}")
    recompute = str(mapping.get("recompute", "none"))
    published = _published(mapping.get("published"), where)
    split = mapping.get("split")
    if split not in SPLITS:
        raise RunError(f"{where}: key 'split' expects calibration or test, got {quote(split)}")
    settings = mapping.get("settings", {})
    gpu_settings = mapping.get("gpu_settings", {})
    if not isinstance(settings, Mapping) or not isinstance(gpu_settings, Mapping):
        raise RunError(f"{where}: keys 'settings', 'gpu_settings' expect mappings of keys")
    return PublishedRun(
        name=name,
        source=source,
        where=str(mapping.get("where", "")),
        gpu=_text(mapping, "gpu", where),
        gpus=_positive(mapping, "gpus", where),
        framework=_text(mapping, "framework", where),
        framework_version=str(mapping.get("framework_version", "")),
        model=model,
        seq=_positive(mapping, "seq", where),
        micro_batch=_positive(mapping, "micro_batch", where),
        global_batch=_positive(mapping, "global_batch", where),
        layout=dict(layout),
        recompute=recompute,
        published=published,
        split=split,
        precision=str(mapping.get("precision", "bf16")),
        attention_kernel=str(mapping.get("attention_kernel", "") or ""),
        compile=bool(mapping.get("compile", False)),
        url=url,
        settings=dict(settings),
        gpu_settings=dict(gpu_settings),
        training={key: mapping[key] for key in TRAINING_KEYS if key in mapping},
        assumptions=tuple(str(item) for item in mapping.get("assumptions", ()) or ()),
        file=file,
    )


def _published(value: Any, where: str) -> Published:
    if not isinstance(value, Mapping):
        raise RunError(f"{where}: key 'published' expects metric, value and flop_convention")
    metric = value.get("metric")
    if metric not in METRICS:
        raise RunError(
            f"{where}: key 'published.metric' expects one of {', '.join(METRICS)}, "
            f"got {quote(metric)}"
        )
    number = value.get("value")
    if isinstance(number, bool) or not isinstance(number, int | float) or not number > 0:
        raise RunError(f"{where}: key 'published.value' expects a positive number")
    convention = value.get("convention")
    if convention is not None and convention not in FLOP_CONVENTIONS:
        raise RunError(
            f"{where}: key 'published.convention' expects one of "
            f"{', '.join(FLOP_CONVENTIONS)}, got {quote(convention)}"
        )
    if metric in ("tflops_per_gpu", "mfu") and convention is None:
        raise RunError(f"{where}: a {metric} figure needs published.convention")
    peak = value.get("peak_flops")
    if peak is not None and (isinstance(peak, bool) or not isinstance(peak, int | float)):
        raise RunError(f"{where}: key 'published.peak_flops' expects a number")
    return Published(
        metric=metric,
        value=float(number),
        flop_convention=str(value.get("flop_convention", "")),
        convention=convention,
        peak_flops=None if peak is None else float(peak),
    )


def _text(mapping: Mapping, key: str, where: str) -> str:
    value = mapping.get(key)
    if not isinstance(value, str) or not value.strip():
        raise RunError(f"{where}: key {key!r} expects a non-empty string")
    return value


def _positive(mapping: Mapping, key: str, where: str) -> int:
    value = mapping.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RunError(f"{where}: key {key!r} expects a positive integer, got {quote(value)}")
    return value
