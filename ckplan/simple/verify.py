"""Run checkpointing schedules on the NumPy MLP and measure them (`ckplan verify`).

The network: L layers of ``relu(x @ w1 + b1) @ w2 + b2``, width d,
hidden f, b rows, float64. The plain step (``model_forward`` / ``model_backward``) keeps
each layer's input and rebuilds the hidden activation in the backward pass; its checkpointed step
(``model_forward_checkpointed`` / ``model_backward_checkpointed``) keeps segment inputs and
re-runs each segment. This module runs *any* schedule of :mod:`ckplan.schedules` on that network:
the plain step is ``store_all``, the segments of K layers are ``uniform:K``, and ``sequential:K``,
``sqrt``, ``block:N``, ``revolve:C`` and ``optimal`` are just other schedules. One executor runs
them all, step by step, holding exactly the arrays that ``schedules.simulate`` says are live and
dropping every other reference, so CPython frees each array the moment the plan says it is dead.

What is measured for one run, and how:

* **gradients**: every weight, bias and input gradient, compared bit for bit (the float64 bit
  patterns) with the plain, un-checkpointed step (:func:`reference_step`, fresh arrays). The
  executor does the same arithmetic in place (each rounding the same), and recomputation re-runs
  the same deterministic kernels on the same inputs, so the gradients are identical to the last
  bit; ``max_abs_grad_diff`` says by how much when not.
* **peak memory**: ``tracemalloc`` (NumPy reports its data allocations to it) over one step: the
  peak of traced bytes minus the traced bytes before the step's input ``x_0`` and output gradient
  ``δ_L`` were allocated. Parameters and the parameter-gradient buffers are allocated before that
  (the gradients are preallocated and written in place with ``out=``), so the peak is the
  activation peak that the planner predicts; both are reported separately.
* **layer forwards and FLOPs**: counted as the executor runs (every matmul adds 2·m·n·k from its
  operands' actual shapes); element-wise ops count 0, as in :mod:`ckplan.ops`.
* **offload** (``offload``, ``offload+optimal``, ``full+offload``): an offloaded tape (or
  checkpointed input) is copied into a host pool
  (:class:`HostPool`, one buffer allocated before the step is traced, so only device arrays are
  traced) when the forward after it ends, and copied back into a fresh device array when the
  step its prefetch overlaps starts, as ``schedules.offload`` rules O1-O3 say; the pool counts
  its bytes in use (host peak, a slot reserved when its copy starts) and the bytes copied both
  ways.
* **time**: the median of several untraced runs of the step, beside the time model's prediction
  (``hardware.step_time`` on a ``cpu`` profile probed on the spot, ``hardware.cpu``: the
  layer's GEMM rate, the element-wise bandwidth at its array size, and the cost of one NumPy
  call, times the calls this executor makes).

The predictions come from the planner itself: ``plans.evaluate`` on a ``kind: mlp`` spec (peak
``activation_bytes``, FLOPs ``flops.total``) and ``schedules.simulate`` on ``plans.layer_chain``
(layer forwards per stage) — the same code the CLI runs. The layer transients are
``simple.mlp.forward_workspace_bytes`` / ``backward_workspace_bytes``, derived from the layer
code below.

Timing is the only impure part; everything else is deterministic for a given ``seed``.
"""

from __future__ import annotations

import math
import statistics
import time
import tracemalloc
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from ckplan.hardware.cpu import CPUProfile, measure_cpu_profile, median_profile
from ckplan.hardware.step_time import step_time
from ckplan.model.spec import ModelSpec, spec_from_mapping
from ckplan.plan import Plan, StrategyError, evaluate, layer_chain, parse_strategy
from ckplan.schedules import (
    BACKWARD,
    FORWARD_DROP,
    FORWARD_KEEP_ALL,
    FORWARD_KEEP_INPUT,
    Step,
    simulate,
)
from ckplan.schedules.offload import offload_window, offload_windows

