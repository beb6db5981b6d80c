"""Megatron-Core's output-discarding recompute modules: `layernorm`, `moe_act`, `mla_up_proj`.

Megatron-Core (megatron/core/transformer/transformer_config.py at core_v0.15.0,
`recompute_modules`): "moe_act, layernorm, and mla_up_proj use output-discarding
checkpointing". `tensor_parallel.CheckpointWithoutOutput` runs a function without building its
autograd graph, keeps the function's inputs, and after the op that reads the function's output
has saved it, frees that output's storage (`discard_output_and_register_recompute`, which also
registers the re-run as a gradient hook on the consumer's output). So the layer stores:

- not the function's output, wherever it is saved (the consumers' saved inputs, or the kept
  input of a recompute group that reads it, e.g. the dense MLP's);
- the function's inputs instead of what its own ops save (for a norm they are the same storage:
  nothing changes; for an activation the fc1 output and the routing probabilities; for MLA's up
  projections the latents and the RoPE key);

and when the backward reaches the consumer block's output (`restore`), the function is re-run
with autograd: its output and its ops' saved tensors are alive again from then on and are freed
as without recomputation.

Which ops each module covers (core_v0.15.0):

- `layernorm`: transformer_layer.py, `input_layernorm` and `pre_mlp_layernorm` under
  `CheckpointWithoutOutput`, outputs discarded after the self-attention and the MLP (or MoE
  layer) have run, recomputed when the backward reaches their outputs (out_proj, the MLP's last
  op). Megatron skips norms that are `IdentityOp`: those fused into Transformer Engine's
  LayerNormLinear (the TE spec's dense layers); ckplan's tables model unfused norms.
- `moe_act`: moe/experts.py, `TEGroupedMLP.forward`: the weighted activation
  `bias_act_func(fc1 output, bias, probs)` checkpointed, its output discarded after the experts'
  fc2 has saved it, recomputed before fc2's backward. The shared experts are not covered (a
  plain `MLP`).
- `mla_up_proj`: multi_latent_attention.py, `qkv_up_proj_and_rope_apply(q_compressed,
  kv_compressed, k_pos_emb, rotary_pos_emb)`: q_layernorm, linear_q_up_proj (linear_q_proj
  without a query latent), kv_layernorm, linear_kv_up_proj and RoPE checkpointed; Q, K, V
  discarded after the core attention has saved them, recomputed when the backward reaches the
  core attention's output (before linear_proj's backward).
"""

from __future__ import annotations

from dataclasses import dataclass

from ckplan.model.op import LayerShapes, Op, in_group
from ckplan.model.spec import ChainSpec

LAYERNORM = "layernorm"
MOE_ACT = "moe_act"
MLA_UP_PROJ = "mla_up_proj"
DISCARDING = (LAYERNORM, MOE_ACT, MLA_UP_PROJ)

# The ops each module runs under its checkpoint (the ops its re-run repeats), by op name.
MEMBERS = {
    LAYERNORM: ("norm1", "norm2"),
    MOE_ACT: ("expert_act",),
    MLA_UP_PROJ: ("q_norm", "q_up", "q_proj", "kv_norm", "kv_up"),
}
# The ops that save the module's output as their input: norm1's output (the QKV projection, or
# MLA's down projections), norm2's (the dense fc1, or the router and the shared experts), the
# activation's (the experts' fc2), Q, K and V (the attention core).
_NORM1_READERS = ("qkv_proj", "q_down", "q_proj", "kv_down")
_NORM2_READERS = ("fc1", "router", "shared_fc1")
_CORE = ("attention_core", "attn_scores", "attn_values")


@dataclass(frozen=True)
class Discard:
    """One output-discarding checkpoint inside a layer (derived from CheckpointWithoutOutput)."""

    members: tuple[str, ...]  # its ops, in forward order
    member_dropped: int  # what its ops save beyond the inputs the checkpoint keeps
    extra_kept: int  # inputs the checkpoint keeps that no op of the layer saves otherwise
    output: int  # bytes of the discarded output
    readers: tuple[str, ...]  # the ops that save that output
    restore: str  # the op before whose backward the function is re-run


def is_discarding(name: str) -> bool:
    return name in DISCARDING


def module_ops(ops: tuple[Op, ...], groups: tuple[str, ...]) -> list[Op]:
    """The ops the backward re-runs for `groups`: a recompute group's members (`in_group`), an
    output-discarding module's checkpointed ops (`MEMBERS`), each op once, in forward order."""
    names = {name for group in groups if is_discarding(group) for name in MEMBERS[group]}
    return [
        op
        for op in ops
        if op.name in names or any(in_group(op, g) for g in groups if not is_discarding(g))
    ]


