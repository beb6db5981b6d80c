"""Megatron-Core's custom pipeline layout (`--pipeline-model-parallel-layout`), parsed and checked
as Megatron-Core parses and checks it.

Source: NVIDIA/Megatron-LM, megatron/core/transformer/pipeline_parallel_layer_layout.py. The
class first ships in core_v0.13.0 (without MTP layers: `validate_layer_layout` raised
NotImplementedError on `m`); core_v0.14.0 admits MTP layers; the rules followed here are those of
core_v0.16.0, unchanged through core_v0.19.0 (`parse_str_to_list`, `__init__`,
`validate_layer_layout`), with the conflicts `TransformerConfig.__post_init__`
(megatron/core/transformer/transformer_config.py) and `validate_args`
(megatron/training/arguments.py) check at core_v0.19.0.

A layout names, virtual chunk by virtual chunk, what each holds: `E` the embedding, `t` a decoder
(transformer) layer, `m` a multi-token-prediction layer, `L` the loss (with the output layer);
chunks are separated by `|`, `(...)*N` and `x*N` repeat, commas are cosmetic. Chunk i of the
flat list sits on pipeline rank i mod p as its virtual chunk i div p (Megatron's 1D-to-2D
conversion), so pipeline rank k holds chunks k, k + p, k + 2p, ... - the interleaved
schedule's chunk-to-rank order (Narayanan et al. 2021 §2.2).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

KEY = "pipeline_layout"
EMBEDDING, DECODER, MTP, LOSS = "E", "t", "m", "L"
LAYER_CHARS = (EMBEDDING, LOSS, DECODER, MTP)  # Megatron's char2layer_type, in its order
# Megatron's two unrolling patterns, applied in this order (parse_str_to_list).
REPEAT_PATTERNS = (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)")
# The most characters an expanded layout may reach: a layer count at the top of its range
# (100,000) with its separators fits; a `(t)*10**9` does not build a billion-character string.
MAX_EXPANDED = 400_000


class LayoutError(ValueError):
    """A layout Megatron-Core refuses (or ckplan cannot plan); the message is one line."""


@dataclass(frozen=True)
class PipelineLayout:
    """A parsed layout: `chunks[k][c]`, the items (E, t, m, L) of virtual chunk c of pipeline
    rank k; `flat`, the chunks in layer-id order (chunk i = c·p + k)."""

    chunks: tuple[tuple[str, ...], ...]

    @property
    def pp(self) -> int:
        return len(self.chunks)

    @property
    def virtual_stages(self) -> int:
        return len(self.chunks[0])

    @property
    def flat(self) -> tuple[str, ...]:
        return tuple(self.chunks[k][c] for c in range(self.virtual_stages) for k in range(self.pp))

    def count(self, item: str) -> int:
        return sum(chunk.count(item) for chunk in self.flat)

    def chunk_layers(self, stage: int) -> tuple[int, ...]:
        """The layers each virtual chunk of rank `stage` runs: its decoder and MTP layers."""
        return tuple(chunk.count(DECODER) + chunk.count(MTP) for chunk in self.chunks[stage])

    def chunk_counts(self, stage: int, item: str = DECODER) -> tuple[int, ...]:
        """How many `item`s each virtual chunk of pipeline rank `stage` holds (Megatron's
        get_num_layers_to_build)."""
        return tuple(chunk.count(item) for chunk in self.chunks[stage])

    def chunk_offset(self, stage: int, chunk: int, item: str = DECODER) -> int:
        """The id of the first `item` of (stage, chunk): the count in every chunk before it in
        flat order (Megatron's get_layer_offset)."""
        before = chunk * self.pp + stage
        return sum(flat.count(item) for flat in self.flat[:before])

    def stage_items(self, stage: int, item: str = DECODER) -> tuple[int, ...]:
        """The ids of the `item`s rank `stage` holds, chunk by chunk (get_layer_id_list)."""
        ids: list[int] = []
        for chunk, count in enumerate(self.chunk_counts(stage, item)):
            start = self.chunk_offset(stage, chunk, item)
            ids.extend(range(start, start + count))
        return tuple(ids)


def _unroll(text: str) -> str:
    """Megatron's unrolling (parse_str_to_list): commas dropped, then `(...)*N` and then `x*N`
    replaced by N copies, each pattern once over the string, left to right. A repetition that
    would pass MAX_EXPANDED characters is refused before it is built."""
    text = text.replace(",", "")
    for pattern in REPEAT_PATTERNS:
        pieces, end, size = [], 0, 0
        for match in re.finditer(pattern, text):
            times = int(match.group(2))
            size += match.start() - end
            if times and len(match.group(1)) * times > MAX_EXPANDED - size:
                raise LayoutError(f"expands to more than {MAX_EXPANDED:,} characters")
            size += len(match.group(1)) * times
            pieces += [text[end : match.start()], match.group(1) * times]
            end = match.end()
        text = "".join(pieces) + text[end:]
        if len(text) > MAX_EXPANDED:
            raise LayoutError(f"expands to more than {MAX_EXPANDED:,} characters")
    return text


def parse_layout_list(text: str) -> tuple[str, ...]:
    """The flat list of chunks of a layout string, each its item characters (Megatron's
    parse_str_to_list): 'Ettt|(tt|)*29,m|L' gives ('Ettt', 'tt' x 29, 'm', 'L')."""
    chunks = tuple(_unroll(text).split("|"))
    for chunk in chunks:
        for char in chunk:
            if char not in LAYER_CHARS:
                raise LayoutError(
                    f"invalid layer character {char!r} in chunk {chunk!r}; known layer "
                    f"characters: {', '.join(LAYER_CHARS)}"
                )
    return chunks


@lru_cache(maxsize=256)
def parse_layout(text: str, pp: int) -> PipelineLayout:
    """The layout on p pipeline ranks (PipelineParallelLayerLayout.__init__): the number of
    chunks must be a multiple of p; chunk i goes to rank i mod p as its chunk i div p."""
    flat = parse_layout_list(text)
    if len(flat) % pp:
        raise LayoutError(
            f"has {len(flat)} chunks, which pp ({pp}) must divide (one per pipeline rank and "
            "virtual stage)"
        )
    v = len(flat) // pp
    return PipelineLayout(tuple(tuple(flat[c * pp + k] for c in range(v)) for k in range(pp)))


def layout_errors(layout: PipelineLayout, layers: int, mtp_layers: int) -> str | None:
    """Megatron's validate_layer_layout (core_v0.16.0 = core_v0.19.0), then ckplan's own rule:
    the first item is the embedding, the last the loss, each exactly once; as many `t` as
    layers and `m` as MTP layers; no decoder layer after the first MTP layer; MTP layers only
    in a rank's last virtual chunk, all in one chunk. ckplan adds: every pipeline rank holds
    at least one decoder layer (its chain is a rank's decoder layers). None when valid."""
    items = "".join(layout.flat)
    if not items or items[0] != EMBEDDING:
        return f"must start with the embedding (E), got {items[:1] or 'nothing'!r}"
    if items[-1] != LOSS:
        return f"must end with the loss (L), got {items[-1]!r}"
    if items.count(EMBEDDING) != 1:
        return "must name the embedding (E) exactly once"
    if items.count(LOSS) != 1:
        return "must name the loss (L) exactly once"
    if items.count(DECODER) != layers:
        return f"places {items.count(DECODER)} decoder layers (t) but the model has {layers}"
    if items.count(MTP) != mtp_layers:
        return f"places {items.count(MTP)} MTP layers (m) but mtp_layers is {mtp_layers}"
    if MTP in items and DECODER in items[items.index(MTP) :]:
        return "must place every decoder layer (t) before the MTP layers (m)"
    for stage, chunks in enumerate(layout.chunks):
        if any(MTP in chunk for chunk in chunks[:-1]):
            return (
                f"places an MTP layer (m) on pipeline rank {stage} outside its last virtual "
                "chunk, which Megatron-Core does not allow"
            )
        if MTP in chunks[-1] and chunks[-1].count(MTP) != mtp_layers:
            return "must place all MTP layers (m) in one virtual chunk"
        if MTP in chunks[-1] and LOSS not in chunks[-1]:
            return (
                "must place the MTP layers (m) in the chunk of the loss (L), as Megatron-Core "
                "core_v0.15.0 requires (ckplan does not model core_v0.16.0's standalone MTP "
                "stage)"
            )
    for stage, chunks in enumerate(layout.chunks):
        if not any(DECODER in chunk for chunk in chunks):
            return f"leaves pipeline rank {stage} without a decoder layer (t)"
    return None
