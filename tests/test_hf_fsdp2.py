"""The Hugging Face Trainer's FSDP2 (framework hf, `fsdp_version` 2, the default of transformers
v5.25): accelerate v1.14.0's units are torchtitan 0.3's, its MixedPrecisionPolicy reduces in bf16,
and frozen base weights are gathered layer by layer (ckplan.model.frameworks `runs_fsdp2`,
`fsdp2_reduce_bytes`, `fsdp2_frozen_layer_backward_bytes`), by hand on Llama 3 8B over 8 ranks
and against PyTorch's FSDPMemTracker (validation/torch_fsdp2_memory.py, layout `accelerate`).
"""

import pytest
from test_fsdp2_memory import (
    EMBEDDING,
    LAYER,
    OUTPUT,
    RESULTS,
    SMALL,
    fsdp2_spec,
    measurement_harness,
)

from ckplan.hardware.step_time import step_time
from ckplan.inputs.gpus import load_gpu
from ckplan.model import finetune, frameworks, memory
from ckplan.model.parts import SpecError
from ckplan.plan import evaluate, parse_strategy
from ckplan.plan.layer_chain import layer_chain

NORM = 4096


def _spec(**changes):
    """Llama 3 8B over 8 ranks at 2 x 8,192 tokens (test_fsdp2_memory's) under framework hf."""
    return fsdp2_spec(**{"framework": "hf", **changes})


def _added(spec):
    """The forward and backward workspace bytes FSDP2 adds to the spec's chain: against the
    same spec at zero 2, whose chain holds no FSDP buffers (they are `buffer_bytes`')."""
    chain, plain = layer_chain(spec, ()), layer_chain(spec.replace(zero=2), ())
    pairs = (
        (chain.forward_workspace_bytes, plain.forward_workspace_bytes),
        (chain.backward_workspace_bytes, plain.backward_workspace_bytes),
    )
    return tuple([a - b for a, b in zip(mine, base, strict=True)] for mine, base in pairs)


def test_the_release_picks_the_version():
    # transformers v5.25.0's Trainer: fsdp_config.get("version", 2); v4.44 knows FSDP1 alone
    assert frameworks.fsdp_version(_spec()) == 2 and frameworks.runs_fsdp2(_spec())
    old = _spec(framework_version="4.44")
    assert frameworks.fsdp_version(old) == 1 and frameworks.fsdp1_resharding(old)
    assert frameworks.fsdp_version(_spec(fsdp_version=1)) == 1
    assert frameworks.fsdp_version(_spec(framework_version="4.44", fsdp_version=2)) == 2
    assert frameworks.runs_fsdp2(_spec(framework="torchtitan"))
    assert not frameworks.runs_fsdp2(_spec(framework="deepspeed"))
    with pytest.raises(SpecError, match="for framework hf, not torchtitan"):
        _spec(framework="torchtitan", fsdp_version=2)
    with pytest.raises(SpecError, match="FSDP2 prefetches the next unit in backward itself"):
        _spec(fsdp_backward_prefetch="backward_pre")


def test_accelerate_shards_like_torchtitan_0_3_reducing_in_bf16():
    spec = _spec()
    assert frameworks.fsdp2_resharding(spec) and not frameworks.fsdp1_resharding(spec)
    assert frameworks.spec_fsdp2_grouping(spec) == frameworks.fsdp2_grouping("0.3")
    assert frameworks.fsdp2_reduce_bytes(spec) == 2  # reduce_dtype bf16
    assert frameworks.fsdp2_reduce_bytes(_spec(fsdp_reduce_dtype="fp32")) == 4
    assert frameworks.fsdp2_reduce_bytes(_spec(framework="torchtitan")) == 4
    # FSDP2 casts nothing before its reduce-scatter: the input is allocated in reduce_dtype
    assert not frameworks.fsdp1_cast_reduce(_spec(fsdp_reduce_dtype="fp32"))
    assert frameworks.fsdp1_cast_reduce(_spec(fsdp_reduce_dtype="fp32", fsdp_version=1))
    # the kept unit: final norm and output in bf16, as torchtitan 0.3
    assert memory.model_state_bytes(spec).buffers == 2 * OUTPUT
    # the weights shard from zero 2 (fully_shard shards whatever reshard_after_forward; FSDP1
    # SHARD_GRAD_OP too)
    assert frameworks.weights_sharded_from(spec) == 2
    assert frameworks.weights_sharded_from(spec.replace(fsdp_version=1)) == 2  # SHARD_GRAD_OP
    assert frameworks.weights_sharded_from(spec.replace(framework="deepspeed")) == 3


