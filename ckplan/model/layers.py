"""Mixed layers: which kind each layer of a model is, and which layers a pipeline stage holds.

A model is a list of layers; layers differ in two ways that change their op table:
  - the MLP: dense, or a mixture of experts (`moe_layers`, e.g. DeepSeek-V3's first 3 layers
    dense, Llama-4-style every other layer MoE);
  - the attention span: full, or a sliding window (`sliding_window_layers`, e.g. Gemma 2's
    alternating local and global layers).
Both keys are *layer sets*, parsed here:

    all | none | TERM[,TERM...]      TERM = N | A-B | A- , optionally :S (every S-th layer)

Layers are 0-based; `A-B` is inclusive; `A-` runs to the last layer; `:S` keeps every S-th
layer of the range starting at its first. So Megatron's `--moe-layer-freq 2` is `0-:2`, DeepSeek's
`first_k_dense_replace: 3` is `3-`, and Gemma 2's sliding layers (the even ones) are `0-:2`.
A YAML list of layer indices is accepted too.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import NamedTuple

from ckplan.model.parts import cached_by_chain
from ckplan.quoting import quote


class LayerSetError(ValueError):
    """A layer set that does not parse or names layers the model does not have."""


# ASCII digits only (\d would read '٣'), at most 18 of them (int() refuses 4,300)
_TERM = re.compile(r"([0-9]{1,18})(?:(-)([0-9]{0,18}))?(?::([0-9]{1,18}))?")


def parse_layer_set(text: str, layers: int) -> frozenset[int]:
    """The 0-based layer indices a layer-set string selects (grammar in the module docstring)."""
    body = text.strip().lower()
    if body == "all":
        return frozenset(range(layers))
    if body in ("none", ""):
        return frozenset()
    selected: set[int] = set()
    for term in body.split(","):
        match = _TERM.fullmatch(term.strip())
        if not match:
            raise LayerSetError(
                f"{quote(term.strip())} is not a layer range (expected N, A-B, A- or A-B:S, "
                "0-based, e.g. 3- or 0-:2)"
            )
        start = int(match.group(1))
        end = start
        if match.group(2):
            end = int(match.group(3)) if match.group(3) else layers - 1
        step = int(match.group(4)) if match.group(4) else 1
        if step < 1:
            raise LayerSetError(f"{quote(term.strip())}: the step must be at least 1")
        if end < start:
            raise LayerSetError(f"{quote(term.strip())}: the range ends before it starts")
        if end >= layers:
            raise LayerSetError(f"{quote(term.strip())}: the model has layers 0..{layers - 1}")
        selected.update(range(start, end + 1, step))
    return frozenset(selected)


def format_layer_set(indices: frozenset[int] | set[int], layers: int) -> str:
    """A compact layer-set string: `all`, `none`, or comma-separated ranges (`0-2,5,7-`)."""
    if len(indices) == layers:
        return "all"
    if not indices:
        return "none"
    ordered = sorted(indices)
    if len(ordered) > 2 and ordered[1] - ordered[0] >= 2:
        # a strided run to the end, such as Gemma 2's 0-:2 (its step is its first gap)
        start, step = ordered[0], ordered[1] - ordered[0]
        if list(range(start, layers, step)) == ordered:
            return f"{start}-:{step}"
    runs, first, last = [], ordered[0], ordered[0]
    for index in ordered[1:]:
        if index == last + 1:
            last = index
            continue
        runs.append((first, last))
        first = last = index
    runs.append((first, last))
    parts = []
    for first, last in runs:
        if first == last:
            parts.append(str(first))
        else:
            parts.append(f"{first}-" if last == layers - 1 else f"{first}-{last}")
    return ",".join(parts)


class LayerKind(NamedTuple):
    """What distinguishes one layer's op table from another's in the same model.

    A named tuple, so that hashing and comparing the kinds of a 100,000-layer model runs in C
    (a frozen dataclass's Python-level ``__eq__``/``__hash__`` cost seconds there); a model's
    layers share one instance per kind (:func:`layer_kinds`)."""

    moe: bool = False  # a mixture-of-experts MLP instead of the dense one
    window: int = 0  # sliding-window attention span in tokens; 0 = full attention

    @property
    def name(self) -> str:
        mlp = "moe" if self.moe else "dense"
        return mlp if not self.window else f"{mlp}, window {self.window}"


DENSE = LayerKind()


@cached_by_chain(maxsize=128)
def layer_kinds(spec) -> tuple[LayerKind, ...]:
    """The kind of every layer of `spec`, in order (one entry per layer)."""
    if spec.kind != "transformer":
        return (DENSE,) * spec.layers
    moe = parse_layer_set(spec.moe_layers, spec.layers) if spec.experts else frozenset()
    window = spec.sliding_window if spec.sliding_window and spec.sliding_window < spec.seq else 0
    windowed = parse_layer_set(spec.sliding_window_layers, spec.layers) if window else frozenset()
    # One instance per kind, picked per layer by a flag byte (1: MoE, 2: windowed).
    flags = bytearray(spec.layers)
    for i in moe:
        flags[i] |= 1
    for i in windowed:
        flags[i] |= 2
    table = [LayerKind(moe=bool(f & 1), window=window if f & 2 else 0) for f in range(4)]
    return tuple(map(table.__getitem__, flags))


@cached_by_chain(maxsize=128)
def distinct_kinds(spec) -> tuple[LayerKind, ...]:
    """The kinds present in the model, in order of first appearance."""
    return tuple(dict.fromkeys(layer_kinds(spec)))


@cached_by_chain(maxsize=128)
def kind_layer_indices(spec) -> dict[LayerKind, tuple[int, ...]]:
    """The layers of each kind, by kind in order of first appearance (computed once per spec)."""
    indices: dict[LayerKind, list[int]] = {kind: [] for kind in distinct_kinds(spec)}
    for i, kind in enumerate(layer_kinds(spec)):
        indices[kind].append(i)
    return {kind: tuple(found) for kind, found in indices.items()}


def is_uniform(spec) -> bool:
    return len(distinct_kinds(spec)) == 1


@cached_by_chain(maxsize=512)
def stage_layer_indices(spec, stage: int) -> tuple[int, ...]:
    """The layers pipeline stage `stage` (0-based) holds, in the order it runs them.

    Megatron-LM's layout: p stages of L/p consecutive layers; with v virtual stages (interleaved
    1F1B), model chunk c of L/(p·v) layers sits on stage c mod p, so stage k holds chunks
    k, k + p, k + 2p, ... (Narayanan et al. 2021, §2.2). Uneven stages (first_stage_layers,
    last_stage_layers) hold consecutive layers. With the embedding and/or loss counted in the
    split (Megatron's get_num_layers_to_build and get_transformer_layer_offset), the chunks cut
    the sequence [embedding, layer 0 .. layer L-1, loss]: the first chunk of the first stage
    holds one layer fewer, the last chunk of the last stage too. A pipeline_layout places each
    chunk's layers itself (Megatron-Core's PipelineParallelLayerLayout.get_layer_id_list).
    """
    if spec.parsed_layout is not None:
        return spec.parsed_layout.stage_items(stage)
    counts = spec.stage_layer_counts
    if spec.first_stage_layers is not None or spec.last_stage_layers is not None:
        start = sum(counts[:stage])
        return tuple(range(start, start + counts[stage]))
    embedding, loss = spec.pipeline_split_extras
    items = spec.layers + embedding + loss
    chunk = items // (spec.pp * spec.virtual_stages)
    chunks = range(stage, spec.pp * spec.virtual_stages, spec.pp)
    return tuple(
        item - embedding
        for c in chunks
        for item in range(c * chunk, (c + 1) * chunk)
        if embedding <= item < spec.layers + embedding
    )


def stage_chunk_layers(spec, stage: int) -> tuple[int, ...]:
    """The layers each virtual chunk of pipeline stage `stage` holds, in chunk order: the
    pipeline_layout's decoder and MTP layers per chunk (Megatron-Core's
    get_num_layers_to_build), else the stage's layers in v equal chunks (the even split)."""
    if spec.parsed_layout is not None:
        return spec.parsed_layout.chunk_layers(stage)
    v = spec.virtual_stages
    return (len(stage_layer_indices(spec, stage)) // v,) * v


@cached_by_chain(maxsize=512)
def stage_kinds(spec, stage: int) -> tuple[LayerKind, ...]:
    kinds = layer_kinds(spec)
    return tuple(kinds[i] for i in stage_layer_indices(spec, stage))


@cached_by_chain(maxsize=512)
def stage_kind_counts(spec, stage: int) -> Counter:
    """How many layers of each kind pipeline stage `stage` holds (kinds in order of first
    appearance). Callers must not modify it (it is cached)."""
    return Counter(stage_kinds(spec, stage))
