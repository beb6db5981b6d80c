"""The verify view: predicted beside measured, run by run."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ckplan import __version__
from ckplan.render.fit import declare
from ckplan.units import format_bytes

if TYPE_CHECKING:  # Rich is imported where a table is built: --json needs none
    from rich.console import Group
    from rich.text import Text

# ---- verify ------------------------------------------------------------------------------
# `report` is a ckplan.simple.verify.VerifyReport (not imported: it imports NumPy).


def verify_run_dict(report: Any, run: Any) -> dict[str, Any]:
    """One run in `verify --json`'s shape (docs/verify.md), with per-layer counts and the
    overhead."""
    overhead = report.overhead(run)
    return {
        "strategy": run.strategy,
        "gradients_identical": run.gradients_identical,
        "max_abs_grad_diff": run.max_abs_grad_diff,
        "predicted": {
            "peak_bytes": run.predicted.peak_bytes,
            "layer_forwards": sum(run.predicted.layer_forwards),
            "flops": run.predicted.flops,
            "seconds": run.predicted.seconds,
        },
        "measured": {
            "peak_bytes": run.measured.peak_bytes,
            "layer_forwards": sum(run.measured.layer_forwards),
            "flops": run.measured.flops,
            "seconds": run.measured.seconds,
        },
        "ok": run.ok,
        "peak_error": run.peak_error,
        "layer_forwards_per_layer": {
            "predicted": list(run.predicted.layer_forwards),
            "measured": list(run.measured.layer_forwards),
        },
        "all_seconds": list(run.measured.all_seconds),
        "time_overhead": None
        if overhead is None
        else {"predicted": overhead[0], "measured": overhead[1]},
    } | (_offload_dict(run) if run.predicted.offloaded else {})


def _offload_dict(run: Any) -> dict[str, Any]:
    """An offload run's host figures (docs/offloading.md): they must be equal."""
    return {
        "offload": {
            "offloaded_layers": list(run.predicted.offloaded),
            "predicted": {
                "host_peak_bytes": run.predicted.host_peak_bytes,
                "bytes_moved": run.predicted.bytes_moved,
            },
            "measured": {
                "host_peak_bytes": run.measured.host_peak_bytes,
                "bytes_moved": run.measured.bytes_moved,
            },
            "ok": run.offload_ok,
        }
    }


def verify_dict(report: Any) -> dict[str, Any]:
    """`ckplan verify --json`: {"runs": [...]} (docs/verify.md) with the setup beside it."""
    return {
        "ckplan_version": __version__,
        "model": report.spec.to_dict(),
        "ok": report.ok,
        "tolerance": {
            "peak_relative": report.tolerance,
            "layer_forwards": "exact",
            "flops": "exact",
            "gradients": "bit-identical to the plain step",
        },
        "parameter_bytes": report.parameter_bytes,
        "gradient_bytes": report.gradient_bytes,
        "optimal_budget_bytes": report.budget_bytes,
        "repeats": report.repeats,
        "seed": report.seed,
        "runs": [verify_run_dict(report, run) for run in report.runs],
        "cpu_profile": None if report.profile is None else _profile_dict(report.profile),
    }


def _profile_dict(profile: Any) -> dict[str, float]:
    return {
        "flops_per_s": profile.flops_per_s,
        "bytes_per_s": profile.bytes_per_s,
        "call_seconds": profile.call_seconds,
        "mask_seconds_per_value": profile.mask_seconds_per_value,
        "probe_spread": profile.probe_spread,
    }


def _mark(ok: bool) -> Text:
    from rich.text import Text

    return Text("yes", style="green") if ok else Text("NO", style="bold red")


def _forwards(counts: Sequence[int]) -> str:
    total = sum(counts)
    return f"{total} (+{total - len(counts)})"


def _seconds(run: Any) -> str:
    predicted = run.predicted.seconds
    if predicted is None:
        return f"{run.measured.seconds:.3f}"
    measured = run.measured.seconds
    return f"{predicted:.3f} / {measured:.3f} ({predicted / measured - 1:+.0%})"


def _only_headers_over(run: Any) -> bool:
    """The run failed on peak memory alone, by a few KiB of Python objects on top."""
    excess = run.measured.peak_bytes - run.predicted.peak_bytes
    return run.gradients_identical and run.counts_ok and run.flops_ok and 0 < excess < 16384


def _profile_note(profile: Any) -> str:
    if profile is None:
        return ""
    return (
        f"Time predicted by the roofline model on a cpu profile probed between the runs "
        f"(medians): GEMM {profile.flops_per_s / 1e9:.1f} GFLOP/s (it moved by "
        f"{profile.probe_spread:.0%} between rounds), element-wise "
        f"{profile.bytes_per_s / 1e9:.1f} GB/s, {profile.call_seconds * 1e6:.2f} µs per NumPy "
        f"call, np.heaviside {profile.mask_seconds_per_value * 1e9:.1f} ns per value.\n"
    )


