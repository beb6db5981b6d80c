"""One MoE layer and one MLA layer in plain PyTorch, for validation/torch_saved_bytes.py.

Written op by op the way Megatron-Core runs them, so that autograd saves what Megatron's
modules save (docs/validation.md, "MoE and MLA"):

* MoELayer: Llama attention (fused RMSNorm, SDPA with GQA), then Megatron's MoELayer with the
  all-to-all dispatcher on one rank (ep = 1: the all-to-alls are identities and save nothing):
  TopKRouter (gating linear; top-k of the logits, softmax of the k scores in fp32, scattered
  into a dense (T, E) map; the aux-loss softmax over all E in fp32, attached to the graph as
  MoEAuxLossAutoScaler does), moe_utils.permute (masked_select of the probabilities with the
  transposed routing map, index_select of the tokens), the experts as grouped GEMMs (one linear
  per expert on its slice) with the probabilities applied inside the SwiGLU
  (weighted_bias_swiglu_impl), moe_utils.unpermute (scatter_add), optional shared experts.
* MLALayer: DeepSeek-V3's MultiLatentAttention as Megatron's MLASelfAttention runs it: q_down,
  q_norm, q_up; kv_down, split, kv_norm on the contiguous latent, kv_up; RoPE on the rope parts
  (cos/sin tables are buffers); Q and K concatenated, V made contiguous, the core attention,
  o_proj; then a dense MLP with Megatron's fused SwiGLU.

With `framework: torchtitan` the two layers follow torchtitan 0.3.0 where its code saves
other tensors (the router and the permutation stay Megatron's):

* MoE: the experts' SwiGLU is not weighted (models/common/moe.py GroupedExperts.forward); the
  combine weights the experts' outputs by their fp32 scores and scatter-adds them
  (models/common/token_dispatcher.py LocalTokenDispatcher.combine: `routed_output_RD.to(
  torch.float32) * topk_scores_experts_sorted_N.reshape(-1, 1)`, then `.to(dtype)`).
* MLA: kv_norm normalises the latent as a view of wkv_a's output, and V is handed to the core
  attention as a view of wkv_b's output (models/deepseek_v3/model.py Attention.forward: no
  `.contiguous()`).

With `framework: hf` they follow Hugging Face transformers 5.25.0 likewise: the experts'
SwiGLU unweighted, the outputs multiplied by the fp32 routing weights (models/mixtral/
modeling_mixtral.py MixtralExperts.forward: `current_hidden_states * top_k_weights[token_idx,
top_k_pos, None]`, bf16 times fp32); V a view of kv_b_proj's output (models/deepseek_v3/
modeling_deepseek_v3.py DeepseekV3Attention.expand_kv), the KV latent normalised as a copy
(DeepseekV3RMSNorm's fp32 cast; the fused norm here takes a contiguous copy).

The core attention of MLA has head dims 192 / 128 (Q, K / V); PyTorch's CPU SDPA has no flash
kernel for unequal head dims (it falls back to the fp32 math path), so `FlashAttention` below
implements a flash kernel's autograd contract (FlashAttention-2: saves Q, K, V, O and the fp32
logsumexp; its backward recomputes the scores), the same contract the CPU flash kernel follows
for equal dims (docs/validation.md §4).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import torch_saved_bytes as base
from torch import nn


class FlashAttention(torch.autograd.Function):
    """softmax(Q·Kᵀ/√d, causal)·V with a flash kernel's saved tensors: Q, K, V, O, fp32 LSE."""

    @staticmethod
    def forward(ctx, q, k, v):  # (b, a, s, d_qk), (b, a, s, d_qk), (b, a, s, d_v)
        scale = 1.0 / math.sqrt(q.shape[-1])
        s = q.shape[-2]
        scores = (q.float() @ k.float().transpose(-2, -1)) * scale
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # (b, a, s) fp32
        out = (torch.exp(scores - lse[..., None]) @ v.float()).to(q.dtype)
        # Laid out (b, s, a, d_v) in memory, as flash kernels write it: merging the heads
        # afterwards is a view, so out_proj saves this same storage.
        out = out.transpose(1, 2).contiguous().transpose(1, 2)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        scale = 1.0 / math.sqrt(q.shape[-1])
        s = q.shape[-2]
        scores = (q.float() @ k.float().transpose(-2, -1)) * scale
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        p = torch.exp(scores - lse[..., None])
        g = grad.float()
        dv = p.transpose(-2, -1) @ g
        dp = g @ v.float().transpose(-2, -1)
        ds = p * (dp - (g * out.float()).sum(-1, keepdim=True)) * scale
        dq, dk = ds @ k.float(), ds.transpose(-2, -1) @ q.float()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _AuxLossScaler(torch.autograd.Function):
    """Megatron's MoEAuxLossAutoScaler: returns the probabilities unchanged and makes the aux
    loss's gradient flow in backward (saves the scalar loss)."""

    @staticmethod
    def forward(ctx, probs, aux_loss):
        ctx.save_for_backward(aux_loss)
        return probs

    @staticmethod
    def backward(ctx, grad):
        (aux_loss,) = ctx.saved_tensors
        return grad, torch.ones_like(aux_loss)


