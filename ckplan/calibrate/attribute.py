"""Which ckplan op saved a tensor: the rule that maps a layer's torch calls to the op table.

Pure Python over what the recorder saw (ckplan.calibrate.record): each top-level torch call of
one layer's forward (`F.linear`, `softmax`, `matmul`, `scaled_dot_product_attention`, ...; calls
nested inside another are part of it), with the innermost norm module and projection module it
ran in. Every tensor autograd saves is saved during one such call. The rule, in order:

1. **Norms.** A call inside a norm module (a module whose class name contains "norm": LayerNorm,
   RMSNorm, LlamaRMSNorm, ...) belongs to that norm, or a top-level `layer_norm`/`rms_norm` call
   outside one. The norms named `q_norm` and `k_norm` (Qwen3, OLMo 2, Gemma 3: on the queries
   and keys) are qk_norm. Of the others, in a pre-norm layer the first is norm1 and the second
   norm2, and calls before norm1 are norm1's. In a layer whose first norm runs after a
   projection (OLMo 2's norms on the sublayers' outputs) the first is norm2 and the second
   norm1, as ckplan counts them ([models](../../docs/models.md)); with four (Gemma 2 and 3) they
   are norm1, post_attn_norm, norm2 and post_mlp_norm. Another count of norms is not a layout
   ckplan's table describes (an error).
2. **Regions.** The calls between the norm before the attention (or the layer's start) and the
   next norm are the attention block, those between the norm before the MLP (or the
   attention's norm) and the next the MLP block. The calls after a block's closing norm (the
   residual add) are that norm's.
3. **Projections** (calls inside a module with a 2-D weight: nn.Linear, Hugging Face's Conv1D).
   In the attention block the last projection module is out_proj and the others (q, k, v, or one
   fused QKV) are qkv_proj; in the MLP block the last is fc2 and the others (fc1, or gate and
   up) are fc1. The other calls from the first of these projections on, before the last one,
   are the attention core (4) or, in the MLP, act (Hugging Face's `act_fn(gate_proj(x)) *
   up_proj(x)` runs the activation between the gate and up projections).
4. **The attention core.** If one of its calls is scaled_dot_product_attention (or a flash-attn
   call), all of them are attention_core.
   Otherwise the first matmul starts attn_scores (RoPE and repeat_kv before it belong to it too,
   as do the scale and the mask after it), the softmax starts softmax (its dtype casts with it),
   a dropout starts attn_dropout, the second matmul starts attn_values (and the head merge after
   it).
5. **After a projection.** A dropout after out_proj is out_dropout, after fc2 mlp_dropout; other
   calls there (residual adds) are the projection's. The calls between fc1 and fc2 are act.

A storage that several ops save (views, or one tensor saved twice) is counted once, under the
first op that saves it outside the attention core (attn_scores, softmax, attn_dropout,
attn_values, attention_core), else under the first: ckplan's convention, under which recomputing
the core never drops a tensor that a later op still needs (flash attention's output O is
out_proj's input; the softmax output without dropout is the softmax's).
"""

from __future__ import annotations

from dataclasses import dataclass

CORE_OPS = ("attn_scores", "softmax", "attn_dropout", "attn_values", "attention_core")
MATMULS = {"matmul", "__matmul__", "__rmatmul__", "bmm", "baddbmm", "einsum"}
SOFTMAXES = {"softmax", "_softmax", "log_softmax"}
DROPOUTS = {"dropout", "native_dropout", "_fused_dropout", "dropout_"}
NORM_CALLS = {"layer_norm", "rms_norm", "native_layer_norm", "group_norm"}


def is_fused_attention(name: str) -> bool:
    return "scaled_dot_product" in name or name.startswith("flash_attn")


class AttributionError(ValueError):
    """A layer whose calls the rule cannot map onto ckplan's op table; one line."""


@dataclass(frozen=True)
class Call:
    """One top-level torch call of the layer's forward."""

    name: str  # the torch function, e.g. "linear", "softmax", "matmul"
    norm: str | None = None  # qualified name of the innermost norm module it ran in
    proj: str | None = None  # qualified name of the innermost projection module it ran in


QK_NORMS = ("q_norm", "k_norm")  # Hugging Face's names of the norms on queries and keys


def attribute(calls: list[Call]) -> list[str]:
    """The ckplan op of every call, by the rule in this module's docstring."""
    units = _norm_units(calls)
    qk = {unit for unit in units if unit.rsplit(".", 1)[-1] in QK_NORMS}
    norms = [unit for unit in units if unit not in qk]
    ops: list[str | None] = [None] * len(calls)
    for index, call in enumerate(calls):
        if _norm_unit(call) in qk:
            ops[index] = "qk_norm"
    attention, mlp = _label_norms(calls, norms, ops)
    _label_block(calls, attention, ops, ("qkv_proj", "out_proj", "out_dropout"), "attention")
    _label_block(calls, mlp, ops, ("fc1", "fc2", "mlp_dropout"), "MLP")
    return [op or "norm2" for op in ops]  # only norm2's own calls can be left: between norms


