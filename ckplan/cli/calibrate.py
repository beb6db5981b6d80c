"""`ckplan calibrate`: measure what autograd saves per op and fit a kernel profile."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
import yaml

from ckplan import render
from ckplan.cli.errors import UserError, user_errors
from ckplan.cli.options import BatchOpt, JsonOpt, LayersOpt, ModelArg, ModelSetOpt, SeqOpt
from ckplan.cli.output import print_json, print_view
from ckplan.cli.resolve import resolve
from ckplan.quoting import quote


def calibrate(
    model: ModelArg,
    out: Annotated[
        str | None, typer.Option("--out", "-o", help="Write the fitted profile to this .yaml.")
    ] = None,
    hf: Annotated[
        bool,
        typer.Option("--hf", help="Measure the real Hugging Face decoder layer (transformers)."),
    ] = False,
    module: Annotated[
        str | None,
        typer.Option(
            "--module",
            help="Measure your own layer: PACKAGE.MODULE:FACTORY or FILE.py:FACTORY, a "
            "factory taking the shape as keywords (docs/profiles.md).",
        ),
    ] = None,
    device: Annotated[
        str, typer.Option("--device", help="cpu, or cuda: also checks peak memory on the GPU.")
    ] = "cpu",
    name: Annotated[str | None, typer.Option("--name", help="The profile's name.")] = None,
    settings: ModelSetOpt = None,
    seq: SeqOpt = None,
    batch: BatchOpt = None,
    layers: LayersOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Measure what autograd saves per op for one layer of MODEL (PyTorch, small shapes), fit
    a kernel profile exactly, check it on a shape left out, and compare it with fused."""
    from ckplan.calibrate import missing_extra

    with user_errors():
        spec = resolve(
            model, settings=settings, seq=seq, batch=batch, layers=layers, gpu_keys="calibrate"
        ).spec
        if device != "cpu" and not device.startswith("cuda"):
            raise UserError(f"--device {quote(device)}: expected cpu or cuda")
        if out is not None and not out.endswith((".yaml", ".yml")):
            raise UserError(f"--out {quote(out)}: expected a .yaml file")
        if out is not None:
            from ckplan.inputs.paths import check_output

            check_output(out, "--out")
        if module is not None and hf:
            raise UserError("--module and --hf: measure one layer, your module or Hugging Face's")
        missing = missing_extra(hf)
        if missing:
            raise UserError(missing)
        from ckplan.calibrate import run

        hf_config = _hf_config(model) if hf else None
        try:
            result = run.calibrate(spec, hf, device, name, hf_config, module)
            if device.startswith("cuda"):
                from ckplan.calibrate.cuda import peak_memory_check

                result.cuda = peak_memory_check(spec, result, device, hf, hf_config)
            comparison = run.compare_with_fused(result)
        except run.CalibrationError as error:
            raise UserError(str(error)) from None
        if out is not None:
            _write_profile(out, result.profile)
    if as_json:
        print_json(render.calibrate_dict(result, comparison, out))
    else:
        print_view(render.calibrate_view(result, comparison, out))


def _hf_config(model: str) -> dict | None:
    """A config.json MODEL's own keys (its model_type picks the layer), else None."""
    if not model.endswith(".json"):
        return None
    return json.loads(Path(model).read_text(encoding="utf-8"))


def _write_profile(path: str, profile: dict) -> None:
    header = "# A kernel profile written by `ckplan calibrate` (terms: ckplan/model/profiles.py)\n"
    text = header + yaml.safe_dump(profile, sort_keys=False, allow_unicode=True, width=100)
    from ckplan.inputs.paths import write_atomic

    write_atomic(path, "--out", lambda temporary: temporary.write_text(text, encoding="utf-8"))
