"""A PyTorch snippet that runs one pipeline stage's layers under the plan.

`torch.utils.checkpoint` (PyTorch 2.x, torch/utils/checkpoint.py):

- `checkpoint(fn, *args, use_reentrant=False, context_fn=...)` keeps fn's inputs and re-runs fn
  in backward: one recomputed segment.
- `checkpoint_sequential(functions, segments, input, use_reentrant=False)` splits the functions
  into `segments` chunks of len // segments, checkpoints all but the last chunk and runs the last
  one normally ("the last chunk has to be non-volatile"): ckplan's `sequential:K` when K divides
  the layers.
- Selective recomputation (Korthikanti et al. 2022 §5, Megatron-LM's `core_attn`) checkpoints
  the attention core alone, as Megatron does (`_checkpointed_attention_forward`): the core's
  inputs q, k, v are kept and QKᵀ, softmax, dropout and ·V are re-run in backward. The snippet's
  `attention_core(core, q, k, v, *rest)` is that call; the model's attention calls its core
  through it. Selective activation checkpointing (`create_selective_checkpoint_contexts`) is
  not used: measured on torch 2.13 (tests/test_export_torch.py), a layer-level policy that
  recomputes the core and saves every other op caches op outputs that autograd never saves,
  and its caches stay alive under an enclosing segment checkpoint, so neither `selective` nor
  `selective+uniform:K` would hold what ckplan predicts.

Offloading (`offload`, `offload+optimal`, `full+offload`, `block:N+offload`;
ckplan.schedules.offload): the layers whose tapes go to host run under
`torch.autograd.graph.save_on_cpu(pin_memory=True)` (PyTorch 2.x, torch/autograd/graph.py),
which packs every tensor autograd saves inside it into pinned host memory and copies it back
when the backward unpacks it. A recomputed segment whose input goes to host runs its
non-reentrant `checkpoint` under `save_on_cpu`: the checkpoint saves its inputs with
`save_for_backward` (`_NoopSaveInputs`, torch/utils/checkpoint.py), so they are packed to host,
while the tensors saved inside the segment go to the checkpoint's own hooks (innermost), which
drop them for the recomputation. Its copies run on the current stream,
not beside the compute, so its step is slower than ckplan's overlapped estimate by up to the
copies' exposed share; its device memory is at most ckplan's (a tape leaves the GPU as it is
saved, not after the next layer).

The snippet defines `forward_layers(layers, hidden)`, which replaces `for layer in layers:
hidden = layer(hidden)` in the model's forward; `layers` holds this stage's transformer blocks.
Nested checkpoints (the attention core inside a recomputed segment) are supported by the
non-reentrant implementation.
"""

from __future__ import annotations

import textwrap

from ckplan.exports.segments import LayerSegments, module_reason
from ckplan.model.op_policy import (
    OP_RECOGNISED,
    counts_matmuls,
    kept_mask,
    kept_units,
    parse_policy,
    region_spans,
    scope_wrap_reason,
    unit_ops,
)
from ckplan.model.spec import ModelSpec
from ckplan.plan import Plan
from ckplan.plan.export_limits import elementwise_ops

NAME = "torch"

_SELECTIVE = '''\
def attention_core(core, q, k, v, *rest):
    """Selective recomputation: the model's attention calls its core (QKᵀ, softmax, dropout,
    ·V) as attention_core(core, q, k, v, ...): q, k, v are kept, the core re-runs in backward."""
    return checkpoint(core, q, k, v, *rest, use_reentrant=False)
'''

_SEQUENTIAL = """\
def forward_layers(layers, hidden):
    # {chunks} chunks of {size} layers; all but the last are re-run in backward.
    return checkpoint_sequential(
        list(layers), {chunks}, hidden, use_reentrant=False
    )
"""

