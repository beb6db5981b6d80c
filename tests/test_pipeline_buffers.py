"""torch.distributed.pipelining's buffers under torchtitan's pipeline parallelism
(frameworks.torch_pipeline_buffer_bytes, memory.pipeline_buffer_bytes), against PipelineStage
itself on the CPU (validation/torch_pipeline_buffers.py) and in the plan."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from needs_torch import torch_or_skip

from ckplan.model import memory
from ckplan.model.frameworks import torch_pipeline_buffer_bytes
from ckplan.plan import evaluate, in_flight_microbatches, parse_strategy
from ckplan.plan.evaluate import megatron_in_flight_forwards
from ckplan.plan.timeline import memory_timeline

SCRIPT = Path(__file__).resolve().parent.parent / "validation" / "torch_pipeline_buffers.py"


def torchtitan_pipeline(spec_of, **overrides):
    values = dict(
        framework="torchtitan", tp=2, sp=True, pp=4, microbatches=8, seq=1024, layers=8, zero=3
    )
    return spec_of("llama3-8b", **{**values, **overrides})


def test_each_stage_kind_holds_its_buffers():
    X, logits = 10, 7
    # first stage: a gradient buffer per micro-batch and the in-flight outputs
    assert torch_pipeline_buffer_bytes(8, 4, X, X, True, False) == 8 * X + 4 * X
    # middle: the idle receive buffers, the gradient buffers, the in-flight outputs
    assert torch_pipeline_buffer_bytes(8, 3, X, X, False, False) == 5 * X + 8 * X + 3 * X
    # last: the idle receive buffers and its kept logits
    assert torch_pipeline_buffer_bytes(8, 1, X, logits, False, True) == 7 * X + logits


def test_against_pipeline_stage_on_the_cpu():
    torch_or_skip()
    # one process per stage (torch.multiprocessing spawns them from the script)
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--json"], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    measured = json.loads(run.stdout.strip().splitlines()[-1])
    stages, microbatches = 3, 6  # the script's STAGES, MICROBATCHES
    assert len(measured) == stages
    for rank_text, seen in measured.items():
        rank, in_flight = int(rank_text), int(seen["in_flight"])
        # Schedule1F1B's in-flight count is the one ckplan's pipeline model uses
        assert in_flight == megatron_in_flight_forwards(stages, 1, microbatches, rank)
        assert seen["receive"] == (0 if rank == 0 else microbatches)
        beyond_inputs = seen["gradient"] + seen["outputs"] + max(0, seen["receive"] - in_flight)
        expected = torch_pipeline_buffer_bytes(
            microbatches, in_flight, 1, 1, rank == 0, rank == stages - 1
        )
        assert beyond_inputs == expected


def test_plan_counts_them_on_its_peak_stage(spec_of):
    spec = torchtitan_pipeline(spec_of)
    plan = evaluate(spec, parse_strategy("full", spec))
    in_flight = math.ceil(in_flight_microbatches(spec, plan.peak_stage))
    expected = memory.pipeline_buffer_bytes(spec, plan.peak_stage, in_flight)
    assert expected > 0
    assert plan.pipeline_buffer_bytes == expected
    assert plan.activation_bytes >= expected


def test_timeline_peak_is_still_the_plan_peak(spec_of):
    spec = torchtitan_pipeline(spec_of, pp=2)
    plan = evaluate(spec, parse_strategy("full", spec))
    assert plan.peak_stage == 0 or plan.pipeline_buffer_bytes
    timeline = memory_timeline(plan)
    if plan.peak_stage == 0:
        assert timeline.peak_bytes == plan.activation_bytes
    assert timeline.buffer_bytes == plan.pipeline_buffer_bytes


@pytest.mark.parametrize(
    "overrides",
    [
        {"framework": "megatron", "zero": 1},  # Megatron-LM frees what it sends
        {"pp": 1},
        {"virtual_stages": 2},  # interleaving: not split between a rank's stages
    ],
)
def test_no_buffers_outside_torchtitan_one_stage_pipelines(spec_of, overrides):
    spec = torchtitan_pipeline(spec_of, **overrides)
    plan = evaluate(spec, parse_strategy("full", spec))
    assert plan.pipeline_buffer_bytes == 0
    assert all(memory.pipeline_buffer_bytes(spec, stage, 1) == 0 for stage in range(spec.pp))


def test_last_stage_keeps_its_logits(spec_of):
    spec = torchtitan_pipeline(spec_of)
    last, X = spec.pp - 1, memory.layer_input_bytes(spec)
    idle_receive = (spec.microbatches - 1) * X
    logits = memory.pipeline_buffer_bytes(spec, last, 1) - idle_receive
    tokens = spec.seq * spec.micro_batch
    assert logits == spec.dtype_bytes * tokens * spec.vocab // spec.tp
