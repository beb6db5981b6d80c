"""Optimizers (ckplan.model.optimizers, docs/fine-tuning.md "Optimizers"): each optimizer's
state of a small Llama-style model, by hand, to the byte; the step in backward; the step's
time; the layouts the search enumerates."""

from math import prod

import pytest
from test_finetune import SMALL as FINETUNE_SMALL

from ckplan.hardware.step_time import optimizer_seconds
from ckplan.inputs.gpus import load_gpu
from ckplan.model import optimizers
from ckplan.model.memory import model_state_bytes, stage_parameters, trainable_tensors
from ckplan.model.spec import SpecError, spec_from_mapping

# h 64, a 4, g 2 (d 16), F 128, V 256, two layers, untied: 106,816 parameters
SMALL = {**FINETUNE_SMALL, "framework": "hf"}  # fp32 weights, no master copy: the state alone
P = 106_816


def small(**changes):
    return spec_from_mapping({**SMALL, **changes})


def test_parameter_count():
    assert stage_parameters(small(), 0) == (P, 0)


@pytest.mark.parametrize(
    ("optimizer", "state"),
    [
        ("adamw", 8 * P),
        ("adamw-bf16", 4 * P),
        ("sgd", 4 * P),
        ("sgd-nomomentum", 0),
        ("lion", 4 * P),
        # per layer: k, v (2,048 values each) and the two norms (64) under 4,096 keep fp32
        # states, 8 bytes a value; q, o (4,096), gate, up, down (8,192) 2 bytes a value and
        # 2·4 bytes per 256-value block; the embedding and output (16,384) likewise, the final
        # norm in fp32
        (
            "adamw-8bit",
            2 * (2 * (4096 * 2 + 8192 * 3) + 8 * (16 + 16 + 32 * 3) + 8 * (2048 * 2 + 64 * 2))
            + 2 * (2 * 16384 + 8 * 64)
            + 8 * 64,
        ),
        # per matrix 4·(rows + columns), per vector 4·n: q 4·128, k and v 4·96, o 4·128,
        # gate, up, down 4·192, the norms 4·64 each; embedding and output 4·320, final norm;
        # and the RMS scalar of each of the 21 tensors
        (
            "adafactor",
            2 * 4 * (128 + 96 + 96 + 128 + 3 * 192 + 2 * 64) + 2 * 4 * 320 + 4 * 64 + 4 * 21,
        ),
    ],
)
def test_state_bytes_by_hand(optimizer, state):
    spec = small(optimizer=optimizer)
    assert model_state_bytes(spec).optimizer == state


def test_paged_is_the_same_bytes():
    assert (
        model_state_bytes(small(optimizer="paged-adamw-8bit")).optimizer
        == model_state_bytes(small(optimizer="adamw-8bit")).optimizer
    )


def test_master_copy_kept_beside_the_state():
    """Megatron's bf16 weights keep an fp32 master copy whatever the optimizer."""
    spec = small(framework="megatron", optimizer="sgd")
    assert model_state_bytes(spec).optimizer == (4 + 4) * P


def test_explicit_optimizer_bytes_win():
    spec = small(optimizer="adamw-8bit", optimizer_bytes=3)
    assert spec.optimizer_bytes == 3
    assert model_state_bytes(spec).optimizer == 3 * P


def test_optimizer_bytes_default_follows_the_optimizer():
    assert small(optimizer="adamw-bf16").optimizer_bytes == 4
    assert small(optimizer="sgd-nomomentum").optimizer_bytes == 0
    # replace derives it again from the new optimizer
    assert small(optimizer="sgd").replace(optimizer="adamw").optimizer_bytes == 8


def test_lora_adapters_only():
    """q_proj and v_proj adapters at r 16: A (16, 64), B (64, 16) and (32, 16), all under
    bitsandbytes' 4,096-value floor: fp32 states, 8 bytes a value."""
    spec = small(training="lora", optimizer="adamw-8bit")
    adapters = 2 * (16 * 64 + 64 * 16 + 16 * 64 + 32 * 16)
    assert model_state_bytes(spec).optimizer == 8 * adapters
    assert model_state_bytes(small(training="lora", optimizer="sgd")).optimizer == 4 * adapters


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"norm": "layernorm", "mlp": "gelu", "bias": True, "positions": "learned"},
        {"qkv_bias": True, "qk_norm": True, "post_norms": True, "tied_embeddings": True},
        {"pp": 2, "framework": "megatron"},
        {"pp": 2, "tied_embeddings": True, "framework": "megatron"},
        {"vocab": 0, "positions": "learned", "norm": "layernorm"},
    ],
)
def test_tensors_sum_to_the_parameters(changes):
    spec = small(**changes)
    for stage in range(spec.pp):
        tensors = trainable_tensors(spec, stage)
        assert sum(count * prod(shape) for shape, count in tensors.items()) == sum(
            stage_parameters(spec, stage)
        )