_SEGMENTS = """\
# (first, last + 1, recompute): a recomputed segment keeps its input and is re-run in backward;
# a stored one keeps every activation.
SEGMENTS = {segments}


def _run(layers, start, end):
    def forward(hidden):
        for layer in layers[start:end]:
            hidden = layer(hidden)
        return hidden

    return forward


def forward_layers(layers, hidden):
    for start, end, recompute in SEGMENTS:
        if recompute:
            hidden = checkpoint(_run(layers, start, end), hidden, use_reentrant=False)
        else:
            hidden = _run(layers, start, end)(hidden)
    return hidden
"""


_OFFLOAD = """\
# (first, last + 1, recompute): a recomputed segment keeps its input and is re-run in backward;
# a stored one keeps every activation. OFFLOADED: the layers whose saved tensors go to host, a
# stored layer's whole tape, a recomputed segment's kept input (its first layer listed).
SEGMENTS = {segments}
OFFLOADED = frozenset({offloaded})


def _layer(layers, index, offload):
    def forward(hidden):
        if offload and index in OFFLOADED:
            with save_on_cpu(pin_memory=True):
                return layers[index](hidden)
        return layers[index](hidden)

    return forward


def _run(layers, start, end, offload):
    def forward(hidden):
        for index in range(start, end):
            hidden = _layer(layers, index, offload)(hidden)
        return hidden

    return forward


def forward_layers(layers, hidden):
    for start, end, recompute in SEGMENTS:
        if recompute and start in OFFLOADED:
            # the checkpoint saves its input under save_on_cpu: the input waits on host
            with save_on_cpu(pin_memory=True):
                hidden = checkpoint(_run(layers, start, end, False), hidden, use_reentrant=False)
        elif recompute:
            hidden = checkpoint(_run(layers, start, end, False), hidden, use_reentrant=False)
        else:
            hidden = _run(layers, start, end, True)(hidden)
    return hidden
"""


# Units a policy_fn can recognise by their aten op: matmuls and grouped GEMMs by their count,
# the attention kernels and collectives by name.
_RECOGNISED = OP_RECOGNISED
# The policy_fn both per-op snippets run (a format argument: single braces): the attention
# kernels, the collectives and grouped GEMMs matched by sets holding only the ops this PyTorch
# build has; matmuls, grouped GEMMs, all-to-alls and element-wise ops counted from 1 in each
# checkpoint's forward and, apart, in its re-forward.
_POLICY_FN = """\
def _ops(namespace, *names):
    return {getattr(namespace, name).default for name in names if hasattr(namespace, name)}


ATTENTION_OPS = _ops(
    torch.ops.aten,
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
)
REDUCE_SCATTER_OPS = _ops(torch.ops._c10d_functional, "reduce_scatter_tensor")
ALL_TO_ALL_OPS = _ops(torch.ops._c10d_functional, "all_to_all_single")
GROUPED_MM_OPS = _ops(torch.ops.aten, "_grouped_mm")
ELEMENTWISE_OPS = {
    torch.ops.aten.mul.Tensor: "mul",
    torch.ops.aten.add.Tensor: "add",
    torch.ops.aten.silu.default: "silu",
}


def _policy(counts, keep):
    \"\"\"A policy_fn keeping the outputs `keep` names: (matmul numbers, grouped GEMM numbers,
    attention kept, reduce-scatter kept, all-to-all numbers, element-wise (aten op, number)).\"\"\"
    matmuls, grouped, attention, scatter, all_to_all, elementwise = keep

    def policy_fn(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if func == torch.ops.aten.mm.default:
            counts[mode] += 1
            kept = counts[mode] in matmuls
        elif func in GROUPED_MM_OPS:
            counts[mode + " grouped"] += 1
            kept = counts[mode + " grouped"] in grouped
        elif func in ATTENTION_OPS:
            kept = attention
        elif func in REDUCE_SCATTER_OPS:
            kept = scatter
        elif func in ALL_TO_ALL_OPS:
            # the expert-parallel dispatch, then the combine
            counts[mode + " all_to_all"] += 1
            kept = counts[mode + " all_to_all"] in all_to_all
        elif func in ELEMENTWISE_OPS:
            name = ELEMENTWISE_OPS[func]
            counts[mode + " " + name] += 1
            kept = (name, counts[mode + " " + name]) in elementwise
        else:
            kept = False
        return CheckpointPolicy.MUST_SAVE if kept else CheckpointPolicy.PREFER_RECOMPUTE

    return policy_fn"""


