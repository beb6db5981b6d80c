"""Plans: a recomputation strategy applied to a model, with its peak memory and FLOPs.

Every strategy is a schedule over one chain (embedding -> L/p layers -> output and loss, each
stage with its forward/backward cost, input size and full-tape size), replayed step by step by
`schedules.simulate`: peak memory is what is actually alive, never a closed-form shortcut.
Strategy names (docs/strategies.md): none, full, uniform:K, sequential:K, sqrt, selective, block:N,
every:K, revolve:C, optimal, and selective+ any of them (the attention core recomputed on top).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass, field
from fractions import Fraction
from functools import lru_cache

from ckplan.cache import BoundedCache
from ckplan.hardware.device_memory import DeviceMemory, device_memory
from ckplan.hardware.gpus import GPU
from ckplan.model import allocator, finetune, frameworks, memory
from ckplan.model import flops as flops_model
from ckplan.model.layers import stage_chunk_layers, stage_kinds
from ckplan.model.loss import loss_cached_bytes
from ckplan.model.op_policy import NO_EXPORT, layerwise_export_reason, parse_policy
from ckplan.model.ops import layer_ops
from ckplan.model.spec import ModelSpec
from ckplan.plan import limits
from ckplan.plan.launcher_ranges import unwritten_reason
from ckplan.plan.layer_chain import layer_chain, layer_offset, stage_names
from ckplan.plan.strategies import (
    MIXED,
    Strategy,
    StrategyError,
    formula_name,
    module_framework_reason,
)
from ckplan.schedules import (
    BACKWARD,
    Chain,
    Replay,
    SegmentReplay,
    SegmentSteps,
    held_after_forward_bytes,
    pipeline_peak_bytes,
    replay_runs,
    run_forwards,
    segment_schedule,
    simulate,
)
from ckplan.simple import formulas as simple
from ckplan.units import format_bytes, format_flops

DEFAULT_SLOTS = 500


@dataclass(frozen=True)
class FlopCount:
    forward: int
    backward: int
    recompute: int

    @property
    def total(self) -> int:
        return self.forward + self.backward + self.recompute

    @property
    def overhead(self) -> float:
        """recompute / (forward + backward)."""
        return self.recompute / (self.forward + self.backward)


@dataclass(frozen=True)
class Plan:
    spec: ModelSpec
    strategy: str
    formula: str
    per_layer_activation_bytes: int
    breakdown: dict[str, int]
    activation_bytes: int  # peak on one GPU under the strategy
    model_states: memory.ModelStateBytes
    parameters_total: int
    parameters_per_gpu: int
    flops: FlopCount
    steps: tuple = field(default=(), repr=False)  # the schedule, when there is one
    stage_names: tuple[str, ...] = ()  # names of the chain's stages the steps refer to
    notes: tuple[str, ...] = ()
    # (pipeline stage, forwards per chain stage) of each pipeline stage evaluated, from the
    # schedule replay: what the time model (ckplan.hardware.step_time) re-runs
    stage_forwards: tuple[tuple[int, tuple[int, ...]], ...] = ()
    # recompute groups re-run inside every stored layer (selective, moe, experts)
    recompute_groups: tuple[str, ...] = ()
    # the pipeline stage whose GPUs peak (model states + activations); its states are shown
    peak_stage: int = 0
    # activation offloading (ckplan.plan.offload): pinned host bytes per GPU at the peak, bytes
    # copied between device and host per iteration (both directions), and for each pipeline
    # stage evaluated the (chain stage, tape bytes) it offloads, which the time model reads
    host_bytes: int = 0
    bytes_moved: int = 0
    stage_offloads: tuple[tuple[int, tuple[tuple[int, int], ...]], ...] = ()
    # per pipeline stage, the chain stage whose backward each offloaded item's copy back
    # overlaps (aligned with stage_offloads; i + 1 but for a multi-layer segment's input)
    stage_prefetch: tuple[tuple[int, tuple[int, ...]], ...] = ()
    # `sac+mixed`: per pipeline stage, whether each chain stage stores the policy's tape (its
    # backward re-runs `recompute_groups`) rather than the full tape
    stage_policy: tuple[tuple[int, tuple[bool, ...]], ...] = ()
    # the pipeline runtime's receive buffers and kept outputs on the peak stage, included in
    # activation_bytes (memory.pipeline_buffer_bytes)
    pipeline_buffer_bytes: int = 0
    # the optimizer step's allocated bytes where it allocates a workspace beside the states
    # (foreach AdamW's exp_avg_sq copy: memory.optimizer_step_bytes), else 0
    optimizer_step_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        """The allocated peak per GPU (torch's max_memory_allocated): activations and model
        states at the schedule's peak, or the optimizer step where it holds more."""
        return max(self.activation_bytes + self.model_states.total, self.optimizer_step_bytes)

    @property
    def step_sets_peak(self) -> bool:
        """Whether the optimizer step, not the forward and backward, holds the peak."""
        return self.optimizer_step_bytes > self.activation_bytes + self.model_states.total

    @property
    def host_total_bytes(self) -> int:
        """Host memory per GPU at the peak: offloaded tapes and offloaded model states
        (`memory.ModelStateBytes.host`)."""
        return self.host_bytes + self.model_states.host

    @property
    def reserved_bytes(self) -> int:
        """The allocator's reserved peak per GPU (max_memory_reserved) with memory to spare
        (model.allocator), the loss's idle segments included where the peak stage runs the
        loss (model.loss `loss_cached_bytes`)."""
        return allocator.reserved_bytes(
            self.total_bytes,
            self.spec.expandable_segments,
            memory.stream_pool_bytes(self.spec, self.peak_stage),
            loss_cached_bytes(self.spec, self.peak_stage),
        )

    def device_memory(self, gpu: GPU) -> DeviceMemory:
        """The peak as nvidia-smi shows it on `gpu`: the reserved peak within what the GPU
        leaves the allocator, the CUDA context, NCCL's buffers and paged optimizer states
        (hardware.device_memory)."""
        return device_memory(
            self.total_bytes,
            self.spec,
            gpu,
            memory.stream_pool_bytes(self.spec, self.peak_stage),
            loss_cached_bytes(self.spec, self.peak_stage),
        )

    @property
    def budgeted_bytes(self) -> int:
        """What a budget is checked against: the allocated peak in the allocator's 2 MiB blocks,
        its cache released under pressure (model.allocator)."""
        return allocator.budgeted_bytes(self.total_bytes)

    @property
    def overhead(self) -> float:
        return self.flops.overhead


def _segment_runs(spec: ModelSpec, chain: Chain, strategy: Strategy, stage: int):
    """The segment-style strategies' segments over pipeline stage `stage`'s chain, as runs
    (start, size, count, recompute) of equal consecutive segments
    (`schedules.segment_replay`): O(1) entries for any number of layers. Uniform segments
    restart at each model chunk (`_segment_spans`)."""
    offset = layer_offset(spec, stage == 0)
    n_layers = chain.length - offset - (1 if _has_output(spec, chain, offset) else 0)
    runs = [(0, offset, 1, False)]
    if strategy.kind == "block":
        recomputed = min(strategy.size, n_layers)  # uneven stages: at most this stage's
        runs.append((offset, 1, recomputed, True))
        runs.append((offset + recomputed, n_layers - recomputed, 1, False))
    elif strategy.kind == "every":
        runs += _every_runs(strategy.size, offset, n_layers)
    else:
        keep_last = strategy.kind == "sequential"  # its last segment is stored
        start = offset
        for span in _segment_spans(spec, strategy, stage, n_layers):
            runs += _uniform_runs(start, span, _segment_size(spec, strategy), keep_last)
            start += span
    runs.append((offset + n_layers, chain.length - offset - n_layers, 1, False))
    return [run for run in runs if run[1] > 0 and run[2] > 0]


def run_segments(runs) -> list[tuple[int, int, bool]]:
    """Runs (start, size, count, recompute) as their (start, end, recompute) segments."""
    return [
        (start + k * size, start + (k + 1) * size, recompute)
        for start, size, count, recompute in runs
        for k in range(count)
    ]


def _segment_spans(spec: ModelSpec, strategy: Strategy, stage: int, n_layers: int):
    """The spans of layers equal segments are laid over: each model chunk of an interleaved
    stage, else the whole stage. A model chunk is a module of its own that runs its forward
    and backward apart from the others, so no segment outlives it: Megatron-LM's uniform
    method checkpoints each chunk's block from its first layer, the last segment clipped to
    the chunk (megatron/core/recompute.py at core_v0.19.0; transformer_block.py
    `_checkpointed_forward` at core_v0.14.0), and torch.utils.checkpoint_sequential applies
    to one module's layers, its last segment stored in each (derived)."""
    if spec.virtual_stages > 1:
        chunks = tuple(n for n in stage_chunk_layers(spec, stage) if n)
        if sum(chunks) == n_layers:
            return chunks
    return (n_layers,)


def _uniform_runs(start: int, n_layers: int, size: int, keep_last: bool):
    """Segments of `size` layers (the last one shorter) over `n_layers` layers from `start`,
    as runs, all recomputed but, with `keep_last`, the last (derived)."""
    size = min(size, n_layers)
    full, rest = divmod(n_layers, size)
    if rest:
        return [(start, size, full, True), (start + full * size, rest, 1, not keep_last)]
    return [(start, size, full - 1, True), (start + (full - 1) * size, size, 1, not keep_last)]


def _every_runs(period: int, offset: int, n_layers: int) -> list[tuple[int, int, int, bool]]:
    """`every:K` as runs (start, size, 1, recompute): of each K layers from the stage's first,
    the K - 1 before the K-th stored as one segment, the K-th re-run from its input; the layers
    after the last K-th stored. torchtitan's per-layer selective checkpointing
    (torchtitan/parallelisms/parallelize_llama.py at 4d88a8a, `_apply_ac_to_transformer_block`:
    a layer is wrapped in checkpoint_wrapper when its 1-based count on the rank
    `ptd_checkpoint_wrapper._count % ac_freq == 0`, ac_freq = int(selective_ac_option))."""
    runs = []
    for start in range(offset, offset + n_layers - period + 1, period):
        if period > 1:
            runs.append((start, period - 1, 1, False))
        runs.append((start + period - 1, 1, 1, True))
    rest = n_layers % period
    if rest:
        runs.append((offset + n_layers - rest, rest, 1, False))
    return runs


def _has_output(spec: ModelSpec, chain: Chain, offset: int) -> bool:
    """Whether the chain ends with the output layer and loss (it carries no activation on)."""
    return spec.kind == "transformer" and spec.vocab > 0 and chain.input_bytes[-1] == 0


def _segment_size(spec: ModelSpec, strategy: Strategy) -> int:
    if strategy.kind == "full":
        return 1
    if strategy.kind == "sqrt":
        return max(1, simple.optimal_segment(spec.layers_per_stage))
    return strategy.size


def _revolve_schedule(chain: Chain, strategy: Strategy):
    """`revolve:C`'s binomial schedule over the chain (the other kinds are replayed in closed
    form, `_stage_schedule`)."""
    from ckplan.schedules.revolve import revolve_schedule  # only where it is used

    limits.check_revolve(chain.length, strategy.size, strategy.name)
    return revolve_schedule(chain, strategy.size)


# ---- evaluation --------------------------------------------------------------------------


def megatron_in_flight_forwards(
    pp: int, virtual_stages: int, microbatches: int, rank: int, group: int | None = None
) -> int:
    """Model-chunk forwards whose activations pipeline rank `rank` holds at its peak.

    Megatron-LM, megatron/core/pipeline_parallel/schedules.py `get_pp_rank_microbatches`
    (core_v0.14.0, core_v0.19.0 and main at 6e091e1b68): of the m·v chunk forwards of an
    iteration a rank runs `warmup` before its first backward, 1F1B: p - r - 1; interleaved:
    2·(p - r - 1) + (v - 1)·g, g = microbatch_group_size_per_vp_stage (default p,
    model_parallel_config.py); capped at m·v (then all forwards come first). Its steady phase
    runs one forward, then one backward, so it peaks holding min(warmup + 1, m·v). With
    interleaving even the last rank holds (v - 1)·g + 1 of them: it finishes the forwards of
    its first v - 1 chunks for g micro-batches before the last chunk's first backward.
    """
    g = pp if group is None else group
    if virtual_stages == 1:
        warmup, total = pp - rank - 1, microbatches
    else:
        warmup = 2 * (pp - rank - 1) + (virtual_stages - 1) * g
        total = microbatches * virtual_stages
    return min(warmup + 1, total)


def in_flight_microbatches(spec: ModelSpec, stage: int = 0) -> Fraction:
    """Micro-batches whose activations pipeline stage `stage` holds at its peak.

    1F1B: stage k holds p - k micro-batches (Narayanan et al. 2021 §2.2; Korthikanti §4.2.3),
    the first p, fewer when the iteration has fewer; the last stage one (its micro-batch's
    backward follows its forward at once). Interleaved over v virtual stages: the chunk
    forwards of `megatron_in_flight_forwards`, v to a micro-batch; the first stage's
    p + (p - 1)/v is Korthikanti §4.2.3's p·(1 + (p - 1)/(p·v)) at the default group
    g = p; each micro-batch more in a group (microbatch_group_size) adds (v - 1)/v of one.
    DualPipe: stage s still holds p - s (`dualpipe_in_flight`); its rank also holds its
    mirror stage's (`dualpipe_rank_peaks`).
    """
    v = spec.virtual_stages
    if spec.parsed_layout is not None:  # each chunk forward holds its chunk's layers
        weights = stage_chunk_layers(spec, stage)
        if len(set(weights)) > 1:
            held = megatron_in_flight_weight(
                weights, spec.pp, spec.microbatches, stage, spec.microbatch_group
            )
            return Fraction(held, sum(weights))
    forwards = megatron_in_flight_forwards(
        spec.pp, v, spec.microbatches, stage, spec.microbatch_group
    )
    return Fraction(forwards, v)


def dualpipe_in_flight(pp: int, rank: int) -> tuple[int, int]:
    """(micro-batches of model stage `rank`, of its mirror p - 1 - rank) whose activations
    DualPipe's pipeline rank `rank` holds at its peak: p - rank and rank + 1, p + 1 in all.

    deepseek-ai/DualPipe at 3da1bbe, dualpipe/dualpipe.py `DualPipe.step`, with h = min(rank,
    p - 1 - rank): step 1 runs (p/2 - h - 1)·2 forwards of the rank's first direction, step 2
    h + 1 forwards of each direction, step 3 (p/2 - h - 1) times a backward of the second
    direction, a weight pass and a forward of it; then steps 4-5 pair a forward of one
    direction with a backward of the other. Its peak, after step 2 or 3's forwards, holds
    p - h forwards of the stage it runs first (stage h) and h + 1 of the other (p - 1 - h)
    (derived: the order replayed in tests/test_dualpipe.py for every rank of p = 2..16), the
    DeepSeek-V3 Technical Report's (arXiv 2412.19437) Table 2 'PP + 1' micro-batches. Stage s
    thus holds p - s, the count it holds under 1F1B (`megatron_in_flight_forwards`)."""
    return pp - rank, rank + 1


@lru_cache(maxsize=256)
def _chunk_order(microbatches: int, virtual_stages: int, group: int) -> list[int]:
    """The model chunk of each forward of one rank in Megatron-LM's interleaved order
    (core_v0.19.0's interleaved schedule with a micro-batch group of `group`, as
    `megatron_in_flight_weight` walks it): `group` micro-batches through chunk 0, the same
    through chunk 1, ..., then the next group; the last group may be shorter."""
    return [
        chunk
        for low in range(0, microbatches, group)
        for chunk in range(virtual_stages)
        for _ in range(low, min(low + group, microbatches))
    ]


def megatron_in_flight_weight(
    weights: tuple[int, ...], pp: int, microbatches: int, rank: int, group: int | None = None
) -> int:
    """The most chunk layers pipeline rank `rank` holds, its chunks weighing `weights`.

    Walks the rank's order in Megatron-LM's interleaved schedule
    (megatron/core/pipeline_parallel/schedules.py, core_v0.19.0:
    `forward_backward_pipelining_with_interleaving`, `get_schedule_table`,
    `get_pp_rank_microbatches`): the forwards follow the schedule table, groups of g
    micro-batches per chunk, chunks in order; the k-th backward is the table's k-th entry on
    the chunk counted from the end; `warmup` forwards, then one forward and one backward per
    step, then the cool-down backwards. The peak is taken after each forward. Equal weights w
    give w · `megatron_in_flight_forwards`, so an even layout is the plain count (derived).
    """
    v = len(weights)
    g = pp if group is None else group
    total = microbatches * v
    warmup = pp - rank - 1 if v == 1 else 2 * (pp - rank - 1) + (v - 1) * g
    warmup = min(warmup, total)
    table = _chunk_order(microbatches, v, g)
    live = peak = 0
    for chunk in table[:warmup]:
        live += weights[chunk]
        peak = max(peak, live)
    for step in range(total - warmup):
        live += weights[table[warmup + step]]
        peak = max(peak, live)
        live -= weights[v - 1 - table[step]]
    return peak


def interleaved_gradient_excess(
    pp: int,
    virtual_stages: int,
    microbatches: int,
    rank: int,
    group: int | None,
    chunk_tape_bytes: int,
    chunk_gradient_bytes: int,
) -> int:
    """The bytes of unsharded fp32 gradients, accumulated over micro-batches per model chunk,
    that pipeline rank `rank` holds beyond its activation peak: max over its schedule of (chunk
    forwards held · `chunk_tape_bytes` + live gradient bytes) less the most chunk forwards held
    · `chunk_tape_bytes`, each of its chunks `chunk_gradient_bytes` of gradients.

    The order is `megatron_in_flight_weight`'s (Megatron-LM core_v0.19.0 interleaved
    schedule); the gradients' lifetimes are torch.distributed.pipelining's under FSDP2 (PyTorch
    v2.13.0): `backward_one_chunk` runs every backward with `set_requires_gradient_sync(False)`,
    so FSDP2 accumulates each chunk's unsharded gradients in reduce_dtype
    (_fsdp_param.py `to_accumulated_grad_if_needed`: `unsharded_accumulated_grad`) from its
    first backward on, and schedules.py `_add_reduce_grad` puts a REDUCE_GRAD right after the
    chunk's last backward ("reduce_grad frees memory"), whose `post_backward` copies them into
    the fp32 reduce-scatter input and drops them (_fsdp_param_group.py
    `unsharded_accumulated_grad = None`); that input is released in the same REDUCE_GRAD
    (stage.py `perform_reduce_grad` calls `_root_post_backward_final_callback`, which clears
    `reduce_scatter_states` on the last backward, _fsdp_state.py). One model chunk (v = 1)
    holds its gradients from its first backward, when the peak's forwards are all held, to the
    end: the full stage.
    derived: the walk over those events; the lifetimes checked on the CPU with four gloo ranks
    (validation/torch_pipeline_reduce_grad.py).
    """
    v = virtual_stages
    if v == 1:
        return chunk_gradient_bytes
    g = pp if group is None else group
    total = microbatches * v
    warmup = min(2 * (pp - rank - 1) + (v - 1) * g, total)
    table = _chunk_order(microbatches, v, g)
    held = most_held = 0
    accumulating = 0  # chunks with gradients
    backwards = [0] * v
    fullest = 0

    def backward(index: int) -> None:
        nonlocal held, accumulating, fullest
        chunk = v - 1 - table[index]
        if backwards[chunk] == 0:
            accumulating += 1
        fullest = max(fullest, held * chunk_tape_bytes + accumulating * chunk_gradient_bytes)
        backwards[chunk] += 1
        held -= 1
        if backwards[chunk] == microbatches:  # REDUCE_GRAD: copy-in beside the accumulated
            copied = (accumulating + 1) * chunk_gradient_bytes
            fullest = max(fullest, held * chunk_tape_bytes + copied)
            accumulating -= 1

    for _ in range(warmup):
        held += 1
        most_held = max(most_held, held)
    for step in range(total - warmup):
        held += 1
        most_held = max(most_held, held)
        fullest = max(fullest, held * chunk_tape_bytes + accumulating * chunk_gradient_bytes)
        backward(step)
    for step in range(total - warmup, total):
        backward(step)
    return max(0, fullest - most_held * chunk_tape_bytes)


@lru_cache(maxsize=128)
def pipeline_stages(spec: ModelSpec) -> tuple[int, ...]:
    """The pipeline stages whose peak can be the fullest: the first (embedding, most
    micro-batches in flight) and the last (output layer and fp32 logits); with mixed layers
    also each middle stage whose layer kinds (under a pipeline_layout: and chunk split) no
    earlier stage holds (an earlier stage with the same layers holds more micro-batches).
    Under DualPipe also the mirror p - 1 - k of each, which the same rank holds: a later rank
    whose two stages have the layers of an earlier one's holds as many micro-batches, p + 1."""
    if spec.pp == 1:
        return (0,)
    seen = {_stage_shape(spec, 0)}
    stages = [0]
    for stage in range(1, spec.pp - 1):
        kinds = _stage_shape(spec, stage)
        if kinds not in seen:
            seen.add(kinds)
            stages.append(stage)
    if spec.pipeline_schedule == "dualpipe":  # each rank's mirror stage beside it
        return tuple(sorted({*stages, spec.pp - 1, *(spec.pp - 1 - stage for stage in stages)}))
    return (*stages, spec.pp - 1)


def _stage_shape(spec: ModelSpec, stage: int) -> tuple:
    """What sets a stage's peak beside its in-flight count: its layers' kinds, and under a
    pipeline_layout also how its chunks split them (they weigh its in-flight micro-batches)."""
    if spec.parsed_layout is None:
        return stage_kinds(spec, stage)
    return stage_kinds(spec, stage), stage_chunk_layers(spec, stage)


def evaluate(
    spec: ModelSpec,
    strategy: Strategy,
    formula: str = "derived",
    budget: int | None = None,
    slots: int = DEFAULT_SLOTS,
    gpu=None,
) -> Plan | None:
    """The plan of `strategy` on `spec`. `budget` (bytes of activation memory) is needed only
    by `optimal`, which returns None when no schedule fits it; `gpu` only by
    `offload+optimal` (its stage times and host link)."""
    if formula_name(formula) == "simple":
        return _evaluate_simple(spec, strategy)
    if strategy.offload:
        return _evaluate_offload(spec, strategy, budget, slots, gpu)
    if strategy.kind == MIXED:
        return _evaluate_mixed(spec, strategy, budget, slots, gpu)
    # One chain for p = 1; else the first pipeline stage (embedding, most micro-batches in
    # flight), the last (output layer and fp32 logits, one micro-batch in flight) and, with
    # mixed layers, the middle stages that hold other layers (`pipeline_stages`).
    results, forwards, buffers, tapes = [], [], {}, {}
    for stage in pipeline_stages(spec):
        chain = layer_chain(spec, strategy.groups, stage=stage)
        in_flight = in_flight_microbatches(spec, stage)
        last_stage = stage == spec.pp - 1 and stage > 0
        found = _stage_schedule(spec, chain, strategy, budget, slots, stage, in_flight, last_stage)
        if found is not None and strategy.kind == "optimal":
            # bitsandbytes' held inputs (`_held_bytes`) come beside the schedule:
            # if they take it over the budget, plan again beside them as if every layer were
            # recomputed, the most they add
            alongside, _ = _held_bytes(spec, ((stage, found[2].layer_forwards),), stage)
            if alongside and found[0] + alongside > budget:
                most, _ = _held_bytes(spec, (), stage, all_layers=True)
                found = _stage_schedule(
                    spec, chain, strategy, budget - most, slots, stage, in_flight, last_stage
                )
        if found is None:
            return None
        peak, steps, replay, group = found
        tapes[stage] = (
            replay.held_bytes
            if isinstance(replay, SegmentReplay)
            else held_after_forward_bytes(chain, replay)
        )
        flops = _stage_flops(spec, strategy, chain, replay, stage)
        # the pipeline runtime's buffers, held all step beside the schedule's peak (v = 1:
        # in_flight is whole)
        buffers[stage] = memory.pipeline_buffer_bytes(spec, stage, math.ceil(in_flight))
        results.append((peak + buffers[stage], steps, flops, stage, group))
        counts = (
            run_forwards(chain.length, steps.runs)
            if isinstance(steps, SegmentSteps)
            else replay.layer_forwards
        )
        forwards.append((stage, counts))
    if spec.pipeline_schedule == "dualpipe":
        return _dualpipe_plan(spec, strategy, budget, results, tapes, tuple(forwards))
    # Memory: the GPU whose model states and activations together are the most (each stage
    # holds its own parameters). FLOPs: the busiest stage, which paces the pipeline.
    states = {stage: memory.model_state_bytes(spec, stage) for *_, stage, _ in results}
    if spec.virtual_stages > 1 and frameworks.fsdp2_pipeline_accumulates(spec):
        for stage, held in tapes.items():
            states[stage] = _accumulated_gradients_at_peak(spec, stage, states[stage], held)
    peak, steps, _, stage, _ = max(results, key=lambda r: (r[0] + states[r[3]].total, -r[3]))
    if memory.gradients_allocated_in_backward(spec):
        trace = simulate(layer_chain(spec, strategy.groups, stage=0), tuple(steps)).trace
        during = [point.during_bytes for point in trace]
        grads = memory.chain_gradient_bytes(spec)
        live = gradients_at_peak(tuple(steps), during, peak - buffers[stage], grads)
        states[stage] = dataclasses.replace(states[stage], gradients=live)
    busiest = max(results, key=lambda result: result[2].total)
    flops = busiest[2]
    names = _stage_names(spec, stage)
    notes = ()
    if spec.pp > 1:
        held = in_flight_microbatches(spec, stage)
        count = f"{float(held):g} micro-batch{'' if held == 1 else 'es'}"
        notes = (f"peak on {stage_label(spec, stage)}, {count} in flight",)
        hidden = max(results, key=lambda result: result[2].recompute)
        if hidden[2].recompute > flops.recompute:
            per_iteration = hidden[2].recompute * spec.microbatches
            notes += (
                f"stage {hidden[3]} recomputes {format_flops(per_iteration)} per iteration, "
                f"within the slack of the busiest stage ({busiest[3]}), whose FLOPs are shown",
            )
    notes += _strategy_notes(spec, strategy, forwards, results)
    held, note = _held_through_checkpoints(spec, tuple(forwards), stage)
    notes += (note,) if note else ()
    return _plan(
        spec,
        strategy.name,
        "derived",
        peak + held,
        _per_iteration(spec, flops),
        steps,
        names,
        notes,
        stage_forwards=tuple(forwards),
        recompute_groups=strategy.groups,
        peak_stage=stage,
        model_states=states[stage],
        pipeline_buffer_bytes=buffers[stage],
    )


def dualpipe_rank_peaks(
    pp: int, peaks: dict[int, int], held: dict[int, int]
) -> dict[int, tuple[int, int]]:
    """Each DualPipe rank's activation peak: rank -> (bytes, the stage whose schedule runs at
    it), from each model stage's peak with its own in-flight micro-batches (`peaks`, p - s on
    stage s) and what one waiting micro-batch of it holds (`held`), for every rank r < p/2
    whose two stages, r and p - 1 - r, are both given (rank p - 1 - r holds the same two).

    derived: one backward runs at a time, so the rank peaks while one of its stages runs its
    schedule's peak and the other's micro-batches wait, `dualpipe_in_flight` of each: the
    larger of peak(r) + (r + 1)·held(p - 1 - r) and peak(p - 1 - r) + (p - r)·held(r). Both
    directions are taken at their most at once, as at the step-2/3 peak of the replayed order.
    """
    ranks: dict[int, tuple[int, int]] = {}
    for stage in sorted(peaks):
        rank, mirror = min(stage, pp - 1 - stage), max(stage, pp - 1 - stage)
        if rank in ranks or rank not in peaks or mirror not in peaks:
            continue
        own, other = dualpipe_in_flight(pp, rank)
        if rank == mirror:  # pp 1 has no DualPipe; kept total for safety
            ranks[rank] = (peaks[rank], rank)
            continue
        running_own = peaks[rank] + other * held[mirror]
        running_mirror = peaks[mirror] + own * held[rank]
        ranks[rank] = (
            (running_own, rank) if running_own >= running_mirror else (running_mirror, mirror)
        )
    return ranks


def _strategy_notes(spec: ModelSpec, strategy: Strategy, forwards, results) -> tuple[str, ...]:
    """The notes every pipelined plan carries about its strategy: what no launcher's per-layer
    export writes, what its framework cannot run, and the optimal DP's grouping of layers
    (`results`: each stage's (peak, steps, FLOPs, stage, group))."""
    notes: tuple[str, ...] = ()
    beside = strategy.kind if strategy.size is None else f"{strategy.kind}:{strategy.size}"
    policy = parse_policy(strategy.policy) if strategy.policy else None
    if strategy.kind in ("block", "optimal") and strategy.size != 0 and policy:
        notes += tuple(filter(None, [layerwise_export_reason(policy, beside)]))
    unrunnable = (module_framework_reason(spec, strategy), _revolve_note(strategy, forwards))
    notes += tuple(filter(None, unrunnable))
    grouped = max(result[4] for result in results)
    if grouped > 1:
        notes += (
            f"optimal over groups of up to {grouped} consecutive layers (the exact DP would "
            "take more than seconds here): the schedule fits; the exact optimum may recompute "
            "less",
        )
    return notes


def _dualpipe_plan(spec, strategy, budget, results, tapes, forwards) -> Plan | None:
    """The plan under DualPipe from each model stage's result ((peak, steps, FLOPs, stage,
    group) with its own in-flight micro-batches): each rank holds its two stages' activations
    (`dualpipe_rank_peaks`) and model states (`memory.rank_stages`), and runs half the
    micro-batches through each (deepseek-ai/DualPipe at 3da1bbe: `half_num_chunks` from each
    end), so its FLOPs per iteration are m/2 of each stage's. `optimal` plans each stage under
    the budget alone; a rank whose two stages together pass it has no plan (None)."""
    p, m = spec.pp, spec.microbatches
    by_stage = {result[3]: result for result in results}
    peaks = {stage: result[0] for stage, result in by_stage.items()}
    ranks = dualpipe_rank_peaks(p, peaks, tapes)
    states = {rank: memory.model_state_bytes(spec, rank) for rank in ranks}
    rank = max(ranks, key=lambda r: (ranks[r][0] + states[r].total, -r))
    peak, side = ranks[rank]
    if strategy.kind == "optimal" and budget is not None and peak > budget:
        return None
    steps = by_stage[side][1]

    def pair_flops(r: int) -> FlopCount:
        a, b = by_stage[r][2], by_stage[p - 1 - r][2]
        return FlopCount(a.forward + b.forward, a.backward + b.backward, a.recompute + b.recompute)

    busiest = max(ranks, key=lambda r: pair_flops(r).total)
    both = pair_flops(busiest)
    flops = FlopCount(both.forward * m // 2, both.backward * m // 2, both.recompute * m // 2)
    own, other = dualpipe_in_flight(p, rank)
    notes = (
        f"peak on pipeline rank {rank} (DualPipe: stages {rank} and {p - 1 - rank}), "
        f"{own + other} micro-batches in flight ({own} of stage {rank}, {other} of stage "
        f"{p - 1 - rank})",
    )
    notes += _strategy_notes(spec, strategy, forwards, results)
    return _plan(
        spec,
        strategy.name,
        "derived",
        peak,
        flops,
        steps,
        _stage_names(spec, side),
        notes,
        stage_forwards=forwards,
        recompute_groups=strategy.groups,
        peak_stage=rank,
        model_states=states[rank],
    )


def gradients_at_peak(
    steps, during: list[int], activation_peak: int, gradients: tuple[int, ...]
) -> int:
    """The gradient bytes to add to the activation peak when each chain stage's gradients are
    allocated by its backward and kept to the end of the step (memory.
    gradients_allocated_in_backward): max over the replayed steps of (the live activations
    `during` each step + the gradients of the stages backpropagated so far, the running one's
    included) less the activation peak (derived; `during` is the replay's trace)."""
    written, best = 0, activation_peak
    for step, live in zip(steps, during, strict=True):
        if step.kind == BACKWARD:
            written += gradients[step.stage]
        best = max(best, live + written)
    return best - activation_peak


def _accumulated_gradients_at_peak(
    spec: ModelSpec, stage: int, states: memory.ModelStateBytes, held: int
) -> memory.ModelStateBytes:
    """`states` with the stage's fp32 unsharded gradients (`frameworks.buffer_bytes`, held all
    step there) replaced by those its model chunks hold at the schedule's fullest point
    (`interleaved_gradient_excess`); `held` one micro-batch's tape through the whole stage.
    derived: the stage's tape and gradients split evenly over its v chunks."""
    v = spec.virtual_stages
    gradients = 4 * sum(memory.stage_parameters(spec, stage))
    excess = interleaved_gradient_excess(
        spec.pp,
        v,
        spec.microbatches,
        stage,
        spec.microbatch_group,
        -(-held // v),
        -(-gradients // v),
    )
    return dataclasses.replace(states, buffers=states.buffers - gradients + excess)


def stage_label(spec: ModelSpec, stage: int) -> str:
    """'the first pipeline stage', 'the last pipeline stage' or 'pipeline stage k'."""
    ends = {0: "the first pipeline stage", spec.pp - 1: "the last pipeline stage"}
    return ends.get(stage, f"pipeline stage {stage}")


@lru_cache(maxsize=64)  # a sweep names the same stages for each of its plans
def _stage_names(spec: ModelSpec, stage: int) -> tuple[str, ...]:
    return tuple(stage_names(spec, stage=stage))


@lru_cache(maxsize=256)
def _stage_kind_counts(spec: ModelSpec, stage: int) -> Counter:
    return Counter(stage_kinds(spec, stage))


def _stage_flops(
    spec: ModelSpec,
    strategy: Strategy,
    chain: Chain,
    replay: Replay | SegmentReplay,
    stage: int = 0,
) -> FlopCount:
    """One micro-batch through one chain; selective recompute is counted as recompute, not as
    the backward the chain charges it to."""
    groups = strategy.groups
    selective_flops = 0
    if groups:
        kinds = _stage_kind_counts(spec, stage)
        selective_flops = sum(
            count * flops_model.group_forward_flops(spec, groups, kind)
            for kind, count in kinds.items()
        )
    return FlopCount(  # the replay's sums: one forward and one backward of every stage
        forward=replay.forward_flops - replay.recompute_flops,
        backward=replay.backward_flops - selective_flops,
        recompute=replay.recompute_flops + selective_flops,
    )


# By chain identity and runs; an entry keeps its chain alive, so its id is not reused.
_REPLAYS = BoundedCache(max_entries=4096, max_weight=2_000_000)


def _replay_runs(chain: Chain, runs: list) -> SegmentReplay:
    """`replay_runs`, remembered by chain (identity) and runs: the layouts that differ only in
    dp, ZeRO or micro-batch count share a chain (`layer_chain`), and `ckplan plan` evaluates
    the same plans on each of them."""
    key = (id(chain), tuple(runs))
    entry = _REPLAYS.get(key)
    if entry is not None and entry[0] is chain:
        return entry[1]
    replay = replay_runs(chain, runs)
    _REPLAYS.put(key, (chain, replay), chain.length)
    return replay


def _stage_schedule(spec, chain, strategy, budget, slots, stage, in_flight, last_stage=False):
    """(peak, steps, replay, largest stage group of the optimal DP) of one pipeline stage with
    `in_flight` micro-batches, or None when `optimal` finds no schedule within `budget`.

    The schedule runs one micro-batch; the in_flight - 1 others waiting for their backward hold
    what their forward left (`schedules.pipeline_peak_bytes`). `optimal` minimises FLOPs under
    that whole-stage peak directly (`optimal_schedule(..., in_flight=...)`, derived). Its slots
    are multiplied by ceil(in_flight): every stored size is rounded up to a slot and the waiting
    micro-batches multiply that rounding, while the first-pass table's cost only grows with
    (slots / in_flight)², so the finer grid costs little on the short chains of a pipeline.
    On the last stage the waiting micro-batches hold no output-layer tape (interleaving:
    `schedules.held_after_forward_bytes`, output_held=False); `optimal` still counts it.
    """
    slots *= math.ceil(in_flight)
    output_held = not last_stage
    if strategy.kind not in ("revolve", "optimal"):
        # Segment plans (store-all is one stored segment): their replay in closed form, O(1)
        # per run of equal segments, and their steps built only if something reads them.
        runs = (
            [(0, chain.length, 1, False)]
            if strategy.kind in ("none", "selective")
            else _segment_runs(spec, chain, strategy, stage)
        )
        replay = _replay_runs(chain, runs)
        held = replay.held_bytes - (0 if output_held else chain.tape_bytes[-1])
        peak = replay.peak_bytes + math.ceil((in_flight - 1) * held)
        return peak, SegmentSteps(chain, runs), replay, 1
    if strategy.kind == "optimal":
        if budget is None:
            raise StrategyError("strategy 'optimal' needs a memory budget (--budget)")
        from ckplan.schedules.rotor import optimal_schedule  # only where it is used (NumPy)

        result = optimal_schedule(chain, budget, slots, in_flight=in_flight)
        if result is None:
            return None
        return result.pipeline_peak_bytes, result.steps, result.replay, result.stage_group
    steps = _revolve_schedule(chain, strategy)
    replay = simulate(chain, steps)
    return pipeline_peak_bytes(chain, replay, in_flight, output_held), steps, replay, 1


def _per_iteration(spec: ModelSpec, flops: FlopCount) -> FlopCount:
    """FLOPs of one iteration on one GPU: every micro-batch of the pipeline passes through it."""
    m = spec.microbatches
    return FlopCount(flops.forward * m, flops.backward * m, flops.recompute * m)


def _plan(
    spec,
    name,
    formula,
    activation_bytes,
    flops,
    steps=(),
    names=(),
    notes=(),
    per_layer=None,
    stage_forwards=(),
    recompute_groups=(),
    peak_stage=0,
    model_states=None,
    host_bytes=0,
    bytes_moved=0,
    stage_offloads=(),
    stage_prefetch=(),
    stage_policy=(),
    pipeline_buffer_bytes=0,
) -> Plan:
    counts = memory.parameter_count(spec)
    notes = tuple(notes) + tuple(
        filter(None, [_unwritten_note(spec, name, steps, names, notes, stage_offloads)])
    )
    return Plan(
        spec=spec,
        strategy=name,
        formula=formula,
        per_layer_activation_bytes=(
            memory.activation_bytes_per_layer(spec) if per_layer is None else per_layer
        ),
        breakdown=memory.activation_breakdown(spec),
        activation_bytes=activation_bytes,
        model_states=memory.model_state_bytes(spec) if model_states is None else model_states,
        parameters_total=counts.total,
        parameters_per_gpu=memory.parameters_per_gpu(spec),
        flops=flops,
        steps=steps,
        stage_names=names,
        notes=notes,
        stage_forwards=stage_forwards,
        recompute_groups=recompute_groups,
        peak_stage=peak_stage,
        host_bytes=host_bytes,
        bytes_moved=bytes_moved,
        stage_offloads=stage_offloads,
        stage_prefetch=stage_prefetch,
        stage_policy=stage_policy,
        pipeline_buffer_bytes=pipeline_buffer_bytes,
        optimizer_step_bytes=memory.optimizer_step_bytes(spec),
    )


def _evaluate_mixed(spec, strategy, budget, slots, gpu) -> Plan | None:
    """`POLICY+mixed` (ckplan.plan.policy_mix): the optimal DP choosing each layer's tape, full
    or the policy's, or its recomputation; one pipeline stage, one micro-batch in flight."""
    from ckplan.plan.policy_mix import mixed_stage

    if budget is None:
        raise StrategyError(f"strategy {strategy.name!r} needs a memory budget (--budget)")
    if spec.pp > 1:
        raise StrategyError(
            f"strategy {strategy.name!r} plans one micro-batch in flight: pipeline parallelism "
            "(pp > 1) is not supported; use sac+optimal"
        )
    found = mixed_stage(spec, strategy, 0, budget, slots, gpu)
    if found is None:
        return None
    replay = found.replay
    flops = FlopCount(
        forward=replay.forward_flops - replay.recompute_flops,
        backward=replay.backward_flops - found.rerun_flops,
        recompute=replay.recompute_flops + found.rerun_flops,
    )
    states = memory.model_state_bytes(spec, 0)
    peak = replay.peak_bytes
    if memory.gradients_allocated_in_backward(spec):
        during = [point.during_bytes for point in replay.trace]
        live = gradients_at_peak(found.steps, during, peak, memory.chain_gradient_bytes(spec))
        states = dataclasses.replace(states, gradients=live)
    stored = sum(found.policy_stages)
    rerun = sum(1 for count in replay.layer_forwards if count > 1)
    n = found.chain.length
    notes = (
        f"{stored} of {n} stages store the {_policy_label(strategy)} tape and {n - stored} the "
        f"full tape; {rerun} are re-run whole "
        f"({'step time on ' + gpu.name if gpu is not None else 'FLOPs'} minimised)",
    )
    if unexported := layerwise_export_reason(parse_policy(strategy.policy), "mixed"):
        notes += (unexported,)
    return _plan(
        spec,
        strategy.name,
        "derived",
        peak,
        _per_iteration(spec, flops),
        found.steps,
        _stage_names(spec, 0),
        notes,
        stage_forwards=((0, replay.layer_forwards),),
        # no stage storing the policy's tape: the plan of `optimal`, the policy re-runs nothing
        recompute_groups=strategy.groups if stored else (),
        model_states=states,
        stage_policy=((0, found.policy_stages),) if stored else (),
    )


def _policy_label(strategy: Strategy) -> str:
    """'sac' or the policy's own spelling, as the strategy's name gives it."""
    return strategy.name.rsplit("+", 1)[0] + " policy's"


def _evaluate_offload(spec, strategy, budget, slots, gpu) -> Plan | None:
    """`offload` and `offload+optimal` (ckplan.plan.offload): each pipeline stage's schedule
    with its tapes on host; the GPU that peaks on device is shown, the most host bytes of any."""
    from ckplan.plan.offload import offload_stage, offloaded_input_count, offloaded_words

    if spec.pipeline_schedule == "dualpipe":
        raise StrategyError(
            f"strategy {strategy.name!r}: offloading under pipeline_schedule dualpipe is not "
            "modelled (each rank's two stages share its host copies); use a strategy without "
            "offload"
        )
    results, forwards, offloads, prefetches = [], [], [], []
    for stage in pipeline_stages(spec):
        chain = layer_chain(spec, strategy.groups, stage=stage)
        in_flight = in_flight_microbatches(spec, stage)
        steps = None
        if strategy.kind not in ("none", "selective", "optimal"):
            segments = run_segments(_segment_runs(spec, chain, strategy, stage))
            steps = segment_schedule(chain, segments)
        found = offload_stage(spec, chain, strategy, stage, in_flight, budget, slots, gpu, steps)
        if found is None:
            return None
        flops = _stage_flops(spec, strategy, chain, found.replay.replay, stage)
        results.append((found, flops, stage))
        forwards.append((stage, found.replay.replay.layer_forwards))
        offloads.append((stage, found.offloaded))
        prefetches.append((stage, found.prefetch))
    states = {stage: memory.model_state_bytes(spec, stage) for *_, stage in results}
    found, _, stage = max(results, key=lambda r: (r[0].peak_bytes + states[r[2]].total, -r[2]))
    if memory.gradients_allocated_in_backward(spec):
        during = [point[0] for point in found.replay.device_trace]
        grads = memory.chain_gradient_bytes(spec)
        live = gradients_at_peak(tuple(found.steps), during, found.peak_bytes, grads)
        states[stage] = dataclasses.replace(states[stage], gradients=live)
    flops = max(results, key=lambda result: result[1].total)[1]
    host = max(result[0].host_bytes for result in results)
    moved = max(result[0].bytes_moved for result in results) * spec.microbatches
    names = _stage_names(spec, stage)
    kept = [i for i, _ in found.offloaded]
    what = offloaded_words(len(kept), offloaded_input_count(found.steps, kept))
    notes = (
        f"{what} of {len(names)} stages offloaded to host memory"
        + (f" ({names[kept[0]]} .. {names[kept[-1]]})" if kept else ""),
    )
    if spec.pp > 1:
        held = in_flight_microbatches(spec, stage)
        count = f"{float(held):g} micro-batch{'' if held == 1 else 'es'}"
        notes += (f"peak on {stage_label(spec, stage)}, {count} in flight",)
    pinned, note = _held_through_checkpoints(spec, tuple(forwards), stage, tuple(kept))
    notes += (note,) if note else ()
    return _plan(
        spec,
        strategy.name,
        "derived",
        found.peak_bytes + pinned,
        _per_iteration(spec, flops),
        found.steps,
        names,
        notes,
        stage_forwards=tuple(forwards),
        recompute_groups=strategy.groups,
        peak_stage=stage,
        model_states=states[stage],
        host_bytes=host,
        bytes_moved=moved,
        stage_offloads=tuple(offloads),
        stage_prefetch=tuple(prefetches),
    )


def _simple_rule_note(spec: ModelSpec) -> str:
    """The simple formula set's should_recompute rule applied to the derived per-layer
    attention and MLP bytes, with the attention core's FLOP fraction as the attention ratio and
    the MLP's share of the layer FLOPs as the FFN ratio."""
    breakdown = memory.activation_breakdown(spec)
    layer_flops = flops_model.layer_forward_flops(spec)
    mlp_flops = sum(op.forward_flops for op in layer_ops(spec) if op.component == "mlp")
    attention = simple.should_recompute(
        "attention", breakdown["attention"], flops_model.attention_core_fraction(spec)
    )
    ffn = simple.should_recompute("ffn", breakdown["mlp"], mlp_flops / layer_flops)
    verdict = {True: "recompute", False: "keep"}
    return f"rule of thumb (should_recompute): attention {verdict[attention]}, ffn {verdict[ffn]}"


def _evaluate_simple(spec: ModelSpec, strategy: Strategy) -> Plan:
    """The simple formula set exactly (ckplan.simple.formulas): 12·sbh·B per layer,
    (n_seg + K)·sbh·B after checkpointing, 4/3 and (3 + 0.15)/3 cost ratios, over the layers of
    one GPU, with the derived per-layer FLOPs as its abstract f_layer."""
    L = spec.layers_per_stage
    shape = {
        "hidden": spec.hidden,
        "seq": spec.seq,
        "batch": spec.micro_batch,
        "bytes_per_value": spec.dtype_bytes,
    }
    f_layer = flops_model.layer_forward_flops(spec)
    kind = strategy.kind
    if (
        (strategy.selective and kind != "selective")
        or strategy.moe
        or strategy.mlp
        or strategy.offload
        or strategy.modules
    ):
        raise StrategyError(f"the simple formula set has no strategy {strategy.name!r}")
    if kind in ("none", "selective"):
        activation_mb = simple.activation_memory_mb(L, **shape)
    elif kind in ("full", "uniform", "sqrt"):
        size = _segment_size(spec, strategy)
        activation_mb = simple.memory_after_checkpoint(L, size, **shape)
    else:
        raise StrategyError(f"the simple formula set has no strategy {strategy.name!r}")
    if kind == "none":
        recompute = 0
    elif kind == "selective":
        cost = simple.selective_checkpoint_cost(L, flops_per_layer=f_layer)
        recompute = round(cost["recompute"])
    else:
        recompute = round(
            simple.checkpoint_cost(L, _segment_size(spec, strategy), f_layer)["recompute"]
        )
    flops = FlopCount(forward=L * f_layer, backward=2 * L * f_layer, recompute=recompute)
    notes = (
        "simple formulas: layers only, no embedding/output terms",
        "the per-component breakdown is the derived model's; the simple formulas have none",
        _simple_rule_note(spec),
    )
    return _plan(
        spec,
        strategy.name,
        "simple",
        round(activation_mb * simple.MB),
        _per_iteration(spec, flops),
        notes=notes,
        per_layer=round(simple.activation_memory_mb(1, **shape) * simple.MB),
    )


def _held_bytes(
    spec: ModelSpec, stage_forwards, stage: int, offloaded: tuple = (), all_layers: bool = False
) -> tuple[int, int]:
    """(bytes, layers) that recomputation and offloading cannot take off the GPU in `stage`
    (`finetune.held_through_checkpoint_bytes`): bitsandbytes' matmuls hold their inputs on
    their autograd nodes, out of reach of the saved-tensor hooks that non-reentrant
    checkpointing and activation offloading act through. A layer whose tape is offloaded
    (`offloaded`: chain indices) keeps them on the GPU; a recomputed layer keeps them from its
    forward to its backward unless checkpointing is reentrant (`frameworks.checkpoint_reentrant`:
    a reentrant first forward builds no graph). All are alive until the first of these layers'
    backward ends, so the sum is exact where the schedule peaks before then and an upper bound
    after. (Per-op policies, whose kept ops would hold some of them already, are refused with
    frozen weights.) `all_layers`: as if every layer of the stage were recomputed, the most they
    add (what `optimal` plans beside)."""
    if spec.training == "full" or not finetune.bitsandbytes_keeps_input(spec):
        return 0, 0
    counts = dict(stage_forwards).get(stage, ())
    first = layer_offset(spec, stage == 0)
    kinds = stage_kinds(spec, stage)
    reentrant = frameworks.checkpoint_reentrant(spec)
    affected = [
        kind
        for index, kind in enumerate(kinds)
        if first + index in offloaded
        or (not reentrant and all_layers)
        or (not reentrant and first + index < len(counts) and counts[first + index] >= 2)
    ]
    per_kind = {
        k: finetune.held_through_checkpoint_bytes(layer_ops(spec, k), spec) for k in set(affected)
    }
    return sum(per_kind[kind] for kind in affected), len(affected)


def _held_through_checkpoints(
    spec: ModelSpec, stage_forwards, stage: int, offloaded: tuple = ()
) -> tuple[int, str | None]:
    """(bytes added to the peak, note): `_held_bytes` of the plan's recomputed and offloaded
    layers, and the note that says so; (0, None) where nothing is held."""
    held, layers = _held_bytes(spec, stage_forwards, stage, offloaded)
    if not held:
        return 0, None
    matmul = "int8" if spec.weight_format == "int8" else "4-bit (before 0.43.2)"
    how = "offloaded or recomputed" if offloaded else "recomputed"
    why = (
        f"bitsandbytes' {matmul} matmul keeps each frozen linear's input on its autograd node, "
        "out of reach of the saved-tensor hooks of non-reentrant checkpointing (transformers "
        f"5.25's default, `export --to peft`'s) and offloading: the {layers} {how} "
        "layers hold them on the GPU through the forward"
    )
    return held, f"includes {format_bytes(held)}: {why}"


def _unwritten_note(spec, name, steps, names, notes, stage_offloads) -> str | None:
    """The note of a plan whose schedule every launcher export refuses
    (`launcher_ranges.unwritten_reason`, the very check the exports make), unless a note already
    says that no export writes it; None when an export writes it."""
    if any(NO_EXPORT in note for note in notes):
        return None
    why = unwritten_reason(spec.pp, name, steps, names, bool(stage_offloads))
    return None if why is None else f"{name}: {NO_EXPORT} it; {why}"


def _revolve_note(strategy: Strategy, forwards) -> str | None:
    """Why no export writes this `revolve:C` or `optimal` plan (a note), None for other
    strategies and for a schedule that runs no layer more than twice: a binomial schedule,
    or an optimal one under a tight budget (the rotor DP, Beaumont et al. 2019, chooses
    nested segments where they cost less), that re-runs some layers more than once from
    checkpoints written during a re-run (Griewank & Walther 2000) has no one-level segments,
    and every launcher ckplan exports to checkpoints one level of segments
    (exports.segments `layer_segments`). The sweep lists such a revolve schedule as a
    reference for the least memory C slots reach. `forwards`: (pipeline stage, forwards per
    chain stage)."""
    if strategy.kind not in ("revolve", "optimal"):
        return None
    if all(max(c, default=0) <= 2 for _, c in forwards):
        return None
    what = "a reference schedule" if strategy.kind == "revolve" else "at this budget a schedule"
    return (
        f"{strategy.name}: {what} {NO_EXPORT} (it re-runs some layers more "
        "than once, nested recomputation; launchers checkpoint one level of segments)"
    )
