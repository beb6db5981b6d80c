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
from ckplan.model.frameworks import (
    torch_interleaved_chunk_counts,
    torch_microbatches_per_round,
    torch_pipeline_buffer_bytes,
    torch_pipeline_finished_bytes,
    torch_pipeline_kept_bytes,
)
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


def test_finished_micro_batches_leave_outputs_and_input_gradients():
    X, logits = 10, 7
    # first stage: its finished outputs only (token ids take no gradient)
    assert torch_pipeline_finished_bytes(8, 5, X, X, True) == 3 * X
    # middle stage: each finished micro-batch's output and its receive buffer's gradient
    assert torch_pipeline_finished_bytes(8, 3, X, X, False) == 5 * (X + X)
    # last stage (one in flight): seven kept logits blocks and seven input gradients
    assert torch_pipeline_finished_bytes(8, 1, X, logits, False) == 7 * (logits + X)
    # every micro-batch in flight: none finished
    assert torch_pipeline_finished_bytes(4, 4, X, X, False) == 0


def test_only_the_late_2024_release_keeps_them(spec_of):
    old = torchtitan_pipeline(spec_of, framework_version="2024.12")
    new = torchtitan_pipeline(spec_of, framework_version="0.3")
    X = memory.layer_input_bytes(old)
    for stage in range(old.pp):
        in_flight = math.ceil(in_flight_microbatches(old, stage))
        extra = memory.pipeline_buffer_bytes(old, stage, in_flight) - (
            memory.pipeline_buffer_bytes(new, stage, in_flight)
        )
        finished = old.microbatches - in_flight
        if stage == old.pp - 1:
            logits = memory.pipeline_buffer_bytes(new, stage, 1) - finished * X
            assert extra == finished * (logits + X)
        else:
            assert extra == finished * (X if stage == 0 else 2 * X)


def test_last_stage_keeps_finished_outputs_on_the_cpu():
    torch_or_skip()
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--json"], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    measured = json.loads(run.stdout.strip().splitlines()[-1])
    stages, microbatches = 3, 6
    for rank_text, seen in measured.items():
        rank, in_flight = int(rank_text), int(seen["in_flight"])
        # the latest backward with the first one's micro-batches in flight
        assert seen["latest_in_flight"] == in_flight
        last = rank == stages - 1
        # PyTorch 2.13 keeps the last stage's outputs (return_outputs left True, as torchtitan
        # 9dec370 leaves it) and no input gradient: the output part of the late-2024 term
        kept = torch_pipeline_finished_bytes(microbatches, in_flight, 0, 1, True) if last else 0
        assert seen["finished_outputs"] == kept
        assert seen["input_gradients"] == 0


def test_interleaved_rounds_follow_the_schedule():
    # ScheduleInterleaved1F1B: number_of_rounds = max(1, m // p), m // rounds per round
    assert torch_microbatches_per_round(8, 8) == 8
    assert torch_microbatches_per_round(16, 8) == 8
    assert torch_microbatches_per_round(12, 8) == 12  # one round of all twelve
    assert torch_microbatches_per_round(4, 8) == 4


def test_interleaved_counts_by_hand():
    # p 8, v 2, m 8: rank 0 runs all 16 forwards before its first backward (warmup
    # min(8 + 14, 16)); rank 7 warms up with the 8 forwards of stage 7, then pairs each forward
    # of stage 15 with its backward: at the last such pair 8 of stage 7 and 1 of stage 15 are
    # in flight and 7 of stage 15 finished
    assert torch_interleaved_chunk_counts(8, 2, 8, 0) == ((8, 0), (8, 0))
    assert torch_interleaved_chunk_counts(8, 2, 8, 7) == ((8, 0), (1, 7))
    for rank in range(8):
        counts = torch_interleaved_chunk_counts(8, 2, 8, rank)
        # no local stage has more than its micro-batches started
        assert all(0 <= held + done <= 8 for held, done in counts)


def test_interleaved_counts_against_the_schedule_on_the_cpu():
    torch_or_skip()
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--interleaved", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    measured = json.loads(run.stdout.strip().splitlines()[-1])
    assert set(measured) == {"3", "4", "6"}
    for microbatches, by_rank in measured.items():
        m = int(microbatches)
        for rank, seen in by_rank.items():
            walked = torch_interleaved_chunk_counts(2, 2, m, int(rank))
            assert [tuple(c) for c in seen["counts"]] == list(walked)
            # every local stage keeps its own buffers, as one stage per rank does
            stages = (int(rank), int(rank) + 2)
            for stage, (receive, gradient) in zip(stages, seen["buffers"], strict=True):
                assert receive == (0 if stage == 0 else m)
                assert gradient == (0 if stage == 3 else m)


def test_kept_bytes_are_the_finished_term():
    X, logits = 10, 7
    finished = torch_pipeline_finished_bytes(8, 5, X, X, True)
    assert torch_pipeline_kept_bytes(3, X, X, True) == finished
    assert torch_pipeline_kept_bytes(7, X, logits, False) == 7 * (logits + X)


def test_interleaved_rank_holds_its_local_stages_buffers(spec_of):
    spec = torchtitan_pipeline(spec_of, virtual_stages=2, framework_version="2024.12")
    p, m = spec.pp, spec.microbatches
    X = memory.layer_input_bytes(spec)
    logits = spec.dtype_bytes * spec.seq * spec.micro_batch * spec.vocab // spec.tp
    for rank in range(p):
        expected = 0
        for chunk, (held, done) in enumerate(torch_interleaved_chunk_counts(p, 2, m, rank)):
            stage = chunk * p + rank
            first, last = stage == 0, stage == 2 * p - 1
            output = logits if last else X
            expected += torch_pipeline_buffer_bytes(m, held, X, output, first, last)
            expected += torch_pipeline_kept_bytes(done, X, output, first)
        assert memory.pipeline_buffer_bytes(spec, rank, 1) == expected
    # only the last rank's second local stage makes logits
    newer = torchtitan_pipeline(spec_of, virtual_stages=2, framework_version="0.3")
    assert memory.pipeline_buffer_bytes(newer, p - 1, 1) > memory.pipeline_buffer_bytes(newer, 0, 1)


def test_interleaved_plan_counts_them_on_its_peak_stage(spec_of):
    spec = torchtitan_pipeline(spec_of, virtual_stages=2)
    plan = evaluate(spec, parse_strategy("full", spec))
    expected = memory.pipeline_buffer_bytes(spec, plan.peak_stage, 1)
    assert expected > 0
    assert plan.pipeline_buffer_bytes == expected


def test_a_runtime_that_frees_what_it_sends_keeps_no_buffers(spec_of):
    """`deallocate_pipeline_outputs` (Llama 3's runtime, §3.3.2): torchtitan's receive, gradient
    and kept-output buffers are not counted on any stage, interleaved or not."""
    for virtual_stages in (1, 2):
        kept = torchtitan_pipeline(spec_of, virtual_stages=virtual_stages)
        freed = kept.replace(deallocate_pipeline_outputs=True)
        stages = range(kept.pp)
        assert all(memory.pipeline_buffer_bytes(kept, stage, 2) > 0 for stage in stages)
        assert [memory.pipeline_buffer_bytes(freed, stage, 2) for stage in stages] == [0] * kept.pp
