"""Megatron-Core's combined 1F1B (overlap_moe_expert_parallel_comm): which chunks it merges
(core_v0.14.0 pipeline_parallel/schedules.py `get_pp_rank_microbatches`, combined_1f1b.py),
the SMs its all-to-alls hold (moe_deepep_num_sms 20; DeepEP v1.2.1 Buffer.num_sms 20), and
what a merged pair hides (`chunk_pairs`, shared with DualPipe)."""

import pytest
from megatron_args import parse, validate

from ckplan import exports
from ckplan.hardware import combined_1f1b
from ckplan.hardware.chunk_pairs import (
    Chunk,
    exposed_beside,
    forward_backward_seconds,
    hidden_in_pair,
)
from ckplan.hardware.step_time import (
    _stage_micro_batch,
    combined_1f1b_chunks,
    combined_1f1b_hidden,
    expert_comm_exposed,
    pipeline_p2p_seconds,
    step_time,
)
from ckplan.inputs.gpus import load_gpu
from ckplan.model.ops import representative_kind
from ckplan.plan import evaluate, parse_strategy

# qwen3-30b-a3b on 8 GPUs of experts, interleaved over 2 stages of 2 virtual stages
INTERLEAVED = {"ep": 8, "dp": 8, "pp": 2, "virtual_stages": 2, "microbatches": 8}


# ---- which chunks merge ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pp", "v", "m", "group", "rank", "warmup", "pairs"),
    [
        # the DeepSeek-V3 H100 layout: (8 - 0 - 1)·2 + 3·8 + 1 = 39 of 128·4 = 512
        (8, 4, 128, 8, 0, 39, 473),
        (8, 4, 128, 8, 7, 25, 487),  # the last rank: 0 + 24 + 1
        (2, 2, 8, 2, 0, 5, 11),  # 2 + 2 + 1 of 16
        (4, 2, 2, 4, 0, 4, 0),  # 6 + 4 + 1 = 11 > 4 chunks: all warm-up, nothing merged
        (1, 1, 4, 1, 0, 0, 3),  # no pipelining: "Phases 1-3" of combined_1f1b.py's 4
        (1, 1, 1, 1, 0, 0, 0),
    ],
)
def test_merged_steps_by_hand(pp, v, m, group, rank, warmup, pairs):
    assert combined_1f1b.warmup_chunks(pp, v, m, group, rank) == warmup
    assert combined_1f1b.paired_chunks(pp, v, m, group, rank) == pairs


def test_warmup_is_one_more_than_interleaved_1f1b():
    """The flag adds "one extra micro-batch forward step before the 1f1b stages" to the
    interleaved warm-up, (p - r - 1)·2 + (v - 1)·g, for every rank of p = 4, v = 3, g = 4."""
    for rank in range(4):
        plain = (4 - rank - 1) * 2 + (3 - 1) * 4
        assert combined_1f1b.warmup_chunks(4, 3, 16, 4, rank) == plain + 1


def test_communication_sms():
    assert combined_1f1b.communication_sms("flex", 24) == combined_1f1b.DEEPEP_NUM_SMS == 20
    assert combined_1f1b.communication_sms("alltoall", 24) == 24


# ---- what a pair hides ---------------------------------------------------------------------------


def test_pair_by_hand():
    """100 SMs, 20 held: compute beside the communication runs at 80/100, a 20 s backward as
    25 s. The forward's 4 s under it add 4·(1 - 20/25) = 0.8 s, the backward's 6 s under the
    10 s forward (12.5 contended) 6·(1 - 10/12.5) = 1.2 s: 30 + 2 = 32 s for the pair, 40 s
    alone, 8 s hidden, all of it expert-parallel."""
    forward, backward = Chunk(10.0, expert=4.0), Chunk(20.0, expert=6.0)
    assert exposed_beside(4.0, 20.0, 100, 20) == pytest.approx(0.8)
    assert exposed_beside(6.0, 10.0, 100, 20) == pytest.approx(1.2)
    assert forward_backward_seconds(forward, backward, 100, 20) == pytest.approx(32.0)
    assert hidden_in_pair(forward, backward, 100, 20) == pytest.approx((8.0, 8.0))


def test_pair_with_a_pipeline_send_by_hand():
    """A 1 s send joins the forward's 4 s beside the backward: 5·0.2 = 1.0 exposed; 41 alone,
    32.2 paired, 8.8 hidden, of which the expert share 10/11: 8.0."""
    forward, backward = Chunk(10.0, expert=4.0, pipeline=1.0), Chunk(20.0, expert=6.0)
    assert hidden_in_pair(forward, backward, 100, 20) == pytest.approx((8.8, 8.0))


def test_communication_that_outlasts_the_compute_by_hand():
    """30 s beside a 20 s backward (25 s contended): it adds 30 - 20 = 10 s."""
    assert exposed_beside(30.0, 20.0, 100, 20) == pytest.approx(10.0)