def test_8bit_tensor_rule():
    assert optimizers.tensor_8bit_state_bytes(4095) == 6 * 4095
    assert optimizers.tensor_8bit_state_bytes(4096) == 8 * 16
    assert optimizers.tensor_8bit_state_bytes(4097) == 8 * 17


def test_adafactor_tensor_rule():
    assert optimizers.tensor_adafactor_state_bytes((8, 3, 5)) == 4 * 8 * (3 + 5) + 4
    assert optimizers.tensor_adafactor_state_bytes((7,)) == 28 + 4


def test_optimizer_in_backward_holds_one_layer():
    """The largest layer's gradients (36,992 parameters) beside the output layer's 16,384."""
    spec = small(optimizer_in_backward=True)
    assert model_state_bytes(spec).gradients == 4 * 36_992
    assert model_state_bytes(small()).gradients == 4 * P
    lora = small(training="lora", optimizer_in_backward=True)
    assert model_state_bytes(lora).gradients == 4 * (16 * 64 + 64 * 16 + 16 * 64 + 32 * 16)


def test_tied_embedding_gradient_is_held_across_the_backward():
    """A tied word embedding's gradient comes from the output layer's backward, the first, and
    its hook fires only after the embedding's, the last: with the step in backward it is held
    beside each layer's gradients, 36,992 + 16,384 parameters, not the larger of the two."""
    tied = small(tied_embeddings=True, optimizer_in_backward=True)
    assert model_state_bytes(tied).gradients == 4 * (36_992 + 16_384)


def test_tied_embedding_gradient_is_written_by_the_output_stage():
    """Without the step in backward the chain's stages write their gradients in backward
    order: the tied (V x h) block with the output stage's final norm, nothing left to the
    embedding (RoPE: no position table); untied, each end keeps its own."""
    from ckplan.model.memory import chain_gradient_bytes

    tied = chain_gradient_bytes(small(tied_embeddings=True))
    assert (tied[0], tied[-1]) == (0, 4 * (16_384 + 64))
    untied = chain_gradient_bytes(small())
    assert (untied[0], untied[-1]) == (4 * 16_384, 4 * (16_384 + 64))
    assert sum(tied) == sum(untied) - 4 * 16_384


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"optimizer": "adamw-8bit", "tp": 2, "framework": "megatron"}, "at tp 1"),
        ({"optimizer": "adafactor", "dp": 2, "zero": 2}, "use zero: 0"),
        ({"optimizer_in_backward": True, "microbatches": 2}, "gradients never accumulate"),
        ({"optimizer": "adam"}, "key 'optimizer' must be one of"),
    ],
)
def test_refused(changes, fragment):
    with pytest.raises(SpecError, match=fragment):
        small(**changes)


def test_step_time_follows_the_bytes():
    gpu = load_gpu("rtx-4090")
    adam = optimizer_seconds(small(), gpu)
    sgd = optimizer_seconds(small(optimizer="sgd-nomomentum"), gpu)
    assert sgd < adam
    per_param = optimizers.step_bytes_per_parameter("adamw", 4, 0, 4, 8)
    assert per_param == 4 + 16 + 2 * 4  # no master copy: the weight is read and written
    assert optimizers.step_bytes_per_parameter("adamw", 4, 4, 2, 8) == 4 + 8 + 16 + 2
    assert optimizers.step_bytes_per_parameter("adafactor", 4, 0, 4, 0) == 8 + 2 * 4


def test_in_backward_is_not_the_frameworks_freed_gradients():
    """hf frees its gradients every step and allocates them in backward; with the step in
    backward each is freed right after its step instead, which the model states count."""
    from ckplan.model.memory import gradients_allocated_in_backward

    assert gradients_allocated_in_backward(small())
    assert not gradients_allocated_in_backward(small(optimizer_in_backward=True))
