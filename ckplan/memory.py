"""Bytes: activations per op and per layer, the embedding and output stages, parameters, and
model states (weights, gradients, optimizer). Pure functions over a ModelSpec."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from ckplan.ops import FP32_BYTES, _split, group_input_bytes, layer_ops
from ckplan.spec import ModelSpec

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
    0 for transformers (not modelled).
    """
    if spec.kind != "mlp":
        return 0
    b, d, f = spec.micro_batch, spec.hidden, spec.ffn_hidden
    return spec.dtype_bytes * b * max(2 * f - d, f)


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
