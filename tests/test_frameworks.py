"""The frameworks' buffers beside the model states, by hand from the parameters they cover."""

from ckplan.model import frameworks
from ckplan.model.memory import layer_parameter_parts, model_state_bytes, stage_parameters


def _stage_and_layer(spec, stage=0):
    dense, expert = stage_parameters(spec, stage)
    layer = layer_parameter_parts(spec).dense_per_rank(spec)
    return dense + expert, layer


def test_torchtitan_2024_12_fsdp_keeps_the_root_and_the_last_layer_unsharded(spec_of):
    # the running and prefetched layers' copies, gradients and reduce-scatter inputs are the
    # layers' chain workspaces (tests/test_fsdp2_memory.py)
    spec = spec_of("llama3-8b", framework="torchtitan", dp=8, zero=3, framework_version="2024.12")
    stage, layer = _stage_and_layer(spec)
    root = stage - spec.layers * layer
    assert model_state_bytes(spec).buffers == 2 * (root + layer)


def test_torchtitan_0_3_fsdp_keeps_the_final_norm_and_output_unsharded(spec_of):
    # the embedding and every block reshard after forward (torchtitan 83e6941 onwards)
    spec = spec_of("llama3-8b", framework="torchtitan", dp=8, zero=3)
    stage, layer = _stage_and_layer(spec)
    root = stage - spec.layers * layer
    embedding = spec.vocab * spec.hidden
    assert model_state_bytes(spec).buffers == 2 * (root - embedding)
    # with tied embeddings the embedding, final norm and output are one kept unit
    tied = spec.replace(tied_embeddings=True)
    stage, layer = _stage_and_layer(tied)
    assert model_state_bytes(tied).buffers == 2 * (stage - tied.layers * layer)


def test_torchtitan_under_pipeline_parallelism_accumulates_unsharded_fp32_gradients(spec_of):
    spec = spec_of("llama3-8b", framework="torchtitan", dp=8, zero=3, pp=4)
    params, layer = _stage_and_layer(spec, 0)
    # the whole stage unsharded in bf16 (no reshard after forward), its gradients in fp32, the
    # running layer's bf16 gradients
    assert model_state_bytes(spec, 0).buffers == 2 * params + 4 * params + 2 * layer


