"""An example of your own decoder layer for `ckplan calibrate --module`.

    ckplan calibrate llama3-8b --set dtype_bytes=4 --module examples/modules/my_block.py:build

`build` takes the layer's shape as keywords and returns an `nn.Module` whose forward takes the
residual stream (batch, seq, hidden) and returns the same shape. This one is a Llama-style
block written the way many training codebases write it: torch's RMSNorm, separate q/k/v
projections, RoPE, `F.scaled_dot_product_attention`, SwiGLU.
"""

import torch
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn_hidden: int, seq: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        d = self.head_dim
        # RoPE's angles for every position, a buffer as torchtitan's freqs_cis (not an activation)
        inverse = 10000.0 ** (-torch.arange(0, d // 2) / (d // 2))
        angles = torch.arange(seq)[:, None] * inverse
        self.register_buffer("cos", angles.cos()[None, :, None, :], persistent=False)
        self.register_buffer("sin", angles.sin()[None, :, None, :], persistent=False)
        self.attention_norm, self.ffn_norm = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
        self.wq = nn.Linear(hidden, heads * d, bias=False)
        self.wk = nn.Linear(hidden, kv_heads * d, bias=False)
        self.wv = nn.Linear(hidden, kv_heads * d, bias=False)
        self.wo = nn.Linear(heads * d, hidden, bias=False)
        self.w1 = nn.Linear(hidden, ffn_hidden, bias=False)
        self.w3 = nn.Linear(hidden, ffn_hidden, bias=False)
        self.w2 = nn.Linear(ffn_hidden, hidden, bias=False)

    def rope(self, x: torch.Tensor) -> torch.Tensor:  # (b, s, heads, d)
        d, cos, sin = self.head_dim, self.cos, self.sin
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        y = self.attention_norm(x)
        q = self.rope(self.wq(y).view(b, s, self.heads, self.head_dim))
        k = self.rope(self.wk(y).view(b, s, self.kv_heads, self.head_dim))
        v = self.wv(y).view(b, s, self.kv_heads, self.head_dim)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        )
        h = x + self.wo(out.transpose(1, 2).reshape(b, s, -1))
        z = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(z)) * self.w3(z))


def build(hidden: int, heads: int, kv_heads: int, ffn_hidden: int, seq: int, **shape) -> nn.Module:
    """The factory: the shape as keywords (micro_batch is not needed here)."""
    return Block(hidden, heads, kv_heads, ffn_hidden, seq)
