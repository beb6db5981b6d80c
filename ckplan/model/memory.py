"""Bytes: activations per op and per layer, the embedding and output stages, parameters, and
model states (weights, gradients, optimizer). Pure functions over a ModelSpec."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

from ckplan.model import finetune, frameworks, mtp, optimizers
from ckplan.model.fp8_blocks import weight_block_amaxes, weight_block_scale_bytes
from ckplan.model.layers import (
    LayerKind,
    layer_kinds,
    stage_kind_counts,
    stage_kinds,
    stage_layer_indices,
)
from ckplan.model.loss import logits_elements
from ckplan.model.mla import mla_parameters
from ckplan.model.modules import Discard, is_discarding, layer_discards
from ckplan.model.moe import moe_layer_parameters, router_bias_parameters
from ckplan.model.op import DENSE_MLP, RESIDUAL_NORMS, in_group, split_share
from ckplan.model.op_policy import is_policy, parse_policy, policy_tape_bytes
from ckplan.model.ops import group_input_bytes, layer_ops, representative_kind
from ckplan.model.parts import cached_by_chain
from ckplan.model.spec import ModelSpec
from ckplan.simple import mlp as numpy_mlp

TOKEN_ID_BYTES = 8  # int64 token ids, the embedding's input


def activation_bytes_by_op(spec: ModelSpec, kind: LayerKind | None = None) -> dict[str, int]:
    """Bytes each op of one layer saves for backward (one micro-batch, one GPU, no recompute).
    `kind`: which layer of a mixed model (default `ops.representative_kind`)."""
    return {op.name: op.saved_bytes for op in layer_ops(spec, kind)}


def activation_breakdown(spec: ModelSpec, kind: LayerKind | None = None) -> dict[str, int]:
    """One layer's saved bytes summed by component: attention, mlp, norm (Korthikanti §4.1)."""
    totals: Counter[str] = Counter({"attention": 0, "mlp": 0, "norm": 0})
    for op in layer_ops(spec, kind):
        totals[op.component] += op.saved_bytes
    return dict(totals)


def activation_bytes_per_layer(spec: ModelSpec, kind: LayerKind | None = None) -> int:
    """Sum of what one layer's ops save: Korthikanti Table 2, row "no parallelism" for t = 1."""
    return sum(op.saved_bytes for op in layer_ops(spec, kind))


def selective_activation_bytes_per_layer(
    spec: ModelSpec, group: str | tuple[str, ...], kind: LayerKind | None = None
) -> int:
    """One layer with `group` (or several) recomputed: its ops' saved bytes dropped, its input
    kept.

    Korthikanti §5: with the attention core recomputed, a layer stores 34sbh (B = 2, t = 1).
    """
    groups = (group,) if isinstance(group, str) else group
    if groups and is_policy(groups[0]):  # a per-op policy decides the whole layer
        return policy_tape_bytes(spec, parse_policy(groups[0]), kind)
    ops = layer_ops(spec, kind)
    total = sum(op.saved_bytes for op in ops)
    for name in groups:
        members = [op for op in ops if in_group(op, name)]
        if members and not is_discarding(name):
            total -= sum(op.saved_bytes for op in members)
            total += group_input_bytes(spec, name, kind)
    for discard, dropped in layer_discard_plan(spec, groups, kind):
        total += discard.extra_kept - discard.member_dropped - dropped
    return total


def layer_discard_plan(
    spec: ModelSpec, groups: tuple[str, ...], kind: LayerKind | None = None
) -> list[tuple[Discard, int]]:
    """Each output-discarding checkpoint of `groups` (`modules.layer_discards`: layernorm,
    moe_act, mla_up_proj) in one layer, with the bytes of its output the tape stops holding.

    derived: the output's storage is freed wherever it is saved, so the tape drops it once,
    from the ops that save it (`Discard.readers`) or, for a reader inside a recomputed group,
    from that group's kept input (the dense MLP's and the MoE block's input is norm2's output,
    the attention core's Q, K and V); never more than the output itself (an FP8 linear saves a
    1-byte copy, and Megatron's `set_save_original_input` then saves the discarded original).
    """
    ops = layer_ops(spec, kind)
    active = {
        name: {op.name for op in ops if in_group(op, name)}
        for name in groups
        if not is_discarding(name)
    }
    plan = []
    for name in groups:
        if not is_discarding(name):
            continue
        for discard in layer_discards(spec, ops, name):
            stored, holders = 0, set()
            for op in ops:
                if op.name not in discard.readers:
                    continue
                holder = next((g for g, members in active.items() if op.name in members), None)
                if holder is None:
                    stored += op.saved_bytes
                else:
                    holders.add(holder)
            stored += sum(group_input_bytes(spec, g, kind) for g in sorted(holders))
            plan.append((discard, min(discard.output, stored)))
    return plan


