"""The chain one GPU runs for one micro-batch, built from a model's op tables: embedding ->
its layers -> output layer and loss, each stage with its FLOPs, input, tape and workspaces.
Layers of different kinds (dense and MoE, full and sliding-window attention) each bring their
own op table (`ckplan.model.layers`)."""

from __future__ import annotations

import dataclasses
from functools import lru_cache

from ckplan.cache import BoundedCache
from ckplan.model import finetune, frameworks, loss, memory, mtp
from ckplan.model import flops as flops_model
from ckplan.model.layers import LayerKind, stage_kinds, stage_layer_indices
from ckplan.model.op import ATTENTION_CORE
from ckplan.model.spec import ModelSpec
from ckplan.schedules import Chain
from ckplan.simple import mlp as numpy_mlp


def recompute_groups(selective: bool | tuple[str, ...]) -> tuple[str, ...]:
    """`True` is the attention core (Korthikanti §5); a tuple names the groups itself
    (`Strategy.groups`)."""
    if isinstance(selective, bool):
        return (ATTENTION_CORE,) if selective else ()
    return tuple(selective)


@lru_cache(maxsize=512)
def layer_stage_costs(
    spec: ModelSpec, kind: LayerKind, groups: tuple[str, ...]
) -> tuple[int, int, int, int]:
    """(forward FLOPs, backward FLOPs, tape bytes, backward workspace bytes) of one layer of
    `kind` as a chain stage, with `groups` recomputed inside it: the tape drops the groups'
    saved tensors and keeps their inputs, the backward re-runs their forward."""
    forward = flops_model.layer_forward_flops(spec, kind)
    backward = flops_model.layer_backward_flops(spec, kind)
    if groups:
        tape = memory.selective_activation_bytes_per_layer(spec, groups, kind)
        backward += flops_model.group_forward_flops(spec, groups, kind)
    else:
        tape = memory.activation_bytes_per_layer(spec, kind)
    recomputed = groups if groups and spec.kind == "transformer" else None
    workspace = memory.layer_backward_workspace_bytes(spec, recomputed, kind)
    return forward, backward, tape, workspace


@lru_cache(maxsize=512)
def mtp_stage_costs(spec: ModelSpec, groups: tuple[str, ...]) -> tuple[int, int, int, int]:
    """(forward FLOPs, backward FLOPs, tape bytes, backward workspace bytes) of one MTP depth
    as a chain stage (ckplan.model.mtp): its transformer block as a layer of the decoder's last
    kind with `groups` recomputed inside it, plus eh_proj's GEMMs and the embedding lookup,
    norms and projection input it keeps (`mtp.projection_saved_bytes`). Its re-run under full
    recomputation is the whole depth, as Megatron checkpoints it (`_checkpointed_forward`)."""
    forward, backward, tape, workspace = layer_stage_costs(spec, mtp.mtp_kind(spec), groups)
    saved = mtp.projection_saved_bytes(memory.layer_input_bytes(spec), memory.token_id_bytes(spec))
    return (
        forward + mtp.projection_forward_flops(spec),
        backward + mtp.projection_backward_flops(spec),
        tape + saved,
        workspace,
    )


def stage_index(spec: ModelSpec, first_stage: bool = True, stage: int | None = None) -> int:
    """The pipeline stage a chain is for: `stage`, else the first or the last."""
    if stage is not None:
        return stage
    return 0 if first_stage else spec.pp - 1


def layer_chain(
    spec: ModelSpec,
    selective: bool | tuple[str, ...],
    first_stage: bool = True,
    stage: int | None = None,
) -> Chain:
    """The chain one GPU runs for one micro-batch: embedding (first pipeline stage), the layers
    its stage holds, then output layer and loss (last stage). With `selective`, each layer's
    tape drops the attention core (or the named recompute groups) and its backward re-runs the
    core's forward (Korthikanti §5)."""
    stage = stage_index(spec, first_stage, stage)
    chain = _layer_chain(spec.chain, recompute_groups(selective), stage)
    if isinstance(spec, ModelSpec) and frameworks.fsdp2_resharding(spec):
        return _with_fsdp2_buffers(spec, chain, stage)
    if isinstance(spec, ModelSpec) and frameworks.fsdp2_frozen_resharding(spec):
        return _with_fsdp2_frozen_buffers(spec, chain)
    if isinstance(spec, ModelSpec) and frameworks.fsdp1_resharding(spec):
        return _with_fsdp1_buffers(spec, chain)
    return chain