_POLICY = """\
# Per-op policy {policy}: selective activation checkpointing.
# Kept outputs: matmuls {numbers}{others}; every other op re-runs in backward.
{order}
KEEP_MATMULS = {keep}
KEEP_GROUPED_MM = {grouped}
KEEP_ATTENTION = {attention}
KEEP_REDUCE_SCATTER = {scatter}
KEEP_ALL_TO_ALL = {all_to_all}
# element-wise outputs: (aten op, its count in the layer)
KEEP_ELEMENTWISE = {elementwise}


{policy_fn}


def context_fn():
    # a new count for every layer's checkpoint (and its re-forward)
    keep = (
        KEEP_MATMULS,
        KEEP_GROUPED_MM,
        KEEP_ATTENTION,
        KEEP_REDUCE_SCATTER,
        KEEP_ALL_TO_ALL,
        KEEP_ELEMENTWISE,
    )
    return create_selective_checkpoint_contexts(_policy(defaultdict(int), keep))
"""

# The layers of a per-op snippet: every stored layer under the policy, or (`POLICY+mixed`) some.
_POLICY_LAYERS = """\
# (first, last + 1, recompute): a recomputed segment keeps its input and is re-run whole in
# backward, each of its layers storing its full tape then; of the stored layers, those in
# POLICY_LAYERS run under the per-op policy, any others store their full tape.
SEGMENTS = {segments}
POLICY_LAYERS = frozenset({policy_layers})


def forward_layers(layers, hidden):
    for start, end, recompute in SEGMENTS:
        if recompute:

            def forward(hidden, start=start, end=end):
                for layer in layers[start:end]:
                    hidden = layer(hidden)
                return hidden

            hidden = checkpoint(forward, hidden, use_reentrant=False)
            continue
        for index in range(start, end):
            if index in POLICY_LAYERS:
                hidden = checkpoint(
                    layers[index], hidden, use_reentrant=False, context_fn=context_fn
                )
            else:
                hidden = layers[index](hidden)
    return hidden
"""


# A scoped policy's regions that are submodules of a layer (`op_policy.SUBMODULE_REGIONS`):
# their names in torchtitan's blocks (torchtitan/models/llama3/model/model.py, models/moe/moe.py
# at v0.2.2; 0.3.0 runs the grouped experts as `moe.routed_experts.inner_experts`, its
# `routed_experts` also holding the token dispatcher, models/common/moe.py) and Hugging Face's
# (modeling_llama.py, modeling_mixtral.py, modeling_deepseek_v3.py, transformers 5.x), tried in
# that order.
REGION_MODULES = {
    "norm1": ("attention_norm", "input_layernorm"),
    "attention": ("attention", "self_attn"),
    "norm2": ("ffn_norm", "post_attention_layernorm"),
    "mlp": ("feed_forward", "mlp"),
    "moe": ("moe", "mlp"),
    "router": ("moe.router", "mlp.gate"),
    "experts": ("moe.experts", "moe.routed_experts.inner_experts", "mlp.experts"),
    "shared_experts": ("moe.shared_experts", "mlp.shared_experts"),
}


def _scoped_reason(spec: ModelSpec, layers: LayerSegments) -> str | None:
    """Why the snippet cannot run scoped policy `layers.policy`, or None."""
    policy = parse_policy(layers.policy)
    if (
        layers.offloaded
        or layers.policy_layers is not None
        or any(recompute for *_, recompute in layers.segments)
    ):
        return (
            f"the scoped policy {layers.policy} beside recomputed or offloaded layers: the "
            "snippet wraps the regions of every layer and nothing else"
        )
    if why := scope_wrap_reason(spec, policy):
        return f"the scoped policy {layers.policy}: {why}"
    return None