def layer_input_bytes(spec: ModelSpec) -> int:
    """The residual stream entering a layer, (s, b, h): what full recompute keeps per layer
    (Korthikanti Table 2, "full recompute" 2sbh for B = 2; /t under sequence parallelism)."""
    if spec.kind == "mlp":
        return numpy_mlp.input_bytes(spec)
    tokens = (spec.seq // spec.cp) * spec.micro_batch
    return spec.dtype_bytes * split_share(tokens * spec.hidden, spec.tp if spec.sp else 1)


@dataclass(frozen=True)
class BackwardPoint:
    """What is alive while one op of a layer runs its backward (`layer_backward_walk`)."""

    op: str
    saved_bytes: int  # saved tensors of the ops not yet backpropagated, this one's included
    grad_bytes: int  # residual-stream gradients, gradients waiting for an earlier op, its own
    workspace_bytes: int  # its backward's temporaries

    @property
    def live_bytes(self) -> int:
        return self.saved_bytes + self.grad_bytes + self.workspace_bytes


def layer_backward_walk(
    spec: ModelSpec,
    recomputed: str | tuple[str, ...] | None = None,
    kind: LayerKind | None = None,
) -> list[BackwardPoint]:
    """The live bytes during each op's backward of one transformer layer, in backward order.

    derived, walking the ops of `ops.transformer_layer_ops` in reverse as autograd runs them:

    - Saved: the layer's tape at the start (the layer input x included, as norm1's saved
      input). An op's saved tensors are freed when its backward returns (`Op.saved_until`: when
      a later-backpropagated op's does, for a storage both save).
    - Residual stream: δ_out, the gradient of the layer output, is alive throughout (the chain
      frees it after the stage's backward, schedules rule 5). The residual adds pass it on
      unchanged, so it is the output gradient of the last op of each branch (fc2 or
      mlp_dropout, out_proj or out_dropout). After norm2's backward its input gradient is added
      to δ_out into a new tensor (δ_out stays alive), the gradient of the mid-layer residual;
      norm1's is added to that one in place, making it δ_in. So residual-stream gradients are
      X = layer_input_bytes until norm2 returns, 2X after. (The add itself peaks lower than
      the norm's backward: the norm's saved input and output gradient, X each, are freed
      first.)
    - Other gradients: each op's `input_grad_bytes` stay alive until the ops before it have
      read them as their `output_grad_bytes`; at op k the walk counts those waiting (op k's own
      output gradient among them), the input gradients op k allocates and its
      `grad_workspace_bytes`.

    So live(k) = saved(ops not yet backpropagated, k included) + residual + waiting +
    input_grad(k) + workspace(k). With `recomputed` (selective recomputation of that group, or
    of each of several disjoint groups), the group's saved tensors are not stored: its input
    (`ops.group_input_bytes`) is, until the group's backward ends, and the re-forward rebuilds
    the group's saved tensors just before the group's first op is backpropagated, counted in
    full besides the kept input (an upper bound: kernels that save their inputs as they are
    share those storages). An output-discarding module (`layer_discard_plan`) stores its
    checkpoint's inputs instead of its output; its re-run rebuilds the output and its ops' saved
    tensors just before the backward of `Discard.restore` (the consumer block's last op, where
    Megatron-Core's gradient hook fires), freed as without recomputation. The re-run's output
    is a second copy (megatron/core/tensor_parallel/random.py at core_v0.15.0,
    `CheckpointWithoutOutput._recompute`: the recomputed outputs are copied into the discarded
    storage and kept in `ctx.outputs` for the function's backward): it and the extra kept
    inputs are freed after the function's first op's backward.
    Parameter gradients are model states and are not counted.
    """
    if spec.kind == "mlp":
        raise ValueError("the NumPy MLP's backward is simple.mlp.backward_workspace_bytes")
    ops = layer_ops(spec, kind)
    names = (
        () if recomputed is None else (recomputed,) if isinstance(recomputed, str) else recomputed
    )
    if names and is_policy(names[0]):
        # A per-op policy re-runs the whole layer before its first backward: the walk of the
        # full tape (`layer_backward_workspace_bytes` measures it against the policy's tape).
        names = ()
    groups = {
        name: [op for op in ops if in_group(op, name)] for name in names if not is_discarding(name)
    }
    groups = {name: members for name, members in groups.items() if members}
    member_of = {op.name: name for name, members in groups.items() for op in members}
    # TiledMLP (`mlp_tiles`): the recomputed MLP runs its re-forward and backward tile by tile
    tiles = spec.mlp_tiles if DENSE_MLP in groups else 1
    tiled = {op.name for op in groups.get(DENSE_MLP, ())} if tiles > 1 else set()

    tokens = (spec.seq // spec.cp) * spec.micro_batch

    def tile(nbytes: int, name: str) -> int:
        """One tile's share of an MLP op's bytes: torch.chunk's largest chunk of the tokens."""
        if name not in tiled:
            return nbytes
        if nbytes % tokens == 0:
            return nbytes // tokens * -(-tokens // tiles)
        return -(-nbytes // tiles)

    freed_after: Counter[str] = Counter()  # bytes freed when the named op's backward returns
    rebuilt = {
        name: sum(tile(op.saved_bytes, op.name) for op in members)
        for name, members in groups.items()
    }
    for op in ops:
        if op.saved_until is None or op.name in member_of:
            freed_after[op.name] += tile(op.saved_bytes, op.name)
        elif op.saved_until in member_of:
            # The stored storage is this op's alone; the re-forward saves a new one.
            freed_after[op.name] += op.saved_bytes
            freed_after[op.saved_until] += tile(op.saved_bytes, op.saved_until)
            rebuilt[member_of[op.saved_until]] += tile(op.saved_bytes, op.saved_until)
        else:
            freed_after[op.saved_until] += op.saved_bytes
    kept = 0
    for name, members in groups.items():
        held = group_input_bytes(spec, name, kind)
        freed_after[members[0].name] += held  # the group's last backward step
        kept += held
    saved = sum(op.saved_bytes for op in ops if op.name not in member_of) + kept
    re_forward: Counter[str] = Counter(
        {members[-1].name: rebuilt[name] for name, members in groups.items()}
    )
    order = [op.name for op in ops]
    for discard, dropped in layer_discard_plan(spec, names, kind):
        # stored: its inputs, not its output; re-run before `restore`'s backward, which
        # restores the output's storage (freed with its readers) and keeps the re-run's own
        # output, with its graph, until the function's backward (freed with its first op)
        saved += discard.extra_kept - discard.member_dropped - dropped
        re_forward[discard.restore] += dropped + discard.member_dropped + discard.output
        first = min((order.index(n) for n in discard.members if n in order), default=None)
        if first is not None:
            freed_after[order[first]] += discard.extra_kept + discard.output
    stream = layer_input_bytes(spec)
    residual, waiting = stream, 0
    points = []
    first = groups[DENSE_MLP][0] if tiled else None
    last = groups[DENSE_MLP][-1].name if tiled else None
    held = 0  # TiledMLP's whole input gradient and incoming gradient, through its tiles
    for op in reversed(ops):
        saved += re_forward.get(op.name, 0)  # a group's re-forward, just before its backward
        if op.name in tiled:
            if op.name == last:  # x_grad = zeros_like(x); the incoming gradient is kept
                held = first.input_grad_bytes + op.output_grad_bytes
                waiting -= op.output_grad_bytes
            own = tile(op.input_grad_bytes, op.name)  # fc1's: a tile's, added into x_grad
            grads = residual + waiting + held + own
            workspace = tile(op.grad_workspace_bytes, op.name)
            points.append(BackwardPoint(op.name, saved, grads, workspace))
            saved -= freed_after[op.name]
            if op.name != last:
                waiting -= tile(op.output_grad_bytes, op.name)
            if op is first:  # the tiles are done: x_grad is the group's input gradient
                waiting += first.input_grad_bytes
                held = 0
            else:
                waiting += own
            continue
        grads = residual + waiting + op.input_grad_bytes
        points.append(BackwardPoint(op.name, saved, grads, op.grad_workspace_bytes))
        saved -= freed_after[op.name]
        waiting -= op.output_grad_bytes
        if op.name in RESIDUAL_NORMS:
            if residual == stream:
                residual += op.input_grad_bytes  # δ_out + grad: a new tensor (δ_out is kept)
        else:
            waiting += op.input_grad_bytes
    if waiting != 0 or saved != 0:  # every gradient read, every saved tensor freed
        raise AssertionError(f"inconsistent backward fields: {waiting=} {saved=}")
    return points


def layer_backward_peak_bytes(
    spec: ModelSpec,
    recomputed: str | tuple[str, ...] | None = None,
    kind: LayerKind | None = None,
) -> int:
    """Peak bytes alive during one layer's backward: tape (as freed op by op), δ_out, the
    gradients in flight and temporaries (derived: the maximum of `layer_backward_walk`).

    Korthikanti's GPT layer (B = 2, F = 4h, dropout, standard attention, t = 1), tape
    T = 34sbh + 5as²b: the MLP peaks at fc2's backward, T - sbh (mlp_dropout's mask freed) +
    2sbh (δ_out) + 2sbh (dropout's input gradient) + 8sbh (fc2's input gradient) = T + 11sbh;
    the attention at attn_values', T - 24sbh (the MLP, norm2, out_dropout and out_proj freed)
    + 4sbh (δ_out, mid-layer residual gradient) + 2sbh (context gradient) + 2as²b + 2sbh (dP,
    dV) = T - 16sbh + 2as²b. The peak is the larger: T + 11sbh while as/h <= 13.5.
    For kind mlp: the NumPy MLP's exact figure, tape + δ_out + δ_in + its workspace.
    """
    if spec.kind == "mlp":
        tape = activation_bytes_per_layer(spec)
        return tape + 2 * layer_input_bytes(spec) + numpy_mlp.backward_workspace_bytes(spec)
    return max(point.live_bytes for point in layer_backward_walk(spec, recomputed, kind))


def layer_backward_workspace_bytes(
    spec: ModelSpec,
    recomputed: str | tuple[str, ...] | None = None,
    kind: LayerKind | None = None,
) -> int:
    """What one layer's backward holds beyond the chain's model of it (schedules rule 5: the
    whole tape, δ_out and δ_in): max(0, layer_backward_peak_bytes - (tape + 2X)), X the layer
    input, the tape the selective one with `recomputed`. Never negative, so the chain's peak is
    never below tape + 2X. For kind mlp: `simple.mlp.backward_workspace_bytes`, exactly.
    """
    if spec.kind == "mlp":
        return numpy_mlp.backward_workspace_bytes(spec)
    tape = (
        activation_bytes_per_layer(spec, kind)
        if not recomputed
        else selective_activation_bytes_per_layer(spec, recomputed, kind)
    )
    # Under a per-op policy the backward holds the rebuilt tape beside the policy's own
    # (its kept outputs are freed as the re-forward consumes them): the full walk's peak.
    peak = layer_backward_peak_bytes(spec, recomputed, kind)
    return max(0, peak - (tape + 2 * layer_input_bytes(spec)))


def token_id_bytes(spec: ModelSpec) -> int:
    """The int64 token ids the embedding reads (s·b·8)."""
    return TOKEN_ID_BYTES * (spec.seq // spec.cp) * spec.micro_batch


def embedding_saved_bytes(spec: ModelSpec) -> int:
    """The embedding stage's tape: its token ids and, with dropout, the 1-byte embedding
    dropout mask, sbh (/t under SP) (Korthikanti §4.3)."""
    mask = layer_input_bytes(spec) // spec.dtype_bytes if spec.dropout > 0 else 0
    return token_id_bytes(spec) + mask


# ---- parameters and model states --------------------------------------------------------


@dataclass(frozen=True)
class ParameterCount:
    embedding: int  # token (+ learned position) embeddings
    per_layer: int  # one layer (of the representative kind, for a mixed model)
    layers: int
    final_norm: int
    output: int  # output projection, 0 when tied to the embedding
    all_layers: int | None = None  # every layer's, when the layers differ; None: per_layer·L
    experts: int = 0  # of all, the routed experts' parameters
    inactive: int = 0  # routed experts' parameters a token does not use (E - k of every E)
    # parameters that train, besides the total: None when all of them do (training: full);
    # LoRA's adapters are not in the total
    trainable: int | None = None
    mtp: int = 0  # the multi-token prediction depths' own weights (`mtp_parameters`)

    @property
    def total(self) -> int:
        layers = self.per_layer * self.layers if self.all_layers is None else self.all_layers
        return self.embedding + layers + self.final_norm + self.output + self.mtp

    @property
    def active(self) -> int:
        """Parameters one token passes through (DeepSeek-V3: 37B of 671B)."""
        return self.total - self.inactive

    @property
    def trained(self) -> int:
        """Parameters that train: all of them, or the fine-tuning's (`trainable`)."""
        return self.total if self.trainable is None else self.trainable


def norm_parameters(spec: ModelSpec) -> int:
    """LayerNorm has a gain and a bias per channel, RMSNorm a gain only (Zhang & Sennrich 2019)."""
    return 2 * spec.hidden if spec.norm == "layernorm" else spec.hidden


def qk_norm_parameters(spec: ModelSpec) -> tuple[int, int]:
    """The gains of the Q-norm and the K-norm (RMSNorm, Zhang & Sennrich 2019): one head's d
    each when each head is normed on its own (Qwen3Attention, Gemma3Attention: RMSNorm(head_dim)),
    all query heads' a·d and all K heads' g·d when the heads are normed together
    (qk_norm_width full: Olmo2Attention's q_norm and k_norm, modeling_olmo2.py, transformers
    v5.25.0); (0, 0) without QK-norms."""
    if not spec.qk_norm:
        return 0, 0
    d = spec.head_dim
    if spec.qk_norm_width == "full":
        return spec.heads * d, spec.kv_heads * d
    return d, d


def sink_parameters(spec: ModelSpec) -> int:
    """Attention sinks: one learned logit per query head (GptOssAttention.sinks,
    modeling_gpt_oss.py, transformers v5.25.0; Megatron-Core's softmax_offset under
    softmax_type learnable, dot_product_attention.py core_v0.19.0, split with the heads over
    tp)."""
    return spec.heads if spec.attention_sinks else 0


@dataclass(frozen=True)
class LayerParameters:
    """One layer's weights by how Megatron-LM lays them out on the tensor-parallel ranks."""

    split: int  # split over tp: column-parallel linears and biases, row-parallel weights
    replicated: int  # whole on every TP rank: norms, row-parallel biases, router, MLA down
    experts: int = 0  # routed experts (all their weights and biases), split over ep·etp
    inactive: int = 0  # the routed experts a token does not use
    kv: int = 0  # K and V projections and biases: g/t heads per rank, one replicated if t > g
    expert_row_bias: int = 0  # of `experts`, their fc2 biases: whole on every etp rank

    @property
    def total(self) -> int:
        return self.split + self.replicated + self.experts + self.kv

    def dense_per_rank(self, spec: ModelSpec) -> int:
        """Dense weights on one TP rank (`tensor_parallel_layout`)."""
        kv = self.kv // spec.kv_heads * -(-spec.kv_heads // spec.tp) if self.kv else 0
        return split_share(self.split, spec.tp) + self.replicated + kv

    def experts_per_rank(self, spec: ModelSpec) -> int:
        """Routed-expert weights on one rank: E/ep experts, each split over etp but for its
        row-parallel fc2 bias."""
        matrices = split_share(self.experts - self.expert_row_bias, spec.ep * spec.etp)
        return matrices + split_share(self.expert_row_bias, spec.ep)


@cached_by_chain(maxsize=256)
def layer_parameter_parts(spec: ModelSpec, kind: LayerKind | None = None) -> LayerParameters:
    """Weights of one layer from its matmul shapes (derived: QKV h·(a·d + 2gd), out-proj
    a·d·h, MLP 2hF for GELU or 3hF gated, biases on every output when `bias` (on Q, K, V only
    with `qkv_bias`), norms; MLA: `mla.mla_parameters`; MoE: `moe.moe_layer_parameters`),
    laid out as Megatron-LM's modules hold them on each tensor-parallel rank
    (megatron/core/tensor_parallel/layers.py, transformer/attention.py):

    - ColumnParallelLinear (QKV, fc1, MLA up projections, the output layer) splits its weight
      and its bias over t;
    - RowParallelLinear (out-proj, fc2) splits its weight over t but keeps the whole bias of
      `output_size` on every rank (it is added after the all-reduce);
    - K and V of GQA: g/t heads per rank, and one head (replicated) on each rank when t > g
      (ckplan's `kv_heads_per_rank`, as for the activations);
    - norms, QK-norms, the MoE router and MLA's down projections and latent norms are whole on
      every rank; routed experts split over ep·etp, their fc2 biases over ep only.
    """

    h, F = spec.hidden, spec.ffn_hidden
    kind = representative_kind(spec) if kind is None else kind
    norms = (4 if spec.post_norms else 2) * norm_parameters(spec)
    row_bias = h if spec.bias else 0  # a row-parallel linear's bias: whole on every rank
    kv = 0
    if spec.mla:
        split, replicated = mla_parameters(spec)
        replicated += norms
    else:
        d = spec.head_dim
        q_out, kv_out = spec.heads * d, 2 * spec.kv_heads * d
        q_norm, k_norm = qk_norm_parameters(spec)
        split = h * q_out + spec.heads * d * h + (q_out if spec.qkv_bias else 0)
        split += (q_norm if spec.qk_norm_width == "full" else 0) + sink_parameters(spec)
        kv = h * kv_out + (kv_out if spec.qkv_bias else 0)
        kv += k_norm if spec.qk_norm_width == "full" else 0
        replicated = norms + (q_norm + k_norm if spec.qk_norm_width == "head" else 0) + row_bias
    if kind.moe:
        moe_split, moe_replicated, experts = moe_layer_parameters(spec)
        shared_bias = row_bias if spec.shared_ffn_hidden else 0  # the shared experts' fc2 bias
        inactive = experts // spec.experts * (spec.experts - spec.top_k)
        return LayerParameters(
            split + moe_split - shared_bias,
            replicated + moe_replicated + shared_bias,
            experts,
            inactive,
            kv,
            spec.experts * row_bias,
        )
    gated = spec.mlp != "gelu"
    split += (3 if gated else 2) * h * F
    if spec.bias:
        split += 2 * F if gated else F
        replicated += row_bias
    return LayerParameters(split, replicated, kv=kv)


def layer_module_parameters(
    spec: ModelSpec, kind: LayerKind | None = None
) -> tuple[int, ...] | None:
    """One dense layer's weights sub-module by sub-module, in the order its forward runs them,
    on one tensor-parallel rank: the input norm, the QKV projection, the out-projection, the
    second norm, fc1 (with the gate, one module in Megatron-LM's ParallelMLP) and fc2, each
    with its biases, split as `layer_parameter_parts` splits them (QK-norms with the QKV
    projection; post-norms, where the layer has them, with the module before). What a
    framework that fetches weights module by module (DeepSpeed ZeRO-3's hooks) sees. None
    for the layers laid out otherwise (MoE, MLA, the NumPy MLP).

    derived: `layer_parameter_parts`, split at Megatron-LM's module boundaries
    (megatron/model/transformer.py ParallelTransformerLayer: input_layernorm, self_attention
    .query_key_value, self_attention.dense, post_attention_layernorm, mlp.dense_h_to_4h,
    mlp.dense_4h_to_h)."""
    kind = representative_kind(spec) if kind is None else kind
    if spec.kind != "transformer" or spec.mla or kind.moe:
        return None
    h, F, d, t = spec.hidden, spec.ffn_hidden, spec.head_dim, spec.tp
    norm = norm_parameters(spec)
    post = norm if spec.post_norms else 0
    row_bias = h if spec.bias else 0
    q_out, kv_out = spec.heads * d, 2 * spec.kv_heads * d
    q_norm, k_norm = qk_norm_parameters(spec)
    full = spec.qk_norm_width == "full"
    q = split_share(h * q_out + (q_out if spec.qkv_bias else 0), t)
    q += split_share((q_norm if full else 0) + sink_parameters(spec), t)
    kv_gains = k_norm if full else 0  # a full-width K-norm's gains split with the K heads
    kv_per_head = (h * kv_out + (kv_out if spec.qkv_bias else 0) + kv_gains) // spec.kv_heads
    kv = kv_per_head * -(-spec.kv_heads // t)
    qkv = q + kv + (0 if full else q_norm + k_norm)
    out_proj = split_share(spec.heads * d * h, t) + row_bias + post
    gated = spec.mlp != "gelu"
    fc1 = split_share(
        (2 if gated else 1) * h * F + ((2 * F if gated else F) if spec.bias else 0), t
    )
    fc2 = split_share(F * h, t) + row_bias + post
    return (norm, qkv, out_proj, norm, fc1, fc2)


def float8_linear_weights(spec: ModelSpec) -> int:
    """The weights of one dense block's linear layers on one tensor-parallel rank, without
    their biases: what torchao's `convert_to_float8_training` swaps for `Float8Linear`
    (torchtitan/float8.py at 9dec370 converts every `nn.Linear` but `output`; later releases'
    `filter_fqns = ["output"]`, train_configs llama3_8b.toml and llama3_405b.toml at 6fc499f):
    Q, K and V (the K and V heads split as `layer_module_parameters` splits them), the
    out-projection, fc1 (with the gate) and fc2. The norms, QK-norms and biases stay in the
    model's dtype; the embedding and output layer are not block linears.

    derived: `layer_module_parameters` without the norms and biases."""
    h, F, d, t = spec.hidden, spec.ffn_hidden, spec.head_dim, spec.tp
    q = split_share(h * spec.heads * d, t)
    kv = (2 * h * d) * -(-spec.kv_heads // t)
    fc1 = split_share((1 if spec.mlp == "gelu" else 2) * h * F, t)
    return q + kv + split_share(spec.heads * d * h, t) + fc1 + split_share(F * h, t)


def float8_gathered_layer_weights(spec: ModelSpec) -> int:
    """The weights of one block on one GPU that FSDP2 gathers and holds unsharded in float8,
    1 byte each, under `fsdp_float8_all_gather` (`float8_linear_weights`; the key is refused
    for MoE and MLA layers); 0 without the key (ckplan.model.frameworks
    `fsdp2_gathered_bytes`)."""
    if not spec.fsdp_float8_all_gather:
        return 0
    return float8_linear_weights(spec)


def float8_gathered_stage_weights(spec: ModelSpec, stage: int) -> int:
    """`float8_gathered_layer_weights` over the blocks of pipeline stage `stage`."""
    if not spec.fsdp_float8_all_gather:
        return 0
    return len(stage_layer_indices(spec, stage)) * float8_linear_weights(spec)


def layer_parameters(spec: ModelSpec, kind: LayerKind | None = None) -> int:
    """Weights of one layer (`layer_parameter_parts`); the NumPy MLP's w1, b1, w2, b2."""
    if spec.kind == "mlp":
        return numpy_mlp.layer_parameters(spec)
    return layer_parameter_parts(spec, kind).total


@cached_by_chain(maxsize=128)
def parameter_count(spec: ModelSpec) -> ParameterCount:
    """Parameters of the whole model. GPT-2 (124M) gives 124,439,808; Llama-3-8B 8,030,261,248;
    Mixtral-8x7B 46,702,792,704; DeepSeek-V3 671,026,420,224 (its 61 layers, MTP excluded)."""
    if spec.kind == "mlp":
        return ParameterCount(0, layer_parameters(spec), spec.layers, 0, 0)
    positions = spec.seq * spec.hidden if spec.positions == "learned" else 0
    embedding = spec.vocab * spec.hidden + positions
    output = 0 if spec.tied_embeddings else spec.vocab * spec.hidden
    final_norm = norm_parameters(spec)
    # Per kind of layer, times its count (the sums are of ints: exact in any order).
    counts = Counter(layer_kinds(spec))
    parts = [(layer_parameter_parts(spec, kind), count) for kind, count in counts.items()]
    all_layers = sum(part.total * count for part, count in parts) if len(counts) > 1 else None
    if spec.mtp_layers:  # the MTP blocks' experts count and route as the layers'
        parts.append((layer_parameter_parts(spec, mtp.mtp_kind(spec)), spec.mtp_layers))
    return ParameterCount(
        embedding,
        layer_parameters(spec),
        spec.layers,
        final_norm,
        output,
        all_layers,
        sum(part.experts * count for part, count in parts),
        sum(part.inactive * count for part, count in parts),
        None
        if spec.training == "full"
        else finetune.lora_parameters(spec, Counter(layer_kinds(spec))),
        mtp_parameters(spec),
    )


def mtp_parameters(spec: ModelSpec) -> int:
    """The MTP depths' own weights (ckplan.model.mtp; the embedding and output head are shared):
    per depth a transformer block of the decoder's last kind, eh_proj's 2h x h and three
    norms. DeepSeek-V3's one depth: 11,610,068,224 (its block 11,507,286,272, eh_proj
    102,760,448 and three norms), where deepseek-ai/DeepSeek-V3's README_WEIGHTS.md states
    "11.5B unique parameters (excluding the shared 0.9B Embedding and 0.9B output Head)"."""
    if not spec.mtp_layers:
        return 0
    block = layer_parameter_parts(spec, mtp.mtp_kind(spec)).total
    projection = 2 * spec.hidden * spec.hidden + 3 * mtp.norm_parameters(spec)
    return spec.mtp_layers * (block + projection)


def rank_stages(spec: ModelSpec, rank: int) -> tuple[int, ...]:
    """The model stages pipeline rank `rank` holds: its own, or under DualPipe its own and its
    mirror p - 1 - rank, one per direction. deepseek-ai/DualPipe at 3da1bbe,
    examples/example_dualpipe.py: `local_full_modules = nn.Sequential(full_modules[rank],
    full_modules[pp_size - 1 - rank])`; the DeepSeek-V3 Technical Report (arXiv 2412.19437)
    §3.2.1 and Table 2: 'keeping two copies of the model parameters', 2x parameters."""
    if spec.pipeline_schedule != "dualpipe":
        return (rank,)
    return (rank, spec.pp - 1 - rank)


@cached_by_chain(maxsize=256)
def stage_parameters(spec: ModelSpec, stage: int = 0) -> tuple[int, int]:
    """(dense, expert) parameters on one GPU of pipeline stage `stage`: those of the model
    stages it holds (`rank_stages`: under DualPipe two, `model_stage_parameters` each)."""
    stages = rank_stages(spec, stage)
    held = [model_stage_parameters(spec, each) for each in stages]
    dense, expert = sum(d for d, _ in held), sum(e for _, e in held)
    if spec.mtp_layers and not spec.tied_embeddings and {0, spec.pp - 1} <= set(stages):
        # the MTP depths' word embedding is the first stage's on the same rank: DeepSeek-V3
        # Technical Report (arXiv 2412.19437) §3.2.3, "Shared Embedding and Output Head for
        # Multi-Token Prediction": with DualPipe the shallowest and deepest layers share a
        # rank, which "enables the physical sharing of parameters and gradients"
        dense -= split_share(spec.vocab * spec.hidden, spec.tp)
    return dense, expert


def model_stage_parameters(spec: ModelSpec, stage: int = 0) -> tuple[int, int]:
    """(dense, expert) parameters of model stage `stage` on one GPU, as Megatron-LM lays
    them out (`layer_parameter_parts`): its layers; on the first stage the vocab-parallel word
    embedding (V/t rows) and the learned position embedding, a plain torch.nn.Embedding whole
    on every TP rank (megatron/core/models/common/embeddings/language_model_embedding.py,
    "Position embedding (serial)"); on the last stage the final norm (whole) and the
    column-parallel output layer (V/t rows), which with tied embeddings and p > 1 is a copy of
    the word embedding kept on the last stage (LanguageModule.
    setup_embeddings_and_output_layer: "maintain duplicated embedding weights in post
    processing stage"), and the MTP depths with their copy of the word embedding
    (ckplan.model.mtp). The NumPy MLP: its stage's layers."""
    counts = parameter_count(spec)
    if spec.kind == "mlp":
        return counts.per_layer * len(stage_layer_indices(spec, stage)), 0
    dense = expert = 0
    for kind, count in stage_kind_counts(spec, stage).items():
        part = layer_parameter_parts(spec, kind)
        dense += count * part.dense_per_rank(spec)
        expert += count * part.experts_per_rank(spec)
    words = split_share(spec.vocab * spec.hidden, spec.tp)
    if stage == 0:
        dense += words + (counts.embedding - spec.vocab * spec.hidden)  # positions, whole
    if stage == spec.pp - 1:
        tied_copy = spec.tied_embeddings and spec.pp > 1
        dense += counts.final_norm + (words if counts.output or tied_copy else 0)
        if spec.mtp_layers:
            # the MTP depths, and the word embedding they look up (GPTModel builds it where
            # pre_process or mtp_process; tied, the output layer's copy is that one)
            block = layer_parameter_parts(spec, mtp.mtp_kind(spec))
            dense += spec.mtp_layers * (
                block.dense_per_rank(spec) + mtp.projection_parameters_per_rank(spec)
            )
            expert += spec.mtp_layers * block.experts_per_rank(spec)
            if stage > 0 and not spec.tied_embeddings:
                dense += words
    return dense, expert


def trainable_stage_parameters(spec: ModelSpec, stage: int = 0) -> tuple[int, int]:
    """(dense, expert) parameters that train on one GPU of pipeline stage `stage`: all of
    `stage_parameters`, or with frozen base weights the LoRA adapters of its layers
    (`finetune.lora_layer_parameters`; none for training: frozen). What the gradients'
    reduction and the optimizer step read."""
    if spec.training == "full":
        return stage_parameters(spec, stage)
    return finetune.lora_parameters(spec, stage_kind_counts(spec, stage)), 0


def stepped_parameters(spec: ModelSpec, stage: int = 0) -> int:
    """The parameters whose optimizer state one GPU of pipeline stage `stage` holds and steps:
    its trainable ones (`trainable_stage_parameters`), from ZeRO 1 the dense ones' share over
    dp·cp and the routed experts' over their expert-data-parallel group (as `states_of`
    shards the optimizer state)."""
    dense, experts = trainable_stage_parameters(spec, stage)
    if spec.zero >= 1:
        dense = split_share(dense, spec.dp * spec.cp)
        experts = split_share(experts, spec.expert_data_parallel) if experts else 0
    return dense + experts


def _allocates_workspace(spec: ModelSpec) -> bool:
    """Whether the optimizer step allocates beside the states on the GPU: foreach AdamW or
    Adafactor, stepping there (not on the host, not tensor by tensor in backward)."""
    if spec.optimizer_offload != "none" or spec.optimizer_in_backward:
        return False
    return spec.optimizer == "adafactor" or frameworks.optimizer_implementation(spec) == "foreach"


def optimizer_workspace_bytes(spec: ModelSpec, stage: int = 0) -> int:
    """What the optimizer step allocates on one GPU of pipeline stage `stage` beside the model
    states: foreach AdamW's copy of exp_avg_sq over the parameters it steps
    (`optimizers.foreach_adamw_workspace_bytes`, `frameworks.optimizer_implementation`
    foreach), or Adafactor's fp32 temporaries of its largest trained tensor
    (`optimizers.adafactor_workspace_bytes`; zero 0, whole tensors); 0 for the fused step,
    which updates in place, and for the other optimizers' kernels, for a step on the host
    (`optimizer_offload`), and for the step in backward, which runs one tensor at a time
    (its largest tensor's temporaries are not counted)."""
    if not _allocates_workspace(spec):
        return 0
    if spec.optimizer == "adafactor":
        largest = largest_trained_parameter(spec)
        if spec.training == "full" and not outside_layer_parameters(spec, stage):
            largest = frameworks.largest_weight(spec, spec.tp)  # no embedding or output here
        return optimizers.adafactor_workspace_bytes(largest, spec.weight_bytes, spec.grad_bytes)
    return optimizers.foreach_adamw_workspace_bytes(
        stepped_parameters(spec, stage), spec.optimizer_bytes
    )


def optimizer_step_bytes(spec: ModelSpec) -> int:
    """The allocated bytes of the optimizer step on the busiest GPU where the step allocates a
    workspace (`optimizer_workspace_bytes`), else 0: the weights, every gradient, the optimizer
    states, the framework's buffers that outlive the backward (`frameworks.step_buffer_bytes`)
    and the workspace; the activations are freed by then (derived). Without a workspace the
    step holds no more than the end of the backward, which the schedule's peak covers."""
    if not _allocates_workspace(spec):
        return 0  # no workspace on any stage
    best = 0
    for stage in distinct_stages(spec):
        workspace = optimizer_workspace_bytes(spec, stage)
        states = model_state_bytes(spec, stage)
        kept = frameworks.step_buffer_bytes(spec, sum(trainable_stage_parameters(spec, stage)))
        held = states.weights + states.gradients + states.optimizer + kept
        best = max(best, held + workspace)
    return best


def distinct_stages(spec: ModelSpec) -> tuple[int, ...]:
    """One pipeline stage of each kind whose parameters can differ: the first, the last, and
    each middle stage whose layer kinds no earlier middle stage holds."""

    stages, seen = [0], set()
    for stage in range(1, spec.pp - 1):
        kinds = Counter(stage_kinds(spec, stage))
        key = frozenset(kinds.items())
        if key not in seen:
            seen.add(key)
            stages.append(stage)
    return (*stages, spec.pp - 1) if spec.pp > 1 else (0,)


@cached_by_chain(maxsize=128)
def busiest_stage(spec: ModelSpec) -> int:
    """The pipeline stage whose GPUs hold the most parameters (the first of equals): the first
    (embedding) or the last (output layer) for a uniform model, else the fullest
    (DeepSeek-V3's first stage holds its three dense layers)."""
    return max(
        distinct_stages(spec), key=lambda stage: (sum(stage_parameters(spec, stage)), -stage)
    )


def parameters_per_gpu(spec: ModelSpec) -> int:
    """Parameters held by the busiest GPU (`busiest_stage`)."""
    return sum(stage_parameters(spec, busiest_stage(spec)))


@dataclass(frozen=True)
class ModelStateBytes:
    weights: int
    gradients: int
    optimizer: int  # fp32 master weights + Adam moments
    # of the above, the routed experts' (sharded over expert-data-parallel ranks by ZeRO)
    expert_weights: int = 0
    expert_gradients: int = 0
    expert_optimizer: int = 0
    # the framework's communication buckets and unsharded copies (model.frameworks)
    buffers: int = 0
    # model states in host memory (optimizer_offload, param_offload: `offloaded_states`), per
    # GPU; not in `total`, which is the device's
    host: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.buffers

    @property
    def expert_total(self) -> int:
        return self.expert_weights + self.expert_gradients + self.expert_optimizer


# every strategy a search evaluates on a layout holds the same states and pipeline buffers
@lru_cache(maxsize=4096)
def model_state_bytes(spec: ModelSpec, stage: int | None = None) -> ModelStateBytes:
    """Weights, gradients and optimizer state per GPU of pipeline stage `stage` (default the
    busiest, `busiest_stage`).

    Megatron-LM's mixed-precision Adam keeps 18 bytes per parameter: bf16 weights (2), fp32 main
    gradients (4), fp32 master weights (4), Adam m and v (4 + 4) (Megatron-LM
    docs/source/distrib_optimizer.md); each part is a spec key. ZeRO (Rajbhandari et al. 2020,
    §5): stage 1 shards master weights and optimizer over the dp·cp ranks that hold the same
    parameters (Megatron's data-parallel group with context parallelism; torchtitan's dp_shard·cp
    FSDP mesh), stage 2 also gradients, stage 3 also weights (torchtitan's FSDP2 from stage 2,
    `frameworks.weights_sharded_from`). Megatron's distributed optimizer,
    6 + 12/d, is zero: 1 here. Routed
    experts' states are sharded over their own data-parallel group, tp·cp·dp/(ep·etp)
    (Megatron-LM's expert_data_parallel_size; `ModelSpec.expert_data_parallel`).
    """
    stage = busiest_stage(spec) if stage is None else stage
    if spec.training != "full":
        return finetune_state_bytes(spec, stage)
    dense, expert = stage_parameters(spec, stage)
    return states_of(
        spec,
        dense,
        expert,
        buffers=stage_buffer_bytes(spec, stage),
        optimizer_extra=optimizer_tensor_bytes(spec, stage),
        held_gradients=in_backward_gradient_parameters(spec, stage),
        fp8_weights=fp8_primary_weights(spec, stage),
    )


def finetune_state_bytes(
    spec: ModelSpec, stage: int, zero: int | None = None, dp: int | None = None
) -> ModelStateBytes:
    """Model states per GPU of pipeline stage `stage` when the base weights are frozen
    (training: frozen, lora, qlora; ckplan.model.finetune).

    derived: a frozen parameter holds its weight and nothing else: no gradient, no master copy,
    no optimizer state (PyTorch optimizers skip parameters whose .grad is None). The layers'
    linear weights are held in weight_format (`finetune.quantized_weight_bytes`: bitsandbytes
    replaces nn.Linear layers, and transformers keeps the output layer in full precision,
    src/transformers/integrations/bitsandbytes.py get_keys_to_not_convert, "keep the lm_head
    in full precision"); the norms, biases, embeddings and output layer at
    weight_bytes (bf16 in torchtune's QLoRA recipes; fp32 after PEFT's
    prepare_model_for_kbit_training, peft v0.17.0 src/peft/utils/other.py, "cast all non INT8
    parameters to fp32", which hf's weight_bytes 4 gives). ZeRO-3 (PyTorch FSDP from zero 2,
    `frameworks.weights_sharded_from`) shards the frozen weights over dp·cp as any
    weight, but for the 4-bit weights' quantisation statistics, which are no parameter's data
    and stay whole on every rank (`sharded_frozen_bytes`). The LoRA adapters train with the
    usual weight, gradient, master and optimizer bytes
    (hf's 4 + 4 + 0 + 8 are PEFT's fp32 adapters: its
    autocast_adapter_dtype=True upcasts bf16 and fp16 adapter weights, peft v0.17.0
    src/peft/tuners/tuners_utils.py `_cast_adapter_dtype`). The framework's buffers
    (`frameworks.buffer_bytes`) are those of the trainable parameters, beside DeepSpeed
    ZeRO-3's whole copies of the adapter matrices below its persistence threshold
    (`frameworks.deepspeed_persistent_bytes`; the norms' copies, some MB, are not counted).
    `zero` and `dp` (the ranks sharing the states, default spec's zero and dp·cp) as
    `states_of` takes them.
    """
    zero = spec.zero if zero is None else zero
    dp = spec.dp * spec.cp if dp is None else dp
    kind_counts = stage_kind_counts(spec, stage)
    base, statistics = frozen_weight_bytes(spec, stage, spec.weight_bytes)
    if zero >= frameworks.weights_sharded_from(spec):
        base = sharded_frozen_bytes(base, statistics, dp)
    on_host = host_frozen_bytes(spec, stage, dp)
    if on_host:  # the parameters' data on the host: the 4-bit statistics stay
        base = statistics
    # the largest layer's adapters and gathered weights size the per-layer buffers
    adapter_layer = max(finetune.lora_layer_parameters(spec, kind) for kind in kind_counts)
    trainable = finetune.lora_parameters(spec, kind_counts)
    gathered = tuple(
        split_share(part, spec.tp)
        for part in max(
            finetune.gathered_layer_bytes(spec, spec.weight_bytes, kind) for kind in kind_counts
        )
    )
    buffers = (
        frameworks.buffer_bytes(spec, trainable, adapter_layer, 0, gathered=gathered)
        if trainable
        else 0
    )
    if frameworks.fsdp1_resharding(spec):  # the root unit's frozen copy, kept all step
        buffers = frameworks.fsdp1_kept_unsharded_bytes(outside_layer_parameters(spec, stage))
    if frameworks.fsdp2_frozen_resharding(spec):  # the kept unit's frozen copy (final norm, output)
        grouping = frameworks.spec_fsdp2_grouping(spec)
        kept = frameworks.fsdp2_outer_units(
            outside_layer_parameters(spec, stage), embedding_parameters(spec, stage), grouping
        )[1]
        buffers = frameworks.fsdp2_kept_unsharded_bytes(kept, 0, grouping.last_block_kept)
    if spec.framework == "deepspeed" and zero == 3 and dp > 1:  # the adapters kept whole
        for kind, count in kind_counts.items():
            elements = finetune.adapter_tensor_elements(spec, kind)
            persistent = frameworks.deepspeed_persistent_bytes(elements)
            buffers += count * split_share(persistent, spec.tp)
    if zero == 2 and dp > 1 and zero >= frameworks.weights_sharded_from(spec):
        # PyTorch FSDP without reshard after forward (FSDP2's reshard_after_forward False,
        # FSDP1's SHARD_GRAD_OP): every unit's frozen weights stay gathered in bf16 (4-bit ones
        # packed) from its forward to the end of the backward, beside the adapters' copies
        # `buffer_bytes` holds (frameworks.weights_sharded_from: their shards are sharded)
        for kind, count in kind_counts.items():
            frozen_layer = finetune.gathered_layer_bytes(spec, frameworks.HALF, kind)[0]
            frozen_layer -= frameworks.HALF * finetune.lora_layer_parameters(spec, kind)
            buffers += count * split_share(frozen_layer, spec.tp)
        buffers += frameworks.HALF * outside_layer_parameters(spec, stage)
    adapters = states_of(
        spec,
        trainable,
        0,
        zero=zero,
        dp=dp,
        optimizer_extra=optimizer_tensor_bytes(spec, stage),
        held_gradients=in_backward_gradient_parameters(spec, stage),
        fp8_weights=fp8_primary_weights(spec, stage),
    )
    # of the frozen weights, the routed experts' (at weight_bytes: never quantised, `finetune`)
    expert_weights = 0 if on_host else stage_parameters(spec, stage)[1] * spec.weight_bytes
    if zero >= frameworks.weights_sharded_from(spec):
        expert_weights = split_share(expert_weights, dp)
    return ModelStateBytes(
        base + adapters.weights,
        adapters.gradients,
        adapters.optimizer,
        expert_weights=expert_weights,
        buffers=buffers,
        host=adapters.host + on_host,
    )


def host_frozen_bytes(spec: ModelSpec, stage: int, dp: int | None = None) -> int:
    """Bytes of the frozen base weights that the host holds for one GPU of pipeline stage
    `stage` under `param_offload: cpu` with frozen base weights: its shard over `dp` ranks
    (default dp·cp) of their parameters' data, as stored (`frozen_weight_bytes` at
    weight_bytes). FSDP's CPU offload keeps every sharded FlatParameter on the CPU, the
    frozen ones among them (torch/distributed/fsdp/_flat_param.py, `_offload_params`,
    PyTorch v2.13.0), and DeepSpeed's offload_param every ZeRO-3 partition; 4-bit weights'
    statistics, no parameter's data, stay on the GPU (`sharded_frozen_bytes`). 0 without
    param_offload or under training: full (`offloaded_states`). derived."""
    if spec.param_offload == "none" or spec.training == "full":
        return 0
    dp = spec.dp * spec.cp if dp is None else dp
    base, statistics = frozen_weight_bytes(spec, stage, spec.weight_bytes)
    return split_share(base - statistics, dp)


def frozen_weight_bytes(spec: ModelSpec, stage: int, per_value: int) -> tuple[int, int]:
    """(bytes, of which quantisation statistics) of the frozen base weights on one GPU of
    pipeline stage `stage`, before ZeRO shards them: the layers' linear weights in
    weight_format (`finetune.frozen_linear_bytes`, statistics included), at `per_value` bytes
    a value where none is given, and every other weight (norms, biases, embeddings, output
    layer) and a mixture of experts' experts and router at `per_value`. Under tp the split
    linears at their format's bytes.

    derived: stage_parameters (dense and experts) less the linears' values, plus the linears as
    stored, summed over the stage's kinds of layer."""
    dense, experts = stage_parameters(spec, stage)
    fmt = spec.weight_format
    linear_values = linear_bytes = statistics = 0
    for kind, count in stage_kind_counts(spec, stage).items():
        linear_whole = finetune.linear_weight_parameters(spec, kind)  # one layer, not split
        if spec.tp == 1:
            values = linear_whole
            linear_bytes += count * finetune.frozen_linear_bytes(spec, per_value, kind)
        else:  # frozen weights under tp (bf16, fp16, fp32): the split linears at their bytes
            part = layer_parameter_parts(spec, kind)
            values = part.dense_per_rank(spec) - (part.total - part.experts - linear_whole)
            linear_bytes += count * values * (per_value if fmt is None else {"fp32": 4}.get(fmt, 2))
        linear_values += count * values
        statistics += count * finetune.layer_quantization_statistics_bytes(spec, kind)
    return (dense + experts - linear_values) * per_value + linear_bytes, statistics


def frozen_gathered_bytes(spec: ModelSpec, stage: int) -> int:
    """Bytes of the frozen base weights on one GPU of pipeline stage `stage` that ZeRO-3 or
    FSDP all-gathers for every forward and backward (training: frozen, lora, qlora; 0 under
    training: full, whose weights `step_time.gradient_reduction` gathers with the rest): the
    parameters' data, 4-bit weights as their packed values (their statistics are no
    parameter's data and stay on every rank, `sharded_frozen_bytes`), every unquantised value
    in the compute dtype (FSDP gathers in MixedPrecisionPolicy.param_dtype, DeepSpeed the bf16
    partition): `frozen_weight_bytes` at min(weight_bytes, dtype_bytes) a value, less the
    statistics. derived."""
    if spec.training == "full":
        return 0
    gathered, statistics = frozen_weight_bytes(
        spec, stage, min(spec.weight_bytes, spec.dtype_bytes)
    )
    return gathered - statistics


def sharded_frozen_bytes(frozen_bytes: int, unsharded_bytes: int, dp: int) -> int:
    """One rank's share of `frozen_bytes` of frozen weights under ZeRO-3 / FSDP over `dp`
    ranks, of which `unsharded_bytes` are not parameter data and stay whole on every rank
    (4-bit weights' quantisation statistics, `finetune.quantization_statistics_bytes`).

    derived: the parameters' data split over the ranks, the rest kept."""
    return split_share(frozen_bytes - unsharded_bytes, dp) + unsharded_bytes


def layer_parameters_per_rank(spec: ModelSpec, kind: LayerKind | None = None) -> int:
    """Parameters on one GPU of one layer of `kind`: its dense parameters over tp, its experts
    over ep·etp (`layer_parameter_parts`)."""
    parts = layer_parameter_parts(spec, kind)
    return parts.dense_per_rank(spec) + parts.experts_per_rank(spec)


def largest_layer_parameters(spec: ModelSpec, stage: int = 0) -> int:
    """Parameters on one GPU of the largest layer pipeline stage `stage` holds (its dense
    parameters over tp, its experts over ep·etp)."""
    return max(layer_parameters_per_rank(spec, kind) for kind in stage_kind_counts(spec, stage))


def output_layer_parameters(spec: ModelSpec) -> int:
    """Parameters on one GPU of the output layer (V/t rows of h, the vocab-parallel split
    rounded up) and the final norm's weight (h): the root module's part whose gradients the
    output stage's backward makes."""
    if not spec.vocab:
        return 0
    return -(-spec.vocab * spec.hidden // spec.tp) + spec.hidden


def embedding_parameters(spec: ModelSpec, stage: int = 0) -> int:
    """Parameters on one GPU of pipeline stage `stage` of the token embedding (V/t rows of h,
    the vocab-parallel split) and a learned position embedding: the first stage's, else 0."""
    if not spec.vocab or stage != 0:
        return 0
    return split_share(spec.vocab * spec.hidden, spec.tp) + (
        parameter_count(spec).embedding - spec.vocab * spec.hidden
    )


def outside_layer_parameters(spec: ModelSpec, stage: int) -> int:
    """The parameters one GPU of pipeline stage `stage` holds outside its transformer layers
    (embedding, final norm, output layer): the stage's less its layers' (derived)."""
    dense, expert = stage_parameters(spec, stage)
    in_layers = sum(
        count * layer_parameters_per_rank(spec, kind)
        for kind, count in stage_kind_counts(spec, stage).items()
    )
    return dense + expert - in_layers


@lru_cache(maxsize=4096)
def pipeline_buffer_bytes(spec: ModelSpec, stage: int, in_flight: int) -> int:
    """The pipeline runtime's buffers on one GPU of pipeline stage `stage` with `in_flight`
    micro-batches waiting for their backward: torch.distributed.pipelining's under torchtitan
    (`frameworks.torch_pipeline_buffer_bytes`; the boundary is the residual stream entering a
    layer, `layer_input_bytes`, and the last stage's output its B-byte logits), and under
    torchtitan 2024.12 the finished micro-batches' outputs and input gradients
    (`frameworks.torch_pipeline_finished_bytes`); 0 without pipeline parallelism or under
    another framework (Megatron-LM frees what it sends). With interleaving (v > 1) the rank's
    v local stages' buffers, each at its own in-flight and finished micro-batches
    (`interleaved_pipeline_buffer_bytes`; `in_flight` is then not read). Under DualPipe none:
    its runtime empties what it sent (deepseek-ai/DualPipe at 3da1bbe, dualpipe.py
    `_free_tensors`), nor where the runtime frees each stage's inputs and outputs once used
    (`deallocate_pipeline_outputs`, Llama 3's, §3.3.2)."""
    if spec.framework != "torchtitan" or spec.pp == 1 or spec.deallocate_pipeline_outputs:
        return 0
    if spec.pipeline_schedule == "dualpipe":  # DualPipe's own runtime: _free_tensors (3da1bbe)
        return 0
    if spec.kind != "transformer":
        return 0
    boundary = layer_input_bytes(spec)
    logits = spec.dtype_bytes * logits_elements(spec.chain)
    if spec.virtual_stages > 1:
        return interleaved_pipeline_buffer_bytes(spec, stage, boundary, logits)
    last = stage == spec.pp - 1
    output = logits if last else boundary
    held = frameworks.torch_pipeline_buffer_bytes(
        spec.microbatches, in_flight, boundary, output, stage == 0, last
    )
    if frameworks.torch_pipeline_keeps_finished(spec):
        held += frameworks.torch_pipeline_finished_bytes(
            spec.microbatches, in_flight, boundary, output, stage == 0
        )
    return held


def interleaved_pipeline_buffer_bytes(
    spec: ModelSpec, rank: int, boundary_bytes: int, logits_bytes: int
) -> int:
    """torch.distributed.pipelining's buffers on one GPU of pipeline rank `rank` under
    ScheduleInterleaved1F1B: torchtitan builds one `PipelineStage` per local stage, model stage
    c·p + rank for c < v (torchtitan 9dec370, pipeline_llama.py with pipelining_utils.py
    `stage_ids_this_rank`, style 'loop'), each with its own receive and gradient buffers and
    kept outputs (`frameworks.torch_pipeline_buffer_bytes`), at the in-flight and finished
    micro-batches of each local stage where the rank holds the most forwards
    (`frameworks.torch_interleaved_chunk_counts`), and under torchtitan 2024.12 each local
    stage's finished outputs and input gradients (`frameworks.torch_pipeline_kept_bytes`). The
    model's last stage (the rank p - 1's last local stage) outputs the B-byte logits, every
    other the residual stream `boundary_bytes`; the first (rank 0's first) receives token ids.
    derived: the per-stage terms summed over the rank's local stages."""
    p, v, m = spec.pp, spec.virtual_stages, spec.microbatches
    counts = frameworks.torch_interleaved_chunk_counts(p, v, m, rank)
    keeps_finished = frameworks.torch_pipeline_keeps_finished(spec)
    held = 0
    for chunk, (in_flight, finished) in enumerate(counts):
        model_stage = chunk * p + rank
        first, last = model_stage == 0, model_stage == p * v - 1
        output = logits_bytes if last else boundary_bytes
        held += frameworks.torch_pipeline_buffer_bytes(
            m, in_flight, boundary_bytes, output, first, last
        )
        if keeps_finished:
            held += frameworks.torch_pipeline_kept_bytes(finished, boundary_bytes, output, first)
    return held


def stream_pool_bytes(spec: ModelSpec, stage: int | None = None) -> int:
    """Bytes the caching allocator holds reserved for FSDP2's side streams on one GPU of
    pipeline stage `stage` (default the busiest) under torchtitan's FSDP
    (`frameworks.fsdp2_stream_pool_bytes`: the stage's sharded fp32 gradients and its
    all-gather pool, `frameworks.fsdp2_all_gather_pool_bytes`, the units in forward order),
    0 otherwise."""
    if spec.kind != "transformer" or not frameworks.fsdp2_sharded(spec):
        return 0
    stage = busiest_stage(spec) if stage is None else stage
    layer = largest_layer_parameters(spec, stage)
    outside = outside_layer_parameters(spec, stage)
    gradients = model_state_bytes(spec, stage).gradients
    grouping = frameworks.spec_fsdp2_grouping(spec)
    embedding, kept = frameworks.fsdp2_outer_units(
        outside, embedding_parameters(spec, stage), grouping
    )
    # the embedding's own unit is gathered before the blocks and the kept one after them;
    # a kept unit holding the embedding (the root module, tied weights) before them
    before, after = (embedding, kept) if grouping.embedding_own_unit else (kept, 0)
    pool = frameworks.fsdp2_all_gather_pool_bytes(
        before,
        layer,
        after,
        len(stage_layer_indices(spec, stage)),
        spec.dp * spec.cp,
        spec.expandable_segments,
        layer_float8=float8_gathered_layer_weights(spec),
    )
    return frameworks.fsdp2_stream_pool_bytes(gradients, pool)


def stage_buffer_bytes(spec: ModelSpec, stage: int) -> int:
    """The framework's buffers on one GPU of pipeline stage `stage` (frameworks.buffer_bytes):
    over its parameters, its largest layer's and those outside the layers."""
    if spec.kind != "transformer":
        return 0
    dense, expert = stage_parameters(spec, stage)
    layer = largest_layer_parameters(spec, stage)
    outside = outside_layer_parameters(spec, stage)
    float8 = (float8_gathered_stage_weights(spec, stage), float8_gathered_layer_weights(spec))
    buffers = frameworks.buffer_bytes(
        spec, dense + expert, layer, outside, embedding_parameters(spec, stage), float8=float8
    )
    if spec.precision == "fp8" and spec.zero < 3:
        # Transformer Engine's FP8 copies of the FP8 linear layers' weights: the module's
        # cached workspace, or with FP8 primary weights the parameter's own transpose
        copy = frameworks.te_fp8_weight_copy_bytes(spec.fp8_param_gather)
        buffers += copy * sum(fp8_linear_parameters(spec, stage))
        # block scaling: both copies' fp32 scales, one per 128x128 block of each matrix
        buffers += sum(fp8_weight_block_scale_bytes(spec, stage))
    return buffers


def _bias_parameters_per_rank(spec: ModelSpec, kind: LayerKind) -> tuple[int, int]:
    """(dense, routed-expert) bias elements of one layer on one rank, as
    `layer_parameter_parts` lays them out: column-parallel biases split over t, row-parallel
    ones whole; the experts' fc1 biases over ep·etp, their fc2 biases over ep."""
    h, t = spec.hidden, spec.tp
    gated = spec.mlp != "gelu"
    dense = expert = 0
    if not spec.mla:
        d = spec.head_dim
        if spec.qkv_bias:
            kv_heads_here = -(-spec.kv_heads // t)
            dense += split_share(spec.heads * d, t) + 2 * d * kv_heads_here
        dense += h if spec.bias else 0  # the out-projection's, whole
    if not spec.bias:
        return dense, expert
    if kind.moe:
        if spec.shared_ffn_hidden:
            shared_fc1 = (2 if gated else 1) * spec.shared_ffn_hidden
            dense += split_share(shared_fc1, t) + h
        fc1 = (2 if gated else 1) * spec.moe_ffn_hidden
        expert += split_share(spec.experts * fc1, spec.ep * spec.etp)
        expert += split_share(spec.experts * h, spec.ep)
        return dense, expert
    fc1 = (2 if gated else 1) * spec.ffn_hidden
    return dense + split_share(fc1, t) + h, expert


def fp8_linear_layer_parameters(spec: ModelSpec, kind: LayerKind) -> tuple[int, int]:
    """(dense, routed-expert) weights of one layer's FP8 linear layers on one rank: the
    weights that Transformer Engine's linear modules (TELayerNormColumnParallelLinear,
    TERowParallelLinear, TEGroupedLinear; megatron/core/models/gpt/gpt_layer_specs.py,
    core_v0.14.0) hold, MLA's down and up projections among them: the layer's parameters
    less its norms (and QK-norms, MLA's latent norms), its biases and the MoE router with its
    expert bias and the shared experts' gate, which are plain parameters. derived:
    `layer_parameter_parts` with those tensors taken out."""
    parts = layer_parameter_parts(spec, kind)
    plain = (4 if spec.post_norms else 2) * norm_parameters(spec)
    if spec.mla:
        plain += spec.kv_lora_rank + (spec.q_lora_rank or 0)
    else:
        q_norm, k_norm = qk_norm_parameters(spec)
        if spec.qk_norm_width == "full":  # split with their heads, as the Q and K weights
            q_norm = split_share(q_norm, spec.tp)
            k_norm = k_norm // spec.kv_heads * -(-spec.kv_heads // spec.tp)
        plain += q_norm + k_norm + split_share(sink_parameters(spec), spec.tp)
    if kind.moe:
        plain += spec.experts * spec.hidden + router_bias_parameters(spec)
        plain += spec.hidden if spec.shared_ffn_hidden and spec.shared_expert_gate else 0
    dense_bias, expert_bias = _bias_parameters_per_rank(spec, kind)
    dense = parts.dense_per_rank(spec) - plain - dense_bias
    return dense, parts.experts_per_rank(spec) - expert_bias


def fp8_linear_parameters(spec: ModelSpec, stage: int) -> tuple[int, int]:
    """(dense, routed-expert) weights of the FP8 linear layers on one GPU of pipeline stage
    `stage` under precision fp8: those of its layers (`fp8_linear_layer_parameters`) and of
    the MTP depths on the last stage (their blocks' and eh_proj's, a column-parallel TE
    linear: multi_token_prediction.py core_v0.14.0). The embedding, the output layer and the
    final norm stay in BF16 (Megatron-LM's VocabParallelEmbedding and ColumnParallelLinear,
    not Transformer Engine's). (0, 0) under any other precision."""
    eh_proj = split_share(2 * spec.hidden * spec.hidden, spec.tp)
    return _fp8_linear_sum(spec, stage, fp8_linear_layer_parameters, eh_proj)


def _fp8_linear_sum(spec: ModelSpec, stage: int, per_layer, eh_proj: int) -> tuple[int, int]:
    """(dense, routed-expert) sums of `per_layer(spec, kind)` over the layers of one GPU of
    pipeline stage `stage` and, on the last stage, each MTP depth's block plus `eh_proj`;
    (0, 0) but under precision fp8."""
    if spec.precision != "fp8" or spec.kind != "transformer":
        return 0, 0
    dense = expert = 0
    for model_stage in rank_stages(spec, stage):
        for kind, count in stage_kind_counts(spec, model_stage).items():
            layer_dense, layer_expert = per_layer(spec, kind)
            dense += count * layer_dense
            expert += count * layer_expert
        if spec.mtp_layers and model_stage == spec.pp - 1:
            block_dense, block_expert = per_layer(spec, mtp.mtp_kind(spec))
            dense += spec.mtp_layers * (block_dense + eh_proj)
            expert += spec.mtp_layers * block_expert
    return dense, expert


def fp8_linear_layer_tensors(spec: ModelSpec, kind: LayerKind) -> tuple[int, int]:
    """(dense, routed-expert) weight tensors of one layer's FP8 linear layers on one rank, as
    Megatron-Core's layer spec builds them (gpt_layer_specs.py core_v0.14.0): attention's
    linear_qkv and linear_proj, or MLA's linear_q_down_proj and linear_q_up_proj (one
    linear_q_proj without q_lora_rank), linear_kv_down_proj, linear_kv_up_proj and
    linear_proj; a dense MLP's linear_fc1 (gate and up fused) and linear_fc2; an MoE layer's
    shared experts' fc1 and fc2, and its routed experts' TEGroupedLinear fc1 and fc2, each
    one weight tensor per local expert (`weight{i}`, Transformer Engine v2.9
    module/grouped_linear.py): 2·E/ep."""
    attention = ((2 if spec.q_lora_rank else 1) + 3) if spec.mla else 2
    if not kind.moe:
        return attention + 2, 0
    shared = 2 if spec.shared_ffn_hidden else 0
    return attention + shared, 2 * (spec.experts // spec.ep)


# a weight matrix as Transformer Engine holds it on one rank: (out_features, in_features, how
# many such tensors)
Matrix = tuple[int, int, int]


def fp8_linear_layer_matrices(
    spec: ModelSpec, kind: LayerKind
) -> tuple[tuple[Matrix, ...], tuple[Matrix, ...]]:
    """(dense, routed-expert) weight matrices of one layer's FP8 linear layers on one rank,
    each (out_features, in_features, count), the tensors `fp8_linear_layer_tensors` counts
    with the shapes Megatron-Core gives them (a TE linear's weight is (out_features,
    in_features); column-parallel linears split out_features over t, row-parallel ones
    in_features; gpt_layer_specs.py, attention.py, multi_latent_attention.py, mlp.py,
    core_v0.14.0):

    - linear_qkv (a·d/t + 2d·ceil(g/t), h) and linear_proj (h, a·d/t);
    - MLA: linear_q_down_proj (q_lora_rank, h) and linear_q_up_proj (a·(d_nope + d_rope)/t,
      q_lora_rank), or linear_q_proj (a·(d_nope + d_rope)/t, h) without q_lora_rank;
      linear_kv_down_proj (kv_lora_rank + d_rope, h), whole on every rank;
      linear_kv_up_proj (a·(d_nope + d_v)/t, kv_lora_rank); linear_proj (h, a·d_v/t);
    - a dense MLP's linear_fc1 (gate and up fused: 2F/t, or F/t for GELU, by h) and
      linear_fc2 (h, F/t); an MoE layer's shared experts alike over shared_ffn_hidden, and
      E/ep routed experts each with its own fc1 (2F_e/etp, h) and fc2 (h, F_e/etp)
      (TEGroupedLinear's `weight{i}`).

    derived: the matrices `layer_parameter_parts` sums; their elements add up to
    `fp8_linear_layer_parameters` where t divides the split dimensions."""
    h, t = spec.hidden, spec.tp
    gated = spec.mlp != "gelu"
    dense: list[Matrix] = []
    if spec.mla:
        a, rope = spec.heads, spec.qk_rope_head_dim
        q_out = split_share(a * (spec.qk_nope_head_dim + rope), t)
        if spec.q_lora_rank:
            dense += [(spec.q_lora_rank, h, 1), (q_out, spec.q_lora_rank, 1)]
        else:
            dense.append((q_out, h, 1))
        kv_up = split_share(a * (spec.qk_nope_head_dim + spec.v_head_dim), t)
        dense += [(spec.kv_lora_rank + rope, h, 1), (kv_up, spec.kv_lora_rank, 1)]
        dense.append((h, split_share(a * spec.v_head_dim, t), 1))
    else:
        d = spec.head_dim
        q_out = split_share(spec.heads * d, t)
        dense += [(q_out + 2 * d * -(-spec.kv_heads // t), h, 1), (h, q_out, 1)]
    up = 2 if gated else 1
    if not kind.moe:
        F = spec.ffn_hidden
        dense += [(split_share(up * F, t), h, 1), (h, split_share(F, t), 1)]
        return tuple(dense), ()
    if spec.shared_ffn_hidden:
        S = spec.shared_ffn_hidden
        dense += [(split_share(up * S, t), h, 1), (h, split_share(S, t), 1)]
    F_e, local = spec.moe_ffn_hidden, spec.experts // spec.ep
    experts = ((split_share(up * F_e, spec.etp), h, local), (h, split_share(F_e, spec.etp), local))
    return tuple(dense), experts


def mtp_eh_proj_matrix(spec: ModelSpec) -> Matrix:
    """An MTP depth's eh_proj on one rank: a column-parallel TE linear from the concatenated
    hidden states and embeddings, 2h, to h (multi_token_prediction.py core_v0.14.0):
    (h/t, 2h), one tensor."""
    return split_share(spec.hidden, spec.tp), 2 * spec.hidden, 1


def _over_matrices(matrices: tuple[Matrix, ...], per_matrix) -> int:
    """`per_matrix(out_features, in_features)` summed over `matrices`, each `count` times."""
    return sum(count * per_matrix(rows, cols) for rows, cols, count in matrices)


def _fp8_block_sum(spec: ModelSpec, stage: int, per_matrix) -> tuple[int, int]:
    """(dense, routed-expert) sums of `per_matrix` over the FP8 weight matrices on one GPU of
    pipeline stage `stage` (`fp8_linear_layer_matrices`, each MTP depth's eh_proj) under
    `fp8_recipe` blockwise; (0, 0) under any other recipe or precision."""
    if spec.fp8_recipe != "blockwise":
        return 0, 0

    def per_layer(spec: ModelSpec, kind: LayerKind) -> tuple[int, int]:
        dense, expert = fp8_linear_layer_matrices(spec, kind)
        return _over_matrices(dense, per_matrix), _over_matrices(expert, per_matrix)

    eh_proj = _over_matrices((mtp_eh_proj_matrix(spec),), per_matrix)
    return _fp8_linear_sum(spec, stage, per_layer, eh_proj)


def fp8_weight_block_scale_bytes(spec: ModelSpec, stage: int) -> tuple[int, int]:
    """(dense, routed-expert) bytes of the fp32 block scales of the FP8 weights on one GPU of
    pipeline stage `stage` under `fp8_recipe` blockwise: each matrix's row-wise and
    column-wise scales (`fp8_blocks.weight_block_scale_bytes`), beside the two FP8 copies
    that `frameworks.te_fp8_weight_copy_bytes` counts: the cached workspace's (module/base.py
    `get_weight_workspace` quantizes into a `Float8BlockwiseQTensor` with both usages,
    Transformer Engine v2.9), or with `fp8_param_gather` the FP8 parameter's row-wise scales
    and the column-wise ones its `update_usage` makes for the backward. (0, 0) under any
    other recipe."""
    return _fp8_block_sum(spec, stage, weight_block_scale_bytes)


def fp8_linear_tensors(spec: ModelSpec, stage: int) -> tuple[int, int]:
    """(dense, routed-expert) FP8 weight tensors on one GPU of pipeline stage `stage`: its
    layers' (`fp8_linear_layer_tensors`) and on the last stage each MTP depth's block and
    eh_proj; (0, 0) under any other precision. The amaxes the master weights' cast
    all-reduces, one each (`frameworks.FP8_AMAX_BYTES`)."""
    return _fp8_linear_sum(spec, stage, fp8_linear_layer_tensors, 1)


def fp8_weight_amaxes(spec: ModelSpec, stage: int) -> tuple[int, int]:
    """(dense, routed-expert) amaxes the FP8 primary weights' cast all-reduces on one GPU of
    pipeline stage `stage` (`frameworks.FP8_AMAX_BYTES` each): one per FP8 weight tensor under
    delayed and current scaling (`fp8_linear_tensors`); under block scaling one per 128x128
    block of every FP8 weight (Transformer Engine v2.9 tensor/utils.py
    `_cast_master_weights_to_fp8_blockwise_scaling`: `packed_amaxes` holds each weight's
    row-wise scale shape, `num_amaxes = scale_shape[0] * scale_shape[1]`), counted matrix by
    matrix with each one's partial edge blocks and its scale shape's padding to 4 columns
    (`fp8_blocks.weight_block_amaxes`)."""
    if spec.fp8_recipe != "blockwise":
        return fp8_linear_tensors(spec, stage)
    return _fp8_block_sum(spec, stage, weight_block_amaxes)


def fp8_primary_weights(spec: ModelSpec, stage: int) -> tuple[int, int]:
    """(dense, routed-expert) weights kept in FP8 on one GPU of pipeline stage `stage`: the
    FP8 linear layers' with `fp8_param_gather` (`frameworks.fp8_primary_weight_bytes`), else
    none."""
    return fp8_linear_parameters(spec, stage) if spec.fp8_param_gather else (0, 0)


def states_of(
    spec: ModelSpec,
    dense: int,
    expert: int,
    zero: int | None = None,
    dp: int | None = None,
    expert_dp: int | None = None,
    buffers: int = 0,
    optimizer_extra: int = 0,
    held_gradients: int | None = None,
    tp: int | None = None,
    microbatches: int | None = None,
    fp8_weights: tuple[int, int] = (0, 0),
) -> ModelStateBytes:
    """The model states of `dense` and `expert` parameters under spec's bytes per parameter
    and its ZeRO stage, its data-parallel ranks `dp` (default dp·cp: the ranks that hold the
    same dense parameters, over which Megatron-LM's distributed optimizer and torchtitan's FSDP
    shard them) and expert data parallelism (or those given): `model_state_bytes`.
    `optimizer_extra`: the dense parameters' shape-dependent optimizer state
    (`optimizer_tensor_bytes`), sharded with the rest of it; `held_gradients`: the dense
    parameters whose gradients are held at once when they are not all
    (`in_backward_gradient_parameters`); `tp` a layout's (the offloaded states' staging
    buffers), default the spec's. The gradients are sharded from ZeRO 2 where the framework
    holds a shard through gradient accumulation (`frameworks.gradients_sharded`, over
    `microbatches`, default the spec's), else whole. `fp8_weights`: of `dense` and `expert`,
    the (dense, expert) weights kept in FP8 (`fp8_primary_weights`), one byte each
    (`frameworks.fp8_primary_weight_bytes`; unsharded: Megatron's zero 1)."""
    zero = spec.zero if zero is None else zero
    dp = spec.dp * spec.cp if dp is None else dp
    expert_dp = spec.expert_data_parallel if expert_dp is None else expert_dp

    def shard(params: int, ranks: int, bytes_per_param: int, from_stage: int) -> int:
        total = params * bytes_per_param
        return split_share(total, ranks) if zero >= from_stage else total

    def both(bytes_per_param: int, from_stage: int) -> tuple[int, int]:
        experts = shard(expert, expert_dp, bytes_per_param, from_stage)
        return shard(dense, dp, bytes_per_param, from_stage) + experts, experts

    weights, expert_weights = both(spec.weight_bytes, frameworks.weights_sharded_from(spec))
    if any(fp8_weights):
        fp8_bytes = frameworks.fp8_primary_weight_bytes(True, spec.weight_bytes)
        dense_fp8, expert_fp8 = fp8_weights
        weights -= (spec.weight_bytes - fp8_bytes) * (dense_fp8 + expert_fp8)
        expert_weights -= (spec.weight_bytes - fp8_bytes) * expert_fp8
    microbatches = spec.microbatches if microbatches is None else microbatches
    sharded_grads = frameworks.gradients_sharded(spec.framework, zero, microbatches, spec.grad_sync)
    grads_from = 2 if sharded_grads else 4  # 4: no ZeRO stage shards them
    gradients, expert_gradients = both(spec.grad_bytes, grads_from)
    if held_gradients is not None:
        gradients = shard(min(held_gradients, dense), dp, spec.grad_bytes, grads_from)
    optimizer, expert_optimizer = both(spec.master_bytes + spec.optimizer_bytes, 1)
    if optimizer_extra:
        optimizer += split_share(optimizer_extra, dp) if zero >= 1 else optimizer_extra
    states = ModelStateBytes(
        weights, gradients, optimizer, expert_weights, expert_gradients, expert_optimizer, buffers
    )
    if spec.optimizer_offload == "none":
        return states
    sharded = split_share(dense, dp) + (split_share(expert, expert_dp) if expert else 0)
    return offloaded_states(spec, states, sharded, zero, tp, microbatches)


def largest_trained_parameter(spec: ModelSpec, tp: int | None = None) -> int:
    """Values of the largest parameter tensor that trains on one GPU, which sizes DeepSpeed's
    CPU-offload gradient staging buffers (`frameworks.largest_parameter`): DeepSpeed takes it
    over the optimizer's groups, whose parameters it keeps only where requires_grad
    (deepspeed/runtime/zero/stage_1_and_2.py v0.19.8, `bit16_groups`, `largest_param_numel`),
    so with frozen base weights the largest adapter tensor (`finetune.adapter_tensor_elements`)."""
    if spec.training == "full":
        return frameworks.largest_parameter(spec, tp)
    return max(finetune.adapter_tensor_elements(spec), default=0)


HOST_GRADIENT_BYTES = 4  # fp32 gradients on the host (DeepSpeed's master dtype; FSDP2's reduce)


def host_gradient_bytes(spec: ModelSpec) -> int:
    """Bytes of one offloaded gradient value on the host: fp32 under DeepSpeed (its master
    dtype); under FSDP the sharded parameter's dtype, weight_bytes (FSDP1 pins
    `_cpu_grad = torch.zeros_like(flat_param._local_shard)`, torch/distributed/fsdp/
    _flat_param.py, PyTorch v2.13.0; FSDP2 copies the reduce-scatter output, cast to the
    sharded parameter's dtype, to the CPU, fp32 in torchtitan's recipe)."""
    return HOST_GRADIENT_BYTES if spec.framework == "deepspeed" else spec.weight_bytes


def offloaded_states(
    spec: ModelSpec,
    states: ModelStateBytes,
    sharded: int,
    zero: int,
    tp: int | None = None,
    microbatches: int | None = None,
) -> ModelStateBytes:
    """The model states `states` (per GPU, on the device) with optimizer_offload: cpu (and
    param_offload: cpu), `sharded` the parameters whose states this GPU owns (its share over
    dp·cp and the experts' data-parallel group): what stays on the device, and `host`, what
    the host holds for this GPU (every byte of it pinned but Adam's moments).

    DeepSpeed ZeRO-Offload (deepspeed/runtime/zero/stage_1_and_2.py and stage3.py, v0.19.8;
    Ren et al. 2021 §4): the fp32 master partition and its fp32 gradient
    (single_partition_of_fp32_groups and its .grad, pinned; ZeRO-3's grad_partitions_flat_buffer
    on the offload device) and DeepSpeedCPUAdam's exp_avg and exp_avg_sq move to the host:
    (master_bytes + optimizer_bytes + 4) per owned parameter; the device keeps no gradient
    buffer beyond the reduce buckets (each bucket's partition is copied out as it is reduced).
    ZeRO 1-2 also pin a weight_bytes copy of the partition on the host for the copy back
    (param_buffer_of_bit16_for_cpu_offload_groups) and two gradient staging buffers of the
    largest parameter, one on each side (`largest_trained_parameter`); the bf16 weights stay
    on the device. With offload_param (ZeRO-3), the weight_bytes partition lives on the host
    instead of the device.

    FSDP CPU offload (torch/distributed/fsdp/_fully_shard/_fsdp_param.py, PyTorch v2.13.0,
    CPUOffloadPolicy): the sharded parameters (weight_bytes, fp32 in torchtitan's recipe, the
    optimizer's own), their sharded gradients (reduce-scatter output copied to the CPU) and
    torch's AdamW moments are on the host: (2·weight_bytes + master_bytes + optimizer_bytes)
    per owned parameter (the gradient in the parameter's dtype, `host_gradient_bytes`); the
    device holds only the gathered parameters and buckets (`buffers`),
    and, where hf's FSDP accumulates several micro-batches under no_sync
    (`frameworks.offload_accumulates_on_device`), their unsharded gradients until the last
    backward reduces them (`states`' gradients, whole). `tp`, `microbatches`: a layout's,
    default the spec's.
    """
    owned = states.optimizer + sharded * host_gradient_bytes(spec)
    weights, expert_weights, buffers = states.weights, states.expert_weights, states.buffers
    if spec.framework == "deepspeed":
        staging = frameworks.HALF * largest_trained_parameter(spec, tp) if zero < 3 else 0
        host = owned + staging
        if zero < 3 or spec.param_offload != "none":
            host += sharded * spec.weight_bytes  # the partition's copy, or the partition
        if spec.param_offload != "none":
            weights = expert_weights = 0
        buffers += staging
    else:
        host = owned + sharded * spec.weight_bytes
        weights = expert_weights = 0
    microbatches = spec.microbatches if microbatches is None else microbatches
    accumulating = microbatches > 1 and frameworks.offload_accumulates_on_device(spec)
    return ModelStateBytes(
        weights=weights,
        gradients=states.gradients if accumulating else 0,
        optimizer=0,
        expert_weights=expert_weights,
        expert_gradients=states.expert_gradients if accumulating else 0,
        expert_optimizer=0,
        buffers=buffers,
        host=host,
    )


def optimizer_at_default(spec: ModelSpec) -> bool:
    """Whether optimizer_bytes is the optimizer's own default (`optimizers.per_parameter_bytes`
    over the framework's): then its shape-dependent state is added per tensor."""
    default = frameworks.training_defaults(spec.framework, spec.zero, spec.optimizer)
    return spec.optimizer_bytes == default["optimizer_bytes"]


def optimizer_tensor_bytes(spec: ModelSpec, stage: int) -> int:
    """The shape-dependent optimizer state of the trainable tensors on one GPU of pipeline stage
    `stage` (`optimizers.tensor_state_bytes` over `trainable_tensors`), before ZeRO shards it;
    0 for the optimizers without one or when optimizer_bytes is given."""
    if spec.optimizer not in optimizers.SHAPED or not optimizer_at_default(spec):
        return 0
    return optimizers.tensor_state_bytes(spec.optimizer, trainable_tensors(spec, stage))


def layer_tensors(spec: ModelSpec) -> Counter:
    """The shapes of one dense layer's parameter tensors, as Hugging Face's Llama-style modules
    hold them (tp 1; `finetune.linear_shapes`): each linear's (out, in) weight and its bias,
    the norms' gains (and LayerNorm's biases), the QK-norms' gains. Their values sum to
    `layer_parameters` (derived from `layer_parameter_parts`)."""
    h = spec.hidden
    tensors: Counter = Counter()
    for name, (fan_in, fan_out) in finetune.linear_shapes(spec).items():
        tensors[(fan_out, fan_in)] += 1
        has_bias = spec.qkv_bias if name in ("q_proj", "k_proj", "v_proj") else spec.bias
        if has_bias:
            tensors[(fan_out,)] += 1
    norms = 4 if spec.post_norms else 2
    tensors[(h,)] += norms * (2 if spec.norm == "layernorm" else 1)
    q_norm, k_norm = qk_norm_parameters(spec)
    for gains in (q_norm, k_norm):
        if gains:
            tensors[(gains,)] += 1
    if spec.attention_sinks:
        tensors[(spec.heads,)] += 1
    return tensors


@cached_by_chain(maxsize=128)
def trainable_tensors(spec: ModelSpec, stage: int = 0) -> Counter:
    """Shape -> count of the tensors that train on one GPU of pipeline stage `stage`: with
    training: full, its layers' (`layer_tensors`), on the first stage the word embedding (V, h)
    and the learned positions, on the last the final norm and the output layer (V, h) (or the
    tied copy with pp > 1); with LoRA, each adapter's A (r, in) and B (out, r) (PEFT's
    lora_A / lora_B nn.Linear weights) and with DoRA its magnitude (out,). Dense transformers
    at tp 1 (the spec's rules)."""
    layers_here = sum(stage_kind_counts(spec, stage).values())
    tensors: Counter = Counter()
    if spec.training != "full":
        rank = spec.finetune.lora_rank
        for adapter in finetune.adapters(spec):
            tensors[(rank, adapter.fan_in)] += layers_here
            tensors[(adapter.fan_out, rank)] += layers_here
            if spec.finetune.use_dora:  # DoRA's magnitude vector (lora_magnitude_vector)
                tensors[(adapter.fan_out,)] += layers_here
        return tensors
    for shape, count in layer_tensors(spec).items():
        tensors[shape] += count * layers_here
    h, vocab = spec.hidden, spec.vocab
    if stage == 0:
        if vocab:
            tensors[(vocab, h)] += 1
        positions = parameter_count(spec).embedding - vocab * h  # learned positions
        if positions:
            tensors[(positions // h, h)] += 1
    if stage == spec.pp - 1:
        tensors[(h,)] += 2 if spec.norm == "layernorm" else 1
        if vocab and (not spec.tied_embeddings or spec.pp > 1):
            tensors[(vocab, h)] += 1
    return tensors


def in_backward_gradient_parameters(spec: ModelSpec, stage: int) -> int | None:
    """With optimizer_in_backward, the trainable parameters whose gradients are held at once on
    one GPU of pipeline stage `stage`: each parameter steps and frees its gradient as soon as
    it is accumulated (PyTorch's `_apply_optimizer_in_backward` registers a post-accumulate-
    grad hook per parameter), so at most one layer's gradients are alive while its backward
    runs, or the largest tensor outside the layers (the output layer's or the embedding's).
    derived: the larger of the two; with a tied word embedding on the chain their sum, as its
    gradient is held from the output layer's backward to the embedding's, when its hook fires
    (`tied_gradient_from_output`). None without it (all gradients are held)."""
    if not spec.optimizer_in_backward:
        return None
    if spec.training != "full":
        return max(
            finetune.lora_layer_parameters(spec, kind) for kind in stage_kind_counts(spec, stage)
        )
    layer = largest_layer_parameters(spec, stage)
    outside = outside_layer_parameters(spec, stage)
    vocab_block = split_share(spec.vocab * spec.hidden, spec.tp) if outside else 0
    largest_outside = min(vocab_block, outside) if outside else 0
    if tied_gradient_from_output(spec):
        return layer + largest_outside
    return max(layer, largest_outside)


# Frameworks whose training loop frees the gradients every step (`optimizer.zero_grad()`,
# set_to_none=True by default since PyTorch 2.0, torch/optim/optimizer.py): the backward
# allocates each parameter's gradient when it reaches it. Megatron-LM keeps its fp32 main
# gradients in a persistent contiguous buffer (distributed/param_and_grad_buffer.py), DeepSpeed
# its gradient partitions and buckets: there the gradients are held for the whole step.
GRADIENTS_FREED_EACH_STEP = ("torchtitan", "hf")


def gradients_kept_between_steps(spec: ModelSpec) -> bool:
    """Whether the training loop's zero_grad keeps every gradient allocated, zeroed, from one
    step to the next (`zero_grad: zeros`), so that from the second step on every trained
    parameter's gradient is alive through the whole step: its forward, its backward and its
    optimizer step, as `states_of` counts them (grad_bytes per trained parameter, sharded as
    the layout shards gradients).

    Source: PyTorch before 2.0, torch/nn/modules/module.py `Module.zero_grad(self, set_to_none:
    bool = False)` and torch/optim/optimizer.py `Optimizer.zero_grad(self, set_to_none: bool =
    False)` (v1.7 to v1.13; zero_() on each existing .grad unless set_to_none); pytorch/pytorch
    pull request 92731 made set_to_none=True the default for 2.0. transformers' Trainer called
    `model.zero_grad()` (the default) until pull request 22136 (March 2023) passed
    set_to_none=True for every PyTorch release."""
    return spec.zero_grad == "zeros"


def gradients_allocated_in_backward(spec: ModelSpec) -> bool:
    """Whether the step's gradients come into being during its backward pass, stage by stage:
    a framework that frees them every step (`GRADIENTS_FREED_EACH_STEP`) with zero_grad
    setting them to None (not `gradients_kept_between_steps`), one micro-batch per step (with
    gradient accumulation they persist from the first micro-batch on) and no pipeline
    parallelism (ckplan replays one chain per GPU then). Not with optimizer_in_backward, whose
    held gradients `in_backward_gradient_parameters` counts."""
    return (
        not spec.optimizer_in_backward
        and not gradients_kept_between_steps(spec)
        and spec.kind == "transformer"
        and spec.framework in GRADIENTS_FREED_EACH_STEP
        and spec.microbatches == 1
        and spec.pp == 1
    )


def gradient_lifetime(spec: ModelSpec) -> str:
    """When the gradients the model states count are alive, as `estimate` reports it: `step`
    (every trained parameter's, all step: a framework's persistent buffer, gradient
    accumulation, pipeline parallelism, or `gradients_kept_between_steps`), `backward` (each
    from the backward that writes it: `gradients_allocated_in_backward`, those written by the
    peak counted), `one_layer` (optimizer_in_backward: `in_backward_gradient_parameters`) or
    `host` (optimizer_offload: none on the device)."""
    if spec.optimizer_offload != "none":
        return "host"
    if spec.optimizer_in_backward:
        return "one_layer"
    return "backward" if gradients_allocated_in_backward(spec) else "step"


def tied_gradient_from_output(spec: ModelSpec) -> bool:
    """Whether one chain holds a word embedding tied to the output layer whose gradient the
    output layer's backward, the first of the step, brings into being: tied embeddings on one
    pipeline stage, trained (training: full).

    derived from PyTorch's autograd engine (torch/csrc/autograd/engine.cpp and
    input_buffer.cpp, v2.5): the shared leaf has one AccumulateGrad node with an edge from each
    use; the engine sums the gradients arriving on those edges in the node's InputBuffer and
    runs the node (which then holds the sum as `.grad`) only when every edge has delivered, so
    the output layer's (V x h) gradient is alive from the output layer's backward to the
    embedding's, across every layer's backward."""
    return spec.tied_embeddings and spec.pp == 1 and spec.training == "full" and spec.vocab > 0


def chain_gradient_bytes(spec: ModelSpec) -> tuple[int, ...]:
    """The gradient bytes each stage of the one-GPU chain (embedding, layers, output and loss)
    writes in its backward, as `states_of` counts them (grad_bytes per trainable parameter,
    sharded over dp·cp from ZeRO 2): derived from `stage_parameters` split by chain stage.
    With frozen base weights only the layers' adapters have gradients. A tied word embedding's
    gradient is written by the output stage (`tied_gradient_from_output`)."""
    from ckplan.model import finetune

    kinds = stage_kinds(spec, 0)
    if spec.training == "full":
        per_layer = [
            states_of(
                spec,
                layer_parameter_parts(spec, kind).dense_per_rank(spec),
                layer_parameter_parts(spec, kind).experts_per_rank(spec),
            ).gradients
            for kind in kinds
        ]
        dense, expert = stage_parameters(spec, 0)
        in_layers = sum(layer_parameters_per_rank(spec, kind) for kind in kinds)
        counts = parameter_count(spec)
        words = split_share(spec.vocab * spec.hidden, spec.tp)
        embedding = words + (counts.embedding - spec.vocab * spec.hidden)
        outside = dense + expert - in_layers
        output = outside - embedding  # final norm and output layer (a tied one: its copy)
        if tied_gradient_from_output(spec):
            embedding, output = embedding - words, output + words
        first = states_of(spec, embedding, 0).gradients
        last = states_of(spec, output, 0).gradients
        if frameworks.fsdp1_resharding(spec):
            # FSDP1's root unit (embedding, final norm, output) reduces its flat gradient after
            # the embedding's backward: its shard comes after the chain's last step, and
            # its bf16 pieces are the chain's workspaces (frameworks.fsdp1_layer_backward_bytes,
            # fsdp1_embedding_backward_bytes)
            first = last = 0
    else:
        per_layer = [
            states_of(spec, finetune.lora_layer_parameters(spec, kind), 0).gradients
            for kind in kinds
        ]
        first = last = 0
    has_ends = spec.vocab > 0
    return (first, *per_layer, last) if has_ends else tuple(per_layer)
