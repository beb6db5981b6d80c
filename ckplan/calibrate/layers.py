"""One transformer layer written op by op in plain PyTorch (torch needed): GPT (nanoGPT /
Megatron-style, unfused) and Llama (Hugging Face eager) blocks, and the fused Megatron-style
RMSNorm and SwiGLU functions, parametrised by `Config`. Shared by `ckplan calibrate` and
validation/torch_saved_bytes.py (docs/validation.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ckplan.calibrate.record import SavedTensorRecorder, tag_tensor

# --------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------


def dropout(x: torch.Tensor, p: float, training: bool, impl: str) -> torch.Tensor:
    """`functional`: F.dropout as written in model code. On CPU it runs the composite
    `input * noise` path (noise has x's dtype), on CUDA it runs `native_dropout` (bool mask).
    `native`: call torch.native_dropout directly, to see on CPU what CUDA saves."""
    if impl == "native" and training and p > 0:
        return torch.native_dropout(x, p, True)[0]
    return F.dropout(x, p=p, training=training)


class HFRMSNorm(nn.Module):
    """Hugging Face LlamaRMSNorm (eager): upcast to fp32, x * rsqrt(mean(x^2) + eps), * w."""

    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class _FusedRMSNormFunction(torch.autograd.Function):
    """A fused RMSNorm kernel's autograd contract (Apex FusedRMSNorm, Transformer Engine,
    torch's CUDA `_fused_rms_norm`): saves its input and the fp32 rstd per token, nothing else.

    Its backward also allocates what a fused kernel allocates (validation/torch_backward_peak.py
    measures that): dX and dW, no (b, s, h) temporary; the element-wise steps run in place in dX
    (in the activation dtype, where a kernel keeps fp32 registers).
    """

    weight_grads = True  # torch_backward_peak.py sets False: it asks for the input gradient only

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)  # (b, s, 1) fp32
        ctx.save_for_backward(x, weight, rstd)
        return (x.float() * rstd).to(x.dtype) * weight

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        grad_weight = None
        if _FusedRMSNormFunction.weight_grads:
            normed = x.float() * rstd
            dims = tuple(range(x.dim() - 1))
            grad_weight = (grad.float() * normed).sum(dim=dims).to(weight.dtype)
        # dX = rstd·(g·w) - x·rstd³·Σ(g·w·x)/h, per token.
        h = x.shape[-1]
        rows = x.numel() // h
        grad_x = torch.mul(grad, weight)  # (b, s, h): dX's buffer, g·w
        dot = torch.bmm(grad_x.reshape(rows, 1, h), x.reshape(rows, h, 1)).reshape(rstd.shape)
        coef = (dot.float() * rstd.pow(3) / h).to(x.dtype)  # (b, s, 1)
        grad_x.mul_(rstd.to(x.dtype))
        torch.addcmul(grad_x, x, coef, value=-1, out=grad_x)
        return grad_x, grad_weight, None


class FusedRMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FusedRMSNormFunction.apply(x, self.weight, self.eps)


class FusedSwiGLU(torch.autograd.Function):
    """Megatron-LM's fused SwiGLU (megatron/core/fusions/fused_bias_swiglu.py, SwiGLUFunction):
    saves only its input, the fc1 output [gate | up] (2F wide), and recomputes silu in backward."""

    @staticmethod
    def forward(ctx, y: torch.Tensor) -> torch.Tensor:  # (b, s, 2F) -> (b, s, F)
        ctx.save_for_backward(y)
        gate, up = torch.chunk(y, 2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        # As Megatron's fused swiglu_back kernel, it allocates [d gate | d up] (2F) and nothing
        # else (validation/torch_backward_peak.py measures that): every step runs in place in
        # the two halves of that output.
        (y,) = ctx.saved_tensors
        gate, up = torch.chunk(y, 2, dim=-1)
        out = torch.empty_like(y)
        d_gate, d_up = torch.chunk(out, 2, dim=-1)
        torch.sigmoid(gate, out=d_up)  # σ
        torch.addcmul(d_up, d_up, d_up, value=-1, out=d_gate)  # σ(1 - σ)
        d_gate.mul_(gate).add_(d_up).mul_(up).mul_(grad)  # g·up·σ(1 + gate(1 - σ))
        d_up.mul_(gate).mul_(grad)  # g·silu(gate)
        return out


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Hugging Face repeat_kv: (b, g, s, d) -> (b, g * n_rep, s, d), expand + reshape (a copy)."""
    b, g, s, d = x.shape
    if n_rep == 1:
        return x
    x = x[:, :, None, :, :].expand(b, g, n_rep, s, d)
    return x.reshape(b, g * n_rep, s, d)


# --------------------------------------------------------------------------------------------
# Layers
# --------------------------------------------------------------------------------------------


class GPTLayer(nn.Module):
    """nanoGPT / Megatron style pre-LN layer with LayerNorm, MHA and a GELU MLP."""

    def __init__(self, cfg: Config):
        super().__init__()
        h, f = cfg.hidden, cfg.ffn_hidden
        self.cfg = cfg
        self.ln1 = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.ln2 = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, f)
        self.fc2 = nn.Linear(f, h)
        s = cfg.seq
        # Additive causal mask (a buffer): `scores + mask` saves nothing for backward. The
        # nanoGPT form `scores.masked_fill(self.bias[:s, :s] == 0, -inf)` saves its boolean mask,
        # and `== 0` makes that a fresh (s, s) tensor in every layer's forward.
        self.register_buffer("mask", torch.full((s, s), float("-inf")).triu(1), persistent=False)
        self.register_buffer("tril", torch.ones(s, s).tril(), persistent=False)

    def forward(self, x: torch.Tensor, rec: SavedTensorRecorder | None = None) -> torch.Tensor:
        cfg = self.cfg
        b, s, h = x.shape  # (b, s, h)
        a = cfg.heads
        d = h // a
        p = cfg.dropout
        tr = self.training
        with tag_tensor(rec, "norm1"):
            y = self.ln1(x)  # (b, s, h)
        with tag_tensor(rec, "qkv_proj"):
            qkv = self.qkv(y)  # (b, s, 3h)
        q, k, v = qkv.split(h, dim=2)
        q = q.view(b, s, a, d).transpose(1, 2)  # (b, a, s, d), a view of qkv
        k = k.view(b, s, a, d).transpose(1, 2)
        v = v.view(b, s, a, d).transpose(1, 2)
        if cfg.attention == "sdpa":
            with tag_tensor(rec, "attention_core"):
                y = F.scaled_dot_product_attention(
                    q, k, v, dropout_p=p if tr else 0.0, is_causal=cfg.mask != "none"
                )  # (b, a, s, d)
            self.sdpa_node = type(y.grad_fn).__name__ if y.grad_fn is not None else None
        else:
            with tag_tensor(rec, "attn_scores"):
                att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d))  # (b, a, s, s)
                if cfg.mask == "additive":
                    att = att + self.mask[:s, :s]
                elif cfg.mask == "masked_fill":  # nanoGPT
                    att = att.masked_fill(self.tril[:s, :s] == 0, float("-inf"))
            with tag_tensor(rec, "softmax"):
                att = F.softmax(att, dim=-1)
            with tag_tensor(rec, "attn_dropout"):
                att = dropout(att, p, tr, cfg.dropout_impl)
            with tag_tensor(rec, "attn_values"):
                y = att @ v  # (b, a, s, d)
        y = y.transpose(1, 2).contiguous().view(b, s, h)  # merge heads: (b, s, h)
        with tag_tensor(rec, "out_proj"):
            y = self.proj(y)
        with tag_tensor(rec, "out_dropout"):
            y = dropout(y, p, tr, cfg.dropout_impl)
        x = x + y
        with tag_tensor(rec, "norm2"):
            y = self.ln2(x)
        with tag_tensor(rec, "fc1"):
            y = self.fc1(y)  # (b, s, F)
        with tag_tensor(rec, "act"):
            y = F.gelu(y)
        with tag_tensor(rec, "fc2"):
            y = self.fc2(y)  # (b, s, h)
        with tag_tensor(rec, "mlp_dropout"):
            y = dropout(y, p, tr, cfg.dropout_impl)
        return x + y


