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
from functools import lru_cache

from ckplan.model.spec import ModelSpec

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
    # What the op's backward holds besides the saved tensors (memory.layer_backward_walk), in
    # bytes on one GPU; parameter gradients are model states, never counted here.
    # The gradient of its output that it reads, allocated by the backward of the op after it
    # and freed when this backward returns; 0 when it is the residual-stream gradient itself
    # (the walk counts that one).
    output_grad_bytes: int = 0
    # The gradients it allocates for its activation inputs, read by the ops before it (a norm's
    # is added to the residual-stream gradient).
    input_grad_bytes: int = 0
    # Temporaries allocated and freed inside its backward, counted alive together with the two
    # gradients above (an upper bound where they are not alive at once).
    grad_workspace_bytes: int = 0
    # Another op that saves the same storage and is backpropagated later: the storage is freed
    # after that op's backward, not this one's (flash attention's output O, out_proj's input).
    saved_until: str | None = None


def _split(value: int, parts: int) -> int:
    """Per-rank share of `value` elements split over `parts` ranks (the largest share)."""
    return -(-value // parts)


def _matmul(m: int, n: int, k: int) -> int:
    """FLOPs of an (m x k) @ (k x n) matmul: one multiply and one add per term."""
    return 2 * m * n * k


def _op(
    name: str,
    component: str,
    saved: int,
    flops: int = 0,
    group: str | None = None,
    *,
    grads: tuple[int, int] = (0, 0),
    workspace: int = 0,
    saved_until: str | None = None,
) -> Op:
    """An op whose backward costs twice its forward: derived, the gradient w.r.t. the input and
    w.r.t. the weight are one matmul each of the forward's size (Korthikanti App. A).
    `grads` is (output_grad_bytes, input_grad_bytes), see `Op`."""
    out_grad, in_grad = grads
    return Op(
        name, component, saved, flops, 2 * flops, group, out_grad, in_grad, workspace, saved_until
    )


def transformer_layer_ops(spec: ModelSpec) -> tuple[Op, ...]:
    """The ops of one transformer layer on one GPU, in forward order.

    Standard attention with dropout, B = 2, F = 4h, a = g, t = 1 reproduces Korthikanti et al.
    2022 §4.1 exactly: attention 11sbh + 5as²b, MLP 19sbh, norms 4sbh (Table 2, 34sbh + 5as²b);
    the other knobs follow from what each op saves (derived, see each line).

    The backward fields (`Op.output_grad_bytes`, `input_grad_bytes`, `grad_workspace_bytes`)
    follow from each op's backward formula as the CUDA kernels Megatron-LM runs evaluate it: a
    gradient has its tensor's size and dtype; element-wise backward ops are one kernel writing a
    new tensor. Checked against PyTorch's memory profiler in docs/validation.md.
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

    X = B * stream  # a residual-stream shaped tensor (or its gradient), bytes
    heads = B * sharded(tokens * h)  # a (b, a, s, d) tensor on this rank: Q, O, the context
    qkv = B * tokens * (sharded(h) + 2 * kv_width)  # the QKV projection output, K and V at g·d
    # Every input gradient of a linear layer is one matmul output, grad_out @ W (under SP the
    # (s, b, h) partial sum before the reduce-scatter is a communication buffer, not counted).
    # norm1's input gradient is added to the residual-stream gradient (memory.layer_backward_walk).
    ops = [_op("norm1", "norm", B * stream, grads=(X, X))]  # saves its input (the layer input)
    # The attention core's gradients of Q, K, V: standard attention's matmuls read K and V
    # repeated to a heads; flash attention returns dK, dV at g·d width.
    q_k_v_grads = 3 * heads if spec.attention == "standard" else qkv
    ops.append(
        _op(
            "qkv_proj",
            "attention",
            B * stream,
            _matmul(tokens, sharded(h) + 2 * kv_width, h),
            # Megatron splits one QKV output into Q, K, V views: torch.split's backward
            # concatenates their gradients (repeated K, V heads summed back to g) into the
            # gradient of the projection output before the input-gradient matmul.
            grads=(q_k_v_grads, X),
            workspace=qkv,
        )
    )
    scores = sharded(a * spec.micro_batch * seq_local * spec.seq)  # (b, a, s, s) elements
    score_flops = sharded(_matmul(seq_local, spec.seq, spec.head_dim) * a * spec.micro_batch)
    if spec.attention == "standard":
        # Q and K, with K repeated to a heads (Megatron's repeat_interleave, HF's repeat_kv copy).
        # Backward: dQ = dS·K, dK = dSᵀ·Q (K's at a heads). Megatron folds the 1/√d scale into
        # baddbmm's alpha and the mask into the fused softmax, so no (b, a, s, s) temporary;
        # eager `(q @ kᵀ) * scale` allocates one more in MulBackward (docs/validation.md).
        ops.append(
            _op(
                "attn_scores",
                "attention",
                B * 2 * sharded(tokens * h),
                score_flops,
                ATTENTION_CORE,
                grads=(B * scores, 2 * heads),
            )
        )
        # Saves its output Y. Backward dS = Y ⊙ (dY - Σ dY ⊙ Y), one new (b, a, s, s) tensor
        # (torch's _softmax_backward_data; Megatron's fused scale-mask-softmax kernel writes it
        # into dY in place, B·as²b less: ckplan keeps the upper bound).
        ops.append(
            _op("softmax", "attention", B * scores, 0, ATTENTION_CORE, grads=(B * scores,) * 2)
        )
        if dropout:
            # 1-byte mask. Backward dY ⊙ mask / (1 - p): one new tensor (CUDA's masked-scale
            # kernel; the CPU composite also casts the mask, docs/validation.md).
            ops.append(
                _op(
                    "attn_dropout",
                    "attention",
                    scores,
                    0,
                    ATTENTION_CORE,
                    grads=(B * scores,) * 2,
                )
            )
        # Saves the probabilities it multiplies (the dropout output; without dropout that is the
        # softmax output, already counted) and V, repeated to a heads. Backward: dP = dC·Vᵀ and
        # dV = Pᵀ·dC from the context gradient dC.
        probs = B * scores if dropout else 0
        values = B * sharded(tokens * h)
        ops.append(
            _op(
                "attn_values",
                "attention",
                probs + values,
                score_flops,
                ATTENTION_CORE,
                grads=(heads, B * scores + heads),
            )
        )
    else:
        # Flash attention (Dao et al. 2022, Alg. 2/4): saves Q, K, V (K, V at g·d width), its
        # output O and the fp32 logsumexp, a·s·b values; no s² tensor, dropout regenerated from
        # the RNG state. O is counted once, as out_proj's input. Its backward recomputes QKᵀ
        # (Alg. 4 line 11): one extra score matmul on top of 2x forward.
        logsumexp = FP32_BYTES * sharded(tokens * a)
        core_flops = 2 * score_flops
        # Backward (FlashAttention-2 csrc/flash_attn/flash_api.cpp mha_bwd, also PyTorch's CUDA
        # flash kernel): reads dO, writes dQ, dK, dV, and allocates an fp32 dQ accumulator
        # (s, b, a, d), the fp32 softmax_d = rowsum(dO ⊙ O) (a·s·b values) and, with fewer K/V
        # heads than Q heads on the rank, dK and dV at a heads before summing them to g.
        expanded = 2 * heads if kv_width < sharded(h) else 0
        workspace = FP32_BYTES * (sharded(tokens * h) + sharded(tokens * a)) + expanded
        ops.append(
            Op(
                "attention_core",
                "attention",
                qkv + logsumexp,
                core_flops,
                2 * core_flops + score_flops,
                ATTENTION_CORE,
                output_grad_bytes=heads,
                input_grad_bytes=qkv,
                grad_workspace_bytes=workspace,
            )
        )
    # Saves its input, the attention context; its output gradient is the residual-stream
    # gradient (no dropout) or the dropout's input gradient. With flash attention that input is
    # the kernel's saved O, one storage, freed after the kernel's backward.
    ops.append(
        _op(
            "out_proj",
            "attention",
            B * sharded(tokens * h),
            _matmul(tokens, sharded(h), h),
            grads=(X if dropout else 0, heads),
            saved_until=None if spec.attention == "standard" else "attention_core",
        )
    )
    if dropout:
        # 1-byte mask; its output is added to the residual stream, so its output gradient is
        # the residual-stream gradient; dY ⊙ mask / (1 - p) is new.
        ops.append(_op("out_dropout", "attention", stream, grads=(0, X)))
    ops.append(_op("norm2", "norm", B * stream, grads=(X, X)))
    ffn = sharded(tokens * F)  # (s, b, F) elements per rank
    if spec.mlp == "gelu":
        ops.append(
            _op("fc1", "mlp", B * stream, _matmul(tokens, sharded(F), h), grads=(B * ffn, X))
        )
        # GELU saves its input; gelu_backward(dY, x) is one element-wise kernel: one new tensor.
        ops.append(_op("act", "mlp", B * ffn, grads=(B * ffn, B * ffn)))
    else:
        # SwiGLU (Shazeer 2020): fc1 computes gate and up (2F wide). A fused kernel (Megatron's
        # bias_swiglu) saves the fc1 output, 2F; eager silu(gate) * up also keeps silu(gate), 3F.
        # Eager code runs fc1 as two linears (HF gate_proj, up_proj): the first's output
        # gradient (F) is freed before the second's input gradient is allocated, so the
        # backward never holds more than d gate, d up and one input gradient (2F + X) either.
        ops.append(
            _op(
                "fc1", "mlp", B * stream, _matmul(tokens, sharded(2 * F), h), grads=(2 * B * ffn, X)
            )
        )
        # Backward: d gate and d up, 2F, from dY, F. Fused (Megatron's swiglu_back): one kernel
        # writing [d gate | d up]. Eager: MulBackward writes d silu(gate) and d up, then
        # SiluBackward d gate while dY is already freed: never more than 3F either.
        ops.append(
            _op(
                "act",
                "mlp",
                B * ffn * (2 if spec.fused_swiglu else 3),
                grads=(B * ffn, 2 * B * ffn),
            )
        )
    # Saves its input; its output gradient is the residual-stream gradient (no dropout) or the
    # dropout's input gradient.
    ops.append(
        _op(
            "fc2",
            "mlp",
            B * ffn,
            _matmul(tokens, h, sharded(F)),
            grads=(X if dropout else 0, B * ffn),
        )
    )
    if dropout:
        ops.append(_op("mlp_dropout", "mlp", stream, grads=(0, X)))  # as out_dropout
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


@lru_cache(maxsize=128)
def layer_ops(spec: ModelSpec) -> tuple[Op, ...]:
    """The op table of one layer of `spec`; cached, since every memory, FLOP and chain function
    reads the same table of a (frozen, hashable) spec. A `profile` other than fused (this table)
    replaces the numbers of the ops it names (ckplan.model.profiles)."""
    if spec.kind == "mlp":
        return mlp_layer_ops(spec)
    ops = transformer_layer_ops(spec)
    if spec.profile == "fused":
        return ops
    from ckplan.io.profiles import load_profile  # the profile's YAML, parsed once per file
    from ckplan.model.profiles import apply_profile

    return apply_profile(ops, spec, load_profile(spec.profile))


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
