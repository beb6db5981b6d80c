"""Checkpointing schedules for a chain of stages: memory replay, optimal DP, Revolve, segments.

Chain model
-----------
A training step is a chain of ``n`` stages ``0..n-1`` (for a transformer: embedding, ``L`` layers,
output layer + loss). Stage ``i`` reads the activation ``x_i`` and produces ``x_{i+1}``; ``x_n`` is
the output of the last stage (0 bytes for a scalar loss). The gradient ``δ_i`` with respect to
``x_i`` has the size of ``x_i``. ``tape_bytes[i]`` is what stage ``i`` keeps for its backward when
run "keep all"; the tape *includes* the stage input ``x_i``.

Schedules are tuples of :class:`Step`. There are four kinds of step:

``forward_drop(i)``        run stage ``i``, keep nothing of it;
``forward_keep_input(i)``  run stage ``i`` and keep its input ``x_i`` as a checkpoint;
``forward_keep_all(i)``    run stage ``i`` and keep its tape (which absorbs ``x_i``);
``backward(i)``            backpropagate stage ``i`` from its tape and ``δ_{i+1}``.

Memory accounting (exact bytes; implemented by :func:`simulate`, assumed by every scheduler)
--------------------------------------------------------------------------------------------
Memory counts activations, tapes and gradients only (parameters, optimizer states are separate).
The live set holds *activations* ``x_k`` (each either a checkpoint or a plain, "pending" value),
*tapes* and the one live *gradient*.

1. Initially ``x_0`` (a checkpoint) and ``δ_n`` (``input_bytes[n]`` bytes) are live.
2. A forward of stage ``i`` (any kind) needs ``x_i`` live as an activation (not inside a tape),
   stage ``i`` not yet backpropagated, ``tape_i`` not live, and its output ``x_{i+1}`` not live
   (neither as an activation nor inside ``tape_{i+1}``): recomputing a live value is rejected.
   While it runs, memory = live set + ``forward_workspace_bytes[i]`` + ``input_bytes[i+1]``.
3. After the forward: ``forward_drop`` frees ``x_i`` unless it is a checkpoint;
   ``forward_keep_input`` marks ``x_i`` a checkpoint; ``forward_keep_all`` replaces ``x_i`` by
   ``tape_i`` (``tape_bytes[i]`` bytes, ``x_i`` no longer counted separately).
4. The output ``x_{i+1}`` is a plain (pending) activation. It stays live after the step only if
   the very next step is a forward of stage ``i+1`` (which consumes it by rule 3); otherwise it is
   dead (nothing could use it without recomputing stage ``i``) and is freed at the end of the
   producing step. In particular ``x_n`` is live only during the forward of stage ``n-1``, and the
   output of the last stage of a re-forwarded segment is freed at once.
5. ``backward(i)`` needs ``tape_i`` and ``δ_{i+1}`` live, and backwards must run exactly once per
   stage in the order ``n-1, ..., 0``. While it runs, memory = live set +
   ``backward_workspace_bytes[i]`` + ``input_bytes[i]`` (for ``δ_i``). Afterwards ``tape_i``,
   ``δ_{i+1}`` and the checkpoint ``x_i`` (if live) are freed and ``δ_i`` is live.
6. A checkpoint ``x_i`` is freed when ``backward(i)`` completes (``x_0`` included).

Each step records the memory *during* it and the live memory *after* it; the peak is the maximum
over the initial state and both figures of every step. (The after-figure of a step never exceeds
the during-figure of the next, so the peak is always attained during some step.)

FLOPs: ``forward_flops`` counts every forward run (recomputation included), ``recompute_flops`` is
the forward work beyond one forward of each stage. All bytes and FLOPs are exact Python ints.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from typing import NamedTuple

__all__ = [
    "BACKWARD",
    "BRUTE_FORCE_MAX_STAGES",
    "FORWARD_DROP",
    "FORWARD_KEEP_ALL",
    "FORWARD_KEEP_INPUT",
    "FORWARD_KINDS",
    "STEP_KINDS",
    "Chain",
    "MemoryPoint",
    "Replay",
    "Schedule",
    "ScheduleResult",
    "Step",
    "beta",
    "brute_force_optimal",
    "enumerate_persistent_schedules",
    "held_after_forward_bytes",
    "optimal_schedule",
    "pipeline_peak_bytes",
    "revolve_dp_min_forwards",
    "revolve_dp_table",
    "revolve_min_forwards",
    "revolve_schedule",
    "segment_schedule",
    "simulate",
    "store_all_schedule",
]

FORWARD_DROP = "forward_drop"
FORWARD_KEEP_INPUT = "forward_keep_input"
FORWARD_KEEP_ALL = "forward_keep_all"
BACKWARD = "backward"
FORWARD_KINDS = frozenset({FORWARD_DROP, FORWARD_KEEP_INPUT, FORWARD_KEEP_ALL})
STEP_KINDS = frozenset({*FORWARD_KINDS, BACKWARD})

# Stages in the exhaustive search; 7 stages have 1806 persistent schedules (a Schröder number).
BRUTE_FORCE_MAX_STAGES = 8


def _int_tuple(name: str, values: Sequence[int], length: int) -> tuple[int, ...]:
    """Validate a sequence of non-negative integers and return it as a tuple of Python ints."""
    if isinstance(values, (str, bytes)):
        raise ValueError(f"{name} must be a sequence of integers")
    out = []
    for k, v in enumerate(values):
        if isinstance(v, bool):
            raise ValueError(f"{name}[{k}] must be an integer, got {v!r}")
        try:
            iv = operator.index(v)
        except TypeError:
            raise ValueError(f"{name}[{k}] must be an integer, got {v!r}") from None
        if iv < 0:
            raise ValueError(f"{name}[{k}] must be >= 0, got {iv}")
        out.append(int(iv))
    if len(out) != length:
        raise ValueError(f"{name} has length {len(out)}, expected {length}")
    return tuple(out)


@dataclass(frozen=True)
class Chain:
    """A chain of ``n`` stages with per-stage costs and sizes (see the module docstring).

    ``forward_workspace_bytes`` / ``backward_workspace_bytes`` default to zeros (pass ``()``).
    Sequences are converted to tuples of Python ints; invalid values raise ``ValueError``.
    """

    forward_flops: tuple[int, ...]
    backward_flops: tuple[int, ...]
    input_bytes: tuple[int, ...]
    tape_bytes: tuple[int, ...]
    forward_workspace_bytes: tuple[int, ...] = ()
    backward_workspace_bytes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.forward_flops, (str, bytes)):
            raise ValueError("forward_flops must be a sequence of integers")
        n = len(self.forward_flops)
        if n < 1:
            raise ValueError("a chain needs at least one stage")
        fields = {
            "forward_flops": (self.forward_flops, n),
            "backward_flops": (self.backward_flops, n),
            "input_bytes": (self.input_bytes, n + 1),
            "tape_bytes": (self.tape_bytes, n),
            "forward_workspace_bytes": (self.forward_workspace_bytes or (0,) * n, n),
            "backward_workspace_bytes": (self.backward_workspace_bytes or (0,) * n, n),
        }
        for name, (values, length) in fields.items():
            object.__setattr__(self, name, _int_tuple(name, values, length))
        for i in range(n):
            if self.tape_bytes[i] < self.input_bytes[i]:
                raise ValueError(
                    f"tape_bytes[{i}] = {self.tape_bytes[i]} < input_bytes[{i}] = "
                    f"{self.input_bytes[i]}: the tape includes the stage input"
                )

    @property
    def length(self) -> int:
        """Number of stages ``n``."""
        return len(self.forward_flops)

    def __len__(self) -> int:
        return len(self.forward_flops)

    @classmethod
    def uniform(
        cls,
        n: int,
        *,
        forward_flops: int,
        backward_flops: int,
        input_bytes: int,
        tape_bytes: int,
        output_bytes: int = 0,
        forward_workspace_bytes: int = 0,
        backward_workspace_bytes: int = 0,
    ) -> Chain:
        """A homogeneous chain: ``n`` equal stages, ``x_n`` of ``output_bytes`` bytes."""
        return cls(
            forward_flops=(forward_flops,) * n,
            backward_flops=(backward_flops,) * n,
            input_bytes=(input_bytes,) * n + (output_bytes,),
            tape_bytes=(tape_bytes,) * n,
            forward_workspace_bytes=(forward_workspace_bytes,) * n,
            backward_workspace_bytes=(backward_workspace_bytes,) * n,
        )


@dataclass(frozen=True)
class Step:
    """One step of a schedule: ``kind`` is one of the four module constants, ``stage`` >= 0."""

    kind: str
    stage: int

    def __post_init__(self) -> None:
        if self.kind not in STEP_KINDS:
            raise ValueError(
                f"unknown step kind {self.kind!r}; expected one of {sorted(STEP_KINDS)}"
            )
        if isinstance(self.stage, bool) or not isinstance(self.stage, int) or self.stage < 0:
            raise ValueError(f"step stage must be a non-negative int, got {self.stage!r}")

    def __str__(self) -> str:
        return f"{self.kind}({self.stage})"


Schedule = tuple[Step, ...]


class MemoryPoint(NamedTuple):
    """Memory while ``step`` runs (``during_bytes``) and once it has finished (``after_bytes``)."""

    step: Step
    during_bytes: int
    after_bytes: int


@dataclass(frozen=True)
class Replay:
    """What :func:`simulate` measured for one schedule (bytes and FLOPs are exact ints)."""

    peak_bytes: int
    forward_flops: int
    backward_flops: int
    recompute_flops: int
    layer_forwards: tuple[int, ...]
    initial_bytes: int
    trace: tuple[MemoryPoint, ...]

    @property
    def total_flops(self) -> int:
        """Forward (recomputation included) plus backward FLOPs."""
        return self.forward_flops + self.backward_flops

    @property
    def peak_step(self) -> int:
        """Index of the first step whose during-figure reaches the peak (-1: initial state)."""
        for t, point in enumerate(self.trace):
            if point.during_bytes == self.peak_bytes:
                return t
        return -1


def _where(t: int, st: Step) -> str:
    return f"step {t} ({st})"


def simulate(chain: Chain, steps: Sequence[Step]) -> Replay:
    """Replay ``steps`` on ``chain`` with the exact accounting of the module docstring.

    derived: the rules are this package's definition of a schedule's memory (module docstring);
    the optimal DP, Revolve and segment schedules are all checked against this replay.
    Raises ``ValueError`` for an invalid schedule (a forward whose input is not live, a backward
    without its tape, out-of-order or missing backwards, recomputing a live value, ...).
    """
    steps = tuple(steps)
    n = chain.length
    inp, tape = chain.input_bytes, chain.tape_bytes
    fws, bws = chain.forward_workspace_bytes, chain.backward_workspace_bytes
    f, b = chain.forward_flops, chain.backward_flops

    acts: dict[int, bool] = {0: True}  # live activations: index -> is a checkpoint
    tapes: set[int] = set()
    live = inp[0] + inp[n]  # x_0 and δ_n
    initial = live
    peak = live
    next_backward = n - 1
    counts = [0] * n
    fwd_flops = 0
    bwd_flops = 0
    trace = []
    for t, st in enumerate(steps):
        if not isinstance(st, Step):
            raise ValueError(f"step {t}: expected a Step, got {st!r}")
        i = st.stage
        if i >= n:
            raise ValueError(f"{_where(t, st)}: stage out of range for a chain of {n} stages")
        if st.kind == BACKWARD:
            if i != next_backward:
                if next_backward < 0:
                    raise ValueError(f"{_where(t, st)}: every stage is already backpropagated")
                raise ValueError(
                    f"{_where(t, st)}: backwards run once per stage in order n-1..0; "
                    f"expected backward({next_backward})"
                )
            if i not in tapes:
                raise ValueError(f"{_where(t, st)}: tape_{i} is not live")
            during = live + bws[i] + inp[i]
            tapes.discard(i)
            live -= tape[i] + inp[i + 1]  # tape_i and δ_{i+1}
            if acts.pop(i, None) is not None:
                live -= inp[i]
            live += inp[i]  # δ_i
            next_backward -= 1
            bwd_flops += b[i]
        else:
            if i > next_backward:
                raise ValueError(f"{_where(t, st)}: stage {i} is already backpropagated")
            if i not in acts:
                raise ValueError(f"{_where(t, st)}: input x_{i} is not live")
            if i in tapes:
                raise ValueError(f"{_where(t, st)}: tape_{i} is already live")
            if i + 1 in acts or i + 1 in tapes:
                raise ValueError(f"{_where(t, st)}: output x_{i + 1} is already live")
            during = live + fws[i] + inp[i + 1]
            if st.kind == FORWARD_DROP:
                if not acts[i]:
                    del acts[i]
                    live -= inp[i]
            elif st.kind == FORWARD_KEEP_INPUT:
                acts[i] = True
            else:  # FORWARD_KEEP_ALL: the tape absorbs x_i
                del acts[i]
                tapes.add(i)
                live += tape[i] - inp[i]
            nxt = steps[t + 1] if t + 1 < len(steps) else None
            if isinstance(nxt, Step) and nxt.kind != BACKWARD and nxt.stage == i + 1 and i + 1 < n:
                acts[i + 1] = False
                live += inp[i + 1]
            counts[i] += 1
            fwd_flops += f[i]
        peak = max(peak, during, live)
        trace.append(MemoryPoint(st, during, live))
    if next_backward >= 0:
        raise ValueError(
            f"schedule ends before every stage is backpropagated (next: backward({next_backward}))"
        )
    return Replay(
        peak_bytes=peak,
        forward_flops=fwd_flops,
        backward_flops=bwd_flops,
        recompute_flops=fwd_flops - sum(f),
        layer_forwards=tuple(counts),
        initial_bytes=initial,
        trace=tuple(trace),
    )


@dataclass(frozen=True)
class ScheduleResult:
    """A schedule found by a solver, with its replay.

    ``total_flops`` / ``recompute_flops`` are the solver's own figures (they equal the replay's);
    ``peak_bytes`` is the exact replayed peak of one micro-batch. ``slot_bytes`` is the
    discretisation unit (1: exact). With ``in_flight`` micro-batches (1F1B pipelining, see
    :func:`pipeline_peak_bytes`), ``held_bytes`` is what each waiting micro-batch holds
    (:func:`held_after_forward_bytes`) and ``pipeline_peak_bytes`` the whole stage's peak,
    ``peak_bytes + ceil((in_flight - 1) * held_bytes)``; it is what fits ``budget_bytes``.
    """

    steps: Schedule
    peak_bytes: int
    total_flops: int
    recompute_flops: int
    budget_bytes: int
    slot_bytes: int
    slots: int
    replay: Replay
    in_flight: Fraction
    held_bytes: int
    pipeline_peak_bytes: int

    @property
    def forward_flops(self) -> int:
        return self.replay.forward_flops

    @property
    def backward_flops(self) -> int:
        return self.replay.backward_flops

    @property
    def layer_forwards(self) -> tuple[int, ...]:
        return self.replay.layer_forwards


def _in_flight(value: int | Fraction) -> Fraction:
    """Validate ``in_flight`` (an int or a Fraction, >= 1) and return it as a Fraction."""
    if isinstance(value, bool) or not isinstance(value, numbers.Rational):
        raise ValueError(f"in_flight must be an int or a Fraction, got {value!r}")
    m = Fraction(value)
    if m < 1:
        raise ValueError(f"in_flight must be >= 1, got {value!r}")
    return m


def held_after_forward_bytes(chain: Chain, replay: Replay) -> int:
    """What one micro-batch leaves alive between its forward pass and its backward pass (its
    checkpoints and tapes): the after-figure of the first forward of the last stage, less δ_n,
    which the replay counts from the start but which arrives only with the backward pass."""
    last = chain.length - 1
    end_of_forward = next(
        index
        for index, point in enumerate(replay.trace)
        if point.step.stage == last and point.step.kind != BACKWARD
    )
    return replay.trace[end_of_forward].after_bytes - chain.input_bytes[-1]


def pipeline_peak_bytes(chain: Chain, replay: Replay, in_flight: int | Fraction = 1) -> int:
    """Peak of a pipeline stage running ``replay``'s schedule with ``in_flight`` micro-batches.

    derived (1F1B): while one micro-batch runs the schedule, ``in_flight - 1`` others wait for
    their backward, each holding :func:`held_after_forward_bytes`, so the stage peaks at
    ``replay.peak_bytes + (in_flight - 1) * held``. A fractional product is rounded up to a
    whole byte, so ``pipeline_peak_bytes(...) <= budget`` exactly when the exact (Fraction)
    peak fits ``budget``. ``in_flight = 1`` gives ``replay.peak_bytes``.
    """
    m = _in_flight(in_flight)
    if m == 1:
        return replay.peak_bytes
    return replay.peak_bytes + math.ceil((m - 1) * held_after_forward_bytes(chain, replay))


# --------------------------------------------------------------------------------------------
# Simple schedules


def store_all_schedule(chain: Chain) -> Schedule:
    """No recomputation: ``forward_keep_all`` every stage, then backward in reverse.

    derived: the plain training step (no checkpointing); peak = all tapes + x_n + δ_n, etc.
    """
    n = chain.length
    return tuple(Step(FORWARD_KEEP_ALL, i) for i in range(n)) + tuple(
        Step(BACKWARD, i) for i in reversed(range(n))
    )


def _check_segments(
    n: int, segments: Sequence[tuple[int, int, bool]]
) -> list[tuple[int, int, bool]]:
    out = []
    expected = 0
    for idx, seg in enumerate(segments):
        try:
            start, end, recompute = seg
        except (TypeError, ValueError):
            raise ValueError(
                f"segment {idx}: expected (start, end, recompute), got {seg!r}"
            ) from None
        if not (isinstance(start, int) and isinstance(end, int)) or isinstance(start, bool):
            raise ValueError(f"segment {idx}: start and end must be ints, got {seg!r}")
        if start != expected:
            raise ValueError(
                f"segment {idx} starts at {start}, expected {expected} "
                "(segments are half-open [start, end) and must cover 0..n-1 in order)"
            )
        if end <= start:
            raise ValueError(f"segment {idx}: end {end} must be > start {start}")
        out.append((start, end, bool(recompute)))
        expected = end
    if expected != n:
        raise ValueError(f"segments cover stages 0..{expected - 1}, expected 0..{n - 1}")
    return out


def segment_schedule(chain: Chain, segments: Sequence[tuple[int, int, bool]]) -> Schedule:
    """Segment checkpointing: half-open segments ``[start, end)`` covering ``0..n-1`` in order.

    A *store* segment (``recompute=False``) runs ``forward_keep_all`` on its stages. A *recompute*
    segment runs ``forward_keep_input(start)`` then ``forward_drop`` on the rest; in the backward
    pass it re-runs ``forward_keep_all(start..end-1)`` from its stored input and backprops the
    segment (the tape of every stage must exist for its backward, so re-forwarding keep-all is the
    cheapest re-forward). Segments are processed in reverse in the backward pass.

    Source: Chen, Xu, Zhang, Guestrin 2016, "Training Deep Nets with Sublinear Memory Cost", §4
    (segments, one extra forward); ``torch.utils.checkpoint_sequential`` keeps the last segment
    (= last segment stored); Megatron ``--recompute-method block`` = first segments recomputed.
    """
    segs = _check_segments(chain.length, segments)
    steps: list[Step] = []
    for start, end, recompute in segs:
        if recompute:
            steps.append(Step(FORWARD_KEEP_INPUT, start))
            steps.extend(Step(FORWARD_DROP, i) for i in range(start + 1, end))
        else:
            steps.extend(Step(FORWARD_KEEP_ALL, i) for i in range(start, end))
    for start, end, recompute in reversed(segs):
        if recompute:
            steps.extend(Step(FORWARD_KEEP_ALL, i) for i in range(start, end))
        steps.extend(Step(BACKWARD, i) for i in reversed(range(start, end)))
    return tuple(steps)


# --------------------------------------------------------------------------------------------
# Revolve (Griewank & Walther 2000)


def beta(s: int, t: int) -> int:
    """``beta(s, t) = C(s + t, s)``: steps reversible with ``s`` checkpoints, ``t`` re-advances.

    Source: Griewank & Walther 2000, "Algorithm 799: Revolve", ACM TOMS 26(1), §2 (binomial
    reversal schedules; Griewank 1992). Defined as 0 for ``t < 0``.
    """
    if s < 0:
        raise ValueError("beta: s must be >= 0")
    if t < 0:
        return 0
    return math.comb(s + t, s)


def revolve_min_forwards(l: int, s: int) -> int:  # noqa: E741 (the paper's name)
    """Minimal number of extra forward steps to reverse ``l`` steps with ``s`` checkpoints.

    Closed form ``r*l - beta(s+1, r-1)`` with ``r`` the integer such that
    ``beta(s, r-1) < l <= beta(s, r)``. Source: Griewank & Walther 2000, "Algorithm 799:
    Revolve", ACM TOMS 26(1), §2, the proposition on the minimal number of extra forward steps
    (checked here against :func:`revolve_dp_table` for l <= 200, s <= 10). ``s`` counts the slot
    holding the initial state; the ``l`` taping forwards that precede each reverse step are not
    counted (in this package's chain model: the recompute count in stage forwards).
    Raises ``ValueError`` when ``s == 0 and l >= 2`` (not reversible).
    """
    if l < 0 or s < 0:
        raise ValueError("revolve_min_forwards: l and s must be >= 0")
    if l <= 1:
        return 0
    if s == 0:
        raise ValueError("cannot reverse more than one step with 0 checkpoints")
    r = 0
    while beta(s, r) < l:
        r += 1
    return r * l - beta(s + 1, r - 1)


@lru_cache(maxsize=8)
def revolve_dp_table(l_max: int, s_max: int) -> tuple[tuple[int | None, ...], ...]:
    """Table ``p[l][s]`` (``l <= l_max``, ``s <= s_max``) of the textbook Revolve recursion.

    ``p(0, s) = p(1, s) = 0``; ``p(l, 0)`` undefined (None) for ``l >= 2``;
    ``p(l, s) = min over 1 <= j < l of j + p(l - j, s - 1) + p(j, s)``: advance ``j`` steps,
    store a checkpoint there, reverse the right part with one slot fewer, then the left part.
    Source: Griewank 1992, "Achieving logarithmic growth of temporal and spatial complexity in
    reverse automatic differentiation", Optim. Methods Softw. 1 (the recursion behind binomial
    checkpointing, Griewank & Walther 2000, §2).
    """
    p: list[list[int | None]] = [[0] * (s_max + 1) for _ in range(l_max + 1)]
    for ll in range(2, l_max + 1):
        p[ll][0] = None
        for s in range(1, s_max + 1):
            best = None
            for j in range(1, ll):
                right = p[ll - j][s - 1]
                if right is None:
                    continue
                cand = j + right + p[j][s]
                if best is None or cand < best:
                    best = cand
            p[ll][s] = best
    return tuple(tuple(row) for row in p)


def revolve_dp_min_forwards(l: int, s: int) -> int:  # noqa: E741 (the paper's name)
    """:func:`revolve_dp_table` at ``(l, s)``; ``ValueError`` where not reversible."""
    if l < 0 or s < 0:
        raise ValueError("revolve_dp_min_forwards: l and s must be >= 0")
    value = revolve_dp_table(l, s)[l][s]
    if value is None:
        raise ValueError("cannot reverse more than one step with 0 checkpoints")
    return value


@lru_cache(maxsize=65536)
def _revolve_cost(l: int, s: int) -> int | None:  # noqa: E741
    if l >= 2 and s == 0:
        return None
    return revolve_min_forwards(l, s)


def revolve_schedule(chain: Chain, slots_count: int) -> Schedule:
    """Binomial (Revolve) schedule with ``slots_count`` checkpoint slots for stored inputs.

    Homogeneous view: every stage counts as one step. ``x_0`` occupies one slot. To reverse stages
    ``[i, j)`` with ``s`` slots: if ``j = i + 1`` run ``forward_keep_all(i), backward(i)``; else
    keep ``x_i`` (``forward_keep_input``), advance with ``forward_drop`` to ``x_k``, reverse
    ``[k, j)`` with ``s - 1`` slots, then ``[i, k)`` with ``s``. The split ``k`` minimises
    ``(k - i) + t(j - k, s - 1) + t(k - i, s)`` with ``t`` the closed form of
    :func:`revolve_min_forwards`, so the schedule re-advances each step several times and its
    recompute count (stage forwards beyond one each) equals ``t(n, slots_count)``.
    Source: Griewank & Walther 2000, "Algorithm 799: Revolve", ACM TOMS 26(1), §2-3.
    """
    n = chain.length
    if isinstance(slots_count, bool) or not isinstance(slots_count, int) or slots_count < 1:
        raise ValueError(f"revolve needs at least one checkpoint slot, got {slots_count!r}")
    steps: list[Step] = []
    stack: list[tuple[int, int, int] | Step] = [(0, n, slots_count)]
    while stack:
        item = stack.pop()
        if isinstance(item, Step):
            steps.append(item)
            continue
        i, j, s = item
        length = j - i
        if length == 1:
            steps += [Step(FORWARD_KEEP_ALL, i), Step(BACKWARD, i)]
            continue
        best_k, best_cost = -1, None
        for adv in range(1, length):
            right = _revolve_cost(length - adv, s - 1)
            if right is None:
                continue
            cost = adv + right + _revolve_cost(adv, s)
            if best_cost is None or cost < best_cost:
                best_k, best_cost = i + adv, cost
        k = best_k
        steps.append(Step(FORWARD_KEEP_INPUT, i))
        steps.extend(Step(FORWARD_DROP, p) for p in range(i + 1, k))
        stack.append((i, k, s))
        stack.append((k, j, s - 1))
    return tuple(steps)


# --------------------------------------------------------------------------------------------
# Optimal persistent schedules (Beaumont et al. 2019)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _make_result(
    chain: Chain,
    steps: Schedule,
    budget_bytes: int,
    slot_bytes: int,
    slots: int,
    total_flops: int | None = None,
    in_flight: Fraction = Fraction(1),
) -> ScheduleResult:
    replay = simulate(chain, steps)
    if total_flops is None:
        total_flops = replay.total_flops
    elif total_flops != replay.total_flops:
        raise RuntimeError(
            f"internal error: solver cost {total_flops} != replayed cost {replay.total_flops}"
        )
    held = held_after_forward_bytes(chain, replay)
    peak = pipeline_peak_bytes(chain, replay, in_flight)
    if peak > budget_bytes:
        raise RuntimeError(
            f"internal error: replayed peak {peak} ({in_flight} in flight) exceeds budget "
            f"{budget_bytes}"
        )
    base = sum(chain.forward_flops) + sum(chain.backward_flops)
    return ScheduleResult(
        steps=steps,
        peak_bytes=replay.peak_bytes,
        total_flops=total_flops,
        recompute_flops=total_flops - base,
        budget_bytes=budget_bytes,
        slot_bytes=slot_bytes,
        slots=slots,
        replay=replay,
        in_flight=in_flight,
        held_bytes=held,
        pipeline_peak_bytes=peak,
    )


def optimal_schedule(
    chain: Chain, budget_bytes: int, slots: int = 500, in_flight: int | Fraction = 1
) -> ScheduleResult | None:
    """Cheapest persistent schedule whose (pipeline) peak fits ``budget_bytes``; None if none fits.

    Source: Beaumont, Eyraud-Dubois, Herrmann, Joly, Shilova 2019, "Optimal checkpointing for
    heterogeneous chains: how to train deep neural networks with limited memory" (rotor,
    hal-02352969): optimal persistent schedules have the recursive structure below, solved by a
    dynamic program over (memory, start, end of the sub-chain). derived: the memory terms are
    re-derived for this module's chain model (tape includes the input, pending outputs, explicit
    workspaces) from the accounting in the module docstring; tests check them against
    :func:`brute_force_optimal`, which replays every persistent schedule.

    Sub-problem ``C(i, j, m)``: ``x_i`` and ``δ_j`` are live, reverse stages ``[i, j)`` within
    ``m`` memory (its own bytes: ``x_i``, ``δ_j`` and everything it creates). With
    ``g_p = x_p + fws_p + x_{p+1}`` and ``bwd_i = tape_i + x_{i+1} + bws_i + x_i``:

    * ``j = i + 1``: keep_all(i), backward(i); needs ``m >= max(x_j + g_i, bwd_i)``.
    * "chain": keep_all(i), solve ``C(i+1, j, m - tape_i)``, backward(i);
      cost ``f_i + b_i + C(i+1, j, m - tape_i)``, needs ``m >= max(x_j + g_i, bwd_i)``.
    * "leaf" at ``i < k < j``: keep_input(i), drop(i+1..k-1), ``C(k, j, m - x_i)``, then
      ``C(i, k, m)``; cost ``sum f_i..f_{k-1} + C(k, j, m - x_i) + C(i, k, m)``, needs
      ``m >= x_j + max(g_i, x_i + max_{i<p<k} g_p)``.

    Pipelining (``in_flight = q > 1``, an int or a Fraction): the budget bounds
    :func:`pipeline_peak_bytes`, ``peak + (q - 1) * held``. derived: ``held`` is the sum of the
    items stored on the *first-pass path* (the top problem and the right sub-problems
    ``C(k, n, .)`` it reaches by "chain", storing ``tape_i``, and "leaf", storing ``x_i``, down
    to the base's ``tape_{n-1}``); the waiting micro-batches hold it at *every* instant of the
    step, the forward pass included (before this micro-batch has stored those items). So a
    schedule fits iff, for some ``H``, its held bytes are ``<= H`` and its one-micro-batch peak
    is ``<= B - ceil((q - 1) H)``. For each ``H`` (slots, with ``B - ceil((q - 1) H) >= H + δ_n``)
    the first-pass table ``P_H(i, h)`` reverses ``[i, n)`` from ``x_i`` with held allowance ``h``
    and own memory ``c_H + h``, ``c_H = B - ceil((q - 1) H) - H`` (storing ``w`` takes ``w`` from
    both, so ``c_H`` is invariant down the path):

    * ``i = n - 1``: ``f_i + b_i``; needs ``tape_i <= h`` and ``c_H + h >= max(x_n + g_i, bwd_i)``.
    * "chain": ``f_i + b_i + P_H(i+1, h - tape_i)``; needs ``tape_i <= h`` and the same threshold.
    * "leaf" at ``i < k < n``: ``sum f_i..f_{k-1} + P_H(k, h - x_i) + C(i, k, c_H + h)``; needs
      ``x_i <= h`` and the leaf threshold on ``c_H + h``.

    The answer is ``min_H P_H(0, H)``. The left sub-problems are regular ``C(i, k, .)``: they run
    once the path below them is reversed, within what the path's live items and the waiting
    micro-batches leave.

    Sizes are discretised into slots of ``ceil(budget / slots)`` bytes, every size rounded up,
    so the discretised schedule fits at exact sizes too (the result may miss schedules that fit
    only at exact sizes; ``slots >= budget_bytes`` is exact). The table is vectorised with NumPy
    over the memory axis and the split point: O(n^3 * slots) work, O(n^2 * slots) memory. The
    first-pass tables are vectorised over (split, ``H``, ``h``), in blocks of rows ``H``:
    O(n^2 * (slots / q)^2) more work (``H <= slots / q``); exact for Fraction ``q`` (``ceil``).
    The returned costs are the DP's; the peaks are the exact replay of the schedule.
    """
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int):
        raise ValueError(f"budget_bytes must be an int, got {budget_bytes!r}")
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise ValueError(f"slots must be a positive int, got {slots!r}")
    q = _in_flight(in_flight)
    unit = max(1, _ceil_div(budget_bytes, slots))
    mem = budget_bytes // unit
    # No recomputation is the cheapest schedule there is: when it fits at exact sizes, it is the
    # answer, even where rounding sizes up to slots would make the DP miss it.
    plain = store_all_schedule(chain)
    if pipeline_peak_bytes(chain, simulate(chain, plain), q) <= budget_bytes:
        return _make_result(chain, plain, budget_bytes, unit, mem, None, q)
    solved = _solve_persistent(chain, unit, mem, q)
    if solved is None:
        return None
    steps, dp_cost = solved
    return _make_result(chain, steps, budget_bytes, unit, mem, dp_cost, q)


class _Rotor(NamedTuple):
    """The regular table ``C(i, k, .)`` (``table[i][k - i]``, decisions in ``what``) and the
    discretised sizes it was built from."""

    a: list[int]
    tp: list[int]
    g: list[int]
    bwd: list[int]
    prefix: list[int]
    runs: list[list[tuple[int, int]]]
    table: list
    what: list
    exact: bool
    inf: int | float


def _solve_persistent(
    chain: Chain, unit: int, mem: int, in_flight: Fraction = Fraction(1)
) -> tuple[Schedule, int | None] | None:
    """Solve the DP of :func:`optimal_schedule` and backtrack.

    Returns ``(steps, dp_cost)`` (``dp_cost`` None if the float64 fallback was used) or None.
    """
    n = chain.length
    if in_flight == 1:
        rotor = _rotor_table(chain, unit, mem, n)
        if rotor.what[0][n, mem] < 0:
            return None
        steps = _backtrack(rotor.what, rotor.a, rotor.tp, 0, n, mem)
        return steps, (int(rotor.table[0][n, mem]) if rotor.exact else None)
    # The first-pass tables need C(i, k, .) for k < n only.
    return _solve_pipelined(chain, _rotor_table(chain, unit, mem, n - 1), mem, in_flight)


def _rotor_table(chain: Chain, unit: int, mem: int, last_j: int) -> _Rotor:
    """Fill the rotor-style table for ``j <= last_j``; see :func:`optimal_schedule`.

    Loop order: ``j`` ascending, ``i`` descending, so that ``C(k, j)`` (``k > i``) sits in a
    contiguous per-``j`` buffer and ``C(i, k)`` (``k < j``) in the table row of ``i``; each
    ``(i, j)`` is one vectorised operation over (split ``k``) x (memory ``m``).
    """
    import numpy as np

    n = chain.length
    f, b = chain.forward_flops, chain.backward_flops
    a = [_ceil_div(x, unit) for x in chain.input_bytes]
    tp = [_ceil_div(x, unit) for x in chain.tape_bytes]
    fw = [_ceil_div(x, unit) for x in chain.forward_workspace_bytes]
    bw = [_ceil_div(x, unit) for x in chain.backward_workspace_bytes]
    g = [a[p] + fw[p] + a[p + 1] for p in range(n)]
    bwd = [tp[i] + a[i + 1] + bw[i] + a[i] for i in range(n)]

    # Exact int64 arithmetic when every finite cost fits (a stage is re-forwarded at most once
    # per enclosing sub-problem, so n * sum(f) + sum(b) bounds any persistent schedule); sums of
    # two table entries and a prefix stay below 2**63, and table entries are clamped to ``inf``.
    exact = n * sum(f) + sum(b) < 2**60
    if exact:
        dtype, inf = np.int64, 2**61
    else:
        dtype, inf = np.float64, np.inf
    width = mem + 1
    # Row i holds C(i, k, .) at index k - i (k = i..n; index 0 unused): half of an n x n table.
    # what[i][k - i, m]: 0 = keep_all(i) ("chain" or the single-stage base), k' > 0 = leaf at k'.
    table = [np.full((n + 1 - i, width), inf, dtype=dtype) for i in range(n)]
    what = [
        np.full((n + 1 - i, width), -1, dtype=np.int16 if n < 2**15 else np.int32) for i in range(n)
    ]
    column = np.full((n + 1, width), inf, dtype=dtype)  # C(., j, .) for the current j
    prefix = [0]
    for x in f:
        prefix.append(prefix[-1] + x)
    prefix_arr = np.array(prefix, dtype=dtype)
    back = [0]
    for x in b:
        back.append(back[-1] + x)

    # Leaf thresholds: m >= x_j + h(i, k), h(i, k) = max(g_i, x_i + max_{i<p<k} g_p), which is
    # non-decreasing in k; runs[i] lists (first k, h) where h changes, to mask whole row blocks.
    h_rows: list[list[int]] = []
    runs: list[list[tuple[int, int]]] = []
    for i in range(n):
        row, run, pm = [], [], 0
        for k in range(i + 1, n + 1):
            if k > i + 1:
                pm = max(pm, g[k - 1])
            h = max(g[i], a[i] + pm)
            if not row or h != row[-1]:
                run.append((k, h))
            row.append(h)
        h_rows.append(row)
        runs.append(run)

    for j in range(1, last_j + 1):
        column.fill(inf)
        i = j - 1
        thr = max(a[j] + g[i], bwd[i])
        if thr <= mem:
            column[i, thr:] = f[i] + b[i]
            what[i][j - i, thr:] = 0
        table[i][j - i] = column[i]
        for i in range(j - 2, -1, -1):
            best = column[i]
            choice = what[i][j - i]
            # "chain" option: keep_all(i), C(i+1, j, m - tape_i), backward(i).
            thr_a = max(a[j] + g[i], bwd[i])
            if thr_a <= mem:
                sh = tp[i]
                best[thr_a:] = column[i + 1, thr_a - sh : width - sh] + (f[i] + b[i])
                if exact:
                    np.minimum(best, inf, out=best)
                choice[thr_a:] = np.where(best[thr_a:] < inf, 0, -1)
            # "leaf" options: keep x_i, advance to x_k, C(k, j, m - x_i), then C(i, k, m).
            # Where the chain option already costs the no-recompute bound, no leaf is better.
            hi = width
            if thr_a <= mem:
                done = best[thr_a:] == prefix[j] - prefix[i] + back[j] - back[i]
                if done.any():
                    hi = thr_a + int(done.argmax())
            lo = a[j] + h_rows[i][0]
            if lo < hi:
                sh = a[i]
                cand = column[i + 1 : j, lo - sh : hi - sh] + table[i][1 : j - i, lo:hi]
                cand += (prefix_arr[i + 1 : j] - prefix[i])[:, None]
                run = runs[i]
                for r in range(1, len(run)):
                    k0, h = run[r]
                    if k0 >= j:
                        break
                    k1 = run[r + 1][0] if r + 1 < len(run) else j
                    cand[k0 - i - 1 : k1 - i - 1, : min(a[j] + h, hi) - lo] = inf
                low = cand.min(axis=0)
                better = low < best[lo:hi]
                if better.any():
                    k_best = (cand == low).argmax(axis=0) + (i + 1)
                    best[lo:hi] = np.where(better, low, best[lo:hi])
                    choice[lo:hi] = np.where(better, k_best, choice[lo:hi])
            if exact:
                np.minimum(best, inf, out=best)
            table[i][j - i] = best

    return _Rotor(a, tp, g, bwd, prefix, runs, table, what, exact, inf)


# First-pass rows H are filled in blocks of at most this many rows and this many entries
# (stages x rows x allowances h), which bounds the table and the per-stage candidates (16 MiB
# each) and the columns h > H a row computes for nothing.
_FIRST_PASS_ROWS = 32
_FIRST_PASS_BLOCK = 1 << 21


def _least_held(n: int, r: _Rotor) -> list[int]:
    """``least[i]``: the fewest slots a first-pass path from node ``i`` can hold (``P(i, h)`` is
    infinite below it): ``tape_{n-1}`` at the base, then ``tape_i`` or ``x_i`` plus the rest."""
    least = [0] * n
    least[n - 1] = r.tp[n - 1]
    for i in range(n - 2, -1, -1):
        least[i] = min(r.tp[i] + least[i + 1], r.a[i] + min(least[i + 1 :]))
    return least


def _first_pass_rows(n: int, r: _Rotor, mem: int, in_flight: Fraction) -> list[int]:
    """Held allowances ``H`` worth a row: at least what any path holds, and the own memory must
    hold the held items and ``δ_n`` (a row whose schedule holds less is beaten by a lower row)."""
    rows = []
    held = _least_held(n, r)[0]
    while mem - math.ceil((in_flight - 1) * held) >= held + r.a[n]:
        rows.append(held)
        held += 1
    return rows


def _solve_pipelined(
    chain: Chain, r: _Rotor, mem: int, in_flight: Fraction
) -> tuple[Schedule, int | None] | None:
    """``min_H P_H(0, H)`` over blocks of rows, then one row again with its decisions."""
    import numpy as np

    n = chain.length
    rows = _first_pass_rows(n, r, mem, in_flight)
    no_recompute = sum(chain.forward_flops) + sum(chain.backward_flops)
    best = None  # (cost, H)
    start = 0
    while start < len(rows):
        end = start + 1
        while (
            end < len(rows)
            and end - start < _FIRST_PASS_ROWS
            and (end + 1 - start) * (rows[end] + 1) * n <= _FIRST_PASS_BLOCK
        ):
            end += 1
        block = rows[start:end]
        table, _ = _first_pass_block(chain, r, mem, in_flight, block, record=False)
        tops = table[0][np.arange(len(block)), block]
        at = int(tops.argmin())
        if tops[at] < r.inf and (best is None or tops[at] < best[0]):
            best = (tops[at], block[at])
            if best[0] <= no_recompute:
                break
        start = end
    if best is None:
        return None
    held = best[1]
    table, choice = _first_pass_block(chain, r, mem, in_flight, [held], record=True)
    c = mem - math.ceil((in_flight - 1) * held) - held
    steps = _backtrack_first_pass(n, r, choice[:, 0, :], c, held)
    return steps, (int(table[0, 0, held]) if r.exact else None)


def _first_pass_block(chain: Chain, r: _Rotor, mem: int, in_flight: Fraction, block, record):
    """``P_H(i, h)`` for the rows ``H`` in ``block`` (ascending) and ``h <= max(block)``, as an
    array ``[i, row, h]``, with the decisions (0: keep_all, k > 0: leaf at k) if ``record``.

    Entries with ``h > H`` are never read (children have smaller allowances); their own memory
    may exceed ``mem`` and reads past the regular table see ``inf``.
    """
    import numpy as np

    n = chain.length
    f, b = chain.forward_flops, chain.backward_flops
    a, tp, g, bwd, prefix, runs, inf = r.a, r.tp, r.g, r.bwd, r.prefix, r.runs, r.inf
    dtype = r.table[0].dtype
    nb, nh = len(block), block[-1] + 1
    c = np.array([mem - math.ceil((in_flight - 1) * held) - held for held in block])
    own = c[:, None] + np.arange(nh)[None, :]  # own memory of a node with allowance h, per row
    table = np.full((n, nb, nh), inf, dtype=dtype)
    choice = np.full((n, nb, nh), -1, dtype=np.int32) if record else None
    prefix_arr = np.array(prefix, dtype=dtype)
    least = _least_held(n, r)
    for i in range(n - 1, -1, -1):
        best = table[i]
        # "chain" (the base at i = n - 1): keep_all(i), P(i+1, h - tape_i), backward(i).
        w = tp[i]
        if w < nh:
            if i == n - 1:
                best[:, w:] = f[i] + b[i]
            else:
                best[:, w:] = table[i + 1][:, : nh - w] + (f[i] + b[i])
            best[own < max(a[n] + g[i], bwd[i])] = inf
            if r.exact:
                np.minimum(best, inf, out=best)
            if record:
                choice[i][best < inf] = 0
        # "leaf" at i < k < n: keep x_i, advance to x_k, P(k, h - x_i), then C(i, k, own).
        if i == n - 1:
            continue
        sh = a[i]
        lo = sh + min(least[i + 1 :])  # P(k, h - x_i) is infinite below
        if lo >= nh:
            continue
        ks = n - 1 - i
        # C(i, k, .) + f_i + ... + f_{k-1} for k = i+1..n-1, padded with inf past ``mem``.
        left = np.full((ks, mem + 1 + nh), inf, dtype=dtype)
        left[:, : mem + 1] = r.table[i][1 : n - i] + (prefix_arr[i + 1 : n] - prefix[i])[:, None]
        run = runs[i]
        for q, (k0, h) in enumerate(run):
            if k0 >= n:
                break
            k1 = min(run[q + 1][0], n) if q + 1 < len(run) else n
            left[k0 - i - 1 : k1 - i - 1, : a[n] + h] = inf  # leaf threshold x_n + h(i, k)
        windows = np.lib.stride_tricks.sliding_window_view(left, nh - lo, axis=1)
        cand = windows[:, c + lo, :]  # at own memory c_H + h, h >= lo: (k, row, h - lo)
        cand += table[i + 1 : n, :, lo - sh : nh - sh]
        if record:
            k_rel = cand.argmin(axis=0)
            low = np.take_along_axis(cand, k_rel[None], axis=0)[0]
        else:
            low = cand.min(axis=0)
        sub = best[:, lo:]
        better = low < sub
        sub[better] = low[better]
        if record:
            choice[i][:, lo:][better] = (k_rel + (i + 1))[better]
        if r.exact:
            np.minimum(best, inf, out=best)
    return table, choice


def _backtrack_first_pass(n: int, r: _Rotor, choice, c: int, held: int) -> Schedule:
    """Walk the first-pass path from ``(0, held)``, then the left sub-problems and backwards it
    left behind, innermost first."""
    steps: list[Step] = []
    after: list[tuple[int, int, int] | Step] = []
    i, h = 0, held
    while True:
        k = int(choice[i, h])
        if k < 0:
            raise RuntimeError(f"internal error: no first-pass decision for ({i}, {h})")
        if i == n - 1:
            steps += [Step(FORWARD_KEEP_ALL, i), Step(BACKWARD, i)]
            break
        if k == 0:
            steps.append(Step(FORWARD_KEEP_ALL, i))
            after.append(Step(BACKWARD, i))
            i, h = i + 1, h - r.tp[i]
        else:
            steps.append(Step(FORWARD_KEEP_INPUT, i))
            steps.extend(Step(FORWARD_DROP, p) for p in range(i + 1, k))
            after.append((i, k, c + h))
            i, h = k, h - r.a[i]
    for item in reversed(after):
        if isinstance(item, Step):
            steps.append(item)
        else:
            steps.extend(_backtrack(r.what, r.a, r.tp, *item))
    return tuple(steps)


def _backtrack(what, a: list[int], tp: list[int], i: int, j: int, mem: int) -> Schedule:
    """Rebuild the schedule of ``C(i, j, mem)`` from the decision table (iteratively: chains can
    be deep)."""
    steps: list[Step] = []
    stack: list[tuple[int, int, int] | Step] = [(i, j, mem)]
    while stack:
        item = stack.pop()
        if isinstance(item, Step):
            steps.append(item)
            continue
        i, j, m = item
        c = int(what[i][j - i, m])
        if c < 0:
            raise RuntimeError(f"internal error: no decision for ({i}, {j}, {m})")
        if j == i + 1:
            steps += [Step(FORWARD_KEEP_ALL, i), Step(BACKWARD, i)]
        elif c == 0:
            steps.append(Step(FORWARD_KEEP_ALL, i))
            stack.append(Step(BACKWARD, i))
            stack.append((i + 1, j, m - tp[i]))
        else:
            steps.append(Step(FORWARD_KEEP_INPUT, i))
            steps.extend(Step(FORWARD_DROP, p) for p in range(i + 1, c))
            stack.append((i, c, m))
            stack.append((c, j, m - a[i]))
    return tuple(steps)


# --------------------------------------------------------------------------------------------
# Exhaustive search (tests)


def enumerate_persistent_schedules(n: int) -> Iterator[Schedule]:
    """Every persistent schedule of an ``n``-stage chain (the decision structure of rotor).

    To reverse ``[i, j)`` from ``x_i``: either store the tape of stage ``i`` and continue, or keep
    ``x_i`` and advance (dropping) to any ``k`` in ``(i, j)``, reverse ``[k, j)``, then ``[i, k)``.
    Counts are the large Schröder numbers 1, 2, 6, 22, 90, 394, 1806, ...
    Source: Beaumont et al. 2019 (rotor), the characterisation of persistent schedules.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"a chain needs at least one stage, got {n!r}")
    yield from _persistent_schedules(0, n)


