"""torchao's float8 all-gather under torchtitan's FSDP2 (`fsdp_float8_all_gather`): the converted
block weights gathered and held unsharded at 1 byte each, the weight casts both ways, the key's
refusals. Values computed by hand for Llama 3 8B (hidden 4096, 8 KV heads of 128, ffn 14336)."""

import pytest

from ckplan.hardware import communication as comm
from ckplan.hardware.code_path import (
    float8_precompute_amax_bytes,
    float8_shard_cast_bytes,
    float8_weight_cast_bytes,
)
from ckplan.hardware.step_time import gradient_reduction
from ckplan.model import frameworks, memory
from ckplan.model.spec import SpecError

# one block's linear weights: wq 4096², wk and wv 4096·1024 each, wo 4096², w1, w3, w2 4096·14336
LINEARS = 4096 * 4096 + 2 * 4096 * 1024 + 4096 * 4096 + 3 * 4096 * 14336  # 218,103,808
NORMS = 2 * 4096  # attention_norm and ffn_norm stay bf16
LAYER = LINEARS + NORMS  # 218,112,000 (validation/torch_fsdp2_memory.py)
ROOT = 1_050_677_248  # embedding, final norm, output: 2 · 128256 · 4096 + 4096


def llama8b(spec_of, **keys):
    layout = dict(framework="torchtitan", dp=8, zero=3, precision="float8")
    return spec_of("llama3-8b", **(layout | keys))


def test_converted_weights_are_the_block_linears(spec_of):
    spec = llama8b(spec_of, fsdp_float8_all_gather=True)
    assert LINEARS == 218_103_808
    assert memory.float8_linear_weights(spec) == LINEARS
    assert memory.layer_parameters(spec) == LAYER
    assert memory.float8_gathered_layer_weights(spec) == LINEARS
    assert memory.float8_gathered_layer_weights(llama8b(spec_of)) == 0
    # over tp 2 each matrix is halved, the 8 KV heads 4 a rank
    assert memory.float8_linear_weights(llama8b(spec_of, tp=2)) == LINEARS // 2


def test_gathered_block_is_one_byte_a_converted_weight():
    assert frameworks.fsdp2_gathered_bytes(LAYER) == 2 * LAYER
    assert frameworks.fsdp2_gathered_bytes(LAYER, LINEARS) == 2 * NORMS + LINEARS  # 218,120,192
    # a block's forward: its unsharded copy and the flat all-gather output
    assert frameworks.fsdp2_layer_forward_bytes(LAYER, float8=LINEARS) == 2 * 218_120_192
    assert frameworks.fsdp2_layer_forward_bytes(LAYER, kept=True, float8=LINEARS) == 218_120_192
    # torchtitan "2024.12" keeps the root module (bf16: the output is filtered) and the last block
    kept = frameworks.fsdp2_kept_unsharded_bytes(ROOT, LAYER, True, layer_float8=LINEARS)
    assert kept == 2 * ROOT + 218_120_192 == 2_319_474_688
    assert frameworks.fsdp2_kept_unsharded_bytes(ROOT, LAYER, True) == 2_537_578_496


def test_block_backward_holds_float8_copies_and_bf16_gradients():
    grouping = frameworks.fsdp2_grouping("2024.12")
    bf16 = frameworks.fsdp2_layer_backward_bytes(LAYER, 0, grouping=grouping)
    float8 = frameworks.fsdp2_layer_backward_bytes(LAYER, 0, grouping=grouping, float8=LINEARS)
    # the running and the prefetched block lose a byte a converted weight; gradients unchanged
    assert bf16 - float8 == 2 * LINEARS


def test_spec_memory_moves_by_the_converted_weights(spec_of):
    off = llama8b(spec_of, framework_version="2024.12")
    on = llama8b(spec_of, framework_version="2024.12", fsdp_float8_all_gather=True)
    assert memory.stage_buffer_bytes(off, 0) - memory.stage_buffer_bytes(on, 0) == LINEARS
    # the all-gather pool's largest pair of consecutive outputs: the root and the first block
    assert memory.stream_pool_bytes(off) - memory.stream_pool_bytes(on) == LINEARS


def test_weight_cast_bytes_both_ways():
    # torchao roofline_utils.py at eab345c: amax read 2 + cast read 2 + two float8 writes
    assert float8_weight_cast_bytes(1000, "cast") == (6000, 0)
    # gathered: no forward cast; the backward's column-major copy reads and writes a byte
    assert float8_weight_cast_bytes(1000, "gathered") == (0, 2000)
    # the fp32 shard read, the float8 shard written, before each all-gather
    assert float8_shard_cast_bytes(LINEARS // 8) == 5 * 27_262_976
    assert float8_precompute_amax_bytes(27_262_976) == 109_051_904


def test_all_gather_moves_one_byte_a_converted_weight(spec_of):
    spec = llama8b(spec_of, fsdp_float8_all_gather=True)
    params, float8, bandwidth = 1_000_000, 600_000, 1e11
    parts = gradient_reduction(spec, 3, 1, params, 8, bandwidth, float8=float8)
    expected = comm.all_gather_seconds(2 * 400_000 + 600_000, 8, bandwidth)
    assert parts.forward == pytest.approx(expected)
    cast = gradient_reduction(spec, 3, 1, params, 8, bandwidth, 0, float8, 1e-3)
    assert cast.forward == pytest.approx(expected + 1e-3)
    assert cast.backward - parts.backward == pytest.approx(1e-3)


@pytest.mark.parametrize(
    ("keys", "fragment"),
    [
        ({"precision": "bf16"}, "needs precision float8"),
        ({"framework": "megatron", "zero": 1}, "needs framework torchtitan"),
        ({"zero": 0}, "zero 2 or 3 with dp > 1"),
        ({"dp": 1}, "zero 2 or 3 with dp > 1"),
        ({"dp": 1, "cp": 2}, "zero 2 or 3 with dp > 1"),  # torchtitan's dp_shard, not cp
    ],
)
def test_key_refused_outside_fsdp2_float8(spec_of, keys, fragment):
    with pytest.raises(SpecError, match="fsdp_float8_all_gather") as error:
        llama8b(spec_of, fsdp_float8_all_gather=True, **keys)
    assert fragment in str(error.value)


def test_measured_unsharded_bytes_match_the_formula():
    """validation/torch_fsdp2_float8_all_gather.py (torch 2.13, torchao 0.18, a fake process
    group of 8): the converted weights' unsharded copies are `Float8TrainingTensor`s of
    float8_e4m3fn, views of FSDP2's all-gather outputs, 1 byte an element; the norms bf16. Its
    block: hidden 256, wk and wv 256 -> 64, ffn 768, two RMSNorms."""
    import json
    from pathlib import Path

    path = Path(__file__).parent.parent / "validation"
    name = "results-fsdp2-float8-all-gather-torch-2.13.0-torchao-0.18.0.json"
    measured = json.loads((path / name).read_text())
    linears = 2 * 256 * 256 + 2 * 256 * 64 + 3 * 256 * 768  # 753,664
    params = linears + 2 * 256
    assert measured["bf16_total_unsharded_bytes"] == frameworks.fsdp2_gathered_bytes(params)
    on = measured["float8_all_gather_total_unsharded_bytes"]
    assert on == frameworks.fsdp2_gathered_bytes(params, linears) == 754_688
    for name, param in measured["float8_all_gather"]["params"].items():
        assert param["views_the_all_gather_output"]
        assert param["unsharded_bytes"] == param["all_gather_output_bytes"]
        float8 = param["dtype"] == "torch.float8_e4m3fn"
        assert float8 == ("norm" not in name)
