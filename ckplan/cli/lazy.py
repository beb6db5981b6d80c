"""The parts of ckplan that a command imports only when an option asks for them (start-up time:
tests/test_startup.py)."""

from __future__ import annotations


def step_time(plan, gpu):
    """The time model, imported when a command is given --gpu (start-up time)."""
    from ckplan.hardware.step_time import step_time

    return step_time(plan, gpu)


def plots():
    """The plot renderer, imported when a command is given --plot."""
    from ckplan.render import plot

    return plot