def reason(spec: ModelSpec, layers: LayerSegments) -> str | None:
    """PyTorch wraps any one-level segments; a per-op policy whose kept units a policy_fn can
    recognise (matmuls, grouped GEMMs, attention kernels, reduce-scatters, all-to-alls) is
    selective activation checkpointing; a scoped one, a checkpoint around each region's
    submodule (`REGION_MODULES`)."""
    if layers.policy and parse_policy(layers.policy).scopes:
        return _scoped_reason(spec, layers)
    if layers.policy:
        if layers.offloaded:
            return (
                f"the per-op policy {layers.policy} with offloaded layers: the snippet runs one "
                "or the other"
            )
        policy = parse_policy(layers.policy)
        if policy.fused_qkv or policy.flex:
            return (
                f"the per-op policy {layers.policy}: the snippet's layer runs q, k and v as "
                "three linears and attention as SDPA, not torchtitan 0.3.0's fused wqkv and "
                "compiled FlexAttention"
            )
        named = sorted(
            name
            for name in policy.names
            if name not in _RECOGNISED
            and name not in elementwise_ops(spec)
            and name in kept_units(spec, policy)
            and not _is_matmul(spec, name)
            and not _is_grouped(spec, name)
        )
        if named:
            return (
                f"the per-op policy {layers.policy}: a policy_fn recognises matmuls, grouped "
                f"GEMMs, attention kernels and collectives by their aten op, and the "
                f"element-wise units of Hugging Face's Llama layers (framework: hf), not "
                f"{', '.join(named)}"
                + (
                    " (a norm kept with its eager statistics, which no one aten op writes)"
                    if spec.framework == "hf" and set(named) & {"norm1", "norm2"}
                    else ""
                )
            )
        return None
    if why := module_reason(layers, "PyTorch snippet"):
        return why
    return None


def _is_matmul(spec: ModelSpec, name: str) -> bool:
    return any(unit.name == name and unit.matmul for unit in unit_ops(spec))


def _is_grouped(spec: ModelSpec, name: str) -> bool:
    return any(unit.name == name and unit.grouped for unit in unit_ops(spec))


def _policy_part(spec: ModelSpec, layers: LayerSegments) -> str:
    policy = parse_policy(layers.policy)
    kept = set(kept_units(spec, policy))
    matmuls = [unit.name for unit in unit_ops(spec) if unit.matmul]
    counting = counts_matmuls(spec.precision)
    keep = sorted(i for i, name in enumerate(matmuls, 1) if name in kept) if counting else []
    grouped = [unit.name for unit in unit_ops(spec) if unit.grouped]
    grouped_keep = [i for i, name in enumerate(grouped, 1) if name in kept]
    others = [name for name in _RECOGNISED if name in kept]
    others += [name for name in grouped if name in kept]
    elementwise = elementwise_ops(spec)
    others += [name for name in elementwise if name in kept]
    pairs = sorted(pair for name in elementwise if name in kept for pair in elementwise[name])
    return _POLICY.format(
        policy_fn=_POLICY_FN,
        policy=layers.policy,
        numbers=", ".join(map(str, keep)) or "none",
        order="\n".join(
            textwrap.wrap(
                "Matmuls are the aten.mm calls of a layer counted from 1: "
                + ", ".join(matmuls)
                + ".",
                width=98,
                initial_indent="# ",
                subsequent_indent="# ",
            )
        ),
        others="".join(f", {name}" for name in others),
        keep="{" + ", ".join(map(str, keep)) + "}" if keep else "set()",
        grouped="{" + ", ".join(map(str, grouped_keep)) + "}" if grouped_keep else "set()",
        attention="attention" in kept,
        scatter="reduce_scatter" in kept,
        elementwise="{" + ", ".join(f"({op!r}, {count})" for op, count in pairs) + "}"
        if pairs
        else "set()",
        all_to_all="{"
        + ", ".join(str(i) for i, n in enumerate(("dispatch", "combine"), 1) if n in kept)
        + "}"
        if {"dispatch", "combine"} & kept
        else "set()",
    )