def test_chain_holds_accelerates_unit_buffers():
    forward, backward = _added(_spec())
    # embedding (its own unit), 32 blocks, output layer and loss: copy and all-gather output
    assert forward == [4 * EMBEDDING, *[4 * LAYER] * 32, 0]
    assert backward == [
        # the embedding: unsharded 2 + gradient 2, the first block's bf16 reduce-scatter input
        4 * EMBEDDING + 2 * LAYER,
        # the first block: running 2 + the embedding prefetched 2 + gradients 2 + input 2
        6 * LAYER + 2 * EMBEDDING,
        *[8 * LAYER] * 30,
        # the last block, first to run: the [norm, output] unit's bf16 reduce-scatter input
        6 * LAYER + 2 * OUTPUT,
        0,
    ]
    fp32_forward, fp32_backward = _added(_spec(fsdp_reduce_dtype="fp32"))
    assert fp32_forward == forward
    assert fp32_backward[2] == 10 * LAYER  # torchtitan's middle block (test_fsdp2_memory)


def test_frozen_layers_gathered_one_at_a_time():
    spec = _spec(training="lora", lora_targets="all-linear", lora_rank=16)
    assert frameworks.fsdp2_frozen_resharding(spec) and not frameworks.fsdp2_resharding(spec)
    gathered = finetune.gathered_layer_bytes(spec, 2)[0]
    adapters = finetune.lora_layer_parameters(spec)
    assert gathered == 2 * (LAYER - 2 * NORM) + 2 * adapters  # bf16 linears and adapters
    forward, backward = _added(spec)
    assert forward == [4 * EMBEDDING, *[2 * gathered] * 32, 0]
    # running, the unit before prefetched (the embedding's before the first), the adapters'
    # bf16 gradients and the layer before's bf16 reduce-scatter input
    assert backward == [
        0,
        gathered + 2 * EMBEDDING + 4 * adapters,
        *[2 * gathered + 4 * adapters] * 31,
        0,
    ]
    assert frameworks.fsdp2_frozen_layer_backward_bytes(10, 3, 7, 4) == 10 + 7 + 6 * 3
    # the kept [norm, output] unit's frozen bf16 copy all step
    assert memory.model_state_bytes(spec).buffers == 2 * OUTPUT
    fsdp1 = spec.replace(fsdp_version=1)  # FSDP1 keeps the whole root (and the embedding)
    assert memory.model_state_bytes(fsdp1).buffers == 2 * (OUTPUT + EMBEDDING)


def test_qlora_gathers_the_packed_weights():
    spec = _spec(training="qlora", weight_format="nf4", lora_targets="all-linear", lora_rank=16)
    gathered = finetune.gathered_layer_bytes(spec, 2)[0]
    assert gathered < (LAYER - 2 * NORM)  # about half a byte a frozen weight
    assert _added(spec)[0][1] == 2 * gathered


def test_the_reduce_scatter_moves_bf16():
    gpu = load_gpu("h100-sxm")
    spec = _spec()
    assert frameworks.spec_reduce_bytes(spec) == 2
    fp32 = _spec(fsdp_reduce_dtype="fp32")
    assert frameworks.spec_reduce_bytes(fp32) == 4
    plan = evaluate(spec, parse_strategy("full", spec))
    slower = evaluate(fp32, parse_strategy("full", fp32))
    assert step_time(slower, gpu).communication_seconds > step_time(plan, gpu).communication_seconds


