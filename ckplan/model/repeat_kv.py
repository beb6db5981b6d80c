"""K and V at the heads the attention kernel sees: torchtitan's Llama attention of December 2024
repeats them to the query heads before SDPA, its 0.3.0 passes `enable_gqa`.

- torchtitan 9dec370 (2024-12-26, `framework_version` "2024.12"), torchtitan/models/llama/
  model.py, `Attention.forward`: after RoPE, `keys = repeat_kv(xk, self.n_rep)` and `values =
  repeat_kv(xv, self.n_rep)`, then `F.scaled_dot_product_attention(xq, xk, xv, is_causal=True)`
  on their transposes. `repeat_kv` is `torch.unsqueeze(x, dim=3).expand(bs, slen, n_kv_heads,
  n_rep, head_dim).reshape(bs, slen, n_kv_heads * n_rep, head_dim)`: the expanded dim has
  stride 0, which no view can merge with the K/V-head dim, so `reshape` copies (aten.clone of
  the expanded tensor, then `_unsafe_view`). The SDPA node saves that copy, at the rank's query
  heads; the repeat's own backward (expand's `sum_to_size`) saves nothing, nor does RoPE's
  complex product with the constant `freqs_cis`, so K and V at the K/V heads are freed after the
  copy. The kernel's dK, dV come out at the query heads and are summed back to the K/V heads
  (aten.sum over the repeat dim): the same transient as a GQA kernel's own expanded dK, dV
  (`ops._attention_ops`). The repeat is the same code at v0.1.0 (torchtitan/models/llama3/model/
  model.py) and until ff0829c ("GQA without kv repeats", 2026-01-27).
- torchtitan 0.3.0 (`framework_version` "0.3"; from ff0829c, also v0.2.2): `enable_gqa=
  self.enable_gqa` (torchtitan/models/common/attention.py in the 0.3.0 wheel, `self.enable_gqa =
  self.n_heads > self.n_kv_heads`), K and V at the rank's K/V heads.

Measured on the CPU (validation/torchtitan_repeat_kv.py, tests/test_torchtitan_repeat_kv.py):
9dec370's Attention saves Q, the repeated K and V, the output and the logsumexp, eager and under
torch.compile alike; the `enable_gqa` form saves K and V at the K/V heads.
"""

from __future__ import annotations

REPEAT_KV_VERSIONS = {"torchtitan": ("2024.12",)}


def repeats_kv(framework: str, version: str | None) -> bool:
    """Whether `framework` at release `version` repeats K and V to the query heads before its
    fused attention kernel: torchtitan "2024.12" (`repeat_kv`, torchtitan/models/llama/model.py
    at 9dec370), not torchtitan "0.3" (`enable_gqa`, torchtitan/models/common/attention.py at
    0.3.0)."""
    return version in REPEAT_KV_VERSIONS.get(framework, ())


def kernel_kv_heads(repeated: bool, heads_r: int, kv_heads_r: int) -> int:
    """The K/V heads per rank the fused attention kernel reads and saves: the rank's query heads
    `heads_r` where K and V are `repeated`, else its K/V heads `kv_heads_r`."""
    return heads_r if repeated else kv_heads_r


def repeat_kv_copy_bytes(
    tokens: int, heads_r: int, kv_heads_r: int, width: int, dtype_bytes: int
) -> int:
    """Bytes the two repeat copies move in the forward (derived from `repeat_kv` at 9dec370, one
    aten.clone of the expanded tensor each for K and V): each reads its `tokens` x `kv_heads_r`
    x `width` input and writes `tokens` x `heads_r` x `width`; `width` the head dims of K and V
    together (2d for Llama). The backward's sum of dK, dV back to the K/V heads reads and writes
    the same. 0 where nothing is repeated (heads_r == kv_heads_r: `repeat_kv` returns its
    input)."""
    if heads_r == kv_heads_r:
        return 0
    return dtype_bytes * tokens * (heads_r + kv_heads_r) * width
