"""A layer is a list of ops: what each saves for backward and what its forward costs.

Modelled the way `torch.utils.flop_counter` models aten ops: one small record per op, with the
bytes it saves for backward, its forward/backward FLOPs (matmuls only, 2·m·n·k each; element-wise
ops count as 0), and the recompute group it belongs to. Every strategy, breakdown and chain is a
sum over this one table, so they cannot disagree.

Notation (Korthikanti et al. 2022, §4): s sequence, b micro-batch, h hidden, a heads, g kv heads,
d = h/a, F ffn hidden, B bytes per activation value, t tensor-parallel size. Dropout masks are one
byte per value. All counts are for one GPU: head- and ffn-sharded tensors are divided by t, the
rest by t only under sequence parallelism (Korthikanti §4.2.2), and every token count by the
context-parallel size cp.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckplan.spec import ModelSpec

ATTENTION_CORE = "attention_core"
FP32_BYTES = 4


@dataclass(frozen=True)
class Op:
    name: str
    component: str  # "attention" | "mlp" | "norm"
    saved_bytes: int  # what autograd keeps for this op's backward
    forward_flops: int
    backward_flops: int
    group: str | None = None  # recompute group, e.g. ATTENTION_CORE


def _split(value: int, parts: int) -> int:
    """Per-rank share of `value` elements split over `parts` ranks (the largest share)."""
    return -(-value // parts)


def _matmul(m: int, n: int, k: int) -> int:
    """FLOPs of an (m x k) @ (k x n) matmul: one multiply and one add per term."""
    return 2 * m * n * k


def _op(name: str, component: str, saved: int, flops: int = 0, group: str | None = None) -> Op:
    """An op whose backward costs twice its forward: derived, the gradient w.r.t. the input and
    w.r.t. the weight are one matmul each of the forward's size (Korthikanti App. A)."""
    return Op(name, component, saved, flops, 2 * flops, group)


def transformer_layer_ops(spec: ModelSpec) -> tuple[Op, ...]:
    """The ops of one transformer layer on one GPU, in forward order.

    Standard attention with dropout, B = 2, F = 4h, a = g, t = 1 reproduces Korthikanti et al.
    2022 §4.1 exactly: attention 11sbh + 5as²b, MLP 19sbh, norms 4sbh (Table 2, 34sbh + 5as²b);
    the other knobs follow from what each op saves (derived, see each line).
    """
    t, B = spec.tp, spec.dtype_bytes
    seq_local = spec.seq // spec.cp
    tokens = seq_local * spec.micro_batch  # s·b on this rank
    h, F, a = spec.hidden, spec.ffn_hidden, spec.heads
    kv_width = kv_heads_per_rank(spec) * spec.head_dim  # g·d / t (at least one head)
    # Tensors that are whole on every TP rank unless sequence parallelism shards them.
    replicated = t if spec.sp else 1
    dropout = spec.dropout > 0
    stream = _split(tokens * h, replicated)  # (s, b, h) residual-stream shaped, per rank

    def sharded(elements: int) -> int:
        return _split(elements, t)

    ops = [_op("norm1", "norm", B * stream)]  # saves its input (the layer input)
    ops.append(
        _op("qkv_proj", "attention", B * stream, _matmul(tokens, sharded(h) + 2 * kv_width, h))
    )
    scores = sharded(a * spec.micro_batch * seq_local * spec.seq)  # (b, a, s, s) elements
    score_flops = sharded(_matmul(seq_local, spec.seq, spec.head_dim) * a * spec.micro_batch)
    if spec.attention == "standard":
        # Q and K, with K repeated to a heads (Megatron's repeat_interleave, HF's repeat_kv copy).
        ops.append(
            _op(
                "attn_scores", "attention", B * 2 * sharded(tokens * h), score_flops, ATTENTION_CORE
            )
        )
        ops.append(_op("softmax", "attention", B * scores, 0, ATTENTION_CORE))  # its output
        if dropout:
            ops.append(_op("attn_dropout", "attention", scores, 0, ATTENTION_CORE))  # 1-byte mask
        # Saves the probabilities it multiplies (the dropout output; without dropout that is the
        # softmax output, already counted) and V, repeated to a heads.
        probs = B * scores if dropout else 0
        values = B * sharded(tokens * h)
        ops.append(_op("attn_values", "attention", probs + values, score_flops, ATTENTION_CORE))
    else:
        # Flash attention (Dao et al. 2022, Alg. 2/4): saves Q, K, V (K, V at g·d width), its
        # output O and the fp32 logsumexp, a·s·b values; no s² tensor, dropout regenerated from
        # the RNG state. O is counted once, as out_proj's input. Its backward recomputes QKᵀ
        # (Alg. 4 line 11): one extra score matmul on top of 2x forward.
        qkv = B * tokens * (sharded(h) + 2 * kv_width)
        logsumexp = FP32_BYTES * sharded(tokens * a)
        core_flops = 2 * score_flops
        ops.append(
            Op(
                "attention_core",
                "attention",
                qkv + logsumexp,
                core_flops,
                2 * core_flops + score_flops,
                ATTENTION_CORE,
            )
        )
    ops.append(
        _op("out_proj", "attention", B * sharded(tokens * h), _matmul(tokens, sharded(h), h))
    )
    if dropout:
        ops.append(_op("out_dropout", "attention", stream))
    ops.append(_op("norm2", "norm", B * stream))
    ffn = sharded(tokens * F)  # (s, b, F) elements per rank
    if spec.mlp == "gelu":
        ops.append(_op("fc1", "mlp", B * stream, _matmul(tokens, sharded(F), h)))
        ops.append(_op("act", "mlp", B * ffn))  # GELU saves its input
    else:
        # SwiGLU (Shazeer 2020): fc1 computes gate and up (2F wide). A fused kernel (Megatron's
        # bias_swiglu) saves the fc1 output, 2F; eager silu(gate) * up also keeps silu(gate), 3F.
        ops.append(_op("fc1", "mlp", B * stream, _matmul(tokens, sharded(2 * F), h)))
        ops.append(_op("act", "mlp", B * ffn * (2 if spec.fused_swiglu else 3)))
    ops.append(_op("fc2", "mlp", B * ffn, _matmul(tokens, h, sharded(F))))  # saves its input
    if dropout:
        ops.append(_op("mlp_dropout", "mlp", stream))
    return tuple(ops)


