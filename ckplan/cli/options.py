"""The options that commands share, as annotated types (`model: ModelArg`), and the shell
completion of MODEL. Typer reads them from each command's signature."""

from __future__ import annotations

import glob
from pathlib import Path
from typing import Annotated

import typer

from ckplan.inputs.presets import preset_names


def complete_model(incomplete: str) -> list[str]:
    """Shell completion of MODEL: preset names, then .yaml/.yml/.json files and folders."""
    names = [name for name in preset_names() if name.startswith(incomplete)]
    for path in sorted(glob.glob(incomplete + "*")):
        if Path(path).is_dir():
            names.append(path + "/")
        elif path.endswith((".yaml", ".yml", ".json")):
            names.append(path)
    return names


ModelArg = Annotated[
    str,
    typer.Argument(
        help="Preset name, a .yaml file, or a HF config.json.", autocompletion=complete_model
    ),
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        help="Override any model key: --set key=value (repeatable); a GPU key with the gpu. "
        "prefix: --set gpu.matmul_efficiency=0.7.",
    ),
]
# For commands that take no GPU (calibrate, export): the same option without the gpu. keys.
ModelSetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", help="Override any model key: --set key=value (repeatable)."),
]
MfuConventionOpt = Annotated[
    str,
    typer.Option(
        "--mfu-convention",
        help="The FLOP count MFU divides: full (Korthikanti et al. App. A, Megatron-LM; the "
        "default), causal (attention halved), recompute (recomputed layers counted), 6n "
        "(6 x non-embedding parameters, PaLM / torchtitan) or 6n-all (all parameters, "
        "llm-foundry).",
    ),
]
GpuOpt = Annotated[
    str | None,
    typer.Option(
        "--gpu",
        help="GPU preset (see `ckplan gpus`) or .yaml file: sets the budget (unless --budget) "
        "and adds step time, MFU and the time overhead.",
    ),
]


SeqOpt = Annotated[int | None, typer.Option("--seq", help="Shortcut for --set seq=N.")]
BatchOpt = Annotated[int | None, typer.Option("--batch", help="Shortcut for --set micro_batch=N.")]
LayersOpt = Annotated[int | None, typer.Option("--layers", help="Shortcut for --set layers=N.")]
MoeImbalanceOpt = Annotated[
    str | None,
    typer.Option(
        "--moe-imbalance",
        help="MoE routing on the busiest expert rank: average (default), worst, or a factor "
        ">= 1 (shortcut for --set moe_imbalance=...).",
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")]
ProfileOpt = Annotated[
    str | None,
    typer.Option(
        "--profile",
        help="Kernel profile: fused (default), torch-eager, torch-sdpa or a .yaml file "
        "(ckplan calibrate writes one). Shortcut for --set profile=NAME.",
    ),
]
FORMATS = ("table", "json", "csv", "markdown")
FormatOpt = Annotated[
    str | None,
    typer.Option(
        "--format", "-f", help="table (default), json, csv, or markdown (e.g. a PR comment)."
    ),
]
PlotOpt = Annotated[
    str | None,
    typer.Option("--plot", help="Also draw it to FILE.png or FILE.svg (needs ckplan[plot])."),
]
QuietOpt = Annotated[
    bool, typer.Option("--quiet", "-q", help="No progress bar and no notes on stderr.")
]
FormulaOpt = Annotated[
    str,
    typer.Option(
        "--formula",
        help="derived (from the architecture's ops) or simple (12·s·b·h·B per layer; seed, its "
        "old name, is accepted).",
    ),
]


BudgetOpt = Annotated[
    str | None,
    typer.Option("--budget", "-b", help="Per-GPU memory: 40GB, 40GiB, 80e9, ... (or --gpu)"),
]
ReserveOpt = Annotated[
    str | None,
    typer.Option(
        "--reserve",
        help="Taken off the budget for CUDA context and allocator slack (default 2GiB).",
    ),
]
SlotsOpt = Annotated[int, typer.Option("--slots", help="Memory slots of the optimal-schedule DP.")]