def _with_unit_buffers(
    cache: BoundedCache, key: tuple, spec: ModelSpec, chain: Chain, add, first_stage: bool = True
) -> Chain:
    """`chain` with an FSDP's per-unit buffers added to its stages' workspaces by
    `add(forward, backward, first, last)`, which changes the two lists in place (`first` and
    `last` the indices of the chain's first and last layer; the embedding stage comes before
    them on the `first_stage`), remembered in `cache` by `key` (the chain's identity first)
    while that chain lives."""
    entry = cache.get(key)
    if entry is not None and entry[0] is chain:
        return entry[1]
    first = layer_offset(spec, first_stage)
    last = chain.length - 1 - (1 if spec.kind == "transformer" and spec.vocab > 0 else 0)
    forward = list(chain.forward_workspace_bytes)
    backward = list(chain.backward_workspace_bytes)
    add(forward, backward, first, last)
    with_buffers = dataclasses.replace(
        chain, forward_workspace_bytes=tuple(forward), backward_workspace_bytes=tuple(backward)
    )
    cache.put(key, (chain, with_buffers), chain.length)
    return with_buffers


_FSDP1_CHAINS = BoundedCache(max_entries=4096, max_weight=1_000_000)


def _with_fsdp1_buffers(spec: ModelSpec, chain: Chain) -> Chain:
    """`chain` with FSDP1's per-layer buffers in its layers' workspaces
    (`frameworks.fsdp1_layer_forward_bytes`, `frameworks.fsdp1_layer_backward_bytes`, with
    `fsdp_backward_prefetch` backward_pre the layer before's copy: `fsdp1_prefetched_layers`;
    beside frozen weights `fsdp1_frozen_layer_backward_bytes`) and the
    root unit's gradient in the embedding stage's backward
    (`frameworks.fsdp1_embedding_backward_bytes`): they live only while a unit runs, so the
    loss's peak does not hold them; under an fp32 reduction of half-precision gradients
    (`frameworks.fsdp1_cast_reduce`) each unit's post-backward holds its gradient and the fp32
    copy (`frameworks.fsdp1_cast_reduce_bytes`) where that is more. Remembered by chain
    (identity) and the sizes."""
    layer = memory.largest_layer_parameters(spec, 0)
    output = memory.output_layer_parameters(spec)
    embedding = memory.embedding_parameters(spec, 0)
    root = memory.outside_layer_parameters(spec, 0)
    frozen = spec.training != "full"
    prefetched = frameworks.fsdp1_prefetched_layers(spec)
    cast = frameworks.fsdp1_cast_reduce(spec) and not frozen
    if frozen:  # the gathered frozen layer (4-bit packed) and its adapters; no gradient
        gathered = finetune.gathered_layer_bytes(spec, frameworks.HALF)[0]
        adapters = finetune.largest_layer_lora_parameters(spec)
        layer_forward = gathered
        layer_backward = frameworks.fsdp1_frozen_layer_backward_bytes(gathered, adapters)
    else:
        gathered = frameworks.fsdp1_layer_forward_bytes(layer)
        layer_forward = gathered
        layer_backward = frameworks.fsdp1_layer_backward_bytes(layer, output)
        if cast:  # its post-backward: the copy freed, the gradient and its fp32 cast, beside
            # the waiting output layer's gradient
            post = frameworks.fsdp1_cast_reduce_bytes(layer) + frameworks.HALF * output
            layer_backward = max(layer_backward, post)

    def add(forward: list[int], backward: list[int], first: int, last: int) -> None:
        for i in range(first, last + 1):
            forward[i] += layer_forward
            backward[i] += layer_backward
            if i > first:  # the layer before, prefetched (the first layer's next unit: the root)
                backward[i] += prefetched * gathered
        if first and not frozen:  # the embedding stage: the root's flat gradient forms in its
            # backward
            root_backward = frameworks.fsdp1_embedding_backward_bytes(root, embedding, output)
            if cast:  # and the root's post-backward casts it
                root_backward = max(root_backward, frameworks.fsdp1_cast_reduce_bytes(root))
            backward[0] += root_backward

    key = (id(chain), layer, output, embedding, root, frozen, prefetched, cast)
    return _with_unit_buffers(_FSDP1_CHAINS, key, spec, chain, add)


_FSDP2_CHAINS = BoundedCache(max_entries=4096, max_weight=1_000_000)


