"""What ckplan refuses to compute because it could not answer in seconds.

Every size key has a documented range (`model.spec.SIZE_RANGES`); inside it, the closed forms and
the segment schedules (at most 3 steps per stage) are fast. Two schedules grow faster than the
chain: Revolve with few slots re-advances quadratically many stages (revolve:1 over n stages runs
n(n+1)/2 forwards), and the optimal DP costs O(n³·slots) time and O(n²·slots) memory. Both are
checked here before they start, and refused with a one-line reason and a way out.
"""

from __future__ import annotations

from ckplan.plan.strategies import StrategyError
from ckplan.quoting import quote
from ckplan.schedules import revolve_min_forwards

# One schedule's replayed steps: `schedules.simulate` takes about 3 µs a step.
MAX_SCHEDULE_STEPS = 1_000_000
# The rotor DP as implemented today (`schedules.rotor`): about 6 s at 258 stages x 500 slots
# (n³·slots = 8.6e9) on the reference machine, and ~10 bytes of table per n²·slots cell.
# Raise both with a faster DP.
DP_MAX_WORK = 10**10  # n³ · slots
DP_MAX_CELLS = 10**8  # n² · slots
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


def dp_within_limits(stages: int, slots: int) -> bool:
    return stages**3 * slots <= DP_MAX_WORK and stages**2 * slots <= DP_MAX_CELLS


def check_dp(stages: int, slots: int, name: str = "optimal") -> None:
    """Refuse an optimal-schedule DP beyond DP_MAX_WORK or DP_MAX_CELLS."""
    if not dp_within_limits(stages, slots):
        raise StrategyError(
            f"strategy {name!r}: the optimal DP over {stages:,} stages x {slots:,} memory slots "
            "is beyond what ckplan solves in seconds; split the layers over pipeline stages "
            "(--set pp=N), use fewer --slots (a pipeline stage multiplies them by its "
            "micro-batches in flight), or a segment strategy"
        )


def check_slots(slots: int) -> int:
    """`--slots`: 1..MAX_SLOTS."""
    if not 1 <= slots <= MAX_SLOTS:
        raise StrategyError(f"--slots must be in 1..{MAX_SLOTS:,}, got {quote(slots)}")
    return slots
