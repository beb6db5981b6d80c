#!/usr/bin/env python3
"""The bytes eager PyTorch's memory-bound kernels move in one torchtitan Llama block, measured on
the CPU against what ckplan's `kernels: eager` code path charges (ckplan.hardware.code_path).

The block is torchtitan 9dec370 (2024-12-26)'s, line for line: torchtitan/models/norms.py
`RMSNorm` (the `norm_type = "rmsnorm"` of train_configs/llama3_8b.toml: `x.float()`, pow, mean,
rsqrt, the product, `type_as`, the weight's product) and torchtitan/models/llama/model.py
`apply_rotary_emb` (RoPE as complex64 products), `repeat_kv`, `Attention`, `FeedForward` and
`TransformerBlock`, in bf16 as FSDP2's `param_dtype=torch.bfloat16` runs it, at Llama 3 8B's
widths (h 4096, 32 heads, 8 K/V heads, FFN 14336).

A TorchDispatchMode sees each ATen op of the forward and of the backward and counts the bytes
it reads and writes: every tensor input (the memory it spans, broadcast dimensions once) and
every output. Views move nothing; the GEMMs (`mm`) and the attention kernel
(`_scaled_dot_product_*`) are left out, as ckplan times them apart (the attention core's bytes
are its own op). Forward ops are grouped by the code region that ran them, backward ops by the
autograd node that ran them (`torch._C._current_autograd_node`). Two sequence lengths are run and
the difference taken, so the per-token bytes exclude what does not grow with the tokens (the
norm weights' gradients' outputs).

Usage: python validation/torchtitan_eager_bytes.py [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections import defaultdict
from dataclasses import dataclass

try:
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode
except ImportError:  # pragma: no cover - the message is the point
    sys.exit("torchtitan_eager_bytes.py needs PyTorch: python3 -m pip install torch")


@dataclass(frozen=True)
class Shape:
    dim: int = 4096
    heads: int = 32
    kv_heads: int = 8
    ffn: int = 14336
    vocab: int = 512  # the loss's bytes are per logit; a small vocabulary measures them

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


REGION: list[str] = ["other"]


@contextlib.contextmanager
def region(name: str):
    REGION.append(name)
    try:
        yield
    finally:
        REGION.pop()


# --- torchtitan 9dec370: torchtitan/models/norms.py, torchtitan/models/llama/model.py --------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x: torch.Tensor):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor):
        with region("rmsnorm"):
            output = self._norm(x.float()).type_as(x)
            return output * self.weight


def precompute_freqs_cis(dim: int, end: int, theta: float = 500000.0) -> torch.Tensor:
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
    with region("rope"):
        xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
        xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
        freqs_cis = reshape_for_broadcast(freqs_cis, xq_)
        xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
        xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
        return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    with region("repeat_kv"):
        return (
            torch.unsqueeze(x, dim=3)
            .expand(bs, slen, n_kv_heads, n_rep, head_dim)
            .reshape(bs, slen, n_kv_heads * n_rep, head_dim)
        )


class Attention(nn.Module):
    def __init__(self, shape: Shape):
        super().__init__()
        self.n_rep = shape.heads // shape.kv_heads
        self.head_dim = shape.head_dim
        self.wq = nn.Linear(shape.dim, shape.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(shape.dim, shape.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(shape.dim, shape.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(shape.heads * self.head_dim, shape.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        with region("wq_wk_wv"):
            xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bs, seqlen, -1, self.head_dim)
        xk = xk.view(bs, seqlen, -1, self.head_dim)
        xv = xv.view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        keys = repeat_kv(xk, self.n_rep)
        values = repeat_kv(xv, self.n_rep)
        xq = xq.transpose(1, 2)
        xk = keys.transpose(1, 2)
        xv = values.transpose(1, 2)
        with region("sdpa"):
            output = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True)
        with region("transpose_contiguous"):
            output = output.transpose(1, 2).contiguous()
        output = output.view(bs, seqlen, -1)
        return self.wo(output)


class FeedForward(nn.Module):
    def __init__(self, shape: Shape):
        super().__init__()
        self.w1 = nn.Linear(shape.dim, shape.ffn, bias=False)
        self.w2 = nn.Linear(shape.ffn, shape.dim, bias=False)
        self.w3 = nn.Linear(shape.dim, shape.ffn, bias=False)

    def forward(self, x):
        with region("w1_w3"):
            gate, up = self.w1(x), self.w3(x)
        with region("swiglu"):
            hidden = F.silu(gate) * up
        return self.w2(hidden)


class TransformerBlock(nn.Module):
    def __init__(self, shape: Shape):
        super().__init__()
        self.attention = Attention(shape)
        self.feed_forward = FeedForward(shape)
        self.attention_norm = RMSNorm(shape.dim)
        self.ffn_norm = RMSNorm(shape.dim)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor):
        attention = self.attention(self.attention_norm(x), freqs_cis)
        with region("residual"):
            h = x + attention
        mlp = self.feed_forward(self.ffn_norm(h))
        with region("residual"):
            return h + mlp


def loss_fn(pred, labels):
    """train.py at 9dec370: cross-entropy on the upcast logits."""
    with region("loss"):
        return torch.nn.functional.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))


# --- measurement ---------------------------------------------------------------------------

TIMED_APART = ("mm", "addmm", "bmm", "_scaled_dot_product")


def spanned_bytes(t: torch.Tensor) -> int:
    """Bytes of memory a tensor's view spans: broadcast (stride-0) dimensions once."""
    elements = 1
    for size, stride in zip(t.shape, t.stride(), strict=True):
        if stride != 0:
            elements *= size
    return elements * t.element_size()


