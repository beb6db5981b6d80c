"""Train a Llama-like model on one GPU under several plans and measure what ckplan predicts.

The model is validation/device/llama_like.yaml: 8 layers of ckplan's eager Llama layer
(ckplan/calibrate/layers.py: Hugging Face's LlamaRMSNorm, separate q/k/v/o projections,
`F.scaled_dot_product_attention` with grouped-query attention, eager SwiGLU; no RoPE), an
embedding, a final norm and an untied output layer with the eager fp32 loss, all in bf16 and
trained by torch.optim.AdamW. Written in PyTorch alone, so that it runs where ckplan is not
installed. For each plan it builds a fresh model and optimizer, runs two steps (the optimizer
states exist from the first), resets the peak counters, runs `--steps` more and records
`torch.cuda.max_memory_allocated`, `max_memory_reserved` and the mean step time.

Plans (ckplan's strategies): none; full (`torch.utils.checkpoint` around every layer);
selective (the attention core checkpointed); sac (torchtitan's per-op policy, as ckplan's torch
export writes it); offload (every layer under `save_on_cpu(pin_memory=True)`); lora (frozen
bf16 base, rank-16 adapters on q_proj and v_proj, no recomputation).

    python validation/device/measure_plans.py --out results.json           # on a CUDA GPU
    python validation/device/measure_plans.py --small --device cpu         # a smoke test
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

SHAPE = {"layers": 8, "hidden": 2048, "heads": 16, "kv_heads": 8, "ffn": 5632, "vocab": 32000,
         "seq": 4096, "batch": 2}  # fmt: skip
SMALL = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 96, "vocab": 256,
         "seq": 32, "batch": 2}  # fmt: skip


class RMSNorm(nn.Module):
    """Hugging Face LlamaRMSNorm (eager)."""

    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class LoRALinear(nn.Module):
    """PEFT's lora.Linear without dropout: base(x) + B(A(x)) * alpha / r, the base frozen."""

    def __init__(self, base: nn.Linear, rank: int = 16, alpha: float = 32.0):
        super().__init__()
        self.base = base
        self.lora_A = nn.Linear(base.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False)
        nn.init.zeros_(self.lora_B.weight)
        self.scaling = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_B(self.lora_A(x)) * self.scaling


def _core(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


class Layer(nn.Module):
    def __init__(self, s: dict, selective: bool = False):
        super().__init__()
        h, a, g, f = s["hidden"], s["heads"], s["kv_heads"], s["ffn"]
        d = h // a
        self.a, self.g, self.d, self.selective = a, g, d, selective
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(h), RMSNorm(h)
        self.q_proj, self.k_proj = nn.Linear(h, a * d, bias=False), nn.Linear(h, g * d, bias=False)
        self.v_proj, self.o_proj = nn.Linear(h, g * d, bias=False), nn.Linear(a * d, h, bias=False)
        self.gate_proj, self.up_proj = nn.Linear(h, f, bias=False), nn.Linear(h, f, bias=False)
        self.down_proj = nn.Linear(f, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        y = self.input_layernorm(x)
        q = self.q_proj(y).view(b, s, self.a, self.d).transpose(1, 2)
        k = self.k_proj(y).view(b, s, self.g, self.d).transpose(1, 2)
        v = self.v_proj(y).view(b, s, self.g, self.d).transpose(1, 2)
        y = checkpoint(_core, q, k, v, use_reentrant=False) if self.selective else _core(q, k, v)
        x = x + self.o_proj(y.transpose(1, 2).contiguous().view(b, s, h))
        y = self.post_attention_layernorm(x)
        y = F.silu(self.gate_proj(y)) * self.up_proj(y)
        return x + self.down_proj(y)


def _ops(namespace, *names):
    return {getattr(namespace, name).default for name in names if hasattr(namespace, name)}


ATTENTION_OPS = _ops(
    torch.ops.aten,
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
)
KEEP_MATMULS = {1, 3, 5, 7}  # `ckplan export ... --plan sac --to torch`: q, v, gate, down


def _sac_context():
    counts = defaultdict(int)

    def policy_fn(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        keep = False
        if func == torch.ops.aten.mm.default:
            counts[mode] += 1
            keep = counts[mode] in KEEP_MATMULS
        elif func in ATTENTION_OPS:
            keep = True
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy_fn)


class Model(nn.Module):
    def __init__(self, s: dict, plan: str):
        super().__init__()
        self.plan = plan
        self.embed = nn.Embedding(s["vocab"], s["hidden"])
        self.layers = nn.ModuleList(Layer(s, plan == "selective") for _ in range(s["layers"]))
        self.norm = RMSNorm(s["hidden"])
        self.output = nn.Linear(s["hidden"], s["vocab"], bias=False)
        if plan == "lora":
            for parameter in self.parameters():
                parameter.requires_grad_(False)
            for layer in self.layers:
                layer.q_proj, layer.v_proj = LoRALinear(layer.q_proj), LoRALinear(layer.v_proj)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            if self.plan == "full":
                x = checkpoint(layer, x, use_reentrant=False)
            elif self.plan == "sac":
                x = checkpoint(layer, x, use_reentrant=False, context_fn=_sac_context)
            elif self.plan == "offload":
                with torch.autograd.graph.save_on_cpu(pin_memory=True):
                    x = layer(x)
            else:
                x = layer(x)
        logits = self.output(self.norm(x))  # (b, s, V) in bf16
        # the eager loss: logits upcast to fp32 (Hugging Face's ForCausalLMLoss, torchtitan)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def measure(plan: str, s: dict, device: str, steps: int) -> dict:
    torch.manual_seed(0)
    model = Model(s, plan).to(device=device, dtype=torch.bfloat16)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-5)
    tokens = torch.randint(0, s["vocab"], (s["batch"], s["seq"]), device=device)
    targets = torch.randint(0, s["vocab"], (s["batch"], s["seq"]), device=device)
    cuda = device.startswith("cuda")

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(tokens, targets).backward()
        optimizer.step()

    for _ in range(2):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if cuda:
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / steps
    result = {
        "plan": plan,
        "step_seconds": seconds,
        "trainable_parameters": sum(p.numel() for p in trainable),
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    if cuda:
        result["max_memory_allocated"] = torch.cuda.max_memory_allocated()
        result["max_memory_reserved"] = torch.cuda.max_memory_reserved()
    return result  # the model and optimizer go with this frame; the caller empties the cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--plans", default="none,full,selective,sac,offload,lora")
    parser.add_argument("--out")
    args = parser.parse_args()
    shape = SMALL if args.small else SHAPE
    report = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "cuda": torch.version.cuda,
        "shape": shape,
        "plans": [],
    }
    for plan in args.plans.split(","):
        result = measure(plan, shape, args.device, args.steps)
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        report["plans"].append(result)
        print(json.dumps(result), flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as file:
            json.dump(report, file, indent=2)


if __name__ == "__main__":
    main()