def test_scaled_chunk():
    chunk = Chunk(8.0, expert=4.0, pipeline=2.0, other=1.0).scaled(0.25)
    assert chunk == Chunk(2.0, expert=1.0, pipeline=0.5, other=0.25)


# ---- the step ------------------------------------------------------------------------------------


def _step(spec, gpu):
    return step_time(evaluate(spec, parse_strategy("selective", spec)), gpu)


def _micro_batches(spec, gpu):
    """Each pipeline stage's micro-batch under selective recomputation, as step_time times it."""
    plan = evaluate(spec, parse_strategy("selective", spec))
    return {
        stage: _stage_micro_batch(spec, gpu, stage, tuple(forwards), plan.recompute_groups)
        for stage, forwards in plan.stage_forwards
    }


def test_step_loses_what_the_merged_pairs_hide(spec_of):
    """The step under the flag is the step without it less the busiest stage's merged pairs
    (11 on rank 0, 13 on rank 1: `test_merged_steps_by_hand`), each a forward and a backward
    chunk of half a micro-batch hiding what `hidden_in_pair` finds on DeepEP's 20 SMs."""
    gpu = load_gpu("h100-sxm")
    plain = spec_of("qwen3-30b-a3b", **INTERLEAVED, moe_token_dispatcher_type="flex")
    merged = plain.replace(overlap_moe_expert_parallel_comm=True)
    times = _micro_batches(merged, gpu)
    stage = max(times, key=lambda s: times[s].total)
    forward, backward = combined_1f1b_chunks(times[stage], pipeline_p2p_seconds(merged, gpu))
    saved, expert = hidden_in_pair(forward.scaled(0.5), backward.scaled(0.5), 132, 20)
    count = {0: 11, 1: 13}[stage]
    assert saved > 0
    assert combined_1f1b_hidden(merged, gpu, times[stage], stage) == pytest.approx(
        (count * saved, count * expert)
    )
    off, on = _step(plain, gpu), _step(merged, gpu)
    assert off.step_seconds - on.step_seconds == pytest.approx(count * saved)
    assert off.expert_parallel_seconds - on.expert_parallel_seconds == pytest.approx(count * expert)


def test_more_sms_hide_less(spec_of):
    """NCCL's 24 channels (alltoall) hold more SMs than DeepEP's 20: the same pair hides
    less."""
    gpu = load_gpu("h100-sxm")
    spec = spec_of("qwen3-30b-a3b", **INTERLEAVED, overlap_moe_expert_parallel_comm=True)
    forward, backward = combined_1f1b_chunks(
        _micro_batches(spec, gpu)[0], pipeline_p2p_seconds(spec, gpu)
    )
    nccl = hidden_in_pair(forward, backward, 132, 24)[0]
    assert 0 < nccl < hidden_in_pair(forward, backward, 132, 20)[0]


def test_the_gpu_files_share_gives_way_to_the_pairs(spec_of):
    """Under the flag the layer leaves all its all-to-alls to the pairs: the GPU file's
    ep_overlap no longer hides a share of them (else counted twice)."""
    spec = spec_of("qwen3-30b-a3b", ep=8, dp=8, overlap_moe_expert_parallel_comm=True)
    kind = representative_kind(spec)
    hidden = load_gpu("h100-sxm", {"ep_overlap": 1})
    assert expert_comm_exposed(spec, hidden, kind) == expert_comm_exposed(
        spec, load_gpu("h100-sxm"), kind
    )
    assert expert_comm_exposed(spec, load_gpu("h100-sxm"), kind)[0] > 0


def test_no_pipelining_merges_m_minus_one(spec_of):
    """pp 1, m 4: three merged micro-batches, whole ones (v = 1), on NCCL's 24 channels."""
    gpu = load_gpu("h100-sxm")
    spec = spec_of("qwen3-30b-a3b", ep=8, dp=8, microbatches=4)
    merged = spec.replace(overlap_moe_expert_parallel_comm=True)
    busiest = _micro_batches(merged, gpu)[0]
    forward, backward = combined_1f1b_chunks(busiest, 0.0)
    saved = hidden_in_pair(forward, backward, 132, 24)[0]
    assert saved > 0
    assert combined_1f1b_hidden(merged, gpu, busiest, 0)[0] == pytest.approx(3 * saved)
    assert combined_1f1b_hidden(spec, gpu, busiest, 0) == (0.0, 0.0)


def test_megatron_export_writes_the_flag(spec_of):
    spec = spec_of("qwen3-30b-a3b", **INTERLEAVED, overlap_moe_expert_parallel_comm=True)
    plan = evaluate(spec, parse_strategy("selective", spec))
    text = exports.export(plan, "megatron").text
    args = validate(parse(text, spec.tp * spec.pp * spec.cp * spec.dp))
    assert "--overlap-moe-expert-parallel-comm" in text
    assert args.overlap_moe_expert_parallel_comm is True
