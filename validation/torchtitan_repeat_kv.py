#!/usr/bin/env python3
"""What torchtitan's Llama attention saves for backward, and what its repeat of K and V copies,
measured on the CPU against ckplan (ckplan.model.repeat_kv).

Two forms of the same Attention module, written as torchtitan writes them:

* "2024.12": torchtitan 9dec370 (2024-12-26), torchtitan/models/llama/model.py:
  `apply_rotary_emb`, `repeat_kv` and `Attention.forward` line for line (RoPE through complex
  products with `freqs_cis`, K and V repeated to the query heads, then
  `F.scaled_dot_product_attention(xq, xk, xv, is_causal=True)` on the transposes);
* "0.3": the same with K and V left at the K/V heads and `enable_gqa=True`, as torchtitan 0.3.0
  calls SDPA (torchtitan/models/common/attention.py, `GQAttention`).

Measured:

* the bytes autograd saves in one forward (`torch.autograd.graph.saved_tensors_hooks`, each
  storage once, the parameters, the `freqs_cis` buffer and the module input left out: the input
  is the QKV projection's saved input, ckplan's `qkv_proj`), eager and, with `--compile`, under
  torch.compile (the compiled region's saved tensors);
* the ATen ops of the forward and the backward (a TorchDispatchMode): the repeat's copy
  (`aten.clone` of the expanded tensor), the SDPA kernel's gradients of K and V and the sum that
  folds them back to the K/V heads.

ckplan's prediction is the attention core's and the output projection's saved bytes (the
attention output is one storage, saved by both) for a one-layer model of the same shape.

Usage: python validation/torchtitan_repeat_kv.py [--compile] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

try:
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils._python_dispatch import TorchDispatchMode
except ImportError:  # pragma: no cover - the message is the point
    sys.exit("torchtitan_repeat_kv.py needs PyTorch: python3 -m pip install torch")

VERSIONS = ("2024.12", "0.3")


@dataclass(frozen=True)
class Shape:
    batch: int = 2
    seq: int = 16
    dim: int = 64
    heads: int = 8
    kv_heads: int = 2

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


# --- torchtitan 9dec370, torchtitan/models/llama/model.py -----------------------------------


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device, dtype=torch.float32)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)


def reshape_for_broadcast(freqs_cis: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    ndim = x.ndim
    seqlen = x.shape[1]
    freqs_cis = freqs_cis[0:seqlen]
    shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(*shape)


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """torch.repeat_interleave(x, dim=2, repeats=n_rep)"""
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return (
        torch.unsqueeze(x, dim=3)
        .expand(bs, slen, n_kv_heads, n_rep, head_dim)
        .reshape(bs, slen, n_kv_heads * n_rep, head_dim)
    )


class Attention(nn.Module):
    """9dec370's `Attention` ("2024.12"), or with `enable_gqa` instead of the repeat ("0.3")."""

    def __init__(self, shape: Shape, version: str):
        super().__init__()
        self.version = version
        self.n_rep = shape.heads // shape.kv_heads
        self.head_dim = shape.head_dim
        self.wq = nn.Linear(shape.dim, shape.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(shape.dim, shape.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(shape.dim, shape.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(shape.heads * self.head_dim, shape.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bs, seqlen, -1, self.head_dim)
        xk = xk.view(bs, seqlen, -1, self.head_dim)
        xv = xv.view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        gqa = self.version != "2024.12"
        keys = xk if gqa else repeat_kv(xk, self.n_rep)
        values = xv if gqa else repeat_kv(xv, self.n_rep)
        xq = xq.transpose(1, 2)
        xk = keys.transpose(1, 2)
        xv = values.transpose(1, 2)
        output = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True, enable_gqa=gqa)
        output = output.transpose(1, 2).contiguous()
        output = output.view(bs, seqlen, -1)
        return self.wo(output)


# --- measurement ---------------------------------------------------------------------------


class OpLog(TorchDispatchMode):
    """Each ATen op run and the shapes of the tensors it returns."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, list[tuple[int, ...]]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        shapes = [tuple(o.shape) for o in outs if isinstance(o, torch.Tensor)]
        self.ops.append((str(func.overloadpacket.__name__), shapes))
        return out


@dataclass
class Measurement:
    version: str
    compiled: bool
    saved_bytes: int
    saved: list[tuple[int, tuple[int, ...], str]]  # (bytes, shape, dtype) per storage
    forward_copies: list[tuple[int, ...]]  # shapes aten.clone wrote (the repeat's copies)
    kernel_grads: list[tuple[int, ...]]  # the SDPA backward's dQ, dK, dV shapes
    folded: list[tuple[int, ...]]  # shapes the sums back to the K/V heads wrote


def measure(version: str, shape: Shape = Shape(), compiled: bool = False) -> Measurement:
    torch.manual_seed(0)
    module = Attention(shape, version).to(torch.bfloat16)
    freqs_cis = precompute_freqs_cis(shape.head_dim, 2 * shape.seq)
    x = torch.randn(shape.batch, shape.seq, shape.dim, dtype=torch.bfloat16, requires_grad=True)
    run = torch.compile(module) if compiled else module
    if compiled:
        run(x, freqs_cis).sum().backward()  # compile before measuring
    excluded = {p.untyped_storage().data_ptr() for p in module.parameters()}
    excluded |= {freqs_cis.untyped_storage().data_ptr(), x.untyped_storage().data_ptr()}
    saved: dict[int, tuple[int, tuple[int, ...], str]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in excluded:
            saved[storage.data_ptr()] = (storage.nbytes(), tuple(t.shape), str(t.dtype))
        return t

    forward, backward = OpLog(), OpLog()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if compiled:
            y = run(x, freqs_cis)
        else:
            with forward:
                y = run(x, freqs_cis)
    if compiled:
        y.sum().backward()
    else:
        with backward:
            y.sum().backward()
    sdpa_backward = [s for name, s in backward.ops if name.startswith("_scaled_dot_product")]
    return Measurement(
        version=version,
        compiled=compiled,
        saved_bytes=sum(v[0] for v in saved.values()),
        saved=sorted(saved.values(), key=lambda v: (-v[0], v[1])),
        forward_copies=[s[0] for name, s in forward.ops if name == "clone"],
        kernel_grads=sdpa_backward[0] if sdpa_backward else [],
        folded=[s[0] for name, s in backward.ops if name == "sum" and len(s[0]) == 5],
    )


# --- ckplan's prediction -------------------------------------------------------------------


def ckplan_prediction(version: str, shape: Shape = Shape()) -> int:
    """ckplan's attention_core + out_proj saved bytes for one layer of `shape` under torchtitan
    `version` (the attention output is the storage both save)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from ckplan.inputs.presets import spec_from_values
    from ckplan.model.memory import activation_bytes_by_op

    values = {
        "name": f"torchtitan-{version}-attention",
        "kind": "transformer",
        "layers": 1,
        "hidden": shape.dim,
        "heads": shape.heads,
        "kv_heads": shape.kv_heads,
        "ffn_hidden": 4 * shape.dim,
        "vocab": 1024,
        "seq": shape.seq,
        "micro_batch": shape.batch,
        "dtype_bytes": 2,
        "norm": "rmsnorm",
        "mlp": "swiglu",
        "positions": "rope",
        "bias": False,
        "attention": "flash",
        "framework": "torchtitan",
        "framework_version": version,
    }
    by_op = activation_bytes_by_op(spec_from_values(values, origin=values["name"]))
    return int(by_op["attention_core"] + by_op["out_proj"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compile", action="store_true", help="also measure under torch.compile")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = []
    for version in VERSIONS:
        for compiled in (False, True) if args.compile else (False,):
            m = measure(version, compiled=compiled)
            rows.append({**asdict(m), "ckplan": ckplan_prediction(version)})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for row in rows:
        mode = "compiled" if row["compiled"] else "eager"
        saved, predicted = row["saved_bytes"], row["ckplan"]
        print(f"{row['version']:8s} {mode:8s} saved {saved:>7,} ckplan {predicted:>7,}")
        for size, dims, dtype in row["saved"]:
            print(f"    {size:>7,}  {dims}  {dtype}")
        if not row["compiled"]:
            print(f"    repeat copies {row['forward_copies']}")
            print(f"    kernel dQ, dK, dV {row['kernel_grads']}; folded {row['folded']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