class _WeightedSwiGLU(torch.autograd.Function):
    """Megatron's weighted_bias_swiglu_impl: silu(gate)·up·w, saving its input (fc1's output,
    [gate | up]) and the per-row weights w (the routing probabilities)."""

    @staticmethod
    def forward(ctx, y, weights):  # (R, 2F), (R, 1)
        ctx.save_for_backward(y, weights)
        gate, up = torch.chunk(y, 2, dim=-1)
        return (F.silu(gate.float()) * up.float() * weights.float()).to(y.dtype)

    @staticmethod
    def backward(ctx, grad):
        y, weights = ctx.saved_tensors
        gate, up = (t.float() for t in torch.chunk(y, 2, dim=-1))
        g, w = grad.float(), weights.float()
        sig = torch.sigmoid(gate)
        silu = gate * sig
        d_gate = g * w * up * sig * (1 + gate * (1 - sig))
        d_up = g * w * silu
        d_w = (g * silu * up).sum(-1, keepdim=True)
        return torch.cat([d_gate, d_up], -1).to(y.dtype), d_w.to(weights.dtype)


def _attention_gqa(layer, x, rec):
    """Llama attention with fused RMSNorm and SDPA (GQA): norm1, qkv_proj, attention_core."""
    cfg = layer.cfg
    b, s, h = x.shape
    a, g = cfg.heads, cfg.kv_heads
    d = h // a
    with base.tag_tensor(rec, "norm1"):
        y = layer.input_layernorm(x)
    with base.tag_tensor(rec, "qkv_proj"):
        q = layer.q_proj(y).view(b, s, a, d).transpose(1, 2)
        k = layer.k_proj(y).view(b, s, g, d).transpose(1, 2)
        v = layer.v_proj(y).view(b, s, g, d).transpose(1, 2)
    with base.tag_tensor(rec, "attention_core"):
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return y.transpose(1, 2).contiguous().view(b, s, a * d)


class MoELayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        h, a, g = cfg.hidden, cfg.heads, cfg.kv_heads
        d = h // a
        E, F_e = cfg.experts, cfg.moe_ffn_hidden
        self.cfg = cfg
        self.input_layernorm = base.FusedRMSNorm(h)
        self.q_proj = nn.Linear(h, a * d, bias=False)
        self.k_proj = nn.Linear(h, g * d, bias=False)
        self.v_proj = nn.Linear(h, g * d, bias=False)
        self.o_proj = nn.Linear(a * d, h, bias=False)
        self.post_attention_layernorm = base.FusedRMSNorm(h)
        self.router = nn.Linear(h, E, bias=False)
        self.fc1 = nn.ModuleList(nn.Linear(h, 2 * F_e, bias=False) for _ in range(E))
        self.fc2 = nn.ModuleList(nn.Linear(F_e, h, bias=False) for _ in range(E))
        if cfg.shared_ffn_hidden:
            self.shared_fc1 = nn.Linear(h, 2 * cfg.shared_ffn_hidden, bias=False)
            self.shared_fc2 = nn.Linear(cfg.shared_ffn_hidden, h, bias=False)

    def forward(self, x, rec=None):
        cfg = self.cfg
        b, s, h = x.shape
        E, k = cfg.experts, cfg.top_k
        titan = cfg.framework in ("torchtitan", "hf")  # outputs weighted after the experts
        y = _attention_gqa(self, x, rec)
        with base.tag_tensor(rec, "out_proj"):
            y = self.o_proj(y)
        x = x + y
        with base.tag_tensor(rec, "norm2"):
            hidden = self.post_attention_layernorm(x).view(b * s, h)  # T = b·s tokens
        tokens = hidden.shape[0]
        with base.tag_tensor(rec, "router"):
            logits = self.router(hidden)  # (T, E)
        with base.tag_tensor(rec, "router_probs"):
            scores, top = torch.topk(logits, k=k, dim=1)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).type_as(logits)
            routing_probs = torch.zeros_like(logits).scatter(1, top, probs)  # (T, E)
            routing_map = torch.zeros_like(logits).int().scatter(1, top, 1).bool()
            aux_scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
            tokens_per_expert = routing_map.sum(dim=0)
            aux_loss = (aux_scores.sum(0) * tokens_per_expert).sum() * (E * 1e-2 / (k * tokens))
            routing_probs = _AuxLossScaler.apply(routing_probs, aux_loss)
        with base.tag_tensor(rec, "permute"):
            map_t = routing_map.T.contiguous()  # (E, T)
            token_ids = torch.arange(tokens).unsqueeze(0).expand(E, -1)
            sorted_ids = token_ids.masked_select(map_t)  # (T·k,), grouped by expert
            permuted_probs = routing_probs.T.contiguous().masked_select(map_t)
            permuted = hidden.index_select(0, sorted_ids)  # (T·k, h)
        counts = tokens_per_expert.tolist()
        outs = []
        start = 0
        for e in range(E):
            rows = slice(start, start + counts[e])
            start += counts[e]
            with base.tag_tensor(rec, "expert_fc1"):
                z = self.fc1[e](permuted[rows])
            with base.tag_tensor(rec, "expert_act"):
                if titan:
                    z = base.FusedSwiGLU.apply(z)
                else:
                    z = _WeightedSwiGLU.apply(z, permuted_probs[rows].unsqueeze(-1))
            with base.tag_tensor(rec, "expert_fc2"):
                outs.append(self.fc2[e](z))
        with base.tag_tensor(rec, "unpermute"):
            expert_out = torch.cat(outs)
            scores = permuted_probs.float().unsqueeze(-1)
            if cfg.framework == "torchtitan":  # the product saves fp32 outputs and scores
                expert_out = (expert_out.to(torch.float32) * scores).to(x.dtype)
            elif cfg.framework == "hf":  # the B-byte outputs and the fp32 weights
                expert_out = (expert_out * scores).to(x.dtype)
            index = sorted_ids.unsqueeze(1).expand(-1, h)
            y = torch.zeros(tokens, h, dtype=x.dtype).scatter_add(0, index, expert_out)
        if cfg.shared_ffn_hidden:
            with base.tag_tensor(rec, "shared_fc1"):
                z = self.shared_fc1(hidden)
            with base.tag_tensor(rec, "shared_act"):
                z = base.FusedSwiGLU.apply(z)
            with base.tag_tensor(rec, "shared_fc2"):
                y = y + self.shared_fc2(z)
        return x + y.view(b, s, h)


