"""What ckplan refuses to compute because it could not answer in seconds.

Every size key has a documented range (`model.spec.SIZE_RANGES`); inside it, the closed forms and
the segment schedules (at most 3 steps per stage) are fast. Revolve with few slots grows
faster than the chain: it re-advances quadratically many stages (revolve:1 over n stages runs
n(n+1)/2 forwards), so it is checked here before it starts and refused with a one-line reason
and a way out. (The optimal DP bounds its own work by grouping layers, `schedules.grouping`.)
"""

from __future__ import annotations

from ckplan.plan.strategies import StrategyError
from ckplan.quoting import quote
from ckplan.schedules import revolve_min_forwards

# One schedule's replayed steps: `schedules.simulate` takes about 3 µs a step.
MAX_SCHEDULE_STEPS = 1_000_000
MAX_SLOTS = 20_000  # --slots


def revolve_steps(stages: int, slots: int) -> int:
    """Steps of `revolve_schedule` over `stages` stages with `slots` slots: one forward and one
    backward per stage plus the re-advances (Griewank & Walther 2000, `revolve_min_forwards`)."""
    if stages <= 1:
        return 2 * stages
    return 2 * stages + revolve_min_forwards(stages, min(slots, stages))


def check_revolve(stages: int, slots: int, name: str) -> None:
    """Refuse a Revolve schedule longer than MAX_SCHEDULE_STEPS, naming the fewest slots that
    would do."""
    steps = revolve_steps(stages, slots)
    if steps <= MAX_SCHEDULE_STEPS:
        return
    low, high = slots, stages  # revolve_steps falls as slots grow; stages slots always do
    while high - low > 1:
        middle = (low + high) // 2
        too_long = revolve_steps(stages, middle) > MAX_SCHEDULE_STEPS
        low, high = (middle, high) if too_long else (low, middle)
    raise StrategyError(
        f"strategy {name!r} over {stages:,} stages runs {steps:,} steps, more than the "
        f"{MAX_SCHEDULE_STEPS:,} ckplan replays; give it at least {high} slots"
    )


def check_slots(slots: int) -> int:
    """`--slots`: 1..MAX_SLOTS."""
    if not 1 <= slots <= MAX_SLOTS:
        raise StrategyError(f"--slots must be in 1..{MAX_SLOTS:,}, got {quote(slots)}")
    return slots
