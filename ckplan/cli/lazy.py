"""The parts of ckplan that a command imports only when an option asks for them (start-up time:
tests/test_startup.py)."""

from __future__ import annotations

import dataclasses


def step_time(plan, gpu, mfu_convention: str = "full"):
    """The time model, imported when a command is given --gpu (start-up time), with MFU in the
    FLOP convention --mfu-convention names."""
    from ckplan.hardware.step_time import in_mfu_convention, step_time

    time = step_time(plan, gpu)
    return None if time is None else in_mfu_convention(time, plan.spec, mfu_convention)


def candidate_in_convention(candidate, mfu_convention: str):
    """A sweep or layout candidate with its step time's MFU in `mfu_convention`."""
    if candidate is None or candidate.time is None or mfu_convention == "full":
        return candidate
    from ckplan.hardware.step_time import in_mfu_convention

    time = in_mfu_convention(candidate.time, candidate.plan.spec, mfu_convention)
    return dataclasses.replace(candidate, time=time)


def sweep_in_convention(result, mfu_convention: str):
    """Every candidate of a sweep with its MFU in `mfu_convention`."""
    if mfu_convention == "full":
        return result
    convert = [candidate_in_convention(c, mfu_convention) for c in result.candidates]
    return dataclasses.replace(
        result,
        candidates=tuple(convert),
        pareto=tuple(candidate_in_convention(c, mfu_convention) for c in result.pareto),
        best=candidate_in_convention(result.best, mfu_convention),
        reference=candidate_in_convention(result.reference, mfu_convention),
    )


def layouts_in_convention(result, mfu_convention: str):
    """Every evaluated layout of `ckplan plan` with its MFU in `mfu_convention`."""
    if mfu_convention == "full":
        return result
    layouts = tuple(
        dataclasses.replace(e, candidate=candidate_in_convention(e.candidate, mfu_convention))
        for e in result.layouts
    )
    return dataclasses.replace(result, layouts=layouts)


def plots():
    """The plot renderer, imported when a command is given --plot."""
    from ckplan.render import plot

    return plot
