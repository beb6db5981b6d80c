"""`ckplan presets` and `ckplan gpus`: the shipped models and GPUs."""

from __future__ import annotations

from typing import Annotated

import typer

from ckplan import render
from ckplan.cli.errors import user_errors
from ckplan.cli.options import JsonOpt
from ckplan.cli.output import print_json, print_view
from ckplan.inputs.gpus import gpu_names, load_gpu
from ckplan.inputs.presets import load_spec, preset_names


def presets(
    name: Annotated[str | None, typer.Argument(help="Show one preset fully resolved.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """List the shipped presets, or show one resolved."""
    from ckplan.model.memory import parameter_count

    with user_errors():
        if name is not None:
            spec = load_spec(name)
            if as_json:
                print_json(spec.to_dict())
            else:
                print_view(render.model_table(spec, f"Preset {name}"))
            return
        rows = []
        for preset in preset_names():
            spec = load_spec(preset)
            rows.append((preset, spec, parameter_count(spec).total))
    if as_json:
        print_json({preset: {**spec.to_dict(), "parameters": p} for preset, spec, p in rows})
    else:
        print_view(render.presets_table(rows))


def gpus(
    name: Annotated[str | None, typer.Argument(help="Show one GPU, every key resolved.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """List the shipped GPU presets (datasheet figures and efficiencies), or show one."""
    with user_errors():
        devices = [load_gpu(name)] if name is not None else [load_gpu(n) for n in gpu_names()]
    if as_json:
        data = {device.name: device.to_dict() for device in devices}
        print_json(devices[0].to_dict() if name is not None else data)
    elif name is not None:
        print_view(render.gpu_table(devices[0]))
    else:
        print_view(render.gpus_table(devices))
