"""`fsdp_reduce_dtype`: the dtype hf's FSDP reduce-scatters the gradients in (ckplan.model.
frameworks `fsdp_reduce_bytes`, `fsdp1_cast_reduce`), by hand: accelerate's half dtype by
default, fp32 where set (Composer's runs), with FSDP1's fp32 copy of each unit's gradient in its
post-backward. The model is tests/test_fsdp1_memory.py's: 4 layers of 590,336 parameters."""

import pytest
from test_fsdp1_memory import EMBEDDING, LAYER, OUTPUT, ROOT_PARAMS, _small_spec

from ckplan.exports import peft
from ckplan.exports.segments import layer_segments
from ckplan.hardware.step_time import gradient_reduction
from ckplan.model import frameworks, memory
from ckplan.model.spec import SpecError
from ckplan.plan import evaluate, parse_strategy
from ckplan.plan.layer_chain import layer_chain
from ckplan.published.predict import run_spec
from ckplan.published.suite import suite_runs

# no mixed precision; without sharding, which ckplan refuses beside fp32 under hf
FP32 = {"precision": "fp32", "dtype_bytes": 4, "zero": 0, "dp": 1}


def test_reduce_bytes_by_framework():
    reduce = frameworks.reduce_bytes_per_parameter
    # accelerate's MixedPrecision: reduce_dtype the training precision's half dtype
    assert reduce("hf", 3, 4, 2, "bf16") == 2
    assert reduce("hf", 2, 4, 2, "fp16") == 2
    assert reduce("hf", 3, 4, 2, "bf16", "fp32") == 4
    assert reduce("hf", 3, 4, 4, "fp32") == 4  # no mixed precision, no policy: fp32
    assert reduce("hf", 0, 4, 2, "bf16") == 4  # DDP all-reduces the fp32 gradients
    assert reduce("torchtitan", 3, 4, 2, "bf16") == 4  # reduce_dtype float32
    assert reduce("megatron", 1, 4, 2, "bf16") == 4
    assert reduce("deepspeed", 3, 4, 2, "bf16") == 2


def test_fp32_reduction_doubles_the_reduce_scatter():
    half, full = _small_spec(), _small_spec(fsdp_reduce_dtype="fp32")
    bandwidth = 100e9
    params = 10**9
    a = gradient_reduction(half, 3, 1, params, 8, bandwidth)
    b = gradient_reduction(full, 3, 1, params, 8, bandwidth)
    assert b.reduce == pytest.approx(2 * a.reduce)
    assert b.gather == a.gather  # the weights are gathered in bf16 either way


def test_fp32_reduction_holds_each_units_gradient_and_its_copy():
    half, full = _small_spec(), _small_spec(fsdp_reduce_dtype="fp32")
    assert frameworks.fsdp1_cast_reduce(full) and not frameworks.fsdp1_cast_reduce(half)
    assert frameworks.fsdp1_cast_reduce_bytes(LAYER) == 6 * LAYER
    a, b = layer_chain(half, False), layer_chain(full, False)
    assert a.forward_workspace_bytes == b.forward_workspace_bytes
    # layers: the compute's copy, gradient and waiting output gradient (2L + 2L + 2·out), or
    # the post-backward's gradient and fp32 copy beside the waiting one (6L + 2·out)
    for i in range(1, 1 + 4):
        extra = 6 * LAYER + 2 * OUTPUT - (4 * LAYER + 2 * OUTPUT)
        assert b.backward_workspace_bytes[i] - a.backward_workspace_bytes[i] == extra
    # the embedding stage: the root's flat gradient and its fp32 copy (6 · root) where that
    # exceeds the pieces and the flat gradient (2 · (root + embedding + output))
    pieces = 2 * (ROOT_PARAMS + EMBEDDING + OUTPUT)
    assert b.backward_workspace_bytes[0] - a.backward_workspace_bytes[0] == max(
        0, 6 * ROOT_PARAMS - pieces
    )


def test_no_copy_without_a_half_precision_gradient():
    fp32 = _small_spec(**FP32, fsdp_reduce_dtype="fp32")
    assert not frameworks.fsdp1_cast_reduce(fp32)
    lora = _small_spec(training="lora", fsdp_reduce_dtype="fp32")
    plain = _small_spec(training="lora")
    # the adapters' gradients, each LoRA leaf its own unit of a few MB: not counted
    assert layer_chain(lora, False) == layer_chain(plain, False)


def test_plan_peak_grows_by_the_copy():
    half, full = _small_spec(), _small_spec(fsdp_reduce_dtype="fp32")
    a = evaluate(half, parse_strategy("full", half))
    b = evaluate(full, parse_strategy("full", full))
    assert b.total_bytes >= a.total_bytes
    assert memory.model_state_bytes(half) == memory.model_state_bytes(full)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"framework": "megatron", "zero": 1}, "the key is for framework hf, not megatron"),
        ({"framework": "torchtitan"}, "the key is for framework hf, not torchtitan"),
        ({"fsdp_reduce_dtype": "fp16"}, "must be fp32 or bf16 under precision bf16"),
        ({**FP32, "fsdp_reduce_dtype": "bf16"}, "must be fp32 under precision fp32"),
        ({"fsdp_reduce_dtype": "float32"}, "must be one of fp32, bf16, fp16"),
    ],
)
def test_refused(changes, message):
    with pytest.raises(SpecError, match=message):
        _small_spec(**{"fsdp_reduce_dtype": "fp32", **changes})


def test_peft_export_refuses_an_fp32_reduction():
    full = _small_spec(fsdp_reduce_dtype="fp32")
    plan = evaluate(full, parse_strategy("full", full))
    assert "no TrainingArguments key writes fp32" in peft.reason(full, layer_segments(plan))
    half = _small_spec(fsdp_reduce_dtype="bf16")
    plan = evaluate(half, parse_strategy("full", half))
    assert peft.reason(half, layer_segments(plan)) is None


def test_composer_runs_reduce_in_fp32():
    composer = [r for r in suite_runs() if r.framework == "composer" and not r.is_memory]
    assert composer
    for run in composer:
        spec = run_spec(run)
        expected = "fp32" if spec.zero >= 2 else None
        assert spec.fsdp_reduce_dtype == expected, run.name
