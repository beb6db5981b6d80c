"""Multi-head latent attention (DeepSeek-V2 §2.1, DeepSeek-V3 §2.1.1): its projections.

Q and K/V are projected through low-rank latents: the layer input x goes down to a query
latent (q_lora_rank wide, RMSNorm) and up to a heads of qk_nope + qk_rope dims, and down to a
KV latent (kv_lora_rank) plus one shared RoPE key (qk_rope dims), the latent normalised and
projected up to a heads of qk_nope (K) + v_head_dim (V). The attention core then runs on
Q, K of qk_nope + qk_rope dims and V of v_head_dim (`ops._attention_ops`).

Parallel layout as Megatron-LM's MLASelfAttention with Transformer Engine
(megatron/core/transformer/multi_latent_attention.py): the down projections are duplicated
linears (whole on every TP rank, each over its own s/t tokens under sequence parallelism),
their norms too; the up projections are column-parallel (a/t heads per rank) and, under
sequence parallelism, save their un-gathered s/t-token input.

What each saves (derived from each op's backward): a linear saves its input, an RMSNorm its
input (the fp32 per-token rstd left out, as for every norm in ckplan); RoPE saves nothing but
its cos/sin tables (Megatron's fused kernels). The norm of the KV latent is taken as saving the
latent alone (a contiguous input, as TE's norm kernels need); normalising a view of the down
projection's output would keep the RoPE key's qk_rope columns alive with it.

Which storages the saved views keep depends on the framework's code (`latent_view_bytes`,
`value_view_bytes`): Megatron-Core copies V (`value.contiguous()`), so the attention kernel's
saved V is V alone; torchtitan and Hugging Face pass V on as a view of kv_up's output, and
torchtitan normalises the KV latent as a view of kv_down's output, so those outputs stay alive
whole (the qk_nope columns of K beside V, the RoPE key beside the latent).

What the time model reads (`ckplan.hardware`), from the same Megatron code: the down
projections are GEMMs over the rank's own tokens with no collective (duplicated linears), the up
projections (and q_proj) column-parallel GEMMs whose input is all-gathered under sequence
parallelism (s·b·rank values, not s·b·h) or whose input gradient is all-reduced without it; the
shared RoPE key is all-gathered under sequence parallelism on its own
(`gather_from_sequence_parallel_region(k_pos_emb)`, `step_time.mla_comm`). Bytes moved: the
latent norms (read x, write y; backward reads dY and x twice, writes dX), the copy that makes
the KV latent contiguous for the norm and its split's gradient, the sum of the query and KV
branches' gradients of x, and the assembly of Q, K and V (`torch.cat([q_nope, q_pe])`,
`torch.cat([k_nope, k_pe expanded to the heads])`, `value.contiguous()`) with their gradients.
The RoPE rotation itself is left out, as for every RoPE in ckplan (the dense QKV projection
counts none either).
"""

from __future__ import annotations

from ckplan.model.op import LayerShapes, Op, make_op, matmul_flops
from ckplan.model.spec import ModelSpec


