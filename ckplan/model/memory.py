"""Bytes: activations per op and per layer, the embedding and output stages, parameters, and
model states (weights, gradients, optimizer). Pure functions over a ModelSpec."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from ckplan.model.ops import FP32_BYTES, _split, group_input_bytes, layer_ops
from ckplan.model.spec import ModelSpec

TOKEN_ID_BYTES = 8  # int64 token ids, the embedding's input


def activation_bytes_by_op(spec: ModelSpec) -> dict[str, int]:
    """Bytes each op of one layer saves for backward (one micro-batch, one GPU, no recompute)."""
    return {op.name: op.saved_bytes for op in layer_ops(spec)}


def activation_breakdown(spec: ModelSpec) -> dict[str, int]:
    """One layer's saved bytes summed by component: attention, mlp, norm (Korthikanti §4.1)."""
    totals: Counter[str] = Counter({"attention": 0, "mlp": 0, "norm": 0})
    for op in layer_ops(spec):
        totals[op.component] += op.saved_bytes
    return dict(totals)


def activation_bytes_per_layer(spec: ModelSpec) -> int:
    """Sum of what one layer's ops save: Korthikanti Table 2, row "no parallelism" for t = 1."""
    return sum(op.saved_bytes for op in layer_ops(spec))


def selective_activation_bytes_per_layer(spec: ModelSpec, group: str) -> int:
    """One layer with `group` recomputed: its ops' saved bytes dropped, its input kept.

    Korthikanti §5: with the attention core recomputed, a layer stores 34sbh (B = 2, t = 1).
    """
    dropped = sum(op.saved_bytes for op in layer_ops(spec) if op.group == group)
    return activation_bytes_per_layer(spec) - dropped + group_input_bytes(spec, group)