def _with_fsdp2_buffers(spec: ModelSpec, chain: Chain, stage: int) -> Chain:
    """`chain` with FSDP2's per-block buffers in its layers' workspaces, by torchtitan release
    (`frameworks.fsdp2_grouping`, `frameworks.fsdp2_layer_forward_bytes`,
    `frameworks.fsdp2_layer_backward_bytes`), and with torchtitan 0.3's resharded embedding in
    the embedding stage's (`frameworks.fsdp2_embedding_backward_bytes`): they live only while a
    unit runs, so the loss's peak does not hold them; under the float8 all-gather the blocks'
    converted weights 1 byte each (`memory.float8_gathered_layer_weights`). Remembered by
    chain (identity: the replays are cached by it), the sizes and the grouping."""
    layer = memory.largest_layer_parameters(spec, stage)
    output = memory.output_layer_parameters(spec)
    embedding = memory.embedding_parameters(spec, stage)
    grouping = frameworks.spec_fsdp2_grouping(spec)
    float8 = memory.float8_gathered_layer_weights(spec)
    reduce = frameworks.fsdp2_reduce_bytes(spec)

    def add(forward: list[int], backward: list[int], first: int, last: int) -> None:
        for i in range(first, last + 1):
            kept = grouping.last_block_kept and i == last
            forward[i] += frameworks.fsdp2_layer_forward_bytes(layer, kept=kept, float8=float8)
            backward[i] += frameworks.fsdp2_layer_backward_bytes(
                layer,
                output,
                first=i == first,
                last=i == last,
                grouping=grouping,
                embedding_params=embedding,
                float8=float8,
                reduce_bytes=reduce,
            )
        if first and grouping.embedding_own_unit:  # the embedding stage, a unit of its own
            forward[0] += frameworks.fsdp2_layer_forward_bytes(embedding)
            backward[0] += frameworks.fsdp2_embedding_backward_bytes(embedding, layer, reduce)

    key = (id(chain), layer, output, embedding, grouping, float8, reduce, stage == 0)
    return _with_unit_buffers(_FSDP2_CHAINS, key, spec, chain, add, first_stage=stage == 0)


def _with_fsdp2_frozen_buffers(spec: ModelSpec, chain: Chain) -> Chain:
    """`chain` with accelerate's FSDP2 buffers beside frozen base weights
    (`frameworks.fsdp2_frozen_resharding`) in its layers' workspaces: in forward each layer's
    gathered weights, its unsharded copy and the all-gather output it came from
    (`frameworks.fsdp2_layer_forward_bytes`, as gathered: 4-bit weights packed); in backward
    `frameworks.fsdp2_frozen_layer_backward_bytes`, the unit before prefetched (before the
    first layer the embedding's own unit, which runs no backward: it is frozen, its input the
    token ids). Remembered by chain (identity) and the sizes."""
    gathered = finetune.gathered_layer_bytes(spec, frameworks.HALF)[0]
    adapters = finetune.largest_layer_lora_parameters(spec)
    embedding = memory.embedding_parameters(spec, 0)
    own = frameworks.spec_fsdp2_grouping(spec).embedding_own_unit
    reduce = frameworks.fsdp2_reduce_bytes(spec)

    def add(forward: list[int], backward: list[int], first: int, last: int) -> None:
        for i in range(first, last + 1):
            forward[i] += 2 * gathered  # the copy and the all-gather output
            before = gathered if i > first else (frameworks.HALF * embedding if own else 0)
            backward[i] += frameworks.fsdp2_frozen_layer_backward_bytes(
                gathered, adapters, before, reduce
            )
        if first and own:
            forward[0] += frameworks.fsdp2_layer_forward_bytes(embedding)

    key = (id(chain), "frozen", gathered, adapters, embedding, own, reduce)
    return _with_unit_buffers(_FSDP2_CHAINS, key, spec, chain, add)


_CHAINS = BoundedCache(max_entries=4096, max_weight=1_000_000)  # weighed in chain stages


def _layer_chain(spec: ModelSpec, groups: tuple[str, ...], stage: int) -> Chain:
    """`layer_chain`, cached: a sweep evaluates hundreds of strategies on the same chains, and
    `ckplan plan` thousands of layouts on a few thousand chains. The least recently used chain
    goes beyond 4,096 chains or a million chain stages in all (deep models hold fewer)."""
    key = (spec, groups, stage)
    chain = _CHAINS.get(key)
    if chain is None:
        chain = _build_layer_chain(spec, groups, stage)
        _CHAINS.put(key, chain, chain.length)
    return chain