PEAK_TOLERANCE = 0.05  # measured peak within ±5 % of the predicted peak
DEFAULT_REPEATS = 3
# What one verify run may allocate and compute, checked before it starts: its arrays live in
# this process, its FLOPs run on the CPU (10-35 GFLOP/s per core measured, README "Verify").
MAX_ARRAY_BYTES = 4 * 2**30
MAX_TOTAL_FLOPS = 10**13  # ~10 minutes on one core; the README's L=32, d=512 run is 4.2e12
MAX_REPEATS = 100
DTYPE_BYTES = 8  # float64

Params = list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]
# The device `offload+optimal` is planned for here: 10 GFLOP/s (a core's float64 GEMMs) with
# the default host link (hardware.gpus: PCIe Gen4 x16 at 0.8); verify measures the memory of
# the schedule it chooses, not its time.
NOMINAL_DEVICE = CPUProfile(flops_per_s=1e10, bytes_per_s=1e10, call_seconds=0.0).as_gpu()


# ---- the network --------------------------------------------------------------------------


def mlp_spec(layers: int, hidden: int, ffn_hidden: int, batch: int) -> ModelSpec:
    """The ``kind: mlp`` spec of the NumPy MLP in float64 (``dtype_bytes: 8``)."""
    return spec_from_mapping(
        {
            "name": f"seed-mlp-L{layers}-d{hidden}-f{ffn_hidden}-b{batch}",
            "source": "the NumPy MLP that ckplan verify runs (ckplan.simple)",
            "kind": "mlp",
            "layers": layers,
            "hidden": hidden,
            "ffn_hidden": ffn_hidden,
            "micro_batch": batch,
            "dtype_bytes": DTYPE_BYTES,
        },
        origin="verify",
    )


def init_network(spec: ModelSpec, seed: int = 0) -> tuple[Params, np.ndarray, np.ndarray]:
    """Parameters ``[(w1, b1, w2, b2)] * L``, input ``x`` (b, d), output gradient (b, d).

    He-style scales (w1 ~ N(0, 2/d), w2 ~ N(0, 1/f)) keep activations O(1) through L layers, so
    the check is not dominated by overflow or underflow; biases are small but non-zero.
    """
    rng = np.random.default_rng(seed)
    b, d, f = spec.micro_batch, spec.hidden, spec.ffn_hidden
    params = []
    for _ in range(spec.layers):
        w1 = rng.standard_normal((d, f)) * np.sqrt(2.0 / d)
        b1 = rng.standard_normal(f) * 0.1
        w2 = rng.standard_normal((f, d)) * np.sqrt(1.0 / f)
        b2 = rng.standard_normal(d) * 0.1
        params.append((w1, b1, w2, b2))
    x = rng.standard_normal((b, d))
    grad_output = rng.standard_normal((b, d))  # δ_L: the gradient of loss = Σ x_L ⊙ grad_output
    return params, x, grad_output


def gradient_buffers(params: Params) -> Params:
    """One (gw1, gb1, gw2, gb2) per layer, preallocated; the executor writes them with ``out=``."""
    return [tuple(np.empty_like(p) for p in layer) for layer in params]


# ---- the reference: the un-checkpointed step, written plainly ---------------------------


def reference_step(params: Params, x: np.ndarray, grad_output: np.ndarray):
    """The plain training step, no checkpointing, in fresh arrays: ``(δ_0, [(gw1, gb1, gw2,
    gb2)] per layer)``, the reference every schedule's gradients must match to the last bit.

    The plain algorithm (model_forward / model_backward): keep each layer's input,
    rebuild the hidden activation from it in the backward pass. The executor below does the same
    arithmetic in place, so any difference is a schedule that ran the wrong thing.
    """
    inputs = []
    for w1, b1, w2, b2 in params:
        inputs.append(x)
        x = np.maximum(x @ w1 + b1, 0) @ w2 + b2  # (b, d)
    grads = []
    g = grad_output
    for (w1, b1, w2, _), x_in in zip(reversed(params), reversed(inputs), strict=True):
        pre = x_in @ w1 + b1  # (b, f), rebuilt
        g_pre = (g @ w2.T) * (pre > 0)  # through fc2 and the ReLU
        grads.append((x_in.T @ g_pre, g_pre.sum(axis=0), np.maximum(pre, 0).T @ g, g.sum(axis=0)))
        g = g_pre @ w1.T  # δ_i (b, d)
    return g, grads[::-1]


