"""The once-per-step data-parallel collectives overlapped one by one: `overlap_grad_reduce` and
`overlap_param_gather` (Megatron-Core core_v0.14.0 DistributedDataParallelConfig), each by
default as `dp_comm_overlap`.

llama3-8b over dp 4 with ZeRO 1 on an A100-80GB node (tests/test_gradient_sync.py's hand
values): once a step the fp32 gradients are reduce-scattered, (4 - 1)/4 · 32,121,044,992 bytes
per rank, and the bf16 weights all-gathered, (4 - 1)/4 · 16,060,522,496 bytes, at
300 GB/s x 0.7."""

import pytest

from ckplan.exports.megatron import model_flags
from ckplan.hardware.roofline import OpTime
from ckplan.hardware.step_time import data_parallel_comm, data_parallel_exposed
from ckplan.hardware.times import ZERO, MicroBatchTime
from ckplan.inputs.gpus import load_gpu

BANDWIDTH = 300e9 * 0.7
RS_FP32 = 24_090_783_744 / BANDWIDTH
AG_BF16 = 12_045_391_872 / BANDWIDTH
BUSIEST = MicroBatchTime(
    forward=OpTime(matmul=0.3, memory=0.05),
    backward=OpTime(matmul=0.6, memory=0.1),
    recompute=ZERO,
    forward_comm=0.0,
    backward_comm=0.0,
    recompute_comm=0.0,
)


@pytest.fixture
def a100():
    return load_gpu("a100-80gb")


@pytest.fixture
def spec(spec_of):
    return spec_of("llama3-8b", dp=4, zero=1, microbatches=8)


def test_both_follow_dp_comm_overlap_unless_set(spec):
    assert (spec.dp_comm_overlap, spec.overlap_grad_reduce, spec.overlap_param_gather) == (
        False,
        False,
        False,
    )
    on = spec.replace(dp_comm_overlap=True)
    assert (on.overlap_grad_reduce, on.overlap_param_gather) == (True, True)
    assert (
        spec.replace(dp_comm_overlap=True).replace(dp_comm_overlap=False).overlap_grad_reduce
        is False
    )
    alone = on.replace(overlap_grad_reduce=False)
    assert (alone.overlap_grad_reduce, alone.overlap_param_gather) == (False, True)
    assert alone.replace(microbatches=2).overlap_grad_reduce is False  # kept through a replace


def test_the_hand_values(spec, a100):
    parts = data_parallel_comm(spec, a100)
    assert parts.reduce == pytest.approx(RS_FP32)
    assert parts.gather == pytest.approx(AG_BF16)
    assert parts.forward == parts.backward == 0.0
    assert a100.dp_overlap == 0.0  # the preset hides nothing without overlap


def exposed(spec, a100, reduce: bool, gather: bool, overlap: bool = True) -> float:
    changed = spec.replace(
        dp_comm_overlap=overlap, overlap_grad_reduce=reduce, overlap_param_gather=gather
    )
    return data_parallel_exposed(changed, a100, BUSIEST)


def test_an_exposed_reduction_beside_an_overlapped_gather(spec, a100):
    both = data_parallel_exposed(spec.replace(dp_comm_overlap=True), a100, BUSIEST)
    assert exposed(spec, a100, True, True) == both  # the defaults are the keys' values
    neither = exposed(spec, a100, False, False)
    assert neither == pytest.approx(RS_FP32 + AG_BF16)  # all of it, as without dp_comm_overlap
    assert neither == pytest.approx(data_parallel_exposed(spec, a100, BUSIEST))
    reduce_exposed = exposed(spec, a100, False, True)
    gather_exposed = exposed(spec, a100, True, False)
    # each collective is charged on its own: the two mixed cases add up to the pure ones
    assert reduce_exposed + gather_exposed == pytest.approx(both + neither)
    assert both < reduce_exposed < neither
    # the reduction hides behind the 0.7 s backward in part; exposed, the whole of it shows
    assert reduce_exposed - both == pytest.approx(RS_FP32 - (gather_exposed - AG_BF16))


def test_without_dp_comm_overlap_the_keys_still_hide_their_collective(spec, a100):
    assert exposed(spec, a100, True, False, overlap=False) == pytest.approx(
        exposed(spec, a100, True, False)
    )


def test_megatron_flags(spec):
    def overlap_flags(changed):
        return [flag for flag in model_flags(changed) if flag[0].startswith("--overlap")]

    on = spec.replace(dp_comm_overlap=True)
    assert overlap_flags(on) == [["--overlap-grad-reduce"], ["--overlap-param-gather"]]
    assert overlap_flags(on.replace(overlap_param_gather=False)) == [["--overlap-grad-reduce"]]
    # Megatron-LM asserts --overlap-param-gather "with --overlap-grad-reduce": neither is written
    assert overlap_flags(on.replace(overlap_grad_reduce=False)) == []
