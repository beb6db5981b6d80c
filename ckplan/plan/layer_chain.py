"""The chain one GPU runs for one micro-batch, built from a model's op table: embedding ->
its layers -> output layer and loss, each stage with its FLOPs, input, tape and workspaces."""

from __future__ import annotations

from functools import lru_cache

from ckplan.model import flops as flops_model
from ckplan.model import memory
from ckplan.model.ops import ATTENTION_CORE
from ckplan.model.spec import ModelSpec
from ckplan.schedules import Chain


@lru_cache(maxsize=64)  # a sweep asks for the same few chains hundreds of times
def layer_chain(spec: ModelSpec, selective: bool, first_stage: bool = True) -> Chain:
    """The chain one GPU runs for one micro-batch: embedding (first pipeline stage), its L/p
    layers, then output layer and loss (last stage). With `selective`, each layer's tape drops
    the attention core and its backward re-runs the core's forward (Korthikanti §5)."""
    per_layer = memory.activation_bytes_per_layer(spec)
    backward = flops_model.layer_backward_flops(spec)
    if selective:
        per_layer = memory.selective_activation_bytes_per_layer(spec, ATTENTION_CORE)
        backward += flops_model.group_forward_flops(spec, ATTENTION_CORE)
    stream = memory.layer_input_bytes(spec)
    n = spec.layers_per_stage
    forward, backwards = [flops_model.layer_forward_flops(spec)] * n, [backward] * n
    inputs, tapes = [stream] * n, [per_layer] * n
    has_embedding = spec.kind == "transformer" and spec.vocab > 0 and first_stage
    has_output = spec.kind == "transformer" and spec.vocab > 0 and (spec.pp == 1 or not first_stage)
    if has_embedding:
        forward, backwards = [0, *forward], [0, *backwards]
        inputs, tapes = (
            [memory.token_id_bytes(spec), *inputs],
            [memory.embedding_saved_bytes(spec), *tapes],
        )
    if has_output:
        logits = flops_model.logits_forward_flops(spec)
        forward, backwards = [*forward, logits], [*backwards, 2 * logits]
        inputs, tapes = [*inputs, stream], [*tapes, memory.output_saved_bytes(spec)]
    final_output = 0 if has_output else stream  # a scalar loss, or the activation sent onward
    # Transients beyond tape + δ_out + δ_in. Forward: exact for the seed's MLP as ckplan verify
    # runs it, not modelled for transformers (zeros). Backward: the seed MLP's exact workspace;
    # a transformer layer's gradients in flight (memory.layer_backward_walk; with selective, the
    # re-forwarded attention core too); the output stage's logits gradient in the activation
    # dtype (memory.output_backward_peak_bytes); nothing for the embedding.
    layer_workspace = memory.layer_backward_workspace_bytes(
        spec, ATTENTION_CORE if selective and spec.kind == "transformer" else None
    )
    backward_workspace = [layer_workspace] * n
    if has_embedding:
        backward_workspace = [0, *backward_workspace]
    if has_output:
        backward_workspace = [*backward_workspace, memory.output_backward_workspace_bytes(spec)]
    stages = len(forward)
    return Chain(
        forward_flops=tuple(forward),
        backward_flops=tuple(backwards),
        input_bytes=(*inputs, final_output),
        tape_bytes=tuple(tapes),
        forward_workspace_bytes=(memory.mlp_forward_workspace_bytes(spec),) * stages,
        backward_workspace_bytes=tuple(backward_workspace),
    )


def stage_names(spec: ModelSpec, first_stage: bool = True) -> list[str]:
    """Readable names of the chain's stages: embedding, layer 0.., output+loss."""
    offset = _layer_offset(spec, first_stage)
    first_layer = 0 if first_stage else spec.layers - spec.layers_per_stage
    names = ["embedding"] * offset
    names += [f"layer {first_layer + i}" for i in range(spec.layers_per_stage)]
    if spec.kind == "transformer" and spec.vocab > 0 and (spec.pp == 1 or not first_stage):
        names.append("output+loss")
    return names


def _layer_offset(spec: ModelSpec, first_stage: bool = True) -> int:
    """Index of the first transformer layer in the chain (after the embedding stage)."""
    return 1 if spec.kind == "transformer" and spec.vocab > 0 and first_stage else 0