def value_view_bytes(spec: ModelSpec, shapes: LayerShapes) -> int:
    """Bytes the attention kernel's saved V keeps beyond V itself: B·tokens·(a/t)·qk_nope.

    torchtitan 0.3.0 (torchtitan/models/deepseek_v3/model.py, Attention.forward: `k_nope, v =
    torch.split(kv, [qk_nope_head_dim, v_head_dim], dim=-1)`, v passed to inner_attention) and
    Hugging Face transformers 5.25.0 (models/deepseek_v3/modeling_deepseek_v3.py,
    DeepseekV3Attention.expand_kv: `k_nope, value_states = torch.split(kv_nope, ...)`) hand the
    kernel V as a view of wkv_b's (kv_b_proj's) output; autograd saves the view, which keeps
    the whole output alive, K's no-RoPE columns included (K itself is a new tensor, a cat).
    Megatron-Core core_v0.19.0 (megatron/core/transformer/multi_latent_attention.py,
    `value = value.contiguous()` before the core attention) saves V alone, as DeepSpeed is taken to
    (its model code is the user's): 0."""
    if spec.framework not in ("torchtitan", "hf"):
        return 0
    return shapes.B * shapes.tokens * (spec.heads // spec.tp) * spec.qk_nope_head_dim


def latent_view_bytes(spec: ModelSpec, shapes: LayerShapes) -> int:
    """Bytes the KV latent norm's saved input keeps beyond the latent: B·(s·b/t)·qk_rope.

    torchtitan 0.3.0 (torchtitan/models/deepseek_v3/model.py: `kv, k_pe = torch.split(
    self.wkv_a(x), [kv_lora_rank, qk_rope_head_dim], dim=-1)`, then `self.kv_norm(kv)`): the
    RMSNorm saves its input, a view of wkv_a's output, which keeps the RoPE key's columns
    alive with it. Megatron-Core core_v0.19.0 (multi_latent_attention.py, kv_layernorm on the
    split latent) runs Transformer Engine's norm, which saves a contiguous copy; Hugging Face's
    DeepseekV3RMSNorm casts its input to fp32 first (a new tensor in 16-bit training): 0."""
    if spec.framework != "torchtitan":
        return 0
    return shapes.B * shapes.stream_tokens * spec.qk_rope_head_dim


def mla_projection_ops(
    spec: ModelSpec, shapes: LayerShapes, core_grads: tuple[int, int, int]
) -> list[Op]:
    """q_down, q_norm, q_up (or q_proj without a query latent), kv_down, kv_norm, kv_up.

    `core_grads` are the attention core's gradients of Q, K, V (bytes on this rank), which the
    up projections read as their output gradients. The backward fields follow the gradients'
    paths: dQ to q_up; dK's no-RoPE part and dV to kv_up, dK's RoPE part summed over the heads
    into the shared RoPE key's gradient (counted at kv_up), which kv_down reads with the
    latent's; x's gradient is kv_down's, into which q_down's is accumulated (workspace).
    """
    B, X, tokens = shapes.B, shapes.X, shapes.tokens
    local = shapes.stream_tokens  # tokens each rank projects down (s/t under SP, else s)
    heads_r = spec.heads // spec.tp
    nope, rope, v_dim = spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim
    qk_dim = nope + rope
    q_rank, kv_rank = spec.q_lora_rank, spec.kv_lora_rank
    d_q, d_k, d_v = core_grads
    # Assembling Q: cat([q_nope, q_pe]) reads and writes Q; backward the split's gradient is
    # concatenated back (read and written). K: cat([k_nope, k_pe expanded]) reads the no-RoPE
    # part and the shared key, writes K; V: value.contiguous() copies V. Backward: dK's no-RoPE
    # part and dV concatenated into the kv_up output gradient, dK's RoPE part summed over the
    # heads into the shared key's gradient.
    nope_part = B * tokens * heads_r * nope
    q_moved = (2 * d_q, 2 * d_q)
    kv_moved = (
        nope_part + B * tokens * rope + d_k + 2 * d_v,
        2 * (nope_part + d_v) + B * tokens * heads_r * rope + B * tokens * rope,
    )
    # x feeds two linears (q_down or q_proj, and kv_down): autograd adds their input gradients.
    x_grad_sum = 3 * X
    ops = []
    if q_rank:
        latent = B * local * q_rank
        # x is saved once, here (kv_down reads the same storage; q_down is backpropagated last).
        ops.append(
            make_op(
                "q_down",
                "attention",
                X,
                matmul_flops(local, q_rank, spec.hidden),
                grads=(latent, 0),
                workspace=X,
                matmul=shapes.linear(local, q_rank, spec.hidden),  # duplicated: no collective
                moved=(0, x_grad_sum),
            )
        )
        ops.append(
            make_op(
                "q_norm",
                "attention",
                latent,
                grads=(latent, latent),
                moved=(2 * latent, 5 * latent),
            )
        )
        ops.append(
            make_op(
                "q_up",
                "attention",
                latent,
                matmul_flops(tokens, heads_r * qk_dim, q_rank),
                grads=(d_q, latent),
                matmul=shapes.linear(tokens, heads_r * qk_dim, q_rank),
                moved=q_moved,
                tp_comm="column",  # the latent all-gathered under SP
            )
        )
    else:
        ops.append(
            make_op(
                "q_proj",
                "attention",
                X,
                matmul_flops(tokens, heads_r * qk_dim, spec.hidden),
                grads=(d_q, 0),
                workspace=X,
                matmul=shapes.linear(tokens, heads_r * qk_dim, spec.hidden),
                moved=(q_moved[0], q_moved[1] + x_grad_sum),
                tp_comm="column",
            )
        )
    kv_latent = B * local * kv_rank
    rope_key = B * local * rope  # the shared RoPE key's gradient, summed over the heads
    ops.append(
        make_op(
            "kv_down",
            "attention",
            0,
            matmul_flops(local, kv_rank + rope, spec.hidden),
            grads=(kv_latent + rope_key, X),
            matmul=shapes.linear(local, kv_rank + rope, spec.hidden),  # duplicated
            # backward: torch.split's gradient, the latent's and the key's concatenated
            moved=(0, 2 * (kv_latent + rope_key)),
        )
    )
    ops.append(
        make_op(
            "kv_norm",
            "attention",
            kv_latent + latent_view_bytes(spec, shapes),
            grads=(kv_latent, kv_latent),
            # the contiguous copy of the latent view (read and write), then the norm
            moved=(2 * kv_latent + 2 * kv_latent, 5 * kv_latent),
        )
    )
    ops.append(
        make_op(
            "kv_up",
            "attention",
            kv_latent,
            matmul_flops(tokens, heads_r * (nope + v_dim), kv_rank),
            grads=(d_k + d_v, kv_latent + rope_key),
            matmul=shapes.linear(tokens, heads_r * (nope + v_dim), kv_rank),
            moved=kv_moved,
            tp_comm="column",  # the latent all-gathered under SP
        )
    )
    return ops


def mla_parameters(spec: ModelSpec) -> tuple[int, int]:
    """(tensor-parallel, replicated) parameters of one MLA block: up projections and the
    output projection split over tp; down projections and the latent norms whole on every
    rank (Megatron-LM's duplicated linears). DeepSeek-V3 (h 7168, a 128, q_lora 1536,
    kv_lora 512, nope 128, rope 64, v 128): 187,107,328 in all."""
    h, a = spec.hidden, spec.heads
    qk_dim = spec.qk_nope_head_dim + spec.qk_rope_head_dim
    kv_rank = spec.kv_lora_rank
    if spec.q_lora_rank:
        q_split = spec.q_lora_rank * a * qk_dim
        q_whole = h * spec.q_lora_rank + spec.q_lora_rank  # q_down and q_norm
    else:
        q_split, q_whole = h * a * qk_dim, 0
    kv_split = kv_rank * a * (spec.qk_nope_head_dim + spec.v_head_dim)
    kv_whole = h * (kv_rank + spec.qk_rope_head_dim) + kv_rank  # kv_down and kv_norm
    out = a * spec.v_head_dim * h
    return q_split + kv_split + out, q_whole + kv_whole
