"""A layer is a list of ops (`ckplan.model.op`): the op table of each kind of layer.

Every strategy, breakdown and chain is a sum over this one table, so they cannot disagree. A
dense or sliding-window transformer layer is built here; multi-head latent attention
(`ckplan.model.mla`) and the mixture-of-experts MLP (`ckplan.model.moe`) bring their own ops. A
kernel profile other than `fused` (`ckplan.model.profiles`) replaces the numbers of the ops it
names.

Notation (Korthikanti et al. 2022, §4): s sequence, b micro-batch, h hidden, a heads, g kv heads,
d = h/a, F ffn hidden, B bytes per activation value, t tensor-parallel size. Dropout masks are one
byte per value. All counts are for one GPU: head- and ffn-sharded tensors are divided by t, the
rest by t only under sequence parallelism (Korthikanti §4.2.2), and every token count by the
context-parallel size cp.
"""

from __future__ import annotations

import dataclasses

from ckplan.model.context_parallel import (
    attention_backward_workspace_bytes,
    cp_moved_bytes,
    te_saved_output_bytes,
    torchtitan_ring_workspace_bytes,
)
from ckplan.model.finetune import frozen_ops
from ckplan.model.fp8_blocks import saved_input_scale_bytes
from ckplan.model.frameworks import framework_version
from ckplan.model.layers import DENSE, LayerKind, layer_kinds
from ckplan.model.mla import mla_projection_ops, value_view_bytes
from ckplan.model.mlp_block import dense_mlp_ops
from ckplan.model.moe import EXPERTS, MOE, experts_input_bytes, moe_ops
from ckplan.model.op import (
    ATTENTION_CORE,
    DENSE_MLP,
    FP32_BYTES,
    MASK_BYTES,
    LayerShapes,
    Matmul,
    Op,
    column_parallel_saved_input_bytes,
    kv_heads_per_rank,
    make_op,
    matmul_flops,
)
from ckplan.model.parts import cached_by_chain
from ckplan.model.repeat_kv import kernel_kv_heads, repeat_kv_copy_bytes, repeats_kv
from ckplan.model.spec import ChainSpec
from ckplan.simple import mlp as numpy_mlp


def transformer_layer_ops(spec: ChainSpec, kind: LayerKind = DENSE) -> tuple[Op, ...]:
    """The ops of one transformer layer of `kind` on one GPU, in forward order.

    Standard attention with dropout, B = 2, F = 4h, a = g, t = 1 reproduces Korthikanti et al.
    2022 §4.1 exactly: attention 11sbh + 5as²b, MLP 19sbh, norms 4sbh (Table 2, 34sbh + 5as²b);
    the other knobs follow from what each op saves (derived, see each line). Multi-head latent
    attention is `ckplan.model.mla`, the mixture-of-experts MLP `ckplan.model.moe`.

    The backward fields (`Op.output_grad_bytes`, `input_grad_bytes`, `grad_workspace_bytes`)
    follow from each op's backward formula as the CUDA kernels Megatron-LM runs evaluate it: a
    gradient has its tensor's size and dtype; element-wise backward ops are one kernel writing a
    new tensor. Checked against PyTorch's memory profiler in docs/validation.md.
    """
    shapes = LayerShapes.of(spec)
    B, X, stream = shapes.B, shapes.X, shapes.stream
    dropout = spec.dropout > 0
    # norm1 saves its input (the layer input); its input gradient is added to the
    # residual-stream gradient (memory.layer_backward_walk).
    ops = [make_op("norm1", "norm", B * stream, grads=(X, X), moved=shapes.norm_moved)]
    ops += _attention_ops(spec, kind, shapes)
    # Gemma 2/3 normalise the attention output before the residual add: the norm saves it.
    tail_grad = X if dropout else 0  # gradient of the attention branch's last op's output
    if spec.post_norms:
        ops.append(
            make_op(
                "post_attn_norm", "norm", B * stream, grads=(tail_grad, X), moved=shapes.norm_moved
            )
        )
    if dropout:
        # 1-byte mask; its output is added to the residual stream, so its output gradient is
        # the residual-stream gradient; dY ⊙ mask / (1 - p) is new.
        ops.append(
            make_op("out_dropout", "attention", stream, grads=(0, X), moved=shapes.dropout_moved)
        )
    # norm2 saves its input, the mid-layer residual stream; with a parallel residual (GPT-NeoX)
    # that is the layer input norm1 already saves: one storage, freed after norm1's backward.
    if spec.parallel_residual:
        ops.append(make_op("norm2", "norm", 0, grads=(X, X), moved=shapes.norm_moved))
    else:
        ops.append(make_op("norm2", "norm", B * stream, grads=(X, X), moved=shapes.norm_moved))
    mlp_out_grad = X if (dropout or spec.post_norms) else 0
    if kind.moe:
        ops += moe_ops(spec, shapes, mlp_out_grad)
    else:
        ops += dense_mlp_ops(spec, shapes, mlp_out_grad)
    if spec.post_norms:
        ops.append(
            make_op(
                "post_mlp_norm",
                "norm",
                B * stream,
                grads=(X if dropout else 0, X),
                moved=shapes.norm_moved,
            )
        )
    if dropout:  # as out_dropout
        ops.append(make_op("mlp_dropout", "mlp", stream, grads=(0, X), moved=shapes.dropout_moved))
    return tuple(ops)