def _block_last(ops: tuple[Op, ...], first: str) -> str:
    """The last op of the MLP (or MoE) block that starts after `first` (norm2): the op whose
    output the bias-dropout-add (or post-norm) reads."""
    names = [op.name for op in ops]
    tail = ("post_mlp_norm", "mlp_dropout")
    block = [name for name in names[names.index(first) + 1 :] if name not in tail]
    return block[-1]


def layer_discards(spec: ChainSpec, ops: tuple[Op, ...], name: str) -> tuple[Discard, ...]:
    """The checkpoints module `name` places in a layer with op table `ops` (empty where the layer
    lacks the part: no experts, no MLA). Bytes as `ops` saves them (derived, see the module
    docstring)."""
    by_name = {op.name: op for op in ops}
    if name == LAYERNORM:
        found = []
        if "norm1" in by_name and "out_proj" in by_name:
            found.append(Discard(("norm1",), 0, 0, spec.dtype_bytes * _stream(spec),
                                 _NORM1_READERS, "out_proj"))  # fmt: skip
        if "norm2" in by_name:
            found.append(Discard(("norm2",), 0, 0, spec.dtype_bytes * _stream(spec),
                                 _NORM2_READERS, _block_last(ops, "norm2")))  # fmt: skip
        return tuple(found)
    if name == MOE_ACT:
        if "expert_act" not in by_name:
            return ()
        act = by_name["expert_act"]
        kept = act_inputs_bytes(act, spec)
        return (
            Discard(
                ("expert_act",),
                act.saved_bytes - kept,
                0,
                act.output_grad_bytes,  # the activation's output, as its gradient
                ("expert_fc2",),
                "expert_fc2",
            ),
        )
    if name == MLA_UP_PROJ:
        if "kv_up" not in by_name:
            return ()
        members = tuple(n for n in MEMBERS[MLA_UP_PROJ] if n in by_name)
        # kept: q_compressed (what q_norm saves; without a query latent x, which q_proj saves),
        # kv_compressed (what kv_norm saves) and k_pos_emb, the RoPE key of every token
        retained = sum(
            by_name[n].saved_bytes for n in ("q_norm", "q_proj", "kv_norm") if n in by_name
        )
        dropped = sum(by_name[n].saved_bytes for n in members) - retained
        return (
            Discard(members, dropped, rope_key_bytes(spec), qkv_bytes(spec), _CORE, "out_proj"),
        )
    raise ValueError(f"no output-discarding module {name!r}")


def _stream(spec: ChainSpec) -> int:
    """Elements of the norm's output, (s, b, h) on this rank (/t under sequence parallelism)."""
    return LayerShapes.of(spec).stream


def act_inputs_bytes(act: Op, spec: ChainSpec) -> int:
    """What the experts' activation checkpoint keeps: its inputs, the fc1 output (2F_e/etp wide
    gated) and the R routing probabilities (moe/experts.py `bias_act_func(intermediate_parallel,
    bias_parallel, permuted_probs)`, core_v0.15.0), the bytes of the activation's input
    gradient (`expert_act`'s input_grad_bytes: the same two tensors' gradients). With
    `moe_act_input_fp8` the activation saves exactly those inputs, the fc1 output in FP8
    (DeepSeek-V3 report §3.3.3, `moe.expert_act_saved_bytes`): what it saves."""
    if spec.moe_act_input_fp8:
        return act.saved_bytes
    return act.input_grad_bytes


def rope_key_bytes(spec: ChainSpec) -> int:
    """MLA's k_pos_emb, kept by the up-projection checkpoint: B·s·b·d_rope (gathered from the
    sequence-parallel region before the checkpoint, multi_latent_attention.py core_v0.15.0).
    derived."""
    return spec.dtype_bytes * LayerShapes.of(spec).tokens * spec.qk_rope_head_dim


def qkv_bytes(spec: ChainSpec) -> int:
    """Q, K and V as MLA's up projections produce them: a/t heads each, qk_nope + qk_rope wide
    for Q and K, v_head_dim for V (derived, as `ops.group_input_bytes` of the attention core)."""
    heads_r = spec.heads // spec.tp
    width = heads_r * (2 * (spec.qk_nope_head_dim + spec.qk_rope_head_dim) + spec.v_head_dim)
    return spec.dtype_bytes * LayerShapes.of(spec).tokens * width
