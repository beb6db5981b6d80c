"""FP8 primary weights (`fp8_param_gather`, Megatron-LM --fp8-param-gather): the weights' bytes,
Transformer Engine's copies, the distributed optimizer's FP8 gather, the master weights' cast
and its amax all-reduce, the key's rules, and the layout search's bounds with it."""

import pytest

from ckplan.hardware import communication as comm
from ckplan.hardware.roofline import memory_seconds
from ckplan.hardware.step_time import (
    data_parallel_comm,
    fp8_amax_reduction_seconds,
    gradient_reduction,
    optimizer_seconds,
    step_time,
)
from ckplan.inputs.gpus import load_gpu
from ckplan.inputs.presets import load_spec
from ckplan.model import frameworks, memory
from ckplan.model.layers import LayerKind
from ckplan.model.op import split_share
from ckplan.model.spec import SpecError
from ckplan.plan.evaluate import evaluate
from ckplan.plan.layout.bounds import Bounds, layout_keys_cleared
from ckplan.plan.layout.space import SearchSpace, layouts
from ckplan.plan.strategies import parse_strategy

H100 = load_gpu("h100-sxm")
LLAMA3_8B = load_spec("llama3-8b", {"precision": "fp8", "dp": 8, "zero": 1})
FP8_PARAMS = LLAMA3_8B.replace(fp8_param_gather=True)


def test_per_parameter_bytes():
    """Hand-checked against the sources in the docstrings: TE's cached FP8 workspace holds the
    row-wise copy and its transpose (2 bytes), an FP8 parameter only its transpose (1); the FP8
    weight is 1 byte; the master weight's cast reads 4 + writes 2 (to BF16), reads 2 + writes 1
    (quantize), and current scaling reads the BF16 copy once more for the amax."""
    assert frameworks.te_fp8_weight_copy_bytes(False) == 2
    assert frameworks.te_fp8_weight_copy_bytes(True) == 1
    assert frameworks.fp8_primary_weight_bytes(True, 2) == 1
    assert frameworks.fp8_primary_weight_bytes(False, 2) == 2
    assert frameworks.fp8_master_cast_bytes("delayed") == 4 + 2 + 2 + 1 == 9
    assert frameworks.fp8_master_cast_bytes("current") == 4 + 2 + 2 + 2 + 1 == 11
    # block scaling: the fp32 master read for the blocks' amaxes, read again, cast to FP8
    assert frameworks.fp8_master_cast_bytes("blockwise") == 4 + 4 + 1 == 9


