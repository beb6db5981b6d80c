"""The expert-parallel layout of a mixture of experts on one GPU: how many experts and MoE
layers it holds and their weights (the estimate's expert line, the time model's dispatch)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ckplan.model.layers import stage_kind_counts
from ckplan.model.memory import busiest_stage, stage_parameters
from ckplan.model.moe import routed_rows
from ckplan.model.op import LayerShapes
from ckplan.model.spec import ModelSpec


@dataclass(frozen=True)
class ExpertLayout:
    """How the experts of an MoE model sit on one GPU (the busiest pipeline stage's)."""

    experts: int
    top_k: int
    ep: int
    etp: int
    expert_data_parallel: int  # tp·cp·dp / (ep·etp), the ranks that share an expert's states
    experts_per_gpu: int  # E / ep local experts
    expert_ffn_per_gpu: int  # F_e / etp of every local expert
    moe_layers_per_gpu: int
    tokens_per_gpu: int  # T entering each MoE layer, one micro-batch
    routed_rows_per_gpu: int  # R its expert GEMMs process, one micro-batch (routed_rows)
    average_rows_per_gpu: int  # R with balanced routing
    expert_parameters_per_gpu: int
    moe_imbalance: str
    capacity_factor: float


@lru_cache(maxsize=64)  # a sweep describes the same layout for each of its plans
def expert_layout(spec: ModelSpec) -> ExpertLayout | None:
    """The expert-parallel layout of `spec` on one GPU; None without experts."""
    if not spec.experts:
        return None
    shapes = LayerShapes.of(spec)
    stage = busiest_stage(spec)
    average = routed_rows(spec.replace(moe_imbalance="average"), shapes)
    return ExpertLayout(
        experts=spec.experts,
        top_k=spec.top_k,
        ep=spec.ep,
        etp=spec.etp,
        expert_data_parallel=spec.expert_data_parallel,
        experts_per_gpu=spec.experts // spec.ep,
        expert_ffn_per_gpu=spec.moe_ffn_hidden // spec.etp,
        moe_layers_per_gpu=sum(
            count for kind, count in stage_kind_counts(spec, stage).items() if kind.moe
        ),
        tokens_per_gpu=shapes.stream_tokens,
        routed_rows_per_gpu=routed_rows(spec, shapes),
        average_rows_per_gpu=average,
        expert_parameters_per_gpu=stage_parameters(spec, stage)[1],
        moe_imbalance=spec.moe_imbalance,
        capacity_factor=spec.capacity_factor,
    )