def _attention_ops(spec: ChainSpec, kind: LayerKind, shapes: LayerShapes) -> list[Op]:
    """QKV projection (or MLA's projections), the attention core, the output projection."""
    B, X, tokens = shapes.B, shapes.X, shapes.tokens
    sharded = shapes.sharded
    dropout = spec.dropout > 0
    heads_r = spec.heads // spec.tp  # a/t query heads on this rank (tp divides heads)
    if spec.mla:
        qk_dim = spec.qk_nope_head_dim + spec.qk_rope_head_dim
        v_dim = spec.v_head_dim
        kv_heads_r = heads_r  # every head has its own K and V
    else:
        qk_dim = v_dim = spec.head_dim
        kv_heads_r = kv_heads_per_rank(spec)  # g/t (at least one head)
    d_q = B * tokens * heads_r * qk_dim  # Q, (b, a, s, d) on this rank
    d_k = B * tokens * kv_heads_r * qk_dim  # K at g heads
    d_v = B * tokens * kv_heads_r * v_dim  # V at g heads
    context = B * tokens * heads_r * v_dim  # the attention output O, (b, a, s, d_v)
    qkv = d_q + d_k + d_v  # Q, K, V as the projections produce them
    # The attention core's gradients of Q, K, V: standard attention's matmuls read K and V
    # repeated to a heads; flash attention returns dK, dV at g heads.
    if spec.attention == "standard":
        core_grads = (d_q, B * tokens * heads_r * qk_dim, context)
    else:
        core_grads = (d_q, d_k, d_v)
    ops: list[Op] = []
    if spec.mla:
        ops += mla_projection_ops(spec, shapes, core_grads)
    else:
        q_width = heads_r * spec.head_dim + 2 * kv_heads_r * spec.head_dim
        # The QKV projection saves its input (norm1's output). Megatron splits one QKV output
        # into Q, K, V views: torch.split's backward concatenates their gradients (repeated K,
        # V heads summed back to g) into the gradient of the projection output before the
        # input-gradient matmul.
        # With qk_norm, dQ and dK come through the norms, K's at g heads.
        out_grad = d_q + d_k + core_grads[2] if spec.qk_norm else sum(core_grads)
        # torchtitan "2024.12": the repeat of K and V to the query heads (one copy kernel each)
        # and, in backward, the sum of their gradients back to the K/V heads, with the
        # projection as the eager RoPE kernels are (ckplan.hardware.code_path)
        repeat_copy = 0
        if spec.attention != "standard" and repeats_kv(spec.framework, framework_version(spec)):
            repeat_copy = repeat_kv_copy_bytes(tokens, heads_r, kv_heads_r, 2 * spec.head_dim, B)
        ops.append(
            make_op(
                "qkv_proj",
                "attention",
                column_parallel_saved_input_bytes(spec, shapes),
                matmul_flops(tokens, q_width, spec.hidden),
                grads=(out_grad, X),
                workspace=qkv,
                matmul=shapes.linear(tokens, q_width, spec.hidden),  # input all-gathered under SP
                # the bias gradient; the repeat copies and their gradients' sum
                moved=(repeat_copy, (B * tokens * q_width if spec.qkv_bias else 0) + repeat_copy),
                tp_comm="column",
            )
        )
        if spec.qk_norm:
            # Qwen3 / Gemma 3: RMSNorm over each head of Q and K before RoPE; saves its inputs,
            # Q and K as projected (Q, K, V then saved by the core are new tensors).
            ops.append(
                make_op(
                    "qk_norm",
                    "attention",
                    d_q + d_k,
                    grads=(core_grads[0] + core_grads[1], d_q + d_k),
                    # reads and writes Q and K; backward reads dY and the input twice, writes dX
                    moved=(2 * (d_q + d_k), 5 * (d_q + d_k)),
                )
            )
    s_local, s = spec.seq // spec.cp, spec.seq
    window = kind.window if kind.window and kind.window < s else 0
    scores = heads_r * spec.micro_batch * s_local * s  # (b, a, s, s) elements on this rank
    score_flops = matmul_flops(s_local, s, qk_dim) * heads_r * spec.micro_batch
    values_flops = matmul_flops(s_local, v_dim, s) * heads_r * spec.micro_batch
    head_batch = spec.micro_batch * heads_r  # one GEMM per (sequence, head) on this rank
    if spec.attention == "standard":
        # Q and K, with K repeated to a heads (Megatron's repeat_interleave, HF's repeat_kv copy).
        # Backward: dQ = dS·K, dK = dSᵀ·Q (K's at a heads). Megatron folds the 1/√d scale into
        # baddbmm's alpha and the mask into the fused softmax, so no (b, a, s, s) temporary;
        # eager `(q @ kᵀ) * scale` allocates one more in MulBackward (docs/validation.md).
        # A sliding window changes nothing here: eager attention materialises every (query,
        # key) score and masks those outside the window.
        k_repeated = B * tokens * heads_r * qk_dim
        ops.append(
            make_op(
                "attn_scores",
                "attention",
                d_q + k_repeated,
                score_flops,
                ATTENTION_CORE,
                grads=(B * scores, d_q + k_repeated),
                matmul=Matmul(s_local, s, qk_dim, head_batch, B),
            )
        )
        # Saves its output Y. Backward dS = Y ⊙ (dY - Σ dY ⊙ Y), one new (b, a, s, s) tensor
        # (torch's _softmax_backward_data; Megatron's fused scale-mask-softmax kernel writes it
        # into dY in place, B·as²b less: ckplan keeps the upper bound).
        # Moves: reads the scores, writes P; backward reads P and dP, writes dS (Megatron's
        # fused scale-mask-softmax, one kernel each way).
        ops.append(
            make_op(
                "softmax",
                "attention",
                B * scores,
                0,
                ATTENTION_CORE,
                grads=(B * scores,) * 2,
                moved=(2 * B * scores, 3 * B * scores),
            )
        )
        if dropout:
            # 1-byte mask. Backward dY ⊙ mask / (1 - p): one new tensor (CUDA's masked-scale
            # kernel; the CPU composite also casts the mask, docs/validation.md).
            ops.append(
                make_op(
                    "attn_dropout",
                    "attention",
                    scores,
                    0,
                    ATTENTION_CORE,
                    grads=(B * scores,) * 2,
                    # reads P, writes P' and the mask; backward reads dP' and the mask, writes dP
                    moved=((2 * B + MASK_BYTES) * scores,) * 2,
                )
            )
        # Saves the probabilities it multiplies (the dropout output; without dropout that is the
        # softmax output, already counted) and V, repeated to a heads. Backward: dP = dC·Vᵀ and
        # dV = Pᵀ·dC from the context gradient dC.
        probs = B * scores if dropout else 0
        ops.append(
            make_op(
                "attn_values",
                "attention",
                probs + context + (value_view_bytes(spec, shapes) if spec.mla else 0),
                values_flops,
                ATTENTION_CORE,
                grads=(context, B * scores + context),
                matmul=Matmul(s_local, v_dim, s, head_batch, B),
                # the context (b, a, s, d) -> (s, b, h) permute copy, and its gradient's
                moved=(2 * context, 2 * context),
            )
        )
    else:
        # Flash attention (Dao et al. 2022, Alg. 2/4): saves Q, K, V (K, V at g heads), its
        # output O and the fp32 logsumexp, a·s·b values; no s² tensor, dropout regenerated from
        # the RNG state. O is counted once, as out_proj's input. Its backward recomputes QKᵀ
        # (Alg. 4 line 11): one extra score matmul on top of 2x forward.
        # With a sliding window W < s the kernel skips the blocks outside it: each query meets
        # W keys instead of s (the count keeps Korthikanti's convention of not discounting
        # the causal mask; FlashAttention-2's window_size=(W - 1, 0)). Saved bytes unchanged.
        if window:
            score_flops = matmul_flops(s_local, window, qk_dim) * heads_r * spec.micro_batch
            values_flops = matmul_flops(s_local, v_dim, window) * heads_r * spec.micro_batch
        logsumexp = FP32_BYTES * sharded(tokens * spec.heads)
        core_flops = score_flops + values_flops
        # Backward (FlashAttention-2 csrc/flash_attn/flash_api.cpp mha_bwd, also PyTorch's CUDA
        # flash kernel): reads dO, writes dQ, dK, dV, and allocates an fp32 dQ accumulator
        # (s, b, a, d), the fp32 softmax_d = rowsum(dO ⊙ O) (a·s·b values) and, with fewer K/V
        # heads than Q heads on the rank, dK and dV at a heads before summing them to g.
        expanded = B * tokens * heads_r * (qk_dim + v_dim) if kv_heads_r < heads_r else 0
        workspace = FP32_BYTES * (tokens * heads_r * qk_dim + sharded(tokens * spec.heads))
        # torchtitan's context parallelism: PyTorch's ring attention all-gathers K‖V and keeps
        # fp32 dQ, dK, dV accumulators and the dK‖dV ring buffers (ckplan.model.context_parallel)
        workspace += torchtitan_ring_workspace_bytes(spec, tokens, heads_r, kv_heads_r)
        # the context-parallel loops' own copies and corrections around the kernel calls
        ring_moved = cp_moved_bytes(spec, heads_r, kv_heads_r)
        # Q, K, V as the kernel reads and saves them: torchtitan "2024.12" repeats K and V to
        # the rank's query heads before SDPA (ckplan.model.repeat_kv), and its copies are what
        # the kernel saves; the K/V-head tensors are freed. Its backward's dK, dV at the query
        # heads, summed back to the K/V heads, are the `expanded` transient above.
        seen = qkv
        if not spec.mla and repeats_kv(spec.framework, framework_version(spec)):
            kv_seen = kernel_kv_heads(True, heads_r, kv_heads_r)
            seen = d_q + B * tokens * kv_seen * (qk_dim + v_dim)
        ops.append(
            Op(
                "attention_core",
                "attention",
                # MLA: V may be a view keeping kv_up's whole output (`mla.value_view_bytes`);
                # TE's all-to-all and all-gather context parallelism keep the kernel's own O
                # (`te_saved_output_bytes`)
                seen
                + logsumexp
                + (value_view_bytes(spec, shapes) if spec.mla else 0)
                + te_saved_output_bytes(spec, heads_r, kv_heads_r),
                core_flops,
                2 * core_flops + score_flops,
                ATTENTION_CORE,
                output_grad_bytes=context,
                input_grad_bytes=sum(core_grads),
                grad_workspace_bytes=attention_backward_workspace_bytes(
                    spec, heads_r, kv_heads_r, workspace + expanded
                ),
                # One fused kernel: reads Q, K, V, writes O and the logsumexp; backward reads
                # Q, K, V, O, dO and the logsumexp, writes dQ, dK, dV (and its fp32 dQ
                # accumulator, read back once).
                forward_bytes=seen + context + logsumexp,
                backward_bytes=2 * seen
                + 2 * context
                + logsumexp
                + 2 * FP32_BYTES * tokens * heads_r * qk_dim,
                fused_kernel=True,
                side_bytes=ring_moved,
            )
        )
    # Saves its input, the attention context; its output gradient is the residual-stream
    # gradient (no dropout, no post-norm) or the gradient the op after it allocates. With flash
    # attention that input is the kernel's saved O, one storage, freed after the kernel's
    # backward.
    ops.append(
        make_op(
            "out_proj",
            "attention",
            context,
            matmul_flops(tokens, spec.hidden, heads_r * v_dim),
            grads=(X if (dropout or spec.post_norms) else 0, context),
            saved_until=None if spec.attention == "standard" else "attention_core",
            # the output is reduce-scattered under SP
            matmul=shapes.linear(tokens, spec.hidden, heads_r * v_dim),
            # without dropout, the residual add follows (with it, out_dropout's fused kernel);
            # a row-parallel bias is added after the reduction: its gradient sums dY
            moved=(0 if dropout else shapes.residual_add, X if spec.bias else 0),
            tp_comm="row",
        )
    )
    return ops