def test_torchtitan_zero_2_shards_the_fp32_weights_and_keeps_the_bf16_copy_unsharded(spec_of):
    # FSDP2 without resharding after forward: the fp32 parameters are the 8 ranks' shards, the
    # unsharded bf16 parameters of the stage stay from forward to backward
    spec = spec_of("llama3-8b", framework="torchtitan", dp=8, zero=2)
    params, layer = _stage_and_layer(spec)
    states = model_state_bytes(spec)
    assert states.weights == -(-4 * params // 8)
    assert states.gradients == -(-4 * params // 8)
    assert states.buffers == 2 * params + (2 + 4) * layer
    zero3 = model_state_bytes(spec.replace(zero=3))
    assert states.weights == zero3.weights
    # DeepSpeed's ZeRO-2 keeps every bf16 weight on every rank
    deepspeed = spec_of("llama3-8b", framework="deepspeed", dp=8, zero=2)
    assert model_state_bytes(deepspeed).weights == 2 * _stage_and_layer(deepspeed)[0]


def test_torchtitan_shards_over_context_parallel_ranks_too(spec_of):
    spec = spec_of("llama3-8b", framework="torchtitan", dp=1, cp=8, zero=3, seq=65536)
    stage, layer = _stage_and_layer(spec)
    root = stage - spec.layers * layer
    assert model_state_bytes(spec).buffers == 2 * (root - spec.vocab * spec.hidden)
    assert model_state_bytes(spec_of("llama3-8b", framework="torchtitan", zero=3)).buffers == 0


def test_torchtitan_launcher_sets_expandable_segments(spec_of):
    assert spec_of("llama3-8b", framework="torchtitan").expandable_segments is True
    assert spec_of("llama3-8b").expandable_segments is False
    assert (
        spec_of("llama3-8b", framework="torchtitan", expandable_segments=False).expandable_segments
        is False
    )


def test_chain_gradients_sum_to_the_model_states(spec_of):
    from ckplan.model.memory import chain_gradient_bytes

    for overrides in ({}, {"dp": 8, "zero": 3}, {"tp": 2, "sp": True}):
        spec = spec_of("llama3-8b", framework="torchtitan", **overrides)
        grads = chain_gradient_bytes(spec)
        assert len(grads) == spec.layers + 2
        total = model_state_bytes(
            spec.replace(framework="megatron", **_torchtitan_bytes())
        ).gradients
        assert abs(sum(grads) - total) <= len(grads)  # each stage's share rounded up


def _torchtitan_bytes():
    return {"weight_bytes": 4, "grad_bytes": 4, "master_bytes": 0, "optimizer_bytes": 8}


def test_gradients_written_by_the_peak_replace_all_of_them(spec_of):
    """torchtitan and the Trainer free the gradients every step: at the loss's backward, the
    activation peak of a plain step, only the output layer's gradient exists (measured on an
    H200: docs/validation.md, "Measured on a GPU"). Megatron's buffer holds all of them, and so
    does gradient accumulation."""
    from pathlib import Path

    from ckplan.model.memory import chain_gradient_bytes
    from ckplan.plan.evaluate import evaluate
    from ckplan.plan.strategies import parse_strategy

    model = Path(__file__).resolve().parents[1] / "validation" / "device" / "llama_like.yaml"
    spec = spec_of(str(model))
    plan = evaluate(spec, parse_strategy("none", spec))
    assert plan.model_states.gradients == chain_gradient_bytes(spec)[-1]
    # with fp32 gradients of 8B parameters and short sequences the peak comes later in the
    # backward, with more of them written
    spec = spec_of("llama3-8b", framework="hf", seq=2048)
    live = evaluate(spec, parse_strategy("none", spec)).model_states.gradients
    assert chain_gradient_bytes(spec)[-1] < live < model_state_bytes(spec).gradients
    held = spec_of("llama3-8b", framework="hf", seq=2048, microbatches=2)
    assert evaluate(held, parse_strategy("none", held)).model_states.gradients == (
        model_state_bytes(held).gradients
    )
    megatron = spec_of("llama3-8b", seq=2048)
    assert evaluate(megatron, parse_strategy("none", megatron)).model_states.gradients == (
        model_state_bytes(megatron).gradients
    )


def test_deepspeed_zero3_allocates_its_reduce_bucket_whole():
    # the IPG bucket, 5e8 bf16 elements whatever trains, and reduce_scatter's flat copy of at
    # most one bucket of the trainable parameters' gradients
    assert frameworks.deepspeed_zero3_reduce_bytes(103_546_880) == 1_000_000_000 + 207_093_760
    assert frameworks.deepspeed_zero3_reduce_bytes(7_000_000_000) == 2_000_000_000
    assert frameworks.deepspeed_zero3_reduce_bytes(10, bucket=100) == 200 + 20


def test_deepspeed_zero3_buffers_of_a_few_trainable_parameters(spec_of):
    # 1,000 trainable parameters on Llama 3 8B: the reduce buffers (1e9 + 2,000 bytes), the
    # prefetch bucket (2,000) and the largest weight gathered, 4,096 x 14,336 in bf16
    spec = spec_of("llama3-8b", framework="deepspeed", dp=8, zero=3)
    expected = 1_000_000_000 + 2_000 + 2_000 + 2 * 4096 * 14336
    assert frameworks.buffer_bytes(spec, 1000, 100, 0) == expected


def test_deepspeed_zero3_keeps_two_layers_gathered_under_the_live_cap():
    # Llama-2-70B's bf16 layer with LoRA (1,713,817,600 bytes): two exceed 1e9 bf16 elements
    assert frameworks.deepspeed_zero3_live_bytes(1_713_817_600, 469_762_048) == 2_000_000_000
    # its nf4 layer packed (427,819,008 bytes a layer): the running one and the prefetched one
    assert frameworks.deepspeed_zero3_live_bytes(427_819_008, 117_440_512) == 855_638_016
    # a single weight larger than the cap is gathered whole
    assert frameworks.deepspeed_zero3_live_bytes(10, 3_000_000_000) == 3_000_000_000


def test_deepspeed_zero3_keeps_the_small_tensors_whole():
    # Llama-2-70B's adapters at r 8: lora_A of q (8 x 8192) and lora_B of k (1024 x 8) are at
    # most 1e5 elements, lora_B of gate (28672 x 8) is not
    assert frameworks.deepspeed_persistent_bytes((65_536, 8_192, 229_376)) == 2 * 73_728
    assert frameworks.deepspeed_persistent_bytes((100_000, 100_001)) == 200_000
    assert frameworks.deepspeed_persistent_bytes((10, 20), threshold=15) == 20
