"""Lower bounds on a layout's step time and per-GPU memory, from a few cached quantities.

A layout's chain depends on few of its keys: one layer's ops and times on (tp, sp, cp,
micro-batch) (and ep, etp, dp for experts), a stage's layers on (pp, split, v), its parameters
on those and (tp, ep, etp). So the search computes each of these once per distinct value and
composes a layout's bounds by arithmetic:

- time: (m + (p - 1)/v) x (the busiest stage's micro-batch + its pipeline sends) + the
  data-parallel reduction not overlapped + the optimizer step, each term as
  `hardware.step_time` composes it for a plan without recomputation (`step_time_from_forwards`:
  `_pipeline`, `data_parallel_seconds`, `optimizer_seconds`, mirrored here on the cached
  parameter counts). Recomputation only adds time, so this bounds every plan of the layout
  from below, and is that of `none`.
- memory: on every stage, model states (`memory.states_of` over the stage's parameters) plus
  the least any schedule holds while one layer runs its backward: that layer's tape, its input
  and output gradients and its backward workspace (the chain's rule for a backward step),
  whatever it recomputes; on the last stage the output layer's backward (fp32 logits and their
  gradient). No plan of the layout fits if this does not. On Megatron-LM the layer-level plans
  also try module sets (`search.layout_module_candidates`), which lower what a stored layer
  keeps but may raise its backward's workspace: the bound that rejects a layout
  (`Bounds.layout_memory`) takes them too, computed only where the plain one is over.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from ckplan.hardware import communication as comm
from ckplan.hardware import host_states
from ckplan.hardware.gpus import GPU
from ckplan.hardware.host_link import copy_seconds
from ckplan.hardware.roofline import memory_seconds
from ckplan.hardware.step_time import (
    amax_all_reduce_seconds,
    embedding_time,
    fp8_master_cast_extra_bytes,
    gradient_reduction,
    layer_time,
    optimizer_step_bytes_per_parameter,
    output_time,
    zero3_gathers_frozen,
)
from ckplan.hardware.times import StageTime
from ckplan.model import allocator, loss, memory
from ckplan.model.layers import LayerKind, stage_kinds
from ckplan.model.modules import LAYERNORM, MLA_UP_PROJ, MOE_ACT
from ckplan.model.moe import EXPERTS, MOE, SHARED_EXPERTS
from ckplan.model.op import ATTENTION_CORE, DENSE_MLP, split_share
from ckplan.model.spec import ModelSpec
from ckplan.plan.layer_chain import layer_stage_costs
from ckplan.plan.layout.space import Layout, Split
from ckplan.plan.search import layout_module_candidates
from ckplan.plan.strategies import parse_strategy

# Every combination of recompute groups a strategy can run (`Strategy.groups`): the attention
# core, the dense MLP or an MoE group, then any of Megatron-Core's other modules (MODULES, in
# order, strategies.MODULES; moe_act and shared_experts not beside an MoE group, which covers them).
_MODULE_GROUPS = (LAYERNORM, MOE_ACT, MLA_UP_PROJ, SHARED_EXPERTS)  # strategies.MODULES
_BASE_GROUPS = (
    (),
    (ATTENTION_CORE,),
    (DENSE_MLP,),
    (ATTENTION_CORE, DENSE_MLP),
    (MOE,),
    (EXPERTS,),
    (ATTENTION_CORE, MOE),
    (ATTENTION_CORE, EXPERTS),
)
_GROUPS = tuple(
    base + extra
    for base in _BASE_GROUPS
    for count in range(len(_MODULE_GROUPS) + 1)
    for extra in itertools.combinations(_MODULE_GROUPS, count)
    if not ((MOE in base or EXPERTS in base) and (MOE_ACT in extra or SHARED_EXPERTS in extra))
)


def _plain(stage: StageTime) -> float:
    """One micro-batch through a chain stage without recomputation (`micro_batch_time`)."""
    return stage.forward.total + stage.backward.total + stage.forward_comm + stage.backward_comm


def _ratio(seconds: float, saved_bytes: int) -> float:
    """Seconds per byte; infinite where nothing is saved."""
    return seconds / saved_bytes if saved_bytes > 0 else float("inf")


def _comm(stage: StageTime) -> float:
    return stage.forward_comm + stage.backward_comm


@dataclass(frozen=True)
class StageShape:
    """One pipeline stage whose contents no other listed stage repeats."""

    index: int
    kinds: tuple[tuple[LayerKind, int], ...]  # its layers, counted by kind
    first: bool
    last: bool


@dataclass(frozen=True)
class TimeBound:
    """The lower bound on step time and its parts (seconds)."""

    seconds: float
    micro_batch: float  # the busiest stage's micro-batch, plain, with its sends
    bubble: float
    communication: float  # exposed TP/CP collectives, pipeline sends, data parallelism
    data_parallel: float
    optimizer: float


@dataclass(frozen=True)
class MemoryBound:
    bytes: int  # the fullest stage's states + least activations
    stage: int
    states: int  # that stage's model states
    activations: int  # the least activations any plan holds there


class Bounds:
    """The caches and bounds of one search (one model, one GPU)."""

    def __init__(self, spec: ModelSpec, gpu: GPU) -> None:
        self.spec = spec
        self.gpu = gpu
        self._stages: dict[tuple, tuple[StageShape, ...]] = {}
        self._layers: dict[tuple, dict[str, Any]] = {}
        self._layer_specs: dict[tuple, ModelSpec] = {}
        self._memories: dict[tuple, dict[str, Any]] = {}
        self._ratios: dict[tuple, dict[Any, float]] = {}
        self._params: dict[tuple, dict[int, tuple[int, int]]] = {}
        self._fp8: dict[tuple, dict[int, tuple[int, int, int, int]]] = {}
        self._trainable: dict[tuple, dict[int, tuple[int, int, int]]] = {}
        self._by_zero: dict[int, ModelSpec] = {}
        self._states: dict[tuple, tuple[tuple[StageShape, int], ...]] = {}

    @cached_property
    def experts(self) -> bool:
        return self.spec.experts > 0

    # ---- cached parts ------------------------------------------------------------------

    def _spec(self, **keys: Any) -> ModelSpec:
        """The model with layout keys changed; the split keys not given are cleared."""
        cleared = {
            key: None for key in ("first_stage_layers", "last_stage_layers", "pipeline_layout")
        }
        cleared |= {
            "account_for_embedding_in_pipeline_split": False,
            "account_for_loss_in_pipeline_split": False,
            "etp": None,
            "microbatch_group_size": None,  # Megatron's default, pp, for every layout
            # the parts' specs run any layout (ZeRO 0 among them); `states` offloads
            "optimizer_offload": "none",
            "param_offload": "none",
            "fp8_param_gather": False,  # zero 1 only; `fp8` counts its weights apart
        }
        return self.spec.replace(**(cleared | keys))

    def stages(self, pp: int, split: Split, v: int) -> tuple[StageShape, ...]:
        """The distinct stages of a pipeline (`memory.distinct_stages`), with their layers."""
        key = (pp, split, v)
        if key not in self._stages:
            spec = self._spec(
                tp=1, sp=False, cp=1, dp=1, zero=0, ep=1, pp=pp, virtual_stages=v,
                microbatches=1, **split.keys(),
            )  # fmt: skip
            self._stages[key] = tuple(
                StageShape(
                    stage,
                    tuple(sorted(Counter(stage_kinds(spec, stage)).items())),
                    stage == 0,
                    stage == pp - 1,
                )
                for stage in memory.distinct_stages(spec)
            )
        return self._stages[key]

    def _layer_key(self, layout: Layout) -> tuple:
        """What one layer's ops depend on: (tp, sp, cp and its exchange, micro-batch), and (ep,
        etp) with experts (dp only shards states and sets the expert-data-parallel group)."""
        experts = (layout.ep, layout.etp) if self.experts else ()
        exchange = (layout.cp_attention, layout.cp_a2a_size)
        return (layout.tp, layout.sp, layout.cp, *exchange, layout.micro_batch, *experts)

    def _layer_spec(self, layout: Layout) -> ModelSpec:
        key = self._layer_key(layout)
        if key not in self._layer_specs:
            keys = {}
            if self.experts:  # the least dp the expert layout allows
                keys = {"ep": layout.ep, "etp": layout.etp}
                keys["dp"] = _least_dp(layout)
            self._layer_specs[key] = self._spec(
                tp=layout.tp, sp=layout.sp, cp=layout.cp, micro_batch=layout.micro_batch,
                cp_attention=layout.cp_attention, cp_a2a_size=layout.cp_a2a_size,
                pp=1, virtual_stages=1, zero=0, microbatches=1, **{"dp": 1, **keys},
            )  # fmt: skip
        return self._layer_specs[key]

    def layer_memory(self, layout: Layout, modules: bool = False) -> dict[str, Any]:
        """One layer's least backward memory per kind, the output's, the residual stream; with
        `modules`, over the module sets of the layer-level plans too (`_module_groups`)."""
        key = (*self._layer_key(layout), modules)
        if key not in self._memories:
            spec = self._layer_spec(layout)
            stream = memory.layer_input_bytes(spec)
            extra = self._module_groups if modules else ()
            kinds = {
                kind: min(
                    tape + workspace + 2 * stream
                    for groups in self._groups(kind) + extra
                    for _, _, tape, workspace in (layer_stage_costs(spec, kind, groups),)
                )
                for kind in dict.fromkeys(memory.layer_kinds(spec))
            }
            output = 0
            if spec.kind == "transformer" and spec.vocab > 0:
                saved = loss.output_saved_bytes(spec)
                output = max(loss.output_backward_peak_bytes(spec), saved + stream)
            self._memories[key] = {"kinds": kinds, "output_bytes": output, "stream": stream}
        return self._memories[key]

    def layer(self, layout: Layout) -> dict[str, Any]:
        """One layer's time per kind ((plain micro-batch, exposed collectives)), the
        embedding's and output's times, the residual stream."""
        key = self._layer_key(layout)
        if key not in self._layers:
            spec = self._layer_spec(layout)
            kinds = {}
            for kind in dict.fromkeys(memory.layer_kinds(spec)):
                time = layer_time(spec, self.gpu, kind)
                kinds[kind] = (_plain(time), _comm(time))
            self._layers[key] = {
                "kinds": kinds,
                "embedding": embedding_time(spec, self.gpu),
                "output": output_time(spec, self.gpu),
                "stream": memory.layer_input_bytes(spec),
            }
        return self._layers[key]

    def ratios(self, layout: Layout) -> dict[Any, float]:
        """The least recompute seconds per byte saved of each layer kind, the embedding and
        the output (`_layer_ratio`)."""
        key = self._layer_key(layout)
        if key not in self._ratios:
            spec = self._layer_spec(layout)
            ratios: dict[Any, float] = {"embedding": float("inf"), "output": float("inf")}
            for kind in dict.fromkeys(memory.layer_kinds(spec)):
                ratios[kind] = self._layer_ratio(spec, kind)
            if spec.kind == "transformer" and spec.vocab > 0:
                layer = self.layer(layout)
                saved = loss.output_saved_bytes(spec)
                ratios["output"] = _ratio(layer["output"].forward.total, saved)
                ratios["embedding"] = _ratio(
                    layer["embedding"].forward.total, memory.embedding_saved_bytes(spec)
                )
            self._ratios[key] = ratios
        return self._ratios[key]

    def _layer_ratio(self, spec: ModelSpec, kind: LayerKind) -> float:
        """The fewest seconds of recomputation per byte a layer of `kind` stops storing: its
        forward for its whole tape, or a recompute group's forward for the bytes the group's
        recomputation drops (`layer_stage_costs`)."""
        tape = layer_stage_costs(spec, kind, ())[2]
        best = _ratio(layer_time(spec, self.gpu, kind).forward.total, tape)
        for groups in self._groups(kind):
            if groups:
                saved = tape - layer_stage_costs(spec, kind, groups)[2]
                core = layer_time(spec, self.gpu, kind, groups).core_forward.total
                best = min(best, _ratio(core, saved))
        return best

    def _groups(self, kind: LayerKind) -> tuple[tuple[str, ...], ...]:
        """The combinations the optimal DP runs on a layer of `kind`: no dense MLP in a MoE
        layer, no MoE group in a dense one, and none of Megatron-Core's other modules, which
        the DP never uses (the layer-level plans try them on Megatron-LM, `_module_groups`):
        their cheap re-runs (a norm's forward) would only loosen the time bound that decides
        where the DP runs."""
        absent = set(_MODULE_GROUPS)
        absent |= {DENSE_MLP} if kind.moe else {MOE, EXPERTS}
        return tuple(groups for groups in _GROUPS if not absent.intersection(groups))

    @cached_property
    def _module_groups(self) -> tuple[tuple[str, ...], ...]:
        """The recompute groups of the module sets the layout search tries on Megatron-LM
        (`search.layout_module_candidates`): they lower what a stored layer keeps and may
        raise its backward's workspace, so the memory bound takes them too. (A strategy's
        groups depend on the model's parts, never on its layout.)"""
        if self.spec.framework != "megatron":
            return ()
        names = layout_module_candidates(self.spec)
        return tuple(parse_strategy(name, self.spec).groups for name in names)

    def _weights_spec(self, layout: Layout) -> ModelSpec:
        """The model laid out as `layout` splits its weights (tp, pp and its split, virtual
        stages, ep, etp), one micro-batch and no data parallelism: what its stages hold."""
        keys = {}
        if self.experts:
            keys = {"ep": layout.ep, "etp": layout.etp, "dp": layout.ep * layout.etp}
        return self._spec(
            tp=layout.tp, sp=layout.tp > 1, cp=1, zero=0, pp=layout.pp,
            virtual_stages=layout.virtual_stages, microbatches=1,
            **{"dp": 1, **keys}, **layout.split.keys(),
        )  # fmt: skip

    def parameters(self, layout: Layout) -> dict[int, tuple[int, int]]:
        """(dense, expert) parameters per GPU of each distinct stage."""
        key = (layout.tp, layout.pp, layout.split, layout.virtual_stages, layout.ep, layout.etp)
        if key not in self._params:
            spec = self._weights_spec(layout)
            self._params[key] = {
                shape.index: memory.stage_parameters(spec, shape.index)
                for shape in self.stages(layout.pp, layout.split, layout.virtual_stages)
            }
        return self._params[key]

    def trainable(self, layout: Layout) -> dict[int, tuple[int, int, int]]:
        """(dense, expert) parameters that train per GPU of each distinct stage, and the bytes
        of its frozen weights every ZeRO-3 pass gathers (`memory.trainable_stage_parameters`,
        `memory.frozen_gathered_bytes`): `parameters` and none under training: full."""
        if self.spec.training == "full":
            return {stage: (*params, 0) for stage, params in self.parameters(layout).items()}
        key = (layout.tp, layout.pp, layout.split, layout.virtual_stages, layout.ep, layout.etp)
        if key not in self._trainable:
            spec = self._weights_spec(layout)
            self._trainable[key] = {
                shape.index: (
                    *memory.trainable_stage_parameters(spec, shape.index),
                    memory.frozen_gathered_bytes(spec, shape.index),
                )
                for shape in self.stages(layout.pp, layout.split, layout.virtual_stages)
            }
        return self._trainable[key]

    def fp8(self, layout: Layout) -> dict[int, tuple[int, int, int, int]]:
        """Per distinct stage, its FP8 primary weights and their tensors on one GPU, (dense,
        expert) each (`memory.fp8_linear_parameters`, `memory.fp8_weight_amaxes`); zeros
        without `fp8_param_gather`."""
        key = (layout.tp, layout.pp, layout.split, layout.virtual_stages, layout.ep, layout.etp)
        if key not in self._fp8:
            spec = self._weights_spec(layout)
            on = self.spec.fp8_param_gather
            self._fp8[key] = {
                shape.index: (
                    *memory.fp8_linear_parameters(spec, shape.index),
                    *memory.fp8_weight_amaxes(spec, shape.index),
                )
                if on
                else (0, 0, 0, 0)
                for shape in self.stages(layout.pp, layout.split, layout.virtual_stages)
            }
        return self._fp8[key]

    def bytes_spec(self, layout: Layout) -> ModelSpec:
        """The model with the bytes per parameter of the layout's ZeRO stage: the framework's
        defaults can depend on it (DeepSpeed's ZeRO-3 accumulates fp32 gradients,
        `frameworks.training_defaults`), and a key still at its default is derived again from
        the layout's, as the layout's own spec is (`ModelSpec.replace`). One per stage."""
        if layout.zero not in self._by_zero:
            self._by_zero[layout.zero] = self.spec.replace(
                **layout_keys_cleared(layout, self.experts)
            )
        return self._by_zero[layout.zero]

    # ---- bounds ------------------------------------------------------------------------

    def states(self, layout: Layout, stage: int) -> memory.ModelStateBytes:
        if self.spec.training != "full" and self.spec.optimizer_offload != "none":
            # frozen weights beside states on the host: the layout's own spec, exactly
            laid_out = self.spec.replace(**layout_keys_cleared(layout, self.experts))
            return memory.model_state_bytes(laid_out, stage)
        if self.spec.training != "full":  # frozen weights (docs/fine-tuning.md)
            spec = self._spec(
                tp=layout.tp, sp=layout.tp > 1, cp=1, dp=1, zero=0, pp=layout.pp,
                virtual_stages=layout.virtual_stages, microbatches=1, **layout.split.keys(),
            )  # fmt: skip
            return memory.finetune_state_bytes(
                spec, stage, zero=layout.zero, dp=layout.dp * layout.cp
            )
        dense, expert = self.parameters(layout)[stage]
        # the step in backward holds one layer's gradients: none here keeps the bound below
        held = 0 if self.spec.optimizer_in_backward else None
        return memory.states_of(
            self.bytes_spec(layout), dense, expert, zero=layout.zero, dp=layout.dp * layout.cp,
            expert_dp=self._expert_dp(layout), held_gradients=held, tp=layout.tp,
            microbatches=layout.microbatches,
        )  # fmt: skip

    def stage_states(self, layout: Layout) -> tuple[tuple[StageShape, int], ...]:
        """Each distinct stage with its model states' total bytes."""
        key = (
            layout.tp, layout.pp, layout.split, layout.virtual_stages, layout.cp, layout.dp,
            layout.ep, layout.etp, layout.zero, min(layout.microbatches, 2),
        )  # fmt: skip
        if key not in self._states:
            shapes = self.stages(layout.pp, layout.split, layout.virtual_stages)
            self._states[key] = tuple(
                (shape, self.states(layout, shape.index).total) for shape in shapes
            )
        return self._states[key]

    def memory(self, layout: Layout, modules: bool = False) -> MemoryBound:
        """The least per-GPU memory any plan of `layout` needs (module docstring); without
        `modules`, any plan but the module sets of Megatron-LM's layer-level plans, which may
        need less (`layout_memory` takes them where that decides)."""
        layer = self.layer_memory(layout, modules)
        kinds, output = layer["kinds"], layer["output_bytes"]
        best = None
        for shape, states in self.stage_states(layout):
            least = max((kinds[kind] for kind, _ in shape.kinds), default=0)
            if shape.last:
                least = max(least, output)
            if best is None or states + least > best.bytes:
                best = MemoryBound(states + least, shape.index, states, least)
        assert best is not None
        return best

    def layout_memory(self, layout: Layout, usable: int) -> MemoryBound:
        """`memory`, and where it exceeds `usable` bytes (as the allocator budgets it), the
        bound over the module sets too: the search rejects a layout on that one, and computes
        it only where the cheaper one would reject (derived: more plans only lower the least)."""
        bound = self.memory(layout)
        if self._module_groups and allocator.budgeted_bytes(bound.bytes) > usable:
            bound = self.memory(layout, modules=True)
        return bound

    def _stage_seconds(self, layout: Layout, shape: StageShape) -> tuple[float, float]:
        """(plain micro-batch seconds, of which exposed collectives) of one stage."""
        layer = self.layer(layout)
        ends = [layer["embedding"]] * shape.first + [layer["output"]] * shape.last
        kinds = layer["kinds"]
        seconds = sum(count * kinds[kind][0] for kind, count in shape.kinds)
        collectives = sum(count * kinds[kind][1] for kind, count in shape.kinds)
        return seconds + sum(map(_plain, ends)), collectives + sum(map(_comm, ends))

    def time(self, layout: Layout) -> TimeBound:
        """The least step time any plan of `layout` takes (module docstring)."""
        layer, gpu = self.layer(layout), self.gpu
        busiest = collectives = 0.0
        for shape in self.stages(layout.pp, layout.split, layout.virtual_stages):
            seconds, exposed = self._stage_seconds(layout, shape)
            if seconds > busiest:
                busiest, collectives = seconds, exposed
        p2p = self._pipeline_sends(layout, layer["stream"])
        per_micro_batch = busiest + p2p
        m, v = layout.microbatches, layout.virtual_stages
        bubble = (layout.pp - 1) / v * per_micro_batch
        dp = self._data_parallel(layout)
        if self.spec.dp_comm_overlap:  # at least one layer's chunk of each collective
            dp /= self.spec.layers  # (a stage holds at most all the layers)
        else:
            dp *= 1 - gpu.dp_overlap
        optimizer = self._optimizer(layout)
        return TimeBound(
            seconds=m * per_micro_batch + bubble + dp + optimizer,
            micro_batch=per_micro_batch,
            bubble=bubble,
            communication=m * (p2p + collectives) + dp,
            data_parallel=dp,
            optimizer=optimizer,
        )

    def recompute_time(
        self, layout: Layout, bound: TimeBound, stage: int, deficit: int, in_flight: float
    ) -> float:
        """The least step time of a plan that frees `deficit` bytes on pipeline stage `stage`
        with `in_flight` micro-batches there (derived: a stage's peak is one micro-batch's peak
        plus what each waiting one holds, so every byte a plan stops storing per micro-batch
        frees at most `in_flight` bytes of the peak; it must stop storing deficit / in_flight
        bytes, each at the least recompute seconds per byte of the stage's layers, embedding or
        output (a fractional knapsack); that time adds to the stage's micro-batch, which paces
        the pipeline once it exceeds the busiest)."""
        shape = self._stage_shape(layout, stage)
        known = self.ratios(layout)
        ratios = [known[kind] for kind, _ in shape.kinds]
        ratios += [known["embedding"]] * shape.first
        ratios += [known["output"]] * shape.last
        extra = deficit / in_flight * min(ratios, default=float("inf"))
        busiest = max(
            self._stage_seconds(layout, s)[0]
            for s in self.stages(layout.pp, layout.split, layout.virtual_stages)
        )
        grow = max(0.0, self._stage_seconds(layout, shape)[0] + extra - busiest)
        steps = layout.microbatches + (layout.pp - 1) / layout.virtual_stages
        return bound.seconds + steps * grow

    def _stage_shape(self, layout: Layout, stage: int) -> StageShape:
        for shape in self.stages(layout.pp, layout.split, layout.virtual_stages):
            if shape.index == stage:
                return shape
        spec = self._spec(
            tp=1, sp=False, cp=1, dp=1, zero=0, ep=1, pp=layout.pp,
            virtual_stages=layout.virtual_stages, microbatches=1, **layout.split.keys(),
        )  # fmt: skip
        kinds = tuple(sorted(Counter(stage_kinds(spec, stage)).items()))
        return StageShape(stage, kinds, stage == 0, stage == layout.pp - 1)

    def _pipeline_sends(self, layout: Layout, stream: int) -> float:
        """`step_time.pipeline_p2p_seconds`: activation and gradient, once per virtual stage,
        the 1/t share under the scatter/gather optimisation."""
        if layout.pp == 1:
            return 0.0
        size = stream if layout.sp else split_share(stream, layout.tp)
        stride = layout.tp * layout.cp * layout.dp
        bandwidth = comm.group_bandwidth(self.gpu, 2, stride)
        return 2 * layout.virtual_stages * comm.p2p_seconds(size, bandwidth)

    def _busiest_stage(self, layout: Layout) -> int:
        """`memory.busiest_stage`: the stage with the most parameters (the first of equals)."""
        params = self.parameters(layout)
        return max(params, key=lambda stage: (sum(params[stage]), -stage))

    def _busiest_parameters(self, layout: Layout) -> tuple[int, int]:
        """`memory.busiest_stage`'s (dense, expert) parameters that train."""
        return self.trainable(layout)[self._busiest_stage(layout)][:2]

    def _expert_dp(self, layout: Layout) -> int:
        return layout.tp * layout.cp * layout.dp // (layout.ep * layout.etp)

    def _data_parallel(self, layout: Layout) -> float:
        """`step_time.data_parallel_seconds`, before overlap: the dense parameters reduced over
        dp·cp ranks tp apart, the experts' over their expert-data-parallel group."""
        dense, experts = self._busiest_parameters(layout)
        fp8_dense, fp8_experts = self.fp8(layout)[self._busiest_stage(layout)][:2]
        ranks = layout.dp * layout.cp
        frozen = 0
        if zero3_gathers_frozen(self.spec, layout.zero):
            frozen = self.trainable(layout)[self._busiest_stage(layout)][2]
        seconds = self._reduction(layout, dense, ranks, layout.tp, fp8_dense, frozen)
        if experts:
            seconds += self._reduction(
                layout, experts, self._expert_dp(layout), layout.ep * layout.etp, fp8_experts
            )
        return seconds

    def _reduction(
        self,
        layout: Layout,
        params: int,
        ranks: int,
        stride: int,
        fp8_params: int = 0,
        frozen_bytes: int = 0,
    ) -> float:
        """`step_time.gradient_reduction` under the layout's ZeRO stage, all of it; under
        torchao's float8 all-gather every weight taken as gathered in 1 byte and its shard's
        cast left out, a bound from below."""
        bandwidth = comm.group_bandwidth(self.gpu, ranks, stride)
        float8 = params if self.spec.fsdp_float8_all_gather else 0
        parts = gradient_reduction(
            self.bytes_spec(layout),
            layout.zero,
            layout.pp,
            params,
            ranks,
            bandwidth,
            float8=float8,
            fp8_params=fp8_params,
            frozen_bytes=frozen_bytes,
        )
        return parts.total(layout.microbatches)

    def _optimizer(self, layout: Layout) -> float:
        """`step_time.optimizer_seconds`: Adam's memory-bound step over this GPU's share."""
        spec = self.bytes_spec(layout)
        dense, experts = self._busiest_parameters(layout)
        fp8_dense, fp8_experts, dense_tensors, expert_tensors = self.fp8(layout)[
            self._busiest_stage(layout)
        ]
        if layout.zero >= 1:
            dense, fp8_dense = (split_share(n, layout.dp * layout.cp) for n in (dense, fp8_dense))
            expert_dp = self._expert_dp(layout)
            experts, fp8_experts = (
                split_share(n, expert_dp) if n else 0 for n in (experts, fp8_experts)
            )
        if spec.optimizer_offload != "none":
            # the CPU step and the copy after it, never hidden (host_states); the copies
            # beside the compute only add to it
            traffic = host_states.state_traffic(spec, dense + experts, layout.zero)
            after = copy_seconds(traffic.after_step_to_device, self.gpu)
            sharing = min(self.gpu.gpus_per_node, layout.gpus)
            return host_states.cpu_adam_seconds(traffic, self.gpu, sharing) + after
        per_param = optimizer_step_bytes_per_parameter(spec)
        cast = fp8_master_cast_extra_bytes(spec, fp8_dense + fp8_experts)
        amax = amax_all_reduce_seconds(self.gpu, dense_tensors, layout.dp * layout.cp, layout.tp)
        amax += amax_all_reduce_seconds(
            self.gpu, expert_tensors, self._expert_dp(layout), layout.ep * layout.etp
        )
        return memory_seconds(self.gpu, (dense + experts) * per_param + cast) + amax


def _least_dp(layout: Layout) -> int:
    """The least dp with ep·etp dividing tp·cp·dp: a valid model for the layer's ops, which do
    not depend on dp."""
    group, ranks = layout.ep * layout.etp, layout.tp * layout.cp
    return group // math.gcd(group, ranks)


def layout_keys_cleared(layout: Layout, experts: bool) -> dict[str, Any]:
    """Every key a layout sets, the split keys it does not use cleared: what `spec.replace`
    needs to turn a model into this layout whatever layout its file had."""
    keys: dict[str, Any] = {
        "first_stage_layers": None,
        "last_stage_layers": None,
        "pipeline_layout": None,
        "account_for_embedding_in_pipeline_split": False,
        "account_for_loss_in_pipeline_split": False,
        "microbatch_group_size": None,  # Megatron's default, pp: the search's layouts use it
    }
    if not experts:
        keys["etp"] = None
    return keys | layout.keys(experts)