def test_llama3_8b_fp8_linear_weights():
    """One Llama-3-8B layer's TE linears at tp 1: QKV 4096 x (4096 + 2·1024), out-proj
    4096 x 4096, fc1 4096 x 2·14336, fc2 14336 x 4096 (the two RMSNorms' 2·4096 stay BF16);
    the GPU's: 32 layers, the embedding, output layer and final norm stay BF16."""
    layer = 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336
    assert layer == 218_103_808
    assert memory.fp8_linear_layer_parameters(LLAMA3_8B, LayerKind()) == (layer, 0)
    assert memory.fp8_linear_parameters(LLAMA3_8B, 0) == (32 * layer, 0)
    assert memory.fp8_linear_layer_tensors(LLAMA3_8B, LayerKind()) == (4, 0)
    # tp 4: every linear splits over the ranks (8 KV heads, 2 a rank)
    at_tp4 = LLAMA3_8B.replace(tp=4, dp=2)
    assert memory.fp8_linear_layer_parameters(at_tp4, LayerKind()) == (layer // 4, 0)


def test_mixtral_layer_keeps_its_router_in_bf16():
    """Mixtral-8x7B at tp 1, ep 1: attention's 41,943,040 weights and the experts' 8 x 3 x
    4096 x 14336 in FP8, the router's 8 x 4096 and the norms not; 2 + 2·8 weight tensors."""
    spec = load_spec("mixtral-8x7b", {"precision": "fp8", "dp": 8, "zero": 1})
    attention = 4096 * (4096 + 2 * 1024) + 4096 * 4096
    experts = 8 * 3 * 4096 * 14336
    moe = LayerKind(moe=True)
    assert memory.fp8_linear_layer_parameters(spec, moe) == (attention, experts)
    assert memory.fp8_linear_layer_tensors(spec, moe) == (2, 16)
    parts = memory.layer_parameter_parts(spec, moe)
    assert parts.total - attention - experts == 8 * 4096 + 2 * 4096  # router, two norms


def test_biases_stay_in_bf16():
    """GPT-3 175B's layer at tp 8 (biases everywhere): the FP8 weights are the four matrices'
    12h² over t, the biases and the LayerNorms' gains and biases not."""
    spec = load_spec("gpt3-175b", {"precision": "fp8", "tp": 8, "dp": 8, "zero": 1})
    h = spec.hidden
    assert spec.bias and spec.ffn_hidden == 4 * h
    assert memory.fp8_linear_layer_parameters(spec, LayerKind()) == (12 * h * h // 8, 0)


def test_model_states_with_fp8_primary_weights():
    """The FP8 linears' weights at 1 byte and their transposes at 1 (TE's workspace, 2, goes);
    the rest of the weights at 2; gradients and the optimizer's share unchanged."""
    fp8, _ = memory.fp8_linear_parameters(LLAMA3_8B, 0)
    total = sum(memory.stage_parameters(LLAMA3_8B, 0))
    before = memory.model_state_bytes(LLAMA3_8B)
    after = memory.model_state_bytes(FP8_PARAMS)
    assert before.weights == 2 * total and before.buffers == 2 * fp8
    assert after.weights == 2 * (total - fp8) + fp8
    assert after.buffers == fp8
    assert (after.gradients, after.optimizer) == (before.gradients, before.optimizer)
    assert before.total - after.total == 2 * fp8


def test_the_gather_moves_one_byte_per_fp8_weight():
    fp8, _ = memory.fp8_linear_parameters(LLAMA3_8B, 0)
    total = sum(memory.stage_parameters(LLAMA3_8B, 0))
    bandwidth = comm.group_bandwidth(H100, 8, 1)
    assert data_parallel_comm(FP8_PARAMS, H100).gather == pytest.approx(
        comm.all_gather_seconds(2 * (total - fp8) + fp8, 8, bandwidth)
    )
    assert data_parallel_comm(LLAMA3_8B, H100).gather == pytest.approx(
        comm.all_gather_seconds(2 * total, 8, bandwidth)
    )
    # the gradients' reduce-scatter is not affected
    assert data_parallel_comm(FP8_PARAMS, H100).reduce == data_parallel_comm(LLAMA3_8B, H100).reduce
    parts = gradient_reduction(FP8_PARAMS, 1, 1, 1000, 8, bandwidth, fp8_params=400)
    assert parts.gather == pytest.approx(comm.all_gather_seconds(600 * 2 + 400, 8, bandwidth))


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_the_step_casts_its_master_shard_and_reduces_amaxes(recipe):
    """The optimizer step: the shard's FP8 weights cost the cast (9 or 11 bytes) in place of the
    BF16 write (2), and one packed all-reduce of 4 bytes per FP8 tensor (32 layers x 4) over
    the 8 data-parallel ranks."""
    plain = LLAMA3_8B.replace(fp8_recipe=recipe)
    spec = plain.replace(fp8_param_gather=True)
    fp8, _ = memory.fp8_linear_parameters(spec, 0)
    shard = split_share(fp8, 8)
    extra = shard * (frameworks.fp8_master_cast_bytes(recipe) - 2)
    bandwidth = comm.group_bandwidth(H100, 8, 1)
    amax = comm.all_reduce_seconds(32 * 4 * 4, 8, bandwidth) + comm.all_reduce_latency(H100, 8)
    assert fp8_amax_reduction_seconds(spec, H100) == pytest.approx(amax)
    assert fp8_amax_reduction_seconds(plain, H100) == 0.0
    assert optimizer_seconds(spec, H100) == pytest.approx(
        optimizer_seconds(plain, H100) + memory_seconds(H100, extra) + amax
    )


def test_blockwise_reduces_one_amax_per_128x128_block():
    """Block scaling's master-weight cast all-reduces one fp32 amax per 128x128 block of every
    FP8 weight on the GPU: Llama-3-8B's 32 x 218,103,808 weights / 16,384 = 425,984 amaxes,
    over the 8 data-parallel ranks; the weights' FP8 copies are those of per-tensor scaling, with
    their block scales beside them."""
    plain = LLAMA3_8B.replace(fp8_recipe="blockwise")
    spec = plain.replace(fp8_param_gather=True)
    assert memory.fp8_weight_amaxes(spec, 0) == (32 * 218_103_808 // 16_384, 0) == (425_984, 0)
    assert memory.fp8_weight_amaxes(FP8_PARAMS, 0) == (32 * 4, 0)
    bandwidth = comm.group_bandwidth(H100, 8, 1)
    amax = comm.all_reduce_seconds(425_984 * 4, 8, bandwidth) + comm.all_reduce_latency(H100, 8)
    assert fp8_amax_reduction_seconds(spec, H100) == pytest.approx(amax)
    fp8, _ = memory.fp8_linear_parameters(spec, 0)
    extra = split_share(fp8, 8) * (9 - 2)
    assert optimizer_seconds(spec, H100) == pytest.approx(
        optimizer_seconds(plain, H100) + memory_seconds(H100, extra) + amax
    )
    # the same FP8 copies, and beside them each 128x128 block's fp32 scale in both copies:
    # 2 x 4 bytes x 425,984 blocks (no matrix of Llama-3-8B at tp 1 needs padding)
    copies = memory.stage_buffer_bytes(spec, 0) - memory.stage_buffer_bytes(FP8_PARAMS, 0)
    assert copies == 2 * 4 * 425_984


@pytest.mark.parametrize(
    "keys, named",
    [
        ({"precision": "bf16"}, "precision fp8"),
        ({"fp8_recipe": "mxfp8"}, "mxfp8"),
        ({"zero": 0}, "zero 1"),
        ({"zero": 3}, "zero 1"),
    ],
)
def test_rules(keys, named):
    with pytest.raises(SpecError, match="fp8_param_gather") as error:
        LLAMA3_8B.replace(fp8_param_gather=True, **keys)
    assert named in str(error.value)
    with pytest.raises(SpecError, match="framework megatron"):
        load_spec(
            "llama3-8b",
            {"precision": "fp8", "framework": "deepspeed", "zero": 1, "dp": 8},
        ).replace(fp8_param_gather=True)


def test_search_bounds_with_fp8_primary_weights():
    """The layout search offers the distributed optimizer alone, and its time bound is the
    time of `none` as hardware.step_time computes it (the FP8 gather, cast and amaxes)."""
    spec = load_spec("gpt2", {"seq": 1024, "layers": 4, "precision": "fp8"})
    spec = spec.replace(fp8_param_gather=True, dp=2, zero=1)
    space = SearchSpace(spec, 8, 8, 16, {})
    bounds = Bounds(spec, H100)
    found = list(layouts(space))
    assert found and {layout.zero for layout in found} == {1}
    for layout in found[::5]:
        each = spec.replace(**layout_keys_cleared(layout, False))
        none = evaluate(each, parse_strategy("none", each))
        assert bounds.time(layout).seconds == pytest.approx(
            step_time(none, H100).step_seconds, rel=1e-9
        )
        assert bounds.memory(layout).bytes <= none.total_bytes


def test_advice_keeps_the_distributed_optimizer():
    """With FP8 primary weights the advice raises dp (and tp, pp, cp) at zero 1 only: Megatron
    runs the key with the distributed optimizer."""
    from ckplan.plan.advice import advise

    spec = load_spec("llama3-70b", {"precision": "fp8", "tp": 8, "sp": True, "dp": 2, "zero": 1})
    spec = spec.replace(fp8_param_gather=True, microbatches=8)
    found = advise(spec, 64 * 2**30)
    assert {"dp": 8} in [advice.keys for advice in found]  # at zero 1, the spec's
    assert all(advice.keys.get("zero", 1) == 1 for advice in found)