def _accelerate_result():
    (case,) = [case for case in RESULTS["cases"] if case["layout"] == "accelerate"]
    return case


def test_recorded_accelerate_measurement():
    """FSDPMemTracker on torchtitan's Llama 3 8B under accelerate's units and policy: the
    states and kept copies are ckplan's, and no reduce-scatter input is live at the peak."""
    case = _accelerate_result()
    spec = _spec(seq=case["seq"], micro_batch=case["micro_batch"])
    states = memory.model_state_bytes(spec)
    peak = case["phases"]["backward"]
    assert case["peak_phase"] == "backward"
    assert peak["Sharded Param"] == states.weights
    assert peak["OptState"] - 4 * (spec.layers * 7 + 3) == states.optimizer
    assert peak["Unsharded Param"] == states.buffers == 2 * OUTPUT
    assert case["phases"]["forward"]["All Gather"] == frameworks.fsdp2_layer_forward_bytes(
        OUTPUT, kept=True
    )


def test_rerun_reduces_in_bf16_at_a_small_shape():
    """The measurement at a small shape: the reduce-scatter input at the backward's peak is the
    bf16 one accelerate's policy makes, half torchtitan's fp32."""
    harness = measurement_harness()
    dim, kv_dim = 256, 2 * 64
    layer = dim * (dim + 2 * kv_dim) + dim * dim + 3 * dim * 768 + 2 * dim  # 786,944
    scattered = {}
    for layout in ("0.3.0", "accelerate"):
        case = {"layout": layout, "ac": "op", "micro_batch": 2, "seq": 128}
        result = harness.measure(case, SMALL)
        assert result["peak_phase"] == "backward"
        scattered[layout] = result["phases"]["backward"]["Reduce Scatter"]
    assert scattered["accelerate"] == frameworks.fsdp2_reduce_bytes(_spec()) * layer
    torchtitan = _spec(framework="torchtitan")
    assert scattered["0.3.0"] == frameworks.fsdp2_reduce_bytes(torchtitan) * layer


@pytest.mark.parametrize("version", [1, 2])
def test_zero_2_shards_the_weights_and_keeps_their_copies(version):
    """Without reshard after forward (FSDP2's reshard_after_forward False, FSDP1's
    SHARD_GRAD_OP) the parameters stay sharded outside the forward and backward, and their
    bf16 copies, frozen ones too, are kept from forward to backward."""
    params = 8_030_261_248  # Llama 3 8B
    full = _spec(zero=2, fsdp_version=version)
    states = memory.model_state_bytes(full)
    assert states.weights == 4 * params // 8
    if version == 1:  # FSDP1's unsharded flat parameters
        assert states.buffers == 2 * params
    lora = _spec(zero=2, fsdp_version=version, training="lora", lora_targets="all-linear")
    adapters = finetune.lora_layer_parameters(lora)
    frozen_layer = finetune.gathered_layer_bytes(lora, 2)[0] - 2 * adapters
    outside = 2 * (EMBEDDING + OUTPUT)
    kept = memory.model_state_bytes(lora).buffers
    assert kept >= 32 * frozen_layer + outside
    # beside them the adapters' copies (and under FSDP2 a layer's adapter gradients in bf16
    # and their bf16 reduce-scatter input, `buffer_bytes`)
    assert kept - (32 * frozen_layer + outside) == 2 * 32 * adapters + (version - 1) * 4 * adapters


def test_estimate_names_the_fsdp_its_buffers_are(cli):
    argv = ["estimate", "llama3-8b", "--set", "framework=hf", "--set", "zero=3", "--set", "dp=8"]
    code, out, _ = cli(*argv, "-s", "full")
    assert code == 0 and "hf's FSDP2 (docs/memory.md)" in out
    code, out, _ = cli(*argv, "--set", "fsdp_version=1", "-s", "full")
    assert code == 0 and "hf's FSDP1 (docs/memory.md)" in out
