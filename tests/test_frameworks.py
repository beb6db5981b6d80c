"""The frameworks' buffers beside the model states, by hand from the parameters they cover."""

from ckplan.model.memory import layer_parameter_parts, model_state_bytes, stage_parameters


def _stage_and_layer(spec, stage=0):
    dense, expert = stage_parameters(spec, stage)
    layer = layer_parameter_parts(spec).dense_per_rank(spec)
    return dense + expert, layer


def test_torchtitan_fsdp_holds_two_layers_the_root_and_one_layer_s_gradients(spec_of):
    spec = spec_of("llama3-8b", framework="torchtitan", dp=8, zero=3)
    stage, layer = _stage_and_layer(spec)
    root = stage - spec.layers * layer
    expected = 2 * (2 * layer + root) + (2 + 4) * layer
    assert model_state_bytes(spec).buffers == expected


def test_torchtitan_under_pipeline_parallelism_accumulates_unsharded_fp32_gradients(spec_of):
    spec = spec_of("llama3-8b", framework="torchtitan", dp=8, zero=3, pp=4)
    params, layer = _stage_and_layer(spec, 0)
    # the whole stage unsharded in bf16 (no reshard after forward), its gradients in fp32, the
    # running layer's bf16 gradients
    assert model_state_bytes(spec, 0).buffers == 2 * params + 4 * params + 2 * layer


def test_torchtitan_shards_over_context_parallel_ranks_too(spec_of):
    spec = spec_of("llama3-8b", framework="torchtitan", dp=1, cp=8, zero=3, seq=65536)
    stage, layer = _stage_and_layer(spec)
    root = stage - spec.layers * layer
    assert model_state_bytes(spec).buffers == 2 * (2 * layer + root) + (2 + 4) * layer
    assert model_state_bytes(spec_of("llama3-8b", framework="torchtitan", zero=3)).buffers == 0


def test_torchtitan_launcher_sets_expandable_segments(spec_of):
    assert spec_of("llama3-8b", framework="torchtitan").expandable_segments is True
    assert spec_of("llama3-8b").expandable_segments is False
    assert (
        spec_of("llama3-8b", framework="torchtitan", expandable_segments=False).expandable_segments
        is False
    )