def _label_norms(calls: list[Call], norms: list[str], ops: list) -> tuple[list[int], list[int]]:
    """Label the layer's norms and the calls after each (rule 1); the indexes of the attention
    block's and the MLP block's calls (rule 2)."""
    projection = next((i for i, call in enumerate(calls) if call.proj is not None), len(calls))
    if len(norms) == 2 and _first(calls, norms[0]) < projection:
        roles = ("norm1", "norm2")  # before the attention, before the MLP
        attention, mlp = (0, 1), (1, None)
    elif len(norms) == 2:
        roles = ("norm2", "norm1")  # after the attention, after the MLP
        attention, mlp = (None, 0), (0, 1)
    elif len(norms) == 4:
        roles = ("norm1", "post_attn_norm", "norm2", "post_mlp_norm")
        attention, mlp = (0, 1), (2, 3)
    else:
        raise AttributionError(
            f"the layer has {len(norms)} norm(s) besides q_norm and k_norm; ckplan's op table "
            "has two (before or after the attention and the MLP) or four (both)"
        )
    for index, call in enumerate(calls):
        unit = _norm_unit(call)
        if unit in norms:
            ops[index] = roles[norms.index(unit)]
    # the calls after each norm up to the next block (the residual adds) are that norm's, and
    # the calls before the first norm its own where no block comes first
    blocks = {attention[0], mlp[0]} - {None}
    for position, unit in enumerate(norms):
        end = _first(calls, norms[position + 1]) if position + 1 < len(norms) else len(calls)
        if position not in blocks:
            for index in range(_last(calls, unit) + 1, end):
                ops[index] = ops[index] or roles[position]
    if attention[0] == 0:
        for index in range(_first(calls, norms[0])):
            ops[index] = ops[index] or roles[0]

    def region(bounds: tuple[int | None, int | None]) -> list[int]:
        start = 0 if bounds[0] is None else _last(calls, norms[bounds[0]]) + 1
        end = len(calls) if bounds[1] is None else _first(calls, norms[bounds[1]])
        return [i for i in range(start, end) if ops[i] is None]

    return region(attention), region(mlp)


def _norm_unit(call: Call) -> str | None:
    if call.norm is not None:
        return call.norm
    return f"call:{id(call)}" if call.name in NORM_CALLS and call.proj is None else None


def _norm_units(calls: list[Call]) -> list[str]:
    units: list[str] = []
    for call in calls:
        unit = _norm_unit(call)
        if unit is not None and unit not in units:
            units.append(unit)
    return units


def _first(calls: list[Call], unit: str) -> int:
    return next(i for i, call in enumerate(calls) if _norm_unit(call) == unit)


def _last(calls: list[Call], unit: str) -> int:
    return max(i for i, call in enumerate(calls) if _norm_unit(call) == unit)


def _label_block(calls, block, ops, names, what) -> None:
    """Projections, the core between them, the dropout after the last (rule 3-5)."""
    inner, last_name, dropout_name = names
    projections: list[str] = []
    for i in block:
        if calls[i].proj is not None and calls[i].proj not in projections:
            projections.append(calls[i].proj)
    if len(projections) < 2:
        raise AttributionError(
            f"the {what} block has {len(projections)} projection module(s); ckplan's op table "
            f"has {inner} before the {what} and {last_name} after it"
        )
    last = projections[-1]
    inner_calls = [i for i in block if calls[i].proj in projections[:-1]]
    last_calls = [i for i in block if calls[i].proj == last]
    outer_start, outer_end = last_calls[0], last_calls[-1]
    if inner_calls[-1] > outer_start:
        raise AttributionError(f"the {what} block runs its projections out of order")
    core = []
    for i in block:
        if calls[i].proj in projections[:-1] or i < inner_calls[0]:
            ops[i] = inner
        elif outer_start <= i <= outer_end:
            ops[i] = last_name
        elif i > outer_end:
            ops[i] = dropout_name if calls[i].name in DROPOUTS else last_name
        else:
            core.append(i)
    if inner == "fc1":
        for i in core:
            ops[i] = "act"
    else:
        _label_core(calls, core, ops)


def _label_core(calls: list[Call], core: list[int], ops: list) -> None:
    if any(is_fused_attention(calls[i].name) for i in core):
        for i in core:
            ops[i] = "attention_core"
        return
    matmuls = [i for i in core if calls[i].name in MATMULS]
    if len(matmuls) < 2:
        raise AttributionError(
            f"the attention core has {len(matmuls)} matmul(s) and no scaled_dot_product_attention"
            "; ckplan's standard attention has two (scores and values)"
        )
    current = "attn_scores"
    for i in core:
        name = calls[i].name
        if i >= matmuls[1]:
            current = "attn_values"
        elif name in SOFTMAXES and i > matmuls[0]:
            current = "softmax"
        elif name in DROPOUTS and current == "softmax":
            current = "attn_dropout"
        ops[i] = current


def resolve(savers: list[str]) -> str:
    """The op a storage counts under, from the ops that saved it, in order (see above)."""
    outside = [op for op in savers if op not in CORE_OPS]
    return outside[0] if outside else savers[0]
