"""Megatron-LM command-line flags for a plan, and the flags read back into a strategy.

The rules, as Megatron-LM states them (megatron/training/arguments.py and
megatron/core/transformer/transformer_config.py, NVIDIA/Megatron-LM main):

- `--recompute-granularity` is `full` or `selective`; `--recompute-method` is `uniform` or
  `block` (argparse choices).
- `selective` takes no method: `validate_args` asserts "recompute method is not yet supported
  for selective recomputing granularity", and `TransformerConfig.__post_init__` requires
  `recompute_num_layers` to be None. It recomputes the core attention (QKᵀ, softmax, dropout,
  ·V), Korthikanti et al. 2022 §5; newer versions name the modules with `--recompute-modules`
  (default `core_attn`).
- `full` needs a method ("recompute_method must be block or uniform") and
  `--recompute-num-layers` ("must be between 1 and num_layers_per_pipeline_rank").
- `uniform` (TransformerBlock._checkpointed_forward): the layers of a model chunk are split into
  chunks of recompute-num-layers from the first, the last one shorter; each chunk's input is
  kept and the chunk re-run in backward; every layer is recomputed. `block`: the first
  recompute-num-layers layers of each model chunk are checkpointed one by one, the rest stored.
  A model chunk is a pipeline stage, or one of its virtual stages when interleaving.
- `--sequence-parallel` is switched off when tp = 1; `--context-parallel-size` > 1 needs
  seq-length a multiple of 2·cp; `--num-layers-per-virtual-pipeline-stage` must divide the layers
  per pipeline stage and needs pp > 1 (pp > 2 with `--no-overlap-p2p-communication`).
- `--use-distributed-optimizer` shards fp32 master weights and Adam states over data parallel,
  6 + 12/dp bytes per parameter (docs/source/distrib_optimizer.md): ckplan's `zero: 1`.
  The data-parallel size is world size / (tp·pp·cp): no flag.
"""

from __future__ import annotations

import shlex

from ckplan.exports.segments import LayerSegments
from ckplan.model.spec import ModelSpec
from ckplan.plan import Plan

NAME = "megatron"


def reason(spec: ModelSpec, layers: LayerSegments) -> str | None:
    """Why Megatron-LM cannot run these layer segments on this layout (None: it can)."""
    if spec.kind != "transformer":
        return f"Megatron-LM trains transformers, not model kind {spec.kind!r}"
    if spec.zero > 1:
        return (
            f"zero={spec.zero}: Megatron-LM's --use-distributed-optimizer shards optimizer "
            "states only (zero=1)"
        )
    if spec.cp > 1 and spec.seq % (2 * spec.cp):
        return f"seq {spec.seq}: Megatron-LM needs a multiple of 2·cp = {2 * spec.cp}"
    if spec.virtual_stages > 1 and spec.pp == 1:
        return "virtual pipeline stages: Megatron-LM interleaves only with pp > 1"
    if layers.moe == "experts":
        return (
            "recomputing only the routed expert MLPs: Megatron-LM's --recompute-modules has moe "
            "(the whole MoE layer) and moe_act (the activation), no experts-only module"
        )
    if layers.moe and layers.recomputed:
        return (
            "MoE recomputation together with whole layers: Megatron-LM's --recompute-modules "
            "need the selective granularity, which takes no --recompute-method"
        )
    if layers.stores_all:
        return None
    if layers.selective:
        if layers.recomputed:
            return (
                "selective recomputation together with whole layers: Megatron-LM's selective "
                "granularity takes no --recompute-method"
            )
        return None
    chunk = spec.layers_per_stage // spec.virtual_stages
    size = layers.uniform_size()
    if size is not None:
        if spec.virtual_stages > 1 and chunk % size:
            return (
                f"uniform segments of {size} layers: with {spec.virtual_stages} virtual stages "
                f"Megatron-LM segments each model chunk of {chunk} layers, so {size} must divide "
                f"{chunk}"
            )
        return None
    if layers.block_count() is not None:
        if spec.virtual_stages > 1:
            return (
                "block recomputation with virtual stages: Megatron-LM recomputes the first "
                "layers of each model chunk, ckplan's block the first layers of the stage"
            )
        return None
    if layers.recomputed and layers.segments[-1][2] is False:
        return (
            "the last segment stored: Megatron-LM's uniform method recomputes every segment "
            "and its block method single layers"
        )
    return (
        f"no Megatron-LM flag recomputes its layer segments {_describe(layers)}: the uniform "
        "method recomputes equal segments from the first layer, the block method the first "
        "layers one by one"
    )