def layer_input_bytes(spec: ModelSpec) -> int:
    """The residual stream entering a layer, (s, b, h): what full recompute keeps per layer
    (Korthikanti Table 2, "full recompute" 2sbh for B = 2; /t under sequence parallelism)."""
    if spec.kind == "mlp":
        return spec.dtype_bytes * spec.micro_batch * spec.hidden
    tokens = (spec.seq // spec.cp) * spec.micro_batch
    return spec.dtype_bytes * _split(tokens * spec.hidden, spec.tp if spec.sp else 1)


def mlp_forward_workspace_bytes(spec: ModelSpec) -> int:
    """Transient bytes of one layer forward of the seed's MLP beyond its input and output.

    derived from ckplan/verify.py's layer forward (the seed's layer_forward, in place):
    ``a = x @ w1`` (b, f); ``a += b1``; ``relu(a)`` in place; ``y = a @ w2`` (b, d); ``y += b2``.
    Alive at once: the hidden activation ``a``, b·f values, and the output ``y`` (counted by the
    chain as x_{i+1}). So the workspace is b·f·B; 0 for transformers (not modelled).
    """
    if spec.kind != "mlp":
        return 0
    return spec.dtype_bytes * spec.micro_batch * spec.ffn_hidden


def mlp_backward_workspace_bytes(spec: ModelSpec) -> int:
    """Transient bytes of one layer backward of the seed's MLP beyond tape x_i, δ_{i+1}, δ_i.

    derived from ckplan/verify.py's layer backward (the seed's model_backward, in place; weight
    and bias gradients go into preallocated buffers, not counted here). In order:
    ``a = x @ w1 + b1``, relu in place (b, f); ``gw2 = aᵀ @ g``; ``gb2 = Σ g``; ``a`` turned in
    place into the 0/1 mask ``(h_pre > 0)``; ``gh = g @ w2ᵀ`` (b, f) — now ``a`` and ``gh`` are
    alive, 2·b·f values; ``gh *= a`` (= the seed's g_pre); ``a`` freed; ``δ_i = gh @ w1ᵀ``
    (b, d) — now ``gh`` and ``δ_i``, b·f + b·d; ``gw1 = xᵀ @ gh``, ``gb1 = Σ gh``; ``gh`` freed.
    The peak is max(2·b·f, b·f + b·d) values; the chain adds δ_i (b·d) to every backward step
    (schedules rule 5), so the workspace is B·b·(max(2f, f + d) - d) = B·b·max(2f - d, f).
    0 for transformers (theirs is `layer_backward_workspace_bytes`).
    """
    if spec.kind != "mlp":
        return 0
    b, d, f = spec.micro_batch, spec.hidden, spec.ffn_hidden
    return spec.dtype_bytes * b * max(2 * f - d, f)


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


def layer_backward_walk(spec: ModelSpec, recomputed: str | None = None) -> list[BackwardPoint]:
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
    input_grad(k) + workspace(k). With `recomputed` (selective recomputation of that group),
    the group's saved tensors are not stored: its input (`ops.group_input_bytes`) is, until the
    group's backward ends, and the re-forward rebuilds the group's saved tensors just before
    the group's first op is backpropagated, counted in full besides the kept input (an upper
    bound: kernels that save their inputs as they are share those storages).
    Parameter gradients are model states and are not counted.
    """
    if spec.kind == "mlp":
        raise ValueError("the seed MLP's backward is mlp_backward_workspace_bytes, not a walk")
    ops = layer_ops(spec)
    group = [op for op in ops if recomputed is not None and op.group == recomputed]
    group_names = {op.name for op in group}
    freed_after: Counter[str] = Counter()  # bytes freed when the named op's backward returns
    rebuilt = sum(op.saved_bytes for op in group)
    for op in ops:
        if op.saved_until is None or op.name in group_names:
            freed_after[op.name] += op.saved_bytes
        elif op.saved_until in group_names:
            # The stored storage is this op's alone; the re-forward saves a new one.
            freed_after[op.name] += op.saved_bytes
            freed_after[op.saved_until] += op.saved_bytes
            rebuilt += op.saved_bytes
        else:
            freed_after[op.saved_until] += op.saved_bytes
    kept = group_input_bytes(spec, recomputed) if group else 0
    if group:
        freed_after[group[0].name] += kept  # the group's last backward step
    saved = sum(op.saved_bytes for op in ops if op.name not in group_names) + kept
    stream = layer_input_bytes(spec)
    residual, waiting = stream, 0
    points = []
    for op in reversed(ops):
        if group and op is group[-1]:
            saved += rebuilt  # the re-forward of the group, just before its backward
        grads = residual + waiting + op.input_grad_bytes
        points.append(BackwardPoint(op.name, saved, grads, op.grad_workspace_bytes))
        saved -= freed_after[op.name]
        waiting -= op.output_grad_bytes
        if op.component == "norm":
            if residual == stream:
                residual += op.input_grad_bytes  # δ_out + grad: a new tensor (δ_out is kept)
        else:
            waiting += op.input_grad_bytes
    if waiting != 0 or saved != 0:  # every gradient read, every saved tensor freed
        raise AssertionError(f"inconsistent backward fields: {waiting=} {saved=}")
    return points


def layer_backward_peak_bytes(spec: ModelSpec, recomputed: str | None = None) -> int:
    """Peak bytes alive during one layer's backward: tape (as freed op by op), δ_out, the
    gradients in flight and temporaries (derived: the maximum of `layer_backward_walk`).

    Korthikanti's GPT layer (B = 2, F = 4h, dropout, standard attention, t = 1), tape
    T = 34sbh + 5as²b: the MLP peaks at fc2's backward, T - sbh (mlp_dropout's mask freed) +
    2sbh (δ_out) + 2sbh (dropout's input gradient) + 8sbh (fc2's input gradient) = T + 11sbh;
    the attention at attn_values', T - 24sbh (the MLP, norm2, out_dropout and out_proj freed)
    + 4sbh (δ_out, mid-layer residual gradient) + 2sbh (context gradient) + 2as²b + 2sbh (dP,
    dV) = T - 16sbh + 2as²b. The peak is the larger: T + 11sbh while as/h <= 13.5.
    For kind mlp: the seed MLP's exact figure, tape + δ_out + δ_in + its workspace.
    """
    if spec.kind == "mlp":
        tape = activation_bytes_per_layer(spec)
        return tape + 2 * layer_input_bytes(spec) + mlp_backward_workspace_bytes(spec)
    return max(point.live_bytes for point in layer_backward_walk(spec, recomputed))


def layer_backward_workspace_bytes(spec: ModelSpec, recomputed: str | None = None) -> int:
    """What one layer's backward holds beyond the chain's model of it (schedules rule 5: the
    whole tape, δ_out and δ_in): max(0, layer_backward_peak_bytes - (tape + 2X)), X the layer
    input, the tape the selective one with `recomputed`. Never negative, so the chain's peak is
    never below tape + 2X. For kind mlp: `mlp_backward_workspace_bytes`, exactly.
    """
    if spec.kind == "mlp":
        return mlp_backward_workspace_bytes(spec)
    tape = (
        activation_bytes_per_layer(spec)
        if recomputed is None
        else selective_activation_bytes_per_layer(spec, recomputed)
    )
    peak = layer_backward_peak_bytes(spec, recomputed)
    return max(0, peak - (tape + 2 * layer_input_bytes(spec)))


def token_id_bytes(spec: ModelSpec) -> int:
    """The int64 token ids the embedding reads (s·b·8)."""
    return TOKEN_ID_BYTES * (spec.seq // spec.cp) * spec.micro_batch


def embedding_saved_bytes(spec: ModelSpec) -> int:
    """The embedding stage's tape: its token ids and, with dropout, the 1-byte embedding
    dropout mask, sbh (/t under SP) (Korthikanti §4.3)."""
    mask = layer_input_bytes(spec) // spec.dtype_bytes if spec.dropout > 0 else 0
    return token_id_bytes(spec) + mask


def output_saved_bytes(spec: ModelSpec) -> int:
    """The output stage's tape: final-norm input and output-layer input, 4sbh/t for B = 2 under
    SP, plus the fp32 logits the cross-entropy keeps, 4sbV/t (Korthikanti §4.3)."""
    tokens = (spec.seq // spec.cp) * spec.micro_batch
    logits = FP32_BYTES * _split(tokens * spec.vocab, spec.tp)
    return 2 * layer_input_bytes(spec) + logits


def output_backward_peak_bytes(spec: ModelSpec) -> int:
    """Peak bytes alive during the output stage's backward (output layer and loss).

    derived, modelling Megatron-LM's vocab-parallel cross-entropy
    (megatron/core/tensor_parallel/cross_entropy.py): its forward turns an fp32 copy of the
    logits into the softmax in place and saves it (the 4sbV/t of the tape); its backward writes
    the logits' gradient into that same buffer in place (softmax - one-hot) and returns it in
    fp32, which autograd casts to the logits' dtype, a new B·sbV/t tensor, while the fp32 one is
    alive: tape + B·sbV/t. Afterwards the fp32 buffer is freed, and the output layer's
    backward (the B·sbV/t gradient, its input and the final norm's input saved, the final
    norm's output gradient X) and the final norm's (adding δ_in, X) hold less. The loss is a
    scalar: no δ_out. An unfused torch.nn.functional.cross_entropy on fp32 logits
    (log_softmax, nll_loss) would hold two more fp32 sbV/t tensors at its backward (the
    gradients of the log-probabilities and of the logits): not modelled.
    """
    tokens = (spec.seq // spec.cp) * spec.micro_batch
    logits_grad = spec.dtype_bytes * _split(tokens * spec.vocab, spec.tp)
    return output_saved_bytes(spec) + logits_grad


def output_backward_workspace_bytes(spec: ModelSpec) -> int:
    """The output stage's backward beyond the chain's tape + δ_in (δ_out is a scalar loss, 0
    bytes): max(0, output_backward_peak_bytes - (output_saved_bytes + X)) = B·sbV/t - X."""
    peak = output_backward_peak_bytes(spec)
    return max(0, peak - (output_saved_bytes(spec) + layer_input_bytes(spec)))


# ---- parameters and model states --------------------------------------------------------


@dataclass(frozen=True)
class ParameterCount:
    embedding: int  # token (+ learned position) embeddings
    per_layer: int
    layers: int
    final_norm: int
    output: int  # output projection, 0 when tied to the embedding

    @property
    def total(self) -> int:
        return self.embedding + self.per_layer * self.layers + self.final_norm + self.output


def norm_parameters(spec: ModelSpec) -> int:
    """LayerNorm has a gain and a bias per channel, RMSNorm a gain only (Zhang & Sennrich 2019)."""
    return 2 * spec.hidden if spec.norm == "layernorm" else spec.hidden


def layer_parameters(spec: ModelSpec) -> int:
    """Weights of one layer from its matmul shapes (derived: QKV h·(h + 2gd), out-proj h², MLP
    2hF for GELU or 3hF for SwiGLU, biases on every output when `bias`, two norms)."""
    h, F = spec.hidden, spec.ffn_hidden
    if spec.kind == "mlp":
        return h * F + F + F * h + h  # w1, b1, w2, b2 of the seed's MLP
    qkv_out = h + 2 * spec.kv_heads * spec.head_dim
    matrices = h * qkv_out + h * h + (2 if spec.mlp == "gelu" else 3) * h * F
    biases = (qkv_out + h + F + h) if spec.bias else 0
    return matrices + biases + 2 * norm_parameters(spec)


def parameter_count(spec: ModelSpec) -> ParameterCount:
    """Parameters of the whole model. GPT-2 (124M) gives 124,439,808; Llama-3-8B 8,030,261,248."""
    if spec.kind == "mlp":
        return ParameterCount(0, layer_parameters(spec), spec.layers, 0, 0)
    positions = spec.seq * spec.hidden if spec.positions == "learned" else 0
    embedding = spec.vocab * spec.hidden + positions
    output = 0 if spec.tied_embeddings else spec.vocab * spec.hidden
    final_norm = norm_parameters(spec)
    return ParameterCount(embedding, layer_parameters(spec), spec.layers, final_norm, output)


def parameters_per_gpu(spec: ModelSpec) -> int:
    """Parameters held by the busiest GPU: the first pipeline stage (embedding and L/p layers),
    plus the output layer and final norm when p = 1; matrices split over t (derived: Megatron's
    vocab-parallel embedding and column/row-parallel linears; norms replicated)."""
    counts = parameter_count(spec)
    if spec.kind == "mlp":
        return counts.total
    replicated = 2 * norm_parameters(spec)  # the two norms of a layer are whole on every rank
    layer = _split(counts.per_layer - replicated, spec.tp) + replicated
    first = _split(counts.embedding, spec.tp) + spec.layers_per_stage * layer
    if spec.pp == 1:
        first += counts.final_norm + _split(counts.output, spec.tp)
    return first


@dataclass(frozen=True)
class ModelStateBytes:
    weights: int
    gradients: int
    optimizer: int  # fp32 master weights + Adam moments

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer


def model_state_bytes(spec: ModelSpec) -> ModelStateBytes:
    """Weights, gradients and optimizer state per GPU.

    Megatron-LM's mixed-precision Adam keeps 18 bytes per parameter: bf16 weights (2), fp32 main
    gradients (4), fp32 master weights (4), Adam m and v (4 + 4) (Megatron-LM
    docs/source/distrib_optimizer.md); each part is a spec key. ZeRO (Rajbhandari et al. 2020,
    §5): stage 1 shards master weights and optimizer over dp, stage 2 also gradients, stage 3
    also weights. Megatron's distributed optimizer, 6 + 12/dp, is zero: 1 here.
    """
    params = parameters_per_gpu(spec)
    dp = spec.dp

    def shard(bytes_per_param: int, from_stage: int) -> int:
        total = params * bytes_per_param
        return _split(total, dp) if spec.zero >= from_stage else total

    return ModelStateBytes(
        weights=shard(spec.weight_bytes, 3),
        gradients=shard(spec.grad_bytes, 2),
        optimizer=shard(spec.master_bytes + spec.optimizer_bytes, 1),
    )