# ---- the executor -------------------------------------------------------------------------


class _Counts:
    """Layer forwards per stage and matmul FLOPs, counted as they run."""

    def __init__(self, layers: int) -> None:
        self.layer_forwards = [0] * layers
        self.flops = 0

    def matmul(self, a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """``a @ b`` (into ``out`` if given), counting 2·m·n·k FLOPs from the actual shapes."""
        (m, k), (_, n) = a.shape, b.shape
        self.flops += 2 * m * n * k
        return np.matmul(a, b, out=out)


def _add_bias(a: np.ndarray, bias: np.ndarray) -> None:
    """``a += bias`` row by row. A broadcasting in-place add makes NumPy's iterator allocate a
    buffer (64 KiB at the default bufsize) that no formula should have to know about; row by row
    there is no temporary, and each element gets the same single rounding as the plain step's
    ``x @ w + b``."""
    for row in a:
        np.add(row, bias, out=row)


def layer_forward(x, w1, b1, w2, b2, counts: _Counts) -> np.ndarray:
    """``layer_forward``, ``relu(x @ w1 + b1) @ w2 + b2``, in place.

    Alive beyond ``x``: the hidden activation ``a`` (b, f) and the output (b, d) —
    ``simple.mlp.forward_workspace_bytes`` is the b·f part (the chain counts the output).
    """
    a = counts.matmul(x, w1)  # (b, f): fc1
    _add_bias(a, b1)
    np.maximum(a, 0.0, out=a)  # relu, in place
    y = counts.matmul(a, w2)  # (b, d): fc2
    _add_bias(y, b2)
    return y


def layer_backward(x, g, w1, b1, w2, b2, grads, counts: _Counts) -> np.ndarray:
    """``model_backward``'s body for one layer, in place; returns ``δ_i`` (b, d).

    Rebuilds ``h_pre`` and ``h`` from the stored input ``x`` as the plain step does. Weight and bias
    gradients go into the preallocated ``grads`` buffers. The mask ``(h_pre > 0)`` is built in
    place of ``h`` as 1.0/0.0 (``heaviside(h, 0)``; ``h > 0`` iff ``h_pre > 0``), so
    ``gh * mask`` has the plain step's bits (it multiplies by the bool mask promoted to 1.0/0.0).
    Transients: ``a`` and ``gh`` (2·b·f), then ``gh`` and ``δ_i`` (b·f + b·d) —
    ``simple.mlp.backward_workspace_bytes``.
    """
    gw1, gb1, gw2, gb2 = grads
    a = counts.matmul(x, w1)  # (b, f): h_pre, recomputed
    _add_bias(a, b1)
    np.maximum(a, 0.0, out=a)  # h = relu(h_pre)
    counts.matmul(a.T, g, out=gw2)  # gw2 = hᵀ @ g   (f, d)
    np.sum(g, axis=0, out=gb2)  # gb2 = Σ g       (d,)
    np.heaviside(a, 0.0, out=a)  # a = (h_pre > 0) as 1.0 / 0.0
    gh = counts.matmul(g, w2.T)  # (b, f)
    np.multiply(gh, a, out=gh)  # g_pre = gh * (h_pre > 0)
    del a
    gx = counts.matmul(gh, w1.T)  # δ_i (b, d)
    counts.matmul(x.T, gh, out=gw1)  # gw1 = xᵀ @ g_pre   (d, f)
    np.sum(gh, axis=0, out=gb1)  # gb1 = Σ g_pre  (f,)
    return gx


class HostPool:
    """Host memory for offloaded tapes: one float64 buffer with a fixed slot per offloaded
    stage, allocated before a step runs; counts the bytes reserved (its peak is the host peak)
    and the bytes copied in both directions."""

    def __init__(self, sizes: dict[int, int]) -> None:
        self.slots: dict[int, tuple[int, int]] = {}
        offset = 0
        for stage, values in sorted(sizes.items()):
            self.slots[stage] = (offset, values)
            offset += values
        self.buffer = np.empty(offset)
        self.in_use = self.peak = self.moved = 0

    def reserve(self, stage: int) -> None:
        """The copy of ``stage``'s tape starts: its host bytes are taken."""
        self.in_use += self.slots[stage][1] * DTYPE_BYTES
        self.peak = max(self.peak, self.in_use)

    def put(self, stage: int, array: np.ndarray) -> None:
        """Copy a device array into the stage's slot."""
        offset, values = self.slots[stage]
        self.buffer[offset : offset + values] = array.reshape(-1)
        self.moved += array.nbytes

    def take(self, stage: int, shape: tuple[int, ...]) -> np.ndarray:
        """A fresh device array with the stage's tape copied back."""
        offset, values = self.slots[stage]
        out = np.empty(shape)
        out.reshape(-1)[:] = self.buffer[offset : offset + values]
        self.moved += out.nbytes
        return out

    def release(self, stage: int) -> None:
        """The copy back is done: the stage's host bytes are free."""
        self.in_use -= self.slots[stage][1] * DTYPE_BYTES


def run_schedule(
    steps: Sequence[Step],
    params: Params,
    grads: Params,
    inputs: list[np.ndarray],
    offloaded: Sequence[int] = (),
    pool: HostPool | None = None,
) -> tuple[np.ndarray, _Counts]:
    """Run one training step along ``steps``; return ``(δ_0, counts)``.

    ``inputs`` is ``[x_0, δ_L]`` and is emptied: the executor owns those arrays, so it can free
    ``x_0`` when the schedule says (rule 6). Live values follow ``schedules.simulate`` exactly:
    activations ``acts`` (``checkpoints`` marks the kept ones), tapes (for this network a layer's
    tape is its input alone), and the one live gradient ``delta``. A forward's
    output is kept only when the next step is the forward of the next stage (rule 4), otherwise
    its reference is dropped at once. The schedule must be valid (``simulate`` it first).

    With ``offloaded`` stages and a ``pool`` (``schedules.offload``, rules O1-O3 and their
    checkpointed-input form): the tape (or checkpointed input) of an offloaded stage goes to the
    pool when the step after its first-pass ``forward_keep_all`` (``forward_keep_input``) ends,
    and comes back when the step its prefetch overlaps starts (``schedules.offload.
    offload_window``).
    """
    steps = tuple(steps)
    windows = offload_windows(steps, len(params)) if offloaded else None
    # per offloaded stage: (step its copy out overlaps, step its copy back overlaps, tape?)
    moves = {}
    for stage in offloaded:
        start, prefetch, tape = offload_window(steps, len(params), stage, windows)
        moves[stage] = (start + 1, prefetch, tape)
    outs = {out: stage for stage, (out, _, _) in moves.items()}
    backs = {back: stage for stage, (_, back, _) in moves.items()}
    shapes: dict[int, tuple[int, ...]] = {}
    delta = inputs.pop()
    acts: dict[int, np.ndarray] = {0: inputs.pop()}
    checkpoints = {0}
    tapes: dict[int, np.ndarray] = {}
    counts = _Counts(len(params))
    for t, step in enumerate(steps):
        i = step.stage
        back = backs.get(t)
        if back is not None:  # prefetch: the copy back overlapping this step starts
            held = tapes if moves[back][2] else acts
            held[back] = pool.take(back, shapes[back])
        if step.kind == BACKWARD:
            gx = layer_backward(tapes[i], delta, *params[i], grads[i], counts)
            del tapes[i]
            acts.pop(i, None)
            checkpoints.discard(i)
            delta = gx  # frees δ_{i+1}
            del gx
        else:
            y = layer_forward(acts[i], *params[i], counts)
            counts.layer_forwards[i] += 1
            if step.kind == FORWARD_DROP:
                if i not in checkpoints:
                    del acts[i]
            elif step.kind == FORWARD_KEEP_INPUT:
                checkpoints.add(i)
            elif step.kind == FORWARD_KEEP_ALL:
                tapes[i] = acts.pop(i)  # the tape absorbs x_i
                checkpoints.discard(i)
            nxt = steps[t + 1] if t + 1 < len(steps) else None
            if nxt is not None and nxt.kind != BACKWARD and nxt.stage == i + 1:
                acts[i + 1] = y  # pending: consumed by the next step
            del y  # otherwise dead, freed now
        out = outs.get(t)
        if out is not None:  # the copy overlapping this step ends: the device array goes
            held = tapes if moves[out][2] else acts
            pool.put(out, held[out])
            del held[out]
        if back is not None:  # the copy back is done: its host bytes are free
            pool.release(back)
        if step.kind != BACKWARD and i in moves and t + 1 == moves[i][0]:
            held = tapes if moves[i][2] else acts
            shapes[i] = held[i].shape
            pool.reserve(i)  # its copy to host starts as the next step does
    return delta, counts


# ---- measurement --------------------------------------------------------------------------


@dataclass(frozen=True)
class Prediction:
    peak_bytes: int
    layer_forwards: tuple[int, ...]  # per layer
    flops: int
    seconds: float | None = None  # the time model on the measured cpu profile
    host_peak_bytes: int = 0  # offload: pinned host bytes at the peak (schedules.offload)
    bytes_moved: int = 0  # offload: bytes copied to host and back
    offloaded: tuple[int, ...] = ()  # offload: the stages whose tapes go to host


@dataclass(frozen=True)
class Measurement:
    peak_bytes: int
    layer_forwards: tuple[int, ...]  # per layer
    flops: int
    seconds: float  # median
    all_seconds: tuple[float, ...]
    host_peak_bytes: int = 0  # the host pool's most bytes in use
    bytes_moved: int = 0  # the host pool's bytes copied, both ways


@dataclass(frozen=True)
class RunResult:
    strategy: str
    predicted: Prediction
    measured: Measurement
    gradients_identical: bool
    max_abs_grad_diff: float
    tolerance: float

    @property
    def peak_error(self) -> float:
        """measured / predicted - 1."""
        return self.measured.peak_bytes / self.predicted.peak_bytes - 1.0

    @property
    def peak_ok(self) -> bool:
        return abs(self.peak_error) <= self.tolerance

    @property
    def counts_ok(self) -> bool:
        return self.measured.layer_forwards == self.predicted.layer_forwards

    @property
    def flops_ok(self) -> bool:
        return self.measured.flops == self.predicted.flops

    @property
    def offload_ok(self) -> bool:
        """Host peak and bytes moved exactly as predicted (both 0 without offloading)."""
        return (self.measured.host_peak_bytes, self.measured.bytes_moved) == (
            self.predicted.host_peak_bytes,
            self.predicted.bytes_moved,
        )

    @property
    def ok(self) -> bool:
        return (
            self.gradients_identical
            and self.peak_ok
            and self.counts_ok
            and self.flops_ok
            and self.offload_ok
        )

    @property
    def recomputed_layers(self) -> int:
        return sum(self.measured.layer_forwards) - len(self.measured.layer_forwards)


@dataclass(frozen=True)
class VerifyReport:
    spec: ModelSpec
    runs: tuple[RunResult, ...]
    parameter_bytes: int
    gradient_bytes: int
    budget_bytes: int | None  # the activation budget the optimal schedule was solved for
    repeats: int
    tolerance: float
    seed: int
    profile: CPUProfile | None = None

    @property
    def ok(self) -> bool:
        return all(run.ok for run in self.runs)

    @property
    def baseline(self) -> RunResult | None:
        return next((run for run in self.runs if run.strategy == "none"), None)

    def overhead(self, run: RunResult) -> tuple[float, float] | None:
        """(predicted, measured) time overhead against ``none``: FLOPs ratio - 1, seconds
        ratio - 1."""
        base = self.baseline
        if base is None:
            return None
        predicted = run.predicted.flops / base.predicted.flops - 1.0
        measured = run.measured.seconds / base.measured.seconds - 1.0
        return predicted, measured


def measure_peak(
    steps: Sequence[Step],
    params: Params,
    grads: Params,
    x: np.ndarray,
    grad_output: np.ndarray,
    offloaded: Sequence[int] = (),
) -> tuple[int, np.ndarray, _Counts, HostPool]:
    """Peak traced bytes of one step above what was traced before ``x_0`` and ``δ_L`` existed,
    with the host pool of its ``offloaded`` stages (allocated before, so not in the peak).

    Works whether or not ``tracemalloc`` is already tracing (then its state is left as found).
    """
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    try:
        pool = HostPool(dict.fromkeys(offloaded, x.size))
        base = tracemalloc.get_traced_memory()[0]
        inputs = [x.copy(), grad_output.copy()]
        tracemalloc.reset_peak()
        dx, counts = run_schedule(steps, params, grads, inputs, offloaded, pool)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        if started:
            tracemalloc.stop()
    return peak, dx, counts, pool


def time_step(
    steps: Sequence[Step],
    params: Params,
    grads: Params,
    x: np.ndarray,
    grad_output: np.ndarray,
    repeats: int,
    offloaded: Sequence[int] = (),
) -> tuple[float, ...]:
    """Wall seconds of ``repeats`` runs of the step (input copies and the host pool made
    outside the timing)."""
    seconds = []
    for _ in range(repeats):
        inputs = [x.copy(), grad_output.copy()]
        pool = HostPool(dict.fromkeys(offloaded, x.size))
        start = time.perf_counter()
        run_schedule(steps, params, grads, inputs, offloaded, pool)
        seconds.append(time.perf_counter() - start)
    return tuple(seconds)


def compare_gradients(dx, grads, ref_dx, ref_grads) -> tuple[bool, float]:
    """(bit-identical, max |difference|) over the input gradient and every parameter gradient."""
    pairs = [(dx, ref_dx)]
    for layer, ref_layer in zip(grads, ref_grads, strict=True):
        pairs += list(zip(layer, ref_layer, strict=True))
    identical = all(
        a.shape == b.shape and np.array_equal(a.view(np.uint64), b.view(np.uint64))
        for a, b in pairs
    )
    diffs = [float(np.max(np.abs(a - b))) if a.shape == b.shape else math.inf for a, b in pairs]
    diff = max((d if math.isfinite(d) else math.inf) for d in diffs)  # NaN (unwritten): inf
    return identical, diff


def forward_calls(rows: int) -> int:
    """NumPy calls of `layer_forward`: two matmuls, relu, and a row-by-row bias add after each
    matmul (b calls each)."""
    return 2 * rows + 3


def backward_calls(rows: int) -> int:
    """NumPy calls of `layer_backward`: the re-run fc1 matmul and its b bias-add calls, relu,
    the four gradient matmuls, two bias-gradient sums, the mask and its multiply."""
    return rows + 10


def predicted_seconds(spec: ModelSpec, plan, profile: CPUProfile) -> float:
    """The time model's seconds for one step of `plan` on this executor: the roofline of every
    op run (forwards per layer from the replay, `hardware.step_time` on the `cpu` profile) plus
    the per-call overhead of the NumPy calls the executor makes and the measured cost of the
    backward's 0/1 mask (`np.heaviside`, b·f values per layer backward)."""
    time = step_time(plan, profile.as_gpu())
    roofline = time.forward_seconds + time.backward_seconds + time.recompute_seconds
    forwards = sum(sum(counts) for _, counts in plan.stage_forwards)
    calls = forwards * forward_calls(spec.micro_batch) + spec.layers * backward_calls(
        spec.micro_batch
    )
    masks = spec.layers * spec.micro_batch * spec.ffn_hidden
    return roofline + calls * profile.call_seconds + masks * profile.mask_seconds_per_value


def predict(spec: ModelSpec, strategy: str, budget: int | None) -> tuple[Prediction, Plan]:
    """The planner's prediction for one strategy and the plan (schedule) it would run."""
    parsed = parse_strategy(strategy, spec)
    plan = evaluate(spec, parsed, budget=budget, gpu=NOMINAL_DEVICE if parsed.offload else None)
    if plan is None:
        raise StrategyError(
            f"strategy {strategy!r}: no schedule fits the activation budget of {budget:,} bytes"
        )
    replay = simulate(layer_chain(spec, parsed.selective), plan.steps)
    offloaded = tuple(i for i, _ in dict(plan.stage_offloads).get(0, ()))
    prediction = Prediction(
        plan.activation_bytes,
        replay.layer_forwards,
        plan.flops.total,
        host_peak_bytes=plan.host_bytes,
        bytes_moved=plan.bytes_moved,
        offloaded=offloaded,
    )
    return prediction, plan


def default_strategies(layers: int) -> tuple[str, ...]:
    """none, full, uniform:K and sequential:K (K = min(4, L)), sqrt, revolve:C, optimal."""
    k = min(4, layers)
    slots = max(1, min(4, layers // 4))
    return (
        "none",
        "full",
        f"uniform:{k}",
        f"sequential:{k}",
        "sqrt",
        f"revolve:{slots}",
        "optimal",
    )


def default_budget(spec: ModelSpec) -> int:
    """The activation budget for ``optimal`` when none is given: the predicted peak of
    ``sqrt``, so that ``optimal`` shows what the best schedule does in the same memory."""
    return evaluate(spec, parse_strategy("sqrt", spec)).activation_bytes


def array_bytes(spec: ModelSpec) -> int:
    """What a verify run holds at most: parameters, their gradient buffers and the reference
    step's gradients (3 copies of L(2df + d + f) values), and two steps' activations (the
    reference's and the run's: L + 2 inputs of b·d values, a layer's b·(2f + d) transients)."""
    L, d, f, b = spec.layers, spec.hidden, spec.ffn_hidden, spec.micro_batch
    parameters = L * (2 * d * f + d + f)
    activations = (L + 2) * b * d + b * (2 * f + d)
    return DTYPE_BYTES * (3 * parameters + 2 * activations)


def check_limits(spec: ModelSpec, flops_per_run: Sequence[int], repeats: int) -> None:
    """Refuse a run beyond MAX_ARRAY_BYTES, MAX_TOTAL_FLOPS or MAX_REPEATS before it starts:
    each strategy runs once traced and `repeats` times timed, after one reference step."""
    if not 1 <= repeats <= MAX_REPEATS:
        raise StrategyError(f"repeats must be in 1..{MAX_REPEATS}, got {repeats:,}")
    size = f"L={spec.layers} d={spec.hidden} f={spec.ffn_hidden} b={spec.micro_batch}"
    held = array_bytes(spec)
    if held > MAX_ARRAY_BYTES:
        raise StrategyError(
            f"verify {size} would hold {held / 2**30:,.1f} GiB of arrays, more than the "
            f"{MAX_ARRAY_BYTES // 2**30} GiB it allows; choose smaller sizes"
        )
    total = flops_per_run[0] + sum(flops_per_run) * (1 + repeats)
    if total > MAX_TOTAL_FLOPS:
        raise StrategyError(
            f"verify {size} would run {total / 1e12:,.1f} TFLOP with {repeats} repeats, more "
            f"than the {MAX_TOTAL_FLOPS / 1e12:g} TFLOP it allows; choose smaller sizes, fewer "
            "strategies or repeats"
        )


def verify(
    spec: ModelSpec,
    strategies: Sequence[str] | None = None,
    budget: int | None = None,
    repeats: int = DEFAULT_REPEATS,
    seed: int = 0,
    tolerance: float = PEAK_TOLERANCE,
    predict_time: bool = True,
) -> VerifyReport:
    """Run every strategy on the NumPy MLP, measure it and put it beside the prediction.

    ``none`` (the plain step) always runs first: it is the baseline of the time overhead.
    With ``predict_time``, a ``cpu`` profile is probed first (``hardware.cpu``) and each run's
    seconds are predicted from it. Raises ``StrategyError`` for a strategy that does not parse
    or has no schedule.
    """
    if spec.kind != "mlp" or spec.dtype_bytes != DTYPE_BYTES or spec.pp != 1:
        raise StrategyError("verify runs the NumPy MLP: kind mlp, dtype_bytes 8, pp 1")
    if repeats < 1:
        raise StrategyError(f"repeats must be at least 1, got {repeats}")
    chosen = strategies or default_strategies(spec.layers)
    names = list(dict.fromkeys(["none", *(name.strip() for name in chosen)]))
    if budget is None and any(name.endswith("optimal") for name in names):
        budget = default_budget(spec)
    planned = [(name, *predict(spec, name, budget)) for name in names]
    check_limits(spec, [prediction.flops for _, prediction, _ in planned], repeats)

    params, x, grad_output = init_network(spec, seed)
    weights = [w1 for w1, _, _, _ in params]
    plans = [plan for _, _, plan in planned]
    planned = [(name, prediction, plan.steps) for name, prediction, plan in planned]
    grads = gradient_buffers(params)
    ref_dx, ref_grads = reference_step(params, x, grad_output)
    traced = []
    for _, prediction, steps in planned:
        for buffer in (g for layer in grads for g in layer):
            buffer.fill(np.nan)  # a gradient the schedule fails to write cannot pass
        offloaded = prediction.offloaded
        peak, dx, counts, pool = measure_peak(steps, params, grads, x, grad_output, offloaded)
        host = (pool.peak, pool.moved)
        del pool
        traced.append((peak, counts, *compare_gradients(dx, grads, ref_dx, ref_grads), host))
        del dx
    # Timed in rounds, every strategy once per round, so that drift in the machine's speed
    # (other load, clocks) falls on all strategies alike.
    # With predict_time, the cpu profile is probed in every round too, between the runs, so it
    # sees the load they see (hardware.cpu).
    seconds: list[list[float]] = [[] for _ in planned]
    probes = []
    for _ in range(repeats):
        if predict_time:
            probes.append(measure_cpu_profile(x, weights))
        for times, (_, prediction, steps) in zip(seconds, planned, strict=True):
            times += time_step(steps, params, grads, x, grad_output, 1, prediction.offloaded)
    profile = median_profile(probes) if predict_time else None
    if profile is not None:
        planned = [
            (name, replace(prediction, seconds=predicted_seconds(spec, plan, profile)), steps)
            for (name, prediction, steps), plan in zip(planned, plans, strict=True)
        ]
    runs = []
    for (name, prediction, _), (peak, counts, identical, diff, host), times in zip(
        planned, traced, seconds, strict=True
    ):
        measured = Measurement(
            peak_bytes=peak,
            layer_forwards=tuple(counts.layer_forwards),
            flops=counts.flops,
            seconds=statistics.median(times),
            all_seconds=tuple(times),
            host_peak_bytes=host[0],
            bytes_moved=host[1],
        )
        runs.append(RunResult(name, prediction, measured, identical, diff, tolerance))
    param_bytes = sum(p.nbytes for layer in params for p in layer)
    return VerifyReport(
        spec=spec,
        runs=tuple(runs),
        parameter_bytes=param_bytes,
        gradient_bytes=sum(g.nbytes for layer in grads for g in layer),
        budget_bytes=budget,
        repeats=repeats,
        tolerance=tolerance,
        seed=seed,
        profile=profile,
    )