@cached_by_chain(maxsize=256)
def layer_ops(spec: ChainSpec, kind: LayerKind | None = None) -> tuple[Op, ...]:
    """The op table of one layer of `kind` (default: `representative_kind`) of `spec` on one
    GPU. Cached by the parts it depends on (`spec.chain`: architecture, run shape, parallelism,
    kernel profile), since every memory, FLOP and chain function reads the same table. A profile
    other than fused (this table) replaces the numbers of the ops it names."""
    if spec.kind == "mlp":
        return numpy_mlp.layer_ops(spec)
    kind = representative_kind(spec) if kind is None else kind
    ops = transformer_layer_ops(spec, kind)
    if spec.precision == "fp8":
        ops = fp8_saved(ops, spec)
    if not spec.profile.is_fused:
        from ckplan.model.profiles import apply_profile  # only with a profile (start-up time)

        ops = apply_profile(ops, spec, spec.profile)
    return frozen_ops(ops, spec, kind) if spec.training != "full" else ops


# Linear layers whose GEMM runs in FP8 (the router and the output layer stay in BF16; the
# attention core's products are not linear layers).
FP8_LINEARS = frozenset(
    {"qkv_proj", "out_proj", "fc1", "fc2", "q_proj", "q_down", "q_up", "kv_down", "kv_up"}
    | {"expert_fc1", "expert_fc2", "shared_fc1", "shared_fc2"}
)