_SCOPED = """\
# Scoped per-op policy {policy}
# Each region is its own checkpoint around a submodule of the layer (torchtitan's name, else
# Hugging Face's), re-run in backward under a selective policy
# that keeps the outputs listed; the rest of the layer runs without checkpoint, its tensors
# saved as autograd saves them. Matmuls (aten.mm) and grouped GEMMs are counted from 1 within
# each region, in the order the comment gives.
{order}
# (submodule names, kept matmuls, kept grouped GEMMs, attention kept, reduce-scatter kept,
#  kept all-to-alls: 1 the dispatch, 2 the combine, kept element-wise outputs: none)
REGIONS = [
{regions}
]


{policy_fn}


def _checkpointed(forward, keep):
    def context_fn():
        # a new count for every call of the region (and its re-forward)
        return create_selective_checkpoint_contexts(_policy(defaultdict(int), keep))

    def run(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    return run


def _submodule(layer, names):
    for name in names:
        try:
            return layer.get_submodule(name)
        except AttributeError:
            continue
    raise LookupError(f"the layer has none of the submodules {{names}}")


def scope_layer(layer):
    \"\"\"Wrap each region's submodule of `layer` in its checkpoint (once); returns `layer`.\"\"\"
    if not getattr(layer, "_ckplan_scoped", False):
        for names, *keep in REGIONS:
            module = _submodule(layer, names)
            module.forward = _checkpointed(module.forward, keep)
        layer._ckplan_scoped = True
    return layer


def forward_layers(layers, hidden):
    for layer in layers:
        hidden = scope_layer(layer)(hidden)
    return hidden
"""


def _numbers(indices) -> str:
    return "{" + ", ".join(map(str, indices)) + "}" if indices else "set()"


def _policy_header(plan: Plan, layers: LayerSegments, usage: str | None = None) -> str:
    """The opening of a per-op snippet: what the plan is, how to call it (`usage`, a further
    comment line, after the `forward_layers` one), and the imports its policy_fn needs."""
    lines = [
        f"# ckplan: plan {plan.strategy} for {plan.spec.name}, {layers.layers} layers per "
        "pipeline stage.",
        "# forward_layers(layers, hidden) replaces `for layer in layers: hidden = layer(hidden)`"
        + (";" if usage else "."),
        *([usage] if usage else []),
        "from collections import defaultdict",
        "",
        "import torch",
        "from torch.utils.checkpoint import (",
        "    CheckpointPolicy,",
        "    checkpoint,",
        "    create_selective_checkpoint_contexts,",
        ")",
    ]
    return "\n".join(lines)


def _scoped_render(plan: Plan, layers: LayerSegments) -> str:
    """The snippet of a scoped policy: `scope_layer` wraps each region's submodule."""
    spec = plan.spec
    policy = parse_policy(layers.policy)
    units = unit_ops(spec)
    spans = region_spans(spec)
    kept = kept_mask(spec, policy)
    counting = counts_matmuls(spec.precision)
    rows, order = [], []
    for name, _ in policy.scopes:
        start, end = spans[name]
        inside = range(start, end)
        matmuls = [i for i in inside if units[i].matmul]
        grouped = [i for i in inside if units[i].grouped]
        if matmuls or grouped:
            order.append(f"{name}: " + ", ".join(units[i].name for i in (*matmuls, *grouped)))
        keep_mm = [n for n, i in enumerate(matmuls, 1) if kept[i]] if counting else []
        keep_grouped = [n for n, i in enumerate(grouped, 1) if kept[i]]
        names = {units[i].name for i in inside if kept[i]}
        all_to_all = [n for n, unit in enumerate(("dispatch", "combine"), 1) if unit in names]
        rows.append(
            f"    ({REGION_MODULES[name]!r}, {_numbers(keep_mm)}, {_numbers(keep_grouped)}, "
            f"{'attention' in names}, {'reduce_scatter' in names}, {_numbers(all_to_all)}, set()),"
        )
    comment = "\n".join(
        textwrap.wrap(
            "Matmuls and grouped GEMMs per region: " + "; ".join(order) + "." if order else "",
            width=98,
            initial_indent="# ",
            subsequent_indent="# ",
        )
    )
    body = _SCOPED.format(
        policy_fn=_POLICY_FN, policy=layers.policy, order=comment, regions="\n".join(rows)
    )
    usage = "# or call scope_layer(layer) on each layer once and run the model as it is."
    return _policy_header(plan, layers, usage) + "\n\n\n" + body


