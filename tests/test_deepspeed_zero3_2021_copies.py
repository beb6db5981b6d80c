"""DeepSpeed ZeRO-3's path of 2021 (framework_version 0.5.4: the fetch of v0.3.12 to v0.5.4),
by hand: the zero-filled gather buffer and the list collectives' copies through PyTorch's
flat buffers (`frameworks.deepspeed_zero3_gather_copy_bytes`), the reduction bucket's copies
and its
whole-bucket division (`frameworks.deepspeed_zero3_reduce_calls`,
`deepspeed_zero3_reduce_copy_bytes`), and what they add to a step (`step_time`).

GPT-3 175B (megatron-175b, h = 12288): one layer's sub-modules hold 2h, 3h² + 3h, h² + h, 2h,
4h² + 4h and 4h² + h elements (tests/test_deepspeed_zero3_gathers.py).
"""

import pytest

from ckplan.hardware import communication as comm
from ckplan.hardware.roofline import memory_seconds
from ckplan.hardware.step_time import (
    Zero3Copies,
    data_parallel_exposed,
    deepspeed_2021_copies,
    deepspeed_2021_reduce_seconds,
    deepspeed_zero3_layer_exposed,
)
from ckplan.hardware.times import ZERO, MicroBatchTime
from ckplan.inputs.gpus import load_gpu
from ckplan.model import memory
from ckplan.model.frameworks import (
    DEEPSPEED_PERSISTENCE,
    DEEPSPEED_REDUCE_BUCKET,
    deepspeed_aligned_elements,
    deepspeed_list_collectives,
    deepspeed_zero3_gather_copy_bytes,
    deepspeed_zero3_prefetch_windows,
    deepspeed_zero3_reduce_call_bytes,
    deepspeed_zero3_reduce_calls,
    deepspeed_zero3_reduce_copy_bytes,
    deepspeed_zero3_reduce_triggers,
    deepspeed_zero3_released,
)

# a micro-batch of no compute: without overlap the data-parallel time does not depend on it
IDLE = MicroBatchTime(ZERO, ZERO, ZERO, 0.0, 0.0, 0.0)
H = 12288
GPT3_MODULES = (2 * H, 3 * H * H + 3 * H, H * H + H, 2 * H, 4 * H * H + 4 * H, 4 * H * H + H)


def _gpt3(spec_of, **overrides):
    values = {"framework": "deepspeed", "tp": 1, "pp": 1, "sp": False, "dp": 8, "zero": 3}
    return spec_of("megatron-175b", **{**values, **overrides})


def test_aligned_elements():
    assert deepspeed_aligned_elements(10, 4) == 12
    assert deepspeed_aligned_elements(12, 4) == 12
    assert deepspeed_aligned_elements(1, 1536) == 1536