def fp8_saved(ops: tuple[Op, ...], spec: ChainSpec) -> tuple[Op, ...]:
    """Transformer Engine's FP8 linear layers save the FP8 (1-byte), column-wise copy of their
    input for the backward instead of the B-byte input (transformer_engine/pytorch/module/
    linear.py: `inputmat.update_usage(rowwise_usage=False, columnwise_usage=True)`, "Discard
    row-wise data since it is not needed in backward pass"); under blockwise scaling with that
    copy's fp32 scales, one per 128 values (`fp8_blocks.saved_input_scale_bytes`). The
    per-tensor scale of delayed and current scaling is a few bytes a layer, and MXFP8's
    E8M0 scales are not counted."""
    B = spec.dtype_bytes
    blockwise = spec.fp8_recipe == "blockwise"
    # a sequence-parallel column-parallel layer quantizes its input in the all-gather format
    gathered = spec.sp and spec.tp > 1
    saved_ops = []
    for op in ops:
        if op.name not in FP8_LINEARS or op.matmul is None:
            saved_ops.append(op)
            continue
        values = -(-op.saved_bytes // B)
        saved = values
        if blockwise and values:
            cols, groups = op.matmul.k, op.matmul.batch
            compact = gathered and op.tp_comm == "column"
            saved += saved_input_scale_bytes(values // cols, cols, groups, compact)
        saved_ops.append(dataclasses.replace(op, saved_bytes=saved))
    return tuple(saved_ops)


@cached_by_chain(maxsize=128)
def representative_kind(spec: ChainSpec) -> LayerKind:
    """The kind shown as "one layer": the one that saves the most bytes for backward (ties:
    the most frequent, then the first); the only kind of a uniform model."""
    kinds = layer_kinds(spec)
    if spec.kind == "mlp" or len(set(kinds)) == 1:
        return kinds[0]
    counts = {kind: kinds.count(kind) for kind in dict.fromkeys(kinds)}

    def weight(kind: LayerKind) -> tuple[int, int]:
        return sum(op.saved_bytes for op in transformer_layer_ops(spec, kind)), counts[kind]

    return max(counts, key=weight)


def group_input_bytes(spec: ChainSpec, group: str, kind: LayerKind | None = None) -> int:
    """Bytes a recompute group must keep as its input so it can be re-run in backward.

    The attention core (Korthikanti §5, selective recomputation) is recomputed from Q, K and V
    as the projections produced them: K and V at g heads, before any repeat to a heads. The MoE
    block (Megatron's --moe-layer-recompute, `tensor_parallel.checkpoint(custom_forward,
    hidden_states)`) and the dense MLP (`--recompute-modules mlp`) from norm2's output; the
    expert MLPs from their dispatched tokens and routing probabilities
    (`moe.experts_input_bytes`); the shared experts nothing more: their checkpoint's input is
    norm2's output, which the router saves. A group the layer does not have keeps nothing.
    """
    if spec.kind == "mlp":
        return 0
    kind = representative_kind(spec) if kind is None else kind
    shapes = LayerShapes.of(spec)
    if group == ATTENTION_CORE:
        heads_r = spec.heads // spec.tp
        if spec.mla:
            qk_dim = spec.qk_nope_head_dim + spec.qk_rope_head_dim
            width = heads_r * (2 * qk_dim + spec.v_head_dim)
        else:
            width = (heads_r + 2 * kv_heads_per_rank(spec)) * spec.head_dim
        return spec.dtype_bytes * shapes.tokens * width
    if group == DENSE_MLP:  # fc1's input, norm2's output, as fc1 saves it
        return 0 if kind.moe else spec.dtype_bytes * shapes.stream
    if not kind.moe:
        return 0
    if group == MOE:
        return shapes.X
    if group == EXPERTS:
        return experts_input_bytes(spec, shapes)
    return 0  # SHARED_EXPERTS among them