def _build_layer_chain(spec: ModelSpec, groups: tuple[str, ...], stage: int) -> Chain:
    kinds = stage_kinds(spec, stage)
    per_kind = {kind: layer_stage_costs(spec, kind, groups) for kind in set(kinds)}
    costs = [per_kind[kind] for kind in kinds]
    forward = [cost[0] for cost in costs]
    backwards = [cost[1] for cost in costs]
    tapes = [cost[2] for cost in costs]
    backward_workspace = [cost[3] for cost in costs]
    stream = memory.layer_input_bytes(spec)
    inputs = [stream] * len(costs)
    has_embedding = spec.kind == "transformer" and spec.vocab > 0 and stage == 0
    has_output = spec.kind == "transformer" and spec.vocab > 0 and stage == spec.pp - 1
    if has_embedding:
        forward, backwards = [0, *forward], [0, *backwards]
        inputs, tapes = (
            [memory.token_id_bytes(spec), *inputs],
            [memory.embedding_saved_bytes(spec), *tapes],
        )
    depths = spec.mtp_layers if has_output else 0
    for depth in range(depths):  # each carries the main and earlier depths' hidden states on
        mtp_forward, mtp_backward, mtp_tape, mtp_workspace = mtp_stage_costs(spec, groups)
        forward, backwards = [*forward, mtp_forward], [*backwards, mtp_backward]
        inputs, tapes = [*inputs, (1 + depth) * stream], [*tapes, mtp_tape]
        backward_workspace = [*backward_workspace, mtp_workspace]
    if has_output:
        # the main head and each MTP depth's: the shared output layer and a loss apiece
        heads = 1 + depths
        logits = flops_model.logits_forward_flops(spec)
        # a frozen output layer (docs/fine-tuning.md): no weight-gradient GEMM
        output_backward = 2 * logits if spec.training == "full" else logits
        forward, backwards = [*forward, heads * logits], [*backwards, heads * output_backward]
        inputs = [*inputs, heads * stream]
        tapes = [*tapes, heads * loss.output_saved_bytes(spec)]
    final_output = 0 if has_output else stream  # a scalar loss, or the activation sent onward
    # Transients beyond tape + δ_out + δ_in. Forward: exact for the NumPy MLP as ckplan verify
    # runs it, not modelled for transformers (zeros). Backward: the NumPy MLP's exact workspace;
    # a transformer layer's gradients in flight (memory.layer_backward_walk; with selective, the
    # re-forwarded groups too); the output stage's logits gradient in the activation dtype
    # (loss.output_backward_peak_bytes); nothing for the embedding.
    if has_embedding:
        backward_workspace = [0, *backward_workspace]
    if has_output:  # the heads' losses run one after another: one head's transients at a time
        backward_workspace = [*backward_workspace, loss.output_backward_workspace_bytes(spec)]
    stages = len(forward)
    # Forward transients: the NumPy MLP's exact workspace; a transformer's output stage holds
    # its loss's (loss.output_forward_workspace_bytes); its layers none beyond their tapes.
    forward_workspace = [
        numpy_mlp.forward_workspace_bytes(spec) if spec.kind == "mlp" else 0
    ] * stages
    if has_output:
        forward_workspace[-1] = loss.output_forward_workspace_bytes(spec)
    return Chain(
        forward_flops=tuple(forward),
        backward_flops=tuple(backwards),
        input_bytes=(*inputs, final_output),
        tape_bytes=tuple(tapes),
        forward_workspace_bytes=forward_workspace,
        backward_workspace_bytes=tuple(backward_workspace),
    )


def stage_names(spec: ModelSpec, first_stage: bool = True, stage: int | None = None) -> list[str]:
    """Readable names of the chain's stages: embedding, layer 0.., output+loss."""
    stage = stage_index(spec, first_stage, stage)
    names = ["embedding"] * layer_offset(spec, stage == 0)
    names += [f"layer {index}" for index in stage_layer_indices(spec, stage)]
    if spec.kind == "transformer" and spec.vocab > 0 and stage == spec.pp - 1:
        names += [f"mtp {depth}" for depth in range(spec.mtp_layers)]
        names.append("output+loss")
    return names


def layer_offset(spec: ModelSpec, first_stage: bool = True) -> int:
    """Index of the first transformer layer in the chain (after the embedding stage)."""
    return 1 if spec.kind == "transformer" and spec.vocab > 0 and first_stage else 0