def _describe(layers: LayerSegments) -> str:
    parts = [f"{start}-{end - 1}" for start, end in layers.recomputed]
    shown = ", ".join(parts[:4]) + (", ..." if len(parts) > 4 else "")
    return f"(recomputed: {shown})"


def flags(plan: Plan, layers: LayerSegments, recompute_modules: bool = True) -> list[list[str]]:
    """The flags, one `[flag, value...]` list per flag, in a fixed order."""
    spec = plan.spec
    out = [
        ["--num-layers", str(spec.layers)],
        ["--seq-length", str(spec.seq)],
        ["--micro-batch-size", str(spec.micro_batch)],
        ["--global-batch-size", str(spec.micro_batch * spec.microbatches * spec.dp)],
        ["--tensor-model-parallel-size", str(spec.tp)],
        ["--pipeline-model-parallel-size", str(spec.pp)],
        ["--context-parallel-size", str(spec.cp)],
    ]
    if spec.virtual_stages > 1:
        chunk = spec.layers_per_stage // spec.virtual_stages
        out.append(["--num-layers-per-virtual-pipeline-stage", str(chunk)])
    if spec.sp:
        out.append(["--sequence-parallel"])
    if spec.zero == 1:
        out.append(["--use-distributed-optimizer"])
    if layers.selective or layers.moe:
        modules = (["core_attn"] if layers.selective else []) + ([layers.moe] if layers.moe else [])
        out.append(["--recompute-granularity", "selective"])
        if recompute_modules:
            out.append(["--recompute-modules", *modules])
        elif layers.moe:  # older Megatron-LM: the MoE layer's own switch
            out.append(["--moe-layer-recompute"])
    elif not layers.stores_all:
        size = layers.uniform_size()
        method, count = ("uniform", size) if size is not None else ("block", layers.block_count())
        if spec.virtual_stages > 1 and method == "block":  # reason() refuses it; never reached
            raise AssertionError("block with virtual stages")
        out += [
            ["--recompute-granularity", "full"],
            ["--recompute-method", method],
            ["--recompute-num-layers", str(count)],
        ]
    return out


def render(plan: Plan, layers: LayerSegments, recompute_modules: bool = True) -> str:
    """One flag per line (`$(ckplan export ...)` splits them into words)."""
    return "\n".join(shlex.join(flag) for flag in flags(plan, layers, recompute_modules)) + "\n"


def notes(plan: Plan, layers: LayerSegments) -> list[str]:
    spec = plan.spec
    gpus = spec.tp * spec.pp * spec.cp * spec.dp
    lines = [
        f"launch on {gpus} GPU{'s' if gpus > 1 else ''}: data-parallel size {spec.dp} = "
        "world size / (tp·pp·cp)",
    ]
    if layers.stores_all and not layers.selective and not layers.moe:
        lines.append("no recompute flags: the plan stores every activation")
    return lines


# ---- flags read back ------------------------------------------------------------------------


def parse_flags(text: str) -> dict[str, list[str]]:
    """`--flag value...` words into {flag: [values]} (a bare switch maps to [])."""
    parsed: dict[str, list[str]] = {}
    current = None
    for word in shlex.split(text):
        if word.startswith("--"):
            current = word
            parsed[current] = []
        elif current is None:
            raise ValueError(f"value {word!r} before any flag")
        else:
            parsed[current].append(word)
    return parsed


def strategy_from_flags(parsed: dict[str, list[str]]) -> str:
    """The ckplan strategy that Megatron-LM flags select (per pipeline stage, no interleaving
    shift): none, selective, moe, selective+moe, uniform:K or block:N."""
    granularity = parsed.get("--recompute-granularity", [None])[0]
    if granularity is None:
        return "moe" if "--moe-layer-recompute" in parsed else "none"
    if granularity == "selective":
        modules = parsed.get("--recompute-modules", ["core_attn"])
        moe = "moe" in modules or "--moe-layer-recompute" in parsed
        names = (["selective"] if "core_attn" in modules else []) + (["moe"] if moe else [])
        return "+".join(names) or "none"
    method = parsed["--recompute-method"][0]
    count = int(parsed["--recompute-num-layers"][0])
    return f"{method}:{count}"