def aliases(func, args, out) -> bool:
    """Whether a non-mutating op returns a tensor sharing an input's memory (a view in all but
    name: `_unsafe_view`, `detach`, `alias`), which moves nothing."""
    if func._schema.is_mutable:
        return False
    inputs = {t.untyped_storage().data_ptr() for t in _tensors(args)}
    return any(t.untyped_storage().data_ptr() in inputs for t in _tensors([out]))


def _tensors(values) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out += _tensors(v)
    return out


class RegionTags(TorchFunctionMode):
    """Tags each autograd node the forward creates with the code region that created it, so
    that the backward's ops can be grouped by region too."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in _tensors([out]):
            if t.grad_fn is not None and "region" not in t.grad_fn.metadata:
                t.grad_fn.metadata["region"] = REGION[-1]
        return out


class ByteCount(TorchDispatchMode):
    """Bytes each non-GEMM, non-attention ATen op reads and writes, by (pass, group, op)."""

    def __init__(self, phase: str):
        super().__init__()
        self.phase = phase
        self.bytes: dict[tuple[str, str, str], int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if func.is_view or name.startswith(TIMED_APART) or aliases(func, args, out):
            return out
        moved = sum(spanned_bytes(t) for t in _tensors(list(args) + list(kwargs.values())))
        moved += sum(t.numel() * t.element_size() for t in _tensors([out]))
        if self.phase == "forward":
            group = REGION[-1]
        else:
            node = torch._C._current_autograd_node()
            group = "engine" if node is None else node.metadata.get("region", "other")
            # the sum of a tensor's gradients from several uses runs as the producer's node
            group += f" ({node.name()})" if node is not None else ""
        self.bytes[(self.phase, group, name)] += moved
        return out


def block_bytes(shape: Shape, batch: int, seq: int) -> dict[tuple[str, str, str], int]:
    torch.manual_seed(0)
    block = TransformerBlock(shape).to(torch.bfloat16)
    freqs_cis = precompute_freqs_cis(shape.head_dim, seq)
    x = torch.randn(batch, seq, shape.dim, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(batch, seq, shape.dim, dtype=torch.bfloat16)
    forward, backward = ByteCount("forward"), ByteCount("backward")
    with RegionTags(), forward:
        y = block(x, freqs_cis)
    with backward:
        y.backward(grad)
    return {**forward.bytes, **backward.bytes}


def loss_bytes(shape: Shape, tokens: int) -> dict[tuple[str, str, str], int]:
    torch.manual_seed(0)
    logits = torch.randn(1, tokens, shape.vocab, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, shape.vocab, (1, tokens))
    forward, backward = ByteCount("forward"), ByteCount("backward")
    with RegionTags(), forward:
        loss = loss_fn(logits, labels)
    with backward:
        loss.backward()
    return {**forward.bytes, **backward.bytes}


def per_token(measure, small: int, large: int) -> dict[tuple[str, str, str], float]:
    """Bytes per token: the difference of two token counts, over the tokens between them."""
    a, b = measure(small), measure(large)
    return {k: (b.get(k, 0) - a.get(k, 0)) / (large - small) for k in sorted(set(a) | set(b))}


def ckplan_per_token() -> dict[str, tuple[float, float]]:
    """ckplan's eager bytes per token of one layer, forward and backward, by op, for torchtitan's
    Llama 3 8B row on 8 H100s (validation/runs/torchtitan-h100.yaml), and its loss per logit."""
    from ckplan.hardware.code_path import spec_code_path
    from ckplan.inputs.gpus import load_gpu
    from ckplan.model.loss import logits_elements, loss_moved_bytes
    from ckplan.model.ops import layer_ops
    from ckplan.published.predict import run_spec
    from ckplan.published.suite import suite_runs

    run = next(r for r in suite_runs() if r.name == "torchtitan-llama3-8b-8xh100-t1-fsdp")
    spec = run_spec(run)
    path = spec_code_path(spec, load_gpu(run.gpu))
    tokens = spec.seq // spec.cp * spec.micro_batch
    out = {}
    for op in layer_ops(spec):
        eager = path._eager(op, spec.dtype_bytes)
        out[op.name] = (eager.forward_bytes / tokens, eager.backward_bytes / tokens)
    forward, backward = loss_moved_bytes(spec)
    logits = logits_elements(spec)
    out["loss per logit"] = (forward / logits, backward / logits)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    shape = Shape()
    block = per_token(lambda s: block_bytes(shape, 1, s), 32, 64)
    loss = per_token(lambda t: loss_bytes(shape, t), 64, 128)
    ckplan = ckplan_per_token()
    if args.json:
        print(
            json.dumps(
                {
                    "torch": torch.__version__,
                    "shape": shape.__dict__,
                    "block_bytes_per_token": {"/".join(k): v for k, v in block.items()},
                    "loss_bytes_per_logit": {"/".join(k): v / shape.vocab for k, v in loss.items()},
                    "ckplan_bytes_per_token": ckplan,
                },
                indent=1,
            )
        )
        return
    h = shape.dim
    print(f"torch {torch.__version__}; bytes per token, in units of h = {h}")
    totals: dict[str, float] = defaultdict(float)
    for (phase, group, name), v in block.items():
        print(f"  {phase:8s} {group:28s} {name:32s} {v / h:8.3f}")
        totals[phase] += v
    regions: dict[tuple[str, str], float] = defaultdict(float)
    for (phase, group, _), v in block.items():
        regions[(phase, group.split(" (")[0])] += v
    for (phase, group), v in sorted(regions.items()):
        print(f"  {phase:8s} {group:28s} {'(region total)':32s} {v / h:8.3f}")
    forward, backward = totals["forward"] / h, totals["backward"] / h
    print(f"  measured block: forward {forward:.2f}, backward {backward:.2f}")
    cf = sum(f for k, (f, b) in ckplan.items() if k not in ("attention_core", "loss per logit"))
    cb = sum(b for k, (f, b) in ckplan.items() if k not in ("attention_core", "loss per logit"))
    print(f"  ckplan eager (attention core left out): forward {cf / h:.2f}, backward {cb / h:.2f}")
    for k, (f, b) in ckplan.items():
        if k != "loss per logit":
            print(f"    {k:16s} forward {f / h:7.2f} backward {b / h:7.2f}")
    print("loss, bytes per logit:")
    for (phase, group, name), v in loss.items():
        print(f"  {phase:8s} {group:28s} {name:32s} {v / shape.vocab:8.3f}")
    f, b = ckplan["loss per logit"]
    print(f"  ckplan eager loss: forward {f:.2f}, backward {b:.2f}")


if __name__ == "__main__":
    main()