class _RoPE(nn.Module):
    """Rotary embedding on the last dim; cos and sin are buffers (saved, never activations)."""

    def __init__(self, dim: int, seq: int):
        super().__init__()
        inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        angles = torch.outer(torch.arange(seq).float(), inv)
        emb = torch.cat([angles, angles], -1)  # (s, dim)
        self.register_buffer("cos", emb.cos()[None, :, None, :], persistent=False)
        self.register_buffer("sin", emb.sin()[None, :, None, :], persistent=False)

    def forward(self, x):  # (b, s, heads, dim)
        x1, x2 = torch.chunk(x, 2, dim=-1)
        rotated = torch.cat([-x2, x1], -1)
        return x * self.cos.to(x.dtype) + rotated * self.sin.to(x.dtype)


class MLALayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        h, a = cfg.hidden, cfg.heads
        nope, rope, v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.cfg = cfg
        self.input_layernorm = base.FusedRMSNorm(h)
        self.q_down = nn.Linear(h, cfg.q_lora_rank, bias=False)
        self.q_norm = base.FusedRMSNorm(cfg.q_lora_rank)
        self.q_up = nn.Linear(cfg.q_lora_rank, a * (nope + rope), bias=False)
        self.kv_down = nn.Linear(h, cfg.kv_lora_rank + rope, bias=False)
        self.kv_norm = base.FusedRMSNorm(cfg.kv_lora_rank)
        self.kv_up = nn.Linear(cfg.kv_lora_rank, a * (nope + v_dim), bias=False)
        self.o_proj = nn.Linear(a * v_dim, h, bias=False)
        self.rope = _RoPE(rope, cfg.seq)
        self.post_attention_layernorm = base.FusedRMSNorm(h)
        self.fc1 = nn.Linear(h, 2 * cfg.ffn_hidden, bias=False)
        self.fc2 = nn.Linear(cfg.ffn_hidden, h, bias=False)

    def forward(self, x, rec=None):
        cfg = self.cfg
        b, s, _ = x.shape  # (b, s, h)
        a = cfg.heads
        nope, rope, v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        with base.tag_tensor(rec, "norm1"):
            y = self.input_layernorm(x)
        with base.tag_tensor(rec, "q_down"):
            q_latent = self.q_down(y)
        with base.tag_tensor(rec, "q_norm"):
            q_latent = self.q_norm(q_latent)
        with base.tag_tensor(rec, "q_up"):
            q = self.q_up(q_latent).view(b, s, a, nope + rope)
        with base.tag_tensor(rec, "kv_down"):
            kv = self.kv_down(y)
        kv_latent, k_rope = torch.split(kv, [cfg.kv_lora_rank, rope], dim=-1)
        titan = cfg.framework == "torchtitan"
        with base.tag_tensor(rec, "kv_norm"):
            kv_latent = self.kv_norm(kv_latent if titan else kv_latent.contiguous())
        with base.tag_tensor(rec, "kv_up"):
            kv = self.kv_up(kv_latent).view(b, s, a, nope + v_dim)
        with base.tag_tensor(rec, "attention_core"):
            q_nope, q_rope = torch.split(q, [nope, rope], dim=-1)
            q = torch.cat([q_nope, self.rope(q_rope)], -1)  # (b, s, a, nope + rope)
            k_nope, v = torch.split(kv, [nope, v_dim], dim=-1)
            k_rope = self.rope(k_rope.unsqueeze(2)).expand(b, s, a, rope)
            k = torch.cat([k_nope, k_rope], -1)
            v = v if cfg.framework in ("torchtitan", "hf") else v.contiguous()
            out = FlashAttention.apply(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        y = out.transpose(1, 2).contiguous().view(b, s, a * v_dim)
        with base.tag_tensor(rec, "out_proj"):
            y = self.o_proj(y)
        x = x + y
        with base.tag_tensor(rec, "norm2"):
            y = self.post_attention_layernorm(x)
        with base.tag_tensor(rec, "fc1"):
            y = self.fc1(y)
        with base.tag_tensor(rec, "act"):
            y = base.FusedSwiGLU.apply(y)
        with base.tag_tensor(rec, "fc2"):
            y = self.fc2(y)
        return x + y