class LlamaLayer(nn.Module):
    """Hugging Face Llama style layer: RMSNorm, GQA attention, SwiGLU MLP, no biases."""

    def __init__(self, cfg: Config):
        super().__init__()
        h, f, a, g = cfg.hidden, cfg.ffn_hidden, cfg.heads, cfg.kv_heads
        d = h // a
        self.cfg = cfg
        norms = {"hf": HFRMSNorm, "fused": FusedRMSNorm, "torch": lambda n: nn.RMSNorm(n, eps=1e-6)}
        norm = norms[cfg.norm_impl]
        self.input_layernorm = norm(h)
        self.q_proj = nn.Linear(h, a * d, bias=False)
        self.k_proj = nn.Linear(h, g * d, bias=False)
        self.v_proj = nn.Linear(h, g * d, bias=False)
        self.o_proj = nn.Linear(a * d, h, bias=False)
        self.post_attention_layernorm = norm(h)
        if cfg.swiglu_impl == "fused":  # Megatron: one fc1 of 2F outputs, [gate | up]
            self.fc1 = nn.Linear(h, 2 * f, bias=False)
        else:  # Hugging Face LlamaMLP
            self.gate_proj = nn.Linear(h, f, bias=False)
            self.up_proj = nn.Linear(h, f, bias=False)
        self.down_proj = nn.Linear(f, h, bias=False)
        s = cfg.seq
        self.register_buffer("mask", torch.full((s, s), float("-inf")).triu(1), persistent=False)

    def forward(self, x: torch.Tensor, rec: SavedTensorRecorder | None = None) -> torch.Tensor:
        cfg = self.cfg
        b, s, h = x.shape  # (b, s, h)
        a, g = cfg.heads, cfg.kv_heads
        d = h // a
        with tag_tensor(rec, "norm1"):
            y = self.input_layernorm(x)
        with tag_tensor(rec, "qkv_proj"):
            q = self.q_proj(y).view(b, s, a, d).transpose(1, 2)  # (b, a, s, d)
            k = self.k_proj(y).view(b, s, g, d).transpose(1, 2)  # (b, g, s, d)
            v = self.v_proj(y).view(b, s, g, d).transpose(1, 2)  # (b, g, s, d)
        if cfg.attention == "sdpa":
            with tag_tensor(rec, "attention_core"):
                if cfg.kv_repeat:
                    k, v = repeat_kv(k, a // g), repeat_kv(v, a // g)
                y = F.scaled_dot_product_attention(
                    q, k, v, is_causal=cfg.mask != "none", enable_gqa=not cfg.kv_repeat
                )
            self.sdpa_node = type(y.grad_fn).__name__ if y.grad_fn is not None else None
        else:
            with tag_tensor(rec, "attn_scores"):
                k = repeat_kv(k, a // g)  # (b, a, s, d): HF eager copies K and V to all heads
                att = (q @ k.transpose(2, 3)) * (1.0 / math.sqrt(d))  # (b, a, s, s)
                if cfg.mask == "additive":
                    att = att + self.mask[:s, :s]
            with tag_tensor(rec, "softmax"):
                if cfg.softmax_fp32:  # HF eager: softmax(..., dtype=float32).to(query.dtype)
                    att = F.softmax(att, dim=-1, dtype=torch.float32).to(q.dtype)
                else:
                    att = F.softmax(att, dim=-1)
            with tag_tensor(rec, "attn_values"):
                v = repeat_kv(v, a // g)
                y = att @ v  # (b, a, s, d)
        y = y.transpose(1, 2).contiguous().view(b, s, h)
        with tag_tensor(rec, "out_proj"):
            y = self.o_proj(y)
        x = x + y
        with tag_tensor(rec, "norm2"):
            y = self.post_attention_layernorm(x)
        if cfg.swiglu_impl == "fused":
            with tag_tensor(rec, "fc1"):
                y = self.fc1(y)  # (b, s, 2F)
            with tag_tensor(rec, "act"):
                y = FusedSwiGLU.apply(y)  # (b, s, F)
        else:
            with tag_tensor(rec, "fc1"):
                gate = self.gate_proj(y)  # (b, s, F)
                up = self.up_proj(y)  # (b, s, F)
            with tag_tensor(rec, "act"):
                y = F.silu(gate) * up  # silu saves gate; mul saves silu(gate) and up
        with tag_tensor(rec, "fc2"):
            y = self.down_proj(y)
        return x + y


# --------------------------------------------------------------------------------------------
# Configurations
# --------------------------------------------------------------------------------------------


@dataclass
class Config:
    name: str
    arch: str  # gpt | llama | moe | mla (the last two: validation/torch_moe_mla.py)
    dtype: str = "float32"  # float32 | bfloat16
    seq: int = 128  # s
    micro_batch: int = 2  # b
    hidden: int = 256  # h
    heads: int = 8  # a
    kv_heads: int | None = None  # g (default a)
    ffn_hidden: int | None = None  # F (default 4h)
    dropout: float = 0.0
    dropout_impl: str = "functional"  # functional | native
    attention: str = "standard"  # standard | sdpa
    mask: str = "additive"  # additive | masked_fill | none
    norm_impl: str = "torch"  # llama only: torch (nn.RMSNorm) | hf (LlamaRMSNorm) | fused
    softmax_fp32: bool = True  # llama standard attention only: HF eager's fp32 softmax
    kv_repeat: bool = False  # llama sdpa only: repeat_kv before SDPA instead of enable_gqa
    swiglu_impl: str = "eager"  # llama only: eager (HF LlamaMLP) | fused (Megatron SwiGLUFunction)
    description: str = ""
    # moe: experts, top-k, expert width, shared experts' width (0: none)
    experts: int = 0
    top_k: int = 2
    moe_ffn_hidden: int = 0
    shared_ffn_hidden: int = 0
    # mla: latent ranks and head dims
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # moe / mla: whose code the layer follows (validation/torch_moe_mla.py): megatron | torchtitan
    framework: str = "megatron"

    def __post_init__(self) -> None:
        if self.kv_heads is None:
            self.kv_heads = self.heads
        if self.ffn_hidden is None:
            self.ffn_hidden = 4 * self.hidden

    @property
    def torch_dtype(self) -> torch.dtype:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16}[self.dtype]

    @property
    def dtype_bytes(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()