def verify_view(report: Any) -> Group:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    spec = report.spec
    title = (
        f"Verify: the NumPy MLP, L={spec.layers} d={spec.hidden} f={spec.ffn_hidden} "
        f"b={spec.micro_batch}, float64"
    )
    table = Table(title=title, title_justify="left")
    table.add_column("strategy")
    table.add_column("peak pred\n(MiB)", justify="right")
    table.add_column("peak meas\n(MiB)", justify="right")
    table.add_column("peak\nerror", justify="right")
    table.add_column("layer forwards\npred / meas", justify="right")
    table.add_column("GFLOP\npred / meas", justify="right")
    timed = report.profile is not None
    table.add_column("time (s)\npred / meas" if timed else "time\n(s)", justify="right")
    table.add_column("overhead vs none\npred / meas", justify="right")
    table.add_column("gradients")
    table.add_column("ok", justify="center")
    # time is reported, not checked: it goes first; the verdicts stay
    time_header = "time (s) pred / meas" if timed else "time (s)"
    declare(
        table, "overhead vs none pred / meas", time_header, "peak pred (MiB)", "GFLOP pred / meas"
    )
    mib = 2**20
    for run in report.runs:
        overhead = report.overhead(run)
        grads = (
            Text("identical", style="green")
            if run.gradients_identical
            else Text(f"diff {run.max_abs_grad_diff:.2g}", style="bold red")
        )
        forwards = f"{_forwards(run.predicted.layer_forwards)} / {sum(run.measured.layer_forwards)}"
        flops = f"{run.predicted.flops / 1e9:,.2f} / {run.measured.flops / 1e9:,.2f}"
        table.add_row(
            run.strategy,
            f"{run.predicted.peak_bytes / mib:,.3f}",
            f"{run.measured.peak_bytes / mib:,.3f}",
            Text(f"{run.peak_error:+.2%}", style=None if run.peak_ok else "bold red"),
            Text(forwards, style=None if run.counts_ok else "bold red"),
            Text(flops, style=None if run.flops_ok else "bold red"),
            _seconds(run),
            "" if overhead is None else f"{overhead[0]:+.1%} / {overhead[1]:+.1%}",
            grads,
            _mark(run.ok),
        )
    budget = (
        f"; optimal solved for an activation budget of {format_bytes(report.budget_bytes, 'MiB')}"
        if report.budget_bytes is not None
        else ""
    )
    notes = Text(
        "MiB = 2^20 bytes. Peak: activations and activation gradients of one step (tracemalloc), "
        f"parameters ({format_bytes(report.parameter_bytes, 'MiB')}) and their preallocated "
        f"gradients ({format_bytes(report.gradient_bytes, 'MiB')}) excluded{budget}.\n"
        "Layer forwards: total (+ recomputed). FLOPs: matmuls, 2·m·n·k. Time: median of "
        f"{report.repeats} runs; overhead against none, predicted = FLOP ratio, measured = time "
        "ratio (reported, not checked).\n"
        + _profile_note(report.profile)
        + f"Tolerances: peak within ±{report.tolerance:.0%} of predicted; layer forwards per layer "
        "and FLOPs exact; gradients bit-identical to the plain step "
        "(model_forward + model_backward).",
        style="dim",
    )
    offloads = [run for run in report.runs if run.predicted.offloaded]
    if offloads:
        notes.append(
            "\nOffload (host pool, exact): "
            + "; ".join(
                f"{run.strategy}: {len(run.predicted.offloaded)} layers, host peak "
                f"{run.predicted.host_peak_bytes / mib:,.3f} / "
                f"{run.measured.host_peak_bytes / mib:,.3f} MiB, moved "
                f"{run.predicted.bytes_moved / mib:,.3f} / "
                f"{run.measured.bytes_moved / mib:,.3f} MiB"
                for run in offloads
            )
            + " (pred / meas)."
        )
    failed = [run.strategy for run in report.runs if not run.ok]
    if failed:
        verdict = Text(f"MISMATCH: {', '.join(failed)} outside tolerance.", style="bold red")
        if all(_only_headers_over(run) for run in report.runs if not run.ok):
            verdict.append(
                " Each measured peak is over by less than 16 KiB: Python's object headers, "
                "which matter only for tiny arrays (try a larger --hidden or --batch).",
                style="red",
            )
    else:
        verdict = Text(
            f"Verified: all {len(report.runs)} runs match the planner within tolerance.",
            style="bold green",
        )
    return Group(table, notes, verdict)