def mlp_layer_ops(spec: ModelSpec) -> tuple[Op, ...]:
    """The seed's NumPy MLP layer (shared/seed): relu(x @ w1 + b1) @ w2 + b2, width d = hidden,
    f = ffn_hidden, rows = micro_batch.

    The seed's executor keeps only each layer's input and rebuilds the hidden activation in the
    backward pass (model_backward recomputes linear_forward(x_in, w1, b1)), so fc1 saves its input
    and nothing else is kept; fc1's backward costs one extra forward matmul (derived: gx = g_pre
    @ w1ᵀ and gw1 = x_inᵀ @ g_pre, plus the re-run of x_in @ w1).
    """
    B, rows, d, f = spec.dtype_bytes, spec.micro_batch, spec.hidden, spec.ffn_hidden
    fc1_flops = _matmul(rows, f, d)
    fc2_flops = _matmul(rows, d, f)
    return (
        Op("fc1", "mlp", B * rows * d, fc1_flops, 3 * fc1_flops),
        Op("act", "mlp", 0, 0, 0),
        Op("fc2", "mlp", 0, fc2_flops, 2 * fc2_flops),
    )


def layer_ops(spec: ModelSpec) -> tuple[Op, ...]:
    return mlp_layer_ops(spec) if spec.kind == "mlp" else transformer_layer_ops(spec)


def group_input_bytes(spec: ModelSpec, group: str) -> int:
    """Bytes a recompute group must keep as its input so it can be re-run in backward.

    The attention core (Korthikanti §5, selective recomputation) is recomputed from Q, K and V
    as the QKV projection produced them: K and V at g·d width, before any repeat to a heads.
    """
    if group != ATTENTION_CORE or spec.kind == "mlp":
        return 0
    tokens = (spec.seq // spec.cp) * spec.micro_batch
    kv_width = kv_heads_per_rank(spec) * spec.head_dim
    return spec.dtype_bytes * tokens * (_split(spec.hidden, spec.tp) + 2 * kv_width)


def kv_heads_per_rank(spec: ModelSpec) -> int:
    """K/V heads on one tensor-parallel rank: g/t, or one replicated head when t > g
    (Megatron-LM replicates the query groups when tp exceeds num_query_groups)."""
    return -(-spec.kv_heads // spec.tp)