def test_gather_copies_by_hand():
    # 10 elements on 4 ranks: padded to 12, partitions of 3, 2 bytes each
    copies = deepspeed_zero3_gather_copy_bytes(10, 4, 2)
    assert copies.serial == 12 * 2  # torch.zeros of the padded weight
    # own partition read and written, the flat output read and written into the outputs
    assert copies.stream == (2 * 3 + 2 * 12) * 2 == 60
    # GPT-3's QKV on 384 ranks: 3h² + 3h = 453,022,464 = 384 · 1,179,746
    qkv = GPT3_MODULES[1]
    assert qkv % 384 == 0
    assert deepspeed_zero3_gather_copy_bytes(qkv, 384, 2).stream == (2 * qkv // 384 + 2 * qkv) * 2


def test_reduce_calls_follow_the_bucket_rule():
    # bucket 500: a gradient that would overflow reduces what is held first; one above the
    # bucket is reduced alone with whatever comes after it
    assert deepspeed_zero3_reduce_calls((604, 604, 24, 151, 453, 24), 500) == (
        (604,), (604,), (24, 151), (453, 24),
    )  # fmt: skip
    assert deepspeed_zero3_reduce_calls((100, 200, 200), 500) == ((100, 200, 200),)
    assert deepspeed_zero3_reduce_calls((100, 200, 201), 500) == ((100, 200), (201,))
    assert deepspeed_zero3_reduce_calls((), 500) == ()


def test_reduce_copies_by_hand():
    # gradients 10 then 3, 4 ranks, 2 bytes, bucket 8: two reductions, (10,) and (3,)
    copies = deepspeed_zero3_reduce_copy_bytes((10, 3), 4, 2, 8)
    # only the 3 fits the bucket and is copied into it
    assert copies.serial == 2 * 3 * 2
    first = 2 * (8 + 10) * 2 + 2 * (12 + 3) * 2  # divide bucket and the 10, flatten, partition
    second = 2 * 8 * 2 + 2 * (4 + 1) * 2  # divide bucket, flatten, partition
    assert copies.stream == first + second == 184


def test_only_the_2021_release_takes_the_path(spec_of):
    spec = _gpt3(spec_of)
    assert not deepspeed_list_collectives(spec)
    assert deepspeed_list_collectives(spec.replace(framework_version="0.5.4"))
    assert deepspeed_2021_copies(spec, load_gpu("a100-80gb"), ()) is None
    assert (
        deepspeed_2021_copies(
            spec.replace(framework_version="0.5.4", zero=2), load_gpu("a100-80gb"), ()
        )
        is None
    )


def test_copies_of_one_micro_batch_by_hand(spec_of):
    a100 = load_gpu("a100-80gb")
    spec = _gpt3(spec_of, framework_version="0.5.4")
    layers = spec.layers
    full = (1, *(2,) * layers, 1)
    kept = [w for w in GPT3_MODULES if w > DEEPSPEED_PERSISTENCE]
    assert kept == list(GPT3_MODULES[1:3] + GPT3_MODULES[4:])  # the norms stay gathered
    released = deepspeed_zero3_released(GPT3_MODULES)
    pairs = zip(GPT3_MODULES, released, strict=True)
    again = [w for w, r in pairs if r and w > DEEPSPEED_PERSISTENCE]
    assert again == [GPT3_MODULES[1], GPT3_MODULES[2], GPT3_MODULES[4]]
    dense = memory.trainable_stage_parameters(spec, 0)[0]
    rest = dense - layers * sum(GPT3_MODULES)  # embeddings, final norm

    def gathered(weights):
        copies = [deepspeed_zero3_gather_copy_bytes(w, 8, 2) for w in weights]
        return sum(c.serial for c in copies), sum(c.stream for c in copies)

    forward = kept * layers + [rest]
    backward = (kept + again) * layers + [rest]
    gradients = (rest, *tuple(reversed(GPT3_MODULES)) * layers)
    reduce = deepspeed_zero3_reduce_copy_bytes(gradients, 8, 2)
    serial = gathered(forward)[0] + gathered(backward)[0] + reduce.serial
    copies = deepspeed_2021_copies(spec, a100, full)
    assert copies.serial == pytest.approx(memory_seconds(a100, serial))
    assert copies.forward == pytest.approx(memory_seconds(a100, gathered(forward)[1]))
    assert copies.backward == pytest.approx(
        memory_seconds(a100, gathered(backward)[1] + reduce.stream)
    )
    # per layer, four reductions in steady state: fc2, fc1, the norm with out-proj, QKV with
    # the first norm, each dividing the whole bucket
    assert deepspeed_zero3_reduce_calls(tuple(reversed(GPT3_MODULES)) * 2)[1:5] == (
        (GPT3_MODULES[4],),
        (GPT3_MODULES[3], GPT3_MODULES[2]),
        (GPT3_MODULES[1], GPT3_MODULES[0]),
        (GPT3_MODULES[5],),
    )
    assert GPT3_MODULES[4] > DEEPSPEED_REDUCE_BUCKET > GPT3_MODULES[1]


def test_copies_lengthen_each_layer_gather(spec_of):
    a100 = load_gpu("a100-80gb")
    spec = _gpt3(spec_of)
    old = spec.replace(framework_version="0.5.4")
    plain = (1, *(1,) * spec.layers, 1)
    now = deepspeed_zero3_layer_exposed(spec, a100, plain)
    then = deepspeed_zero3_layer_exposed(old, a100, plain)
    # each gather is longer by its stream copies: more of it left exposed, never less
    assert then[0] > now[0] and then[1] > now[1]


def test_without_overlap_the_copies_add_whole(spec_of):
    """Without overlap_comm ckplan charges the communication less the GPU's dp_overlap; the
    copies of each micro-batch are added whole."""
    a100 = load_gpu("a100-80gb")
    spec = _gpt3(spec_of, dp_comm_overlap=False, microbatches=3)
    old = spec.replace(framework_version="0.5.4")
    plain = (1, *(1,) * spec.layers, 1)
    copies = deepspeed_2021_copies(old, a100, plain)
    added = data_parallel_exposed(old, a100, IDLE, 0, plain) - data_parallel_exposed(
        spec, a100, IDLE, 0, plain
    )
    assert added == pytest.approx(3 * (copies.serial + copies.forward + copies.backward))
    assert isinstance(copies, Zero3Copies) and copies.serial > 0


def test_reduce_triggers_by_hand():
    # bucket 500: the hook of the second 604 reduces the first, the norm's the second, QKV's
    # the norm with out-proj; QKV and the last norm are left for the epilogue
    assert deepspeed_zero3_reduce_triggers((604, 604, 24, 151, 453, 24), 500) == (
        ((), (604,), (604,), (), (24, 151), ()),
        (453, 24),
    )
    call = deepspeed_zero3_reduce_call_bytes((24, 151), 4, 2, 500)
    assert call.serial == 2 * (24 + 151) * 2
    assert call.stream == 2 * 500 * 2 + 2 * (24 + 6) * 2 + 2 * (152 + 38) * 2


def test_windows_take_the_collectives_issued_before_the_next_fetch():
    uses = ((1.0, 0.0), (3.0, 3.0), (1.0, 1.0), (0.0, 0.0), (4.0, 4.0), (4.0, 4.5))
    issued = (0.5, 0.0, 0.25, 0.125, 0.0, 1.0)
    assert deepspeed_zero3_prefetch_windows(uses, issued) == (
        (3.0 + 1.0 + 0.5, 4.0 + 1.0),  # issued by the previous layer's fc2 and the norm
        (1.0 + 0.0, 3.0),
        (4.0 + 0.25 + 0.125, 1.0 + 0.0),
        (4.5 + 0.0, 4.0),
    )
    assert deepspeed_zero3_prefetch_windows(uses, ()) == deepspeed_zero3_prefetch_windows(uses)


def test_gpt3_reduce_scatters_per_backward_hook(spec_of):
    """GPT-3's backward delivers fc2, fc1, the second norm, out-proj, QKV, the first norm:
    fc2's hook reduces the previous layer's QKV and norm, fc1's fc2, the norm's fc1, QKV's the
    norm with out-proj."""
    a100 = load_gpu("a100-80gb")
    spec = _gpt3(spec_of, framework_version="0.5.4")
    bandwidth = comm.group_bandwidth(a100, 8, 1)
    norm1, qkv, out_proj, norm2, fc1, fc2 = GPT3_MODULES

    def reduction(*call):
        rs = comm.reduce_scatter_seconds(2 * sum(call), 8, bandwidth)
        return rs + memory_seconds(a100, deepspeed_zero3_reduce_call_bytes(call, 8, 2).stream)

    by_hand = (reduction(qkv, norm1), reduction(fc2), reduction(fc1), 0.0)
    by_hand += (reduction(norm2, out_proj), 0.0)
    seconds = deepspeed_2021_reduce_seconds(spec, a100, GPT3_MODULES, 8, bandwidth)
    assert seconds == pytest.approx(by_hand)
    # the later releases: reduce-scatters behind the whole backward, none per hook
    assert deepspeed_2021_reduce_seconds(_gpt3(spec_of), a100, GPT3_MODULES, 8, bandwidth) == (
        (0.0,) * 6
    )
