"""When torch.distributed.pipelining's interleaved schedule frees the unsharded fp32 gradients
FSDP2 accumulates over micro-batches: the check behind `interleaved_gradient_excess`
(ckplan/plan/evaluate.py, docs/validation.md).

Four gloo ranks on the CPU (pp 2 x dp 2), two model chunks per rank (one nn.Linear each),
fully_shard over the dp mesh with reshard_after_forward=False and
MixedPrecisionPolicy(param bf16, reduce fp32), ScheduleInterleaved1F1B with 4 micro-batches
(PyTorch v2.13.0). After every backward and every REDUCE_GRAD, each dp-rank-0 GPU prints how
many of each chunk's parameters hold `unsharded_accumulated_grad`. Observed: a chunk's count
rises at its first backward and falls to 0 at the REDUCE_GRAD right after its last backward,
e.g. rank 0: B 2 mb0 [0, 2] ... B 2 mb3 [2, 2], RG 2 [2, 0], B 0 mb2 [2, 0], B 0 mb3 [2, 0],
RG 0 [0, 0].

Run: torchrun --nproc_per_node 4 validation/torch_pipeline_reduce_grad.py
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B
from torch.distributed.pipelining import stage as stage_module

MICROBATCHES = 4
CHUNKS_PER_RANK = 2
PP, DP = 2, 2


def accumulating(chunks: list[nn.Module]) -> list[int]:
    """Per chunk, how many parameters hold an unsharded accumulated gradient."""
    return [
        sum(
            param.unsharded_accumulated_grad is not None
            for group in fully_shard.state(chunk)._fsdp_param_groups
            for param in group.fsdp_params
        )
        for chunk in chunks
    ]


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    pp_rank = mesh["pp"].get_local_rank()
    torch.manual_seed(0)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    chunks, stages = [], []
    for virtual in range(CHUNKS_PER_RANK):
        chunk = nn.Sequential(nn.Linear(16, 16))
        fully_shard(chunk, mesh=mesh["dp"], reshard_after_forward=False, mp_policy=policy)
        chunks.append(chunk)
        index = pp_rank + PP * virtual
        stages.append(
            PipelineStage(
                chunk,
                index,
                PP * CHUNKS_PER_RANK,
                torch.device("cpu"),
                group=mesh["pp"].get_group(),
            )
        )
    events = []
    backward = stage_module._PipelineStageBase.backward_one_chunk
    reduce_grad = stage_module._PipelineStageBase.perform_reduce_grad

    def logged_backward(self, microbatch, *args, **kwargs):
        result = backward(self, microbatch, *args, **kwargs)
        events.append(f"B {self.stage_index} mb{microbatch} {accumulating(chunks)}")
        return result

    def logged_reduce_grad(self, *args, **kwargs):
        result = reduce_grad(self, *args, **kwargs)
        events.append(f"RG {self.stage_index} {accumulating(chunks)}")
        return result

    stage_module._PipelineStageBase.backward_one_chunk = logged_backward
    stage_module._PipelineStageBase.perform_reduce_grad = logged_reduce_grad
    schedule = ScheduleInterleaved1F1B(
        stages,
        n_microbatches=MICROBATCHES,
        loss_fn=lambda output, target: ((output.float() - target) ** 2).mean(),
    )
    if pp_rank == 0:
        schedule.step(torch.randn(MICROBATCHES, 4, 16))
    else:
        schedule.step(target=torch.randn(MICROBATCHES, 4, 16))
    if mesh["dp"].get_local_rank() == 0:
        print(f"rank {dist.get_rank()} (pp {pp_rank}): " + ", ".join(events), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