def render(plan: Plan, layers: LayerSegments) -> str:
    spec = plan.spec
    if layers.policy and parse_policy(layers.policy).scopes:
        return _scoped_render(plan, layers)
    if layers.policy:
        policy_layers = layers.policy_layers
        if policy_layers is None:
            policy_layers = tuple(
                i
                for start, end, recompute in layers.segments
                if not recompute
                for i in range(start, end)
            )
        tail = _POLICY_LAYERS.format(
            segments=list(layers.segments),
            policy_layers=_indices(policy_layers) if policy_layers else "",
        )
        parts = [_policy_header(plan, layers), _policy_part(spec, layers), tail]
        return "\n\n\n".join(part.rstrip("\n") for part in parts) + "\n"
    chunks = None if layers.offloaded else sequential_chunks(layers)
    names = set()
    if chunks:
        names.add("checkpoint_sequential")
    if layers.selective or not chunks:
        names.add("checkpoint")
    header = [
        f"# ckplan: plan {plan.strategy} for {spec.name}, {layers.layers} layers per pipeline "
        "stage.",
        "# forward_layers(layers, hidden) replaces `for layer in layers: hidden = layer(hidden)`.",
        f"from torch.utils.checkpoint import {', '.join(sorted(names))}",
    ]
    if layers.offloaded:
        header.append("from torch.autograd.graph import save_on_cpu")
    parts = ["\n".join(header)]
    if layers.selective:
        parts.append(_SELECTIVE)
    if layers.offloaded:
        parts.append(
            _OFFLOAD.format(segments=list(layers.segments), offloaded=_indices(layers.offloaded))
        )
    elif chunks:
        parts.append(_SEQUENTIAL.format(chunks=chunks, size=layers.layers // chunks))
    else:
        parts.append(_SEGMENTS.format(segments=list(layers.segments)))
    return "\n\n\n".join(part.rstrip("\n") for part in parts) + "\n"


def _indices(indices: tuple[int, ...]) -> str:
    """`range(a, b)` for consecutive indices, else their list."""
    ordered = sorted(indices)
    if ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"range({ordered[0]}, {ordered[-1] + 1})"
    return str(ordered)


def sequential_chunks(layers: LayerSegments) -> int | None:
    """s when the segments are exactly checkpoint_sequential's with s > 1 chunks: s - 1 chunks
    of layers // s recomputed from the first layer, the rest stored."""
    segments = layers.segments
    count = len(segments)
    if count < 2 or segments[-1][2] or not all(r for *_, r in segments[:-1]):
        return None
    size = layers.layers // count
    expected = [(i * size, (i + 1) * size, True) for i in range(count - 1)]
    expected.append(((count - 1) * size, layers.layers, False))
    return count if list(segments) == expected else None


def notes(plan: Plan, layers: LayerSegments) -> list[str]:
    lines = ["paste it into the model's module; `layers` are this stage's transformer blocks"]
    if layers.selective:
        lines.append("selective: call the attention core as attention_core(core, q, k, v, ...)")
    if layers.policy:
        lines.append(
            "the matmul numbers assume the layer runs each projection as its own linear, in "
            "the order the policy comment gives (torchtitan's and Hugging Face's Llama blocks)"
        )
    if plan.spec.pp > 1:
        lines.append(f"each pipeline stage runs it on its own {layers.layers} layers")
    if layers.offloaded:
        lines.append(
            f"offload: {len(layers.offloaded)} layers save their tensors (a recomputed layer: "
            "its input) in pinned host memory (save_on_cpu copies on the compute stream: slower "
            "than the overlapped estimate); the embedding's and output layer's tapes stay where "
            "the model keeps them"
        )
    return lines