@lru_cache(maxsize=4096)
def _persistent_schedules(i: int, j: int) -> tuple[Schedule, ...]:
    if j == i + 1:
        return ((Step(FORWARD_KEEP_ALL, i), Step(BACKWARD, i)),)
    out: list[Schedule] = []
    head_all = (Step(FORWARD_KEEP_ALL, i),)
    tail = (Step(BACKWARD, i),)
    out.extend(head_all + rest + tail for rest in _persistent_schedules(i + 1, j))
    for k in range(i + 1, j):
        head = (Step(FORWARD_KEEP_INPUT, i), *(Step(FORWARD_DROP, p) for p in range(i + 1, k)))
        for right in _persistent_schedules(k, j):
            out.extend(head + right + left for left in _persistent_schedules(i, k))
    return tuple(out)


def brute_force_optimal(
    chain: Chain, budget_bytes: int, in_flight: int | Fraction = 1
) -> ScheduleResult | None:
    """Exhaustive search: replay every persistent schedule, keep the cheapest that fits.

    derived: independent of the DP's memory equations — each candidate's peak and cost come from
    :func:`simulate` (with ``in_flight`` micro-batches, its :func:`pipeline_peak_bytes` must
    fit). Exact bytes, no discretisation. For chains of at most ``BRUTE_FORCE_MAX_STAGES``
    stages (1806 schedules at 7 stages).
    """
    n = chain.length
    if n > BRUTE_FORCE_MAX_STAGES:
        raise ValueError(f"brute force is limited to {BRUTE_FORCE_MAX_STAGES} stages, got {n}")
    q = _in_flight(in_flight)
    best: tuple[int, Schedule] | None = None
    for steps in enumerate_persistent_schedules(n):
        replay = simulate(chain, steps)
        if pipeline_peak_bytes(chain, replay, q) > budget_bytes:
            continue
        if best is None or replay.total_flops < best[0]:
            best = (replay.total_flops, steps)
    if best is None:
        return None
    return _make_result(chain, best[1], budget_bytes, 1, budget_bytes, in_flight=q)
