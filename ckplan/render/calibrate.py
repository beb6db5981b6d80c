"""The calibrate view: the fitted profile op by op against `fused`, the fit and its check."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckplan.render.common import gib

if TYPE_CHECKING:  # Rich is imported where a table is built: --json needs none
    from rich.console import Group


def calibrate_dict(result, comparison: list[dict], written: str | None) -> dict[str, Any]:
    check = result.profile["calibration"]["check"]
    return {
        "model": result.spec.to_dict(),
        "block": result.block,
        "device": result.device,
        "torch_version": result.torch_version,
        "fit_shapes": [s.shape.text() for s in result.samples],
        "max_residual_bytes": str(result.max_residual),
        "check": {**check, "error": result.check_error},
        "sdpa_node": result.check.sdpa_node,
        "ops": comparison,
        "unmeasured_ops": result.unmeasured,
        "unmodelled_ops": result.unmodelled,
        "profile": result.profile,
        "written": written,
        **({"cuda": result.cuda} if getattr(result, "cuda", None) else {}),
    }


def calibrate_view(result, comparison: list[dict], written: str | None) -> Group:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    spec = result.spec
    title = (
        f"Calibrate {spec.name}: {result.block}, torch {result.torch_version} on {result.device}"
    )
    table = Table(title=title, title_justify="left")
    table.add_column("op")
    table.add_column("fused saves")
    table.add_column("measured saves")
    table.add_column(f"fused at s={spec.seq} b={spec.micro_batch}", justify="right")
    table.add_column("calibrated", justify="right")
    table.add_column("x fused", justify="right")
    for row in comparison:
        fused, calibrated = row["fused_bytes"], row["calibrated_bytes"]
        ratio = f"{calibrated / fused:.3f}" if fused else ("-" if not calibrated else "new")
        style = None if row["fused"] == row["calibrated"] else "bold yellow"
        table.add_row(
            row["op"],
            row["fused"],
            row["calibrated"],
            gib(fused),
            gib(calibrated),
            ratio,
            style=style,
        )
    fused_total = sum(row["fused_bytes"] for row in comparison)
    total = sum(row["calibrated_bytes"] for row in comparison)
    table.add_row(
        "total", "", "", gib(fused_total), gib(total), f"{total / fused_total:.3f}", style="bold"
    )
    check = result.profile["calibration"]["check"]
    lines = [
        f"Fit: {len(result.samples)} shapes ({result.samples[0].shape.text()}, ...), exact "
        f"rational least squares, largest residual {result.max_residual} B"
        + (" (every op an exact function of the terms)." if result.max_residual == 0 else "."),
        f"Check at {check['shape']} (not fitted): measured {check['measured_bytes']:,} B, "
        f"predicted {check['predicted_bytes']:,} B ({result.check_error:+.4%}).",
        "Terms: elements per rank (ckplan/model/profiles.py); coefficients: bytes per element, "
        f"B = {spec.dtype_bytes}. Rows in yellow differ from fused.",
    ]
    if result.check.sdpa_node:
        lines.append(f"SDPA ran {result.check.sdpa_node}.")
    if result.unmeasured:
        lines.append(
            f"Not in the measured layer (profile: saves 0): {', '.join(result.unmeasured)}."
        )
    if result.unmodelled:
        lines.append(f"Measured but not in this model's table: {', '.join(result.unmodelled)}.")
    cuda = getattr(result, "cuda", None)
    if cuda:
        for run in cuda["runs"]:
            lines.append(
                f"CUDA {run['strategy']}: max_memory_allocated {run['measured_bytes']:,} B of "
                f"activations, plan {run['predicted_bytes']:,} B ({run['error']:+.2%})."
            )
    lines.append(
        f"Wrote the profile to {written}: use it with --profile {written}."
        if written
        else "--out FILE writes the profile."
    )
    return Group(table, *(Text(line) for line in lines))
