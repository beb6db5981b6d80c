"""The chain of stages and the exact memory replay every scheduler is measured by.

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
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import NamedTuple

FORWARD_DROP = "forward_drop"
FORWARD_KEEP_INPUT = "forward_keep_input"
FORWARD_KEEP_ALL = "forward_keep_all"
BACKWARD = "backward"
FORWARD_KINDS = frozenset({FORWARD_DROP, FORWARD_KEEP_INPUT, FORWARD_KEEP_ALL})
STEP_KINDS = frozenset({*FORWARD_KINDS, BACKWARD})


def _int_tuple(name: str, values: Sequence[int], length: int) -> tuple[int, ...]:
    """Validate a sequence of non-negative integers and return it as a tuple of Python ints."""
    if isinstance(values, (str, bytes)):
        raise ValueError(f"{name} must be a sequence of integers")
    # The common case, checked in C: plain ints, none negative (else the loop below says
    # which value is wrong).
    if (
        isinstance(values, (tuple, list))
        and len(values) == length
        and (not values or (set(map(type, values)) == {int} and min(values) >= 0))
    ):
        return tuple(values)
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
    stage_group: int = 1  # >1: the DP ran on groups of up to this many stages (grouping.py)

    @property
    def forward_flops(self) -> int:
        return self.replay.forward_flops

    @property
    def backward_flops(self) -> int:
        return self.replay.backward_flops

    @property
    def layer_forwards(self) -> tuple[int, ...]:
        return self.replay.layer_forwards


def in_flight_fraction(value: int | Fraction) -> Fraction:
    """Validate ``in_flight`` (an int or a Fraction, >= 1) and return it as a Fraction."""
    if isinstance(value, bool) or not isinstance(value, numbers.Rational):
        raise ValueError(f"in_flight must be an int or a Fraction, got {value!r}")
    m = Fraction(value)
    if m < 1:
        raise ValueError(f"in_flight must be >= 1, got {value!r}")
    return m


def held_after_forward_bytes(chain: Chain, replay: Replay, output_held: bool = True) -> int:
    """What one micro-batch leaves alive between its forward pass and its backward pass (its
    checkpoints and tapes): the after-figure of the first forward of the last stage, less δ_n,
    which the replay counts from the start but which arrives only with the backward pass.

    ``output_held=False``: less the last stage's tape too (its input included), for waiting
    micro-batches that never ran the last stage. derived: on the last rank of Megatron-LM's
    interleaved schedule the waiting chunk forwards are those of its first v - 1 model chunks,
    which hold no output layer, and each chunk's output is freed once sent
    (megatron/core/pipeline_parallel/schedules.py `deallocate_output_tensor`).
    """
    last = chain.length - 1
    end_of_forward = next(
        index
        for index, point in enumerate(replay.trace)
        if point.step.stage == last and point.step.kind != BACKWARD
    )
    held = replay.trace[end_of_forward].after_bytes - chain.input_bytes[-1]
    return held if output_held else held - chain.tape_bytes[-1]


def pipeline_peak_bytes(
    chain: Chain, replay: Replay, in_flight: int | Fraction = 1, output_held: bool = True
) -> int:
    """Peak of a pipeline stage running ``replay``'s schedule with ``in_flight`` micro-batches.

    derived (1F1B): while one micro-batch runs the schedule, ``in_flight - 1`` others wait for
    their backward, each holding :func:`held_after_forward_bytes`, so the stage peaks at
    ``replay.peak_bytes + (in_flight - 1) * held``. A fractional product is rounded up to a
    whole byte, so ``pipeline_peak_bytes(...) <= budget`` exactly when the exact (Fraction)
    peak fits ``budget``. ``in_flight = 1`` gives ``replay.peak_bytes``. ``output_held``: see
    :func:`held_after_forward_bytes`.
    """
    m = in_flight_fraction(in_flight)
    if m == 1:
        return replay.peak_bytes
    held = held_after_forward_bytes(chain, replay, output_held)
    return replay.peak_bytes + math.ceil((m - 1) * held)
