#!/usr/bin/env python3
"""Measure what PyTorch autograd saves for backward in ONE forward of one transformer layer.

This is the validation of ckplan's activation accounting (docs/validation.md). PyTorch is an
optional dependency, used only here (`pip install torch`, or `pip install '.[torch]'`); ckplan
itself never imports it.

Method
------
* Small single layers are written op by op in plain PyTorch, the way nanoGPT / Megatron /
  Hugging Face eager code writes them (no fused kernels unless a variant says so).
* `torch.autograd.graph.saved_tensors_hooks` sees every tensor autograd saves. Each saved tensor
  is reduced to its underlying storage (`untyped_storage().data_ptr()`), and each storage is
  counted once, with its full `nbytes()` (that is what stays allocated). Storages of
  parameters and buffers (the weights, the causal-mask buffer) are excluded: they are model
  state, not activations.
* A storage is attributed to the op that saved it first. The "current op" is set by a context
  manager around the lines that run the op; the names are ckplan's op names (norm1, qkv_proj,
  attn_scores, softmax, attn_dropout, attn_values, out_proj, out_dropout, norm2, fc1, act, fc2,
  mlp_dropout; attention_core for scaled_dot_product_attention).

Usage
-----
    python validation/torch_saved_bytes.py                 # table for the default configs
    python validation/torch_saved_bytes.py --detail        # plus every saved storage
    python validation/torch_saved_bytes.py --json          # machine-readable
    python validation/torch_saved_bytes.py --compare       # ckplan's prediction vs measured
    python validation/torch_saved_bytes.py --config gpt-bf16-dropout --seq 256
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

try:
    import torch
    import torch.nn.functional as F
    from torch import nn
except ImportError:  # pragma: no cover - the message is the point
    sys.exit("torch_saved_bytes.py needs PyTorch: python3 -m pip install torch")

GPT_OPS = [
    "norm1", "qkv_proj", "q_down", "q_norm", "q_up", "kv_down", "kv_norm", "kv_up",
    "attn_scores", "softmax", "attn_dropout", "attn_values",
    "attention_core", "out_proj", "out_dropout", "norm2", "fc1", "act", "fc2", "mlp_dropout",
    "router", "router_probs", "permute", "expert_fc1", "expert_act", "expert_fc2", "unpermute",
    "shared_fc1", "shared_act", "shared_fc2",
]  # fmt: skip


# --------------------------------------------------------------------------------------------
# Recording saved tensors
# --------------------------------------------------------------------------------------------


@dataclass
class SavedStorage:
    op: str
    dtype: str
    shape: list[int]  # shape of the first saved tensor that referenced this storage
    tensor_bytes: int  # numel * itemsize of that tensor
    storage_bytes: int  # what the storage holds (counted)
    saves: int = 1  # how many saved-tensor references point at this storage
    ops: list[str] = field(default_factory=list)  # every op that saved it (first one counts)


class SavedTensorRecorder:
    """Counts autograd-saved storages, deduplicated, attributed to the current op tag."""

    def __init__(self, exclude_ptrs: set[int]):
        self.exclude = exclude_ptrs
        self.current = "untagged"
        self.storages: dict[int, SavedStorage] = {}
        self.excluded_refs = 0
        self._keep: list[torch.Tensor] = []  # keeps storages alive so pointers are not reused

    @contextlib.contextmanager
    def op(self, name: str) -> Iterator[None]:
        previous, self.current = self.current, name
        try:
            yield
        finally:
            self.current = previous

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.exclude:
            self.excluded_refs += 1
        elif ptr in self.storages:
            st = self.storages[ptr]
            st.saves += 1
            if self.current not in st.ops:
                st.ops.append(self.current)
        else:
            self.storages[ptr] = SavedStorage(
                op=self.current,
                dtype=str(t.dtype).removeprefix("torch."),
                shape=list(t.shape),
                tensor_bytes=t.numel() * t.element_size(),
                storage_bytes=storage.nbytes(),
                ops=[self.current],
            )
            self._keep.append(t)
        return t

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield

    def by_op(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.storages.values():
            out[s.op] = out.get(s.op, 0) + s.storage_bytes
        return out


_NULL = contextlib.nullcontext


def _tag(rec: SavedTensorRecorder | None, name: str):
    return rec.op(name) if rec is not None else _NULL()


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
        with _tag(rec, "norm1"):
            y = self.ln1(x)  # (b, s, h)
        with _tag(rec, "qkv_proj"):
            qkv = self.qkv(y)  # (b, s, 3h)
        q, k, v = qkv.split(h, dim=2)
        q = q.view(b, s, a, d).transpose(1, 2)  # (b, a, s, d), a view of qkv
        k = k.view(b, s, a, d).transpose(1, 2)
        v = v.view(b, s, a, d).transpose(1, 2)
        if cfg.attention == "sdpa":
            with _tag(rec, "attention_core"):
                y = F.scaled_dot_product_attention(
                    q, k, v, dropout_p=p if tr else 0.0, is_causal=cfg.mask != "none"
                )  # (b, a, s, d)
            self.sdpa_node = type(y.grad_fn).__name__ if y.grad_fn is not None else None
        else:
            with _tag(rec, "attn_scores"):
                att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d))  # (b, a, s, s)
                if cfg.mask == "additive":
                    att = att + self.mask[:s, :s]
                elif cfg.mask == "masked_fill":  # nanoGPT
                    att = att.masked_fill(self.tril[:s, :s] == 0, float("-inf"))
            with _tag(rec, "softmax"):
                att = F.softmax(att, dim=-1)
            with _tag(rec, "attn_dropout"):
                att = dropout(att, p, tr, cfg.dropout_impl)
            with _tag(rec, "attn_values"):
                y = att @ v  # (b, a, s, d)
        y = y.transpose(1, 2).contiguous().view(b, s, h)  # merge heads: (b, s, h)
        with _tag(rec, "out_proj"):
            y = self.proj(y)
        with _tag(rec, "out_dropout"):
            y = dropout(y, p, tr, cfg.dropout_impl)
        x = x + y
        with _tag(rec, "norm2"):
            y = self.ln2(x)
        with _tag(rec, "fc1"):
            y = self.fc1(y)  # (b, s, F)
        with _tag(rec, "act"):
            y = F.gelu(y)
        with _tag(rec, "fc2"):
            y = self.fc2(y)  # (b, s, h)
        with _tag(rec, "mlp_dropout"):
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
        with _tag(rec, "norm1"):
            y = self.input_layernorm(x)
        with _tag(rec, "qkv_proj"):
            q = self.q_proj(y).view(b, s, a, d).transpose(1, 2)  # (b, a, s, d)
            k = self.k_proj(y).view(b, s, g, d).transpose(1, 2)  # (b, g, s, d)
            v = self.v_proj(y).view(b, s, g, d).transpose(1, 2)  # (b, g, s, d)
        if cfg.attention == "sdpa":
            with _tag(rec, "attention_core"):
                if cfg.kv_repeat:
                    k, v = repeat_kv(k, a // g), repeat_kv(v, a // g)
                y = F.scaled_dot_product_attention(
                    q, k, v, is_causal=cfg.mask != "none", enable_gqa=not cfg.kv_repeat
                )
            self.sdpa_node = type(y.grad_fn).__name__ if y.grad_fn is not None else None
        else:
            with _tag(rec, "attn_scores"):
                k = repeat_kv(k, a // g)  # (b, a, s, d): HF eager copies K and V to all heads
                att = (q @ k.transpose(2, 3)) * (1.0 / math.sqrt(d))  # (b, a, s, s)
                if cfg.mask == "additive":
                    att = att + self.mask[:s, :s]
            with _tag(rec, "softmax"):
                if cfg.softmax_fp32:  # HF eager: softmax(..., dtype=float32).to(query.dtype)
                    att = F.softmax(att, dim=-1, dtype=torch.float32).to(q.dtype)
                else:
                    att = F.softmax(att, dim=-1)
            with _tag(rec, "attn_values"):
                v = repeat_kv(v, a // g)
                y = att @ v  # (b, a, s, d)
        y = y.transpose(1, 2).contiguous().view(b, s, h)
        with _tag(rec, "out_proj"):
            y = self.o_proj(y)
        x = x + y
        with _tag(rec, "norm2"):
            y = self.post_attention_layernorm(x)
        if cfg.swiglu_impl == "fused":
            with _tag(rec, "fc1"):
                y = self.fc1(y)  # (b, s, 2F)
            with _tag(rec, "act"):
                y = FusedSwiGLU.apply(y)  # (b, s, F)
        else:
            with _tag(rec, "fc1"):
                gate = self.gate_proj(y)  # (b, s, F)
                up = self.up_proj(y)  # (b, s, F)
            with _tag(rec, "act"):
                y = F.silu(gate) * up  # silu saves gate; mul saves silu(gate) and up
        with _tag(rec, "fc2"):
            y = self.down_proj(y)
        return x + y


# --------------------------------------------------------------------------------------------
# Configurations
# --------------------------------------------------------------------------------------------


@dataclass
class Config:
    name: str
    arch: str  # gpt | llama | moe | mla (validation/torch_moe_mla.py)
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


def default_configs() -> list[Config]:
    llama = dict(arch="llama", kv_heads=2, ffn_hidden=704)  # F ~ 8h/3 rounded up to 64
    return [
        Config("gpt-fp32-dropout", "gpt", "float32", dropout=0.1,
               description="GPT, fp32, dropout 0.1 (F.dropout), standard attention"),
        Config("gpt-bf16-dropout", "gpt", "bfloat16", dropout=0.1,
               description="GPT, bf16, dropout 0.1 (F.dropout), standard attention"),
        Config("gpt-bf16-dropout-native", "gpt", "bfloat16", dropout=0.1, dropout_impl="native",
               description="as gpt-bf16-dropout, dropout via torch.native_dropout (CUDA's path)"),
        Config("gpt-bf16-nodrop", "gpt", "bfloat16", dropout=0.0,
               description="GPT, bf16, no dropout, standard attention"),
        Config("gpt-bf16-maskedfill", "gpt", "bfloat16", dropout=0.0, mask="masked_fill",
               description="as gpt-bf16-nodrop, nanoGPT's masked_fill(tril == 0) causal mask"),
        Config("gpt-bf16-sdpa", "gpt", "bfloat16", dropout=0.0, attention="sdpa",
               description="GPT, bf16, no dropout, F.scaled_dot_product_attention(is_causal)"),
        Config("gpt-bf16-sdpa-dropout", "gpt", "bfloat16", dropout=0.1, dropout_impl="native",
               attention="sdpa",
               description="GPT, bf16, dropout 0.1 (native), SDPA(is_causal, dropout_p=0.1)"),
        Config("llama-bf16-torchrms", **llama, dtype="bfloat16", norm_impl="torch",
               description="Llama, bf16, nn.RMSNorm, HF eager attention (repeat_kv, fp32 softmax)"),
        Config("llama-bf16-hfrms", **llama, dtype="bfloat16", norm_impl="hf",
               description="Llama, bf16, HF LlamaRMSNorm, HF eager attention"),
        Config("llama-fp32-hfrms", **llama, dtype="float32", norm_impl="hf",
               description="Llama, fp32, HF LlamaRMSNorm, HF eager attention"),
        Config("llama-bf16-sdpa", **llama, dtype="bfloat16", norm_impl="torch", attention="sdpa",
               description="Llama, bf16, nn.RMSNorm, SDPA(is_causal, enable_gqa=True)"),
        Config("llama-bf16-sdpa-repeat", **llama, dtype="bfloat16", norm_impl="torch",
               attention="sdpa", kv_repeat=True,
               description="Llama, bf16, nn.RMSNorm, repeat_kv then SDPA(is_causal)"),
        Config("llama-bf16-fusedswiglu", **llama, dtype="bfloat16", norm_impl="torch",
               attention="sdpa", swiglu_impl="fused",
               description="as llama-bf16-sdpa, Megatron's fused SwiGLU (saves fc1 output only)"),
        Config("llama-bf16-fused", **llama, dtype="bfloat16", norm_impl="fused", attention="sdpa",
               swiglu_impl="fused",
               description="Megatron/TE-style Llama: fused RMSNorm, SDPA(GQA), fused SwiGLU"),
        Config("moe-bf16", "moe", "bfloat16", kv_heads=2, experts=8, top_k=2, moe_ffn_hidden=128,
               shared_ffn_hidden=256, attention="sdpa",
               description="Megatron-Core MoE layer: 8 experts of 128, top-2, a shared expert "
                           "of 256, weighted SwiGLU, SDPA(GQA), fused RMSNorm"),
        Config("mla-bf16", "mla", "bfloat16", heads=4, ffn_hidden=704, q_lora_rank=96,
               kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
               attention="sdpa",
               description="DeepSeek-V3-style MLA layer (Megatron's MLASelfAttention), flash "
                           "kernel contract, dense fused SwiGLU MLP"),
    ]  # fmt: skip


# --------------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------------


@dataclass
class Measurement:
    config: Config
    by_op: dict[str, int]
    total: int
    storages: list[SavedStorage]
    sdpa_node: str | None = None
    excluded_param_refs: int = 0
    extra: dict = field(default_factory=dict)


def measure(cfg: Config, seed: int = 0, device: str = "cpu") -> Measurement:
    torch.manual_seed(seed)
    layer_cls = {"gpt": GPTLayer, "llama": LlamaLayer}.get(cfg.arch)
    if layer_cls is None:
        here = str(Path(__file__).resolve().parent)
        if here not in sys.path:
            sys.path.insert(0, here)
        import torch_moe_mla

        layer_cls = {"moe": torch_moe_mla.MoELayer, "mla": torch_moe_mla.MLALayer}[cfg.arch]
    layer = layer_cls(cfg).to(device=device, dtype=cfg.torch_dtype).train()
    exclude = {t.untyped_storage().data_ptr() for t in layer.parameters()}
    exclude |= {t.untyped_storage().data_ptr() for t in layer.buffers()}
    x = torch.randn(cfg.micro_batch, cfg.seq, cfg.hidden, dtype=cfg.torch_dtype, device=device)
    x.requires_grad_(True)  # the layer input is an activation (the previous layer's output)
    rec = SavedTensorRecorder(exclude)
    with rec.recording():
        out = layer(x, rec)
    by_op = rec.by_op()
    # Backward once, to prove the recorded graph is a working one.
    out.float().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad.float()).all()
    return Measurement(
        config=cfg,
        by_op=by_op,
        total=sum(by_op.values()),
        storages=list(rec.storages.values()),
        sdpa_node=getattr(layer, "sdpa_node", None),
        excluded_param_refs=rec.excluded_refs,
    )


# --------------------------------------------------------------------------------------------
# ckplan's prediction
# --------------------------------------------------------------------------------------------


def ckplan_mapping(cfg: Config) -> dict:
    """The YAML keys of DESIGN.md for the same layer."""
    return {
        "name": cfg.name,
        "kind": "transformer",
        "layers": 1,
        "hidden": cfg.hidden,
        "heads": cfg.heads,
        "kv_heads": cfg.kv_heads,
        "ffn_hidden": cfg.ffn_hidden,
        "vocab": 1024,
        "seq": cfg.seq,
        "micro_batch": cfg.micro_batch,
        "dtype_bytes": cfg.dtype_bytes,
        "norm": "layernorm" if cfg.arch == "gpt" else "rmsnorm",
        "mlp": "gelu" if cfg.arch == "gpt" else "swiglu",
        "attention": "flash" if cfg.attention == "sdpa" else "standard",
        "dropout": cfg.dropout,
    }


def ckplan_mapping_for(cfg: Config) -> dict:
    """ckplan_mapping plus ckplan's optional knobs that match the measured code, where the
    installed ckplan has them (fused_swiglu: eager silu(gate) * up keeps silu(gate) too)."""
    mapping = ckplan_mapping(cfg)
    _import_ckplan()
    from ckplan.model.spec import field_names

    fields = set(field_names())
    if "fused_swiglu" in fields and cfg.arch == "llama":
        mapping["fused_swiglu"] = cfg.swiglu_impl == "fused"
    if "bias" in fields:
        mapping["bias"] = cfg.arch == "gpt"
    if "positions" in fields and cfg.arch == "llama":
        mapping["positions"] = "rope"  # parameter count only; no RoPE op is run here
    if cfg.arch in ("moe", "mla"):
        mapping |= {"norm": "rmsnorm", "mlp": "swiglu", "positions": "rope", "bias": False}
        mapping["fused_swiglu"] = True
    if cfg.arch == "moe":
        mapping |= {
            "experts": cfg.experts,
            "top_k": cfg.top_k,
            "moe_ffn_hidden": cfg.moe_ffn_hidden,
        }
        if cfg.shared_ffn_hidden:
            mapping |= {"shared_experts": 1, "shared_ffn_hidden": cfg.shared_ffn_hidden}
    if cfg.arch == "mla":
        mapping["kv_heads"] = cfg.heads
        for key in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim"):
            mapping[key] = getattr(cfg, key)
        mapping["v_head_dim"] = cfg.v_head_dim
    return mapping


def _import_ckplan() -> None:
    repo = Path(__file__).resolve().parent.parent
    if str(repo) not in sys.path:
        sys.path.insert(0, str(repo))


def ckplan_prediction(cfg: Config) -> dict[str, int]:
    _import_ckplan()
    from ckplan.model.memory import activation_bytes_by_op
    from ckplan.model.spec import spec_from_mapping

    spec = spec_from_mapping(ckplan_mapping_for(cfg), origin=cfg.name)
    return {k: int(v) for k, v in activation_bytes_by_op(spec).items()}


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------


def _sbh(cfg: Config) -> int:
    return cfg.seq * cfg.micro_batch * cfg.hidden


def _coef(n: int, cfg: Config) -> str:
    return f"{n / _sbh(cfg):.3f}"


def _ops_in_order(*dicts: dict[str, int]) -> list[str]:
    names = [op for op in GPT_OPS if any(op in d for d in dicts)]
    for d in dicts:
        names += [op for op in d if op not in names]
    return names


def _header(cfg: Config) -> str:
    return (
        f"== {cfg.name}: {cfg.description}\n"
        f"   s={cfg.seq} b={cfg.micro_batch} h={cfg.hidden} a={cfg.heads} g={cfg.kv_heads} "
        f"F={cfg.ffn_hidden} d={cfg.hidden // cfg.heads} dtype={cfg.dtype} "
        f"(B={cfg.dtype_bytes}) dropout={cfg.dropout} ({cfg.dropout_impl}) "
        f"attention={cfg.attention} mask={cfg.mask}"
        + (f" norm={cfg.norm_impl}" if cfg.arch == "llama" else "")
        + f"  sbh={_sbh(cfg)}"
    )


def print_measurement(m: Measurement, detail: bool) -> None:
    cfg = m.config
    print(_header(cfg))
    if m.sdpa_node:
        print(f"   SDPA autograd node: {m.sdpa_node}")
    print(f"   {'op':<15}{'bytes':>12}{'/sbh':>9}")
    for op in _ops_in_order(m.by_op):
        print(f"   {op:<15}{m.by_op[op]:>12}{_coef(m.by_op[op], cfg):>9}")
    print(f"   {'TOTAL':<15}{m.total:>12}{_coef(m.total, cfg):>9}")
    if detail:
        print("   saved storages (op, dtype, shape of first saving tensor, storage bytes, refs):")
        for st in m.storages:
            note = "" if st.tensor_bytes == st.storage_bytes else f" (a {st.tensor_bytes} B view)"
            also = f" also saved by {', '.join(st.ops[1:])}" if len(st.ops) > 1 else ""
            print(
                f"     {st.op:<15}{st.dtype:<9}{st.shape!s:<22}{st.storage_bytes:>10}"
                f"  x{st.saves}{note}{also}"
            )
    print()


def print_comparison(m: Measurement, pred: dict[str, int]) -> None:
    cfg = m.config
    print(_header(cfg))
    if m.sdpa_node:
        print(f"   SDPA autograd node: {m.sdpa_node}")
    print(f"   {'op':<15}{'predicted':>12}{'measured':>12}{'diff':>11}{'meas/pred':>11}")
    for op in _ops_in_order(pred, m.by_op):
        p, q = pred.get(op, 0), m.by_op.get(op, 0)
        ratio = f"{q / p:.3f}" if p else ("-" if q == 0 else "inf")
        flag = "" if p == q else "  *"
        print(f"   {op:<15}{p:>12}{q:>12}{q - p:>+11}{ratio:>11}{flag}")
    pt = sum(pred.values())
    print(f"   {'TOTAL':<15}{pt:>12}{m.total:>12}{m.total - pt:>+11}{m.total / pt:>11.3f}")
    for st in m.storages:
        if len(st.ops) > 1:
            print(
                f"   shared: {st.storage_bytes} B ({st.dtype} {st.shape}) saved by "
                f"{' and '.join(st.ops)}, counted once under {st.op}"
            )
    print()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", action="append", help="config name (repeatable); default: all")
    ap.add_argument("--list", action="store_true", help="list the configs and exit")
    ap.add_argument("--seq", type=int, help="override s")
    ap.add_argument("--batch", type=int, help="override b")
    ap.add_argument("--hidden", type=int, help="override h")
    ap.add_argument("--heads", type=int, help="override a")
    ap.add_argument(
        "--set", action="append", default=[], metavar="FIELD=VALUE",
        help="override a Config field of the chosen configs, e.g. softmax_fp32=false",
    )  # fmt: skip
    ap.add_argument("--json", action="store_true", help="print JSON instead of tables")
    ap.add_argument("--compare", action="store_true", help="compare with ckplan's prediction")
    ap.add_argument("--detail", action="store_true", help="list every saved storage")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--device", default="cpu", help="torch device (default cpu; e.g. cuda)")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    configs = default_configs()
    if args.list:
        for c in configs:
            print(f"{c.name:<26}{c.description}")
        return 0
    if args.config:
        known = {c.name: c for c in configs}
        missing = [n for n in args.config if n not in known]
        if missing:
            print(f"unknown config(s): {', '.join(missing)}; see --list", file=sys.stderr)
            return 2
        configs = [known[n] for n in args.config]
    for c in configs:
        if args.seq:
            c.seq = args.seq
        if args.batch:
            c.micro_batch = args.batch
        if args.hidden:
            c.hidden = args.hidden
            c.ffn_hidden = 4 * args.hidden if c.arch == "gpt" else c.ffn_hidden
        if args.heads:
            c.heads = args.heads
            c.kv_heads = args.heads if c.arch == "gpt" else c.kv_heads

    for item in args.set:
        key, sep, raw = item.partition("=")
        if not sep or key not in Config.__dataclass_fields__ or key == "name":
            print(f"--set expects FIELD=VALUE with a Config field, got {item!r}", file=sys.stderr)
            return 2
        for c in configs:
            current = getattr(c, key)
            if isinstance(current, bool):
                value = raw.lower() in ("1", "true", "yes", "on")
            elif isinstance(current, int):
                value = int(raw)
            elif isinstance(current, float):
                value = float(raw)
            else:
                value = raw
            setattr(c, key, value)
            c.description += f" [{key}={raw}]"

    results = [measure(c, device=args.device) for c in configs]
    preds = [ckplan_prediction(m.config) for m in results] if args.compare else None

    if args.json:
        runs = []
        for i, m in enumerate(results):
            run = {
                "config": asdict(m.config),
                "ckplan_spec": ckplan_mapping_for(m.config) if args.compare else None,
                "sbh": _sbh(m.config),
                "measured": {"by_op": m.by_op, "total": m.total},
                "sdpa_node": m.sdpa_node,
                "storages": [asdict(s) for s in m.storages],
            }
            if preds is not None:
                run["predicted"] = {"by_op": preds[i], "total": sum(preds[i].values())}
            runs.append(run)
        out = {"torch_version": torch.__version__, "device": args.device, "runs": runs}
        print(json.dumps(out, indent=2))
        return 0

    print(f"torch {torch.__version__} on {args.device}; bytes saved for backward by one layer "
          "forward, deduplicated by storage, parameters and buffers excluded\n")  # fmt: skip
    for i, m in enumerate(results):
        if preds is not None:
            print_comparison(m, preds[i])
        else:
            print_measurement(m, args.detail)
    untagged = [m.config.name for m in results if "untagged" in m.by_op]
    if untagged:
        print(f"warning: untagged saved tensors in {', '.join(untagged)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
