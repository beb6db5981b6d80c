#!/usr/bin/env python3
"""Measure what autograd saves for one Llama layer with frozen base weights and LoRA adapters
(docs/fine-tuning.md), on the CPU or a GPU, and, where bitsandbytes is installed, the bytes of
one 4-bit weight and what its matmul saves.

The layer is ckplan/calibrate/layers.py's LlamaLayer (fused RMSNorm, SDPA with GQA, Hugging
Face's eager SwiGLU) with every base weight frozen and PEFT's lora.Linear forward beside the
targeted linears (peft v0.17.0, src/peft/tuners/lora/layer.py: `result + lora_B(lora_A(
dropout(x))) * scaling`, nn.Dropout as PEFT builds it). Saved tensors are recorded with
`saved_tensors_hooks`, deduplicated by storage, parameters excluded, by ckplan op.

    python validation/torch_finetune_saved_bytes.py                # CPU, JSON on stdout
    python validation/torch_finetune_saved_bytes.py --device cuda  # a GPU's kernels
    python validation/torch_finetune_saved_bytes.py --compare      # beside ckplan's prediction
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

try:
    import torch
except ImportError:  # pragma: no cover - the message is the point
    sys.exit("torch_finetune_saved_bytes.py needs PyTorch: python3 -m pip install torch")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ckplan.calibrate.layers import Config, LlamaLayer
from ckplan.calibrate.record import SavedTensorRecorder

nn = torch.nn
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CASES = [
    ("frozen", (), 0.0),
    ("lora", ("q_proj", "v_proj"), 0.0),
    ("lora", ("q_proj", "v_proj"), 0.1),
    ("lora", TARGETS, 0.0),
    ("lora", TARGETS, 0.05),
]


class LoraLinear(nn.Module):
    """A frozen nn.Linear with a LoRA adapter, as PEFT's lora.Linear runs it."""

    def __init__(self, base: nn.Linear, rank: int, dropout: float):
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.Linear(base.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False)
        nn.init.normal_(self.lora_B.weight)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.scaling = 2.0

    def forward(self, x):
        result = self.base_layer(x)
        return result + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling


def measure(cfg: Config, targets, rank: int, dropout: float, device: str) -> dict[str, int]:
    torch.manual_seed(0)
    layer = LlamaLayer(cfg).to(device=device, dtype=cfg.torch_dtype).train()
    layer.requires_grad_(False)
    for name in targets:
        adapted = LoraLinear(getattr(layer, name), rank, dropout)
        setattr(layer, name, adapted.to(device=device, dtype=cfg.torch_dtype).train())
    exclude = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    exclude |= {b.untyped_storage().data_ptr() for b in layer.buffers()}
    x = torch.randn(cfg.micro_batch, cfg.seq, cfg.hidden, dtype=cfg.torch_dtype, device=device)
    x.requires_grad_(True)
    recorder = SavedTensorRecorder(exclude)
    with recorder.recording():
        out = layer(x, recorder)
    out.float().sum().backward()
    return recorder.by_op()


def four_bit(device: str) -> dict | None:
    """One 4096 x 4096 bf16 weight through bitsandbytes' quantize_4bit (nf4, blocksize 64,
    double quantisation): the bytes of every tensor it keeps, and what MatMul4Bit saves."""
    try:
        import bitsandbytes as bnb
        import bitsandbytes.functional as bnbf
    except ImportError:
        return None
    weight = torch.randn(4096, 4096, dtype=torch.bfloat16, device=device)
    packed, state = bnbf.quantize_4bit(
        weight, blocksize=64, compress_statistics=True, quant_type="nf4"
    )
    parts = {
        "packed": packed.numel() * packed.element_size(),
        "absmax": state.absmax.numel() * state.absmax.element_size(),
        "code": state.code.numel() * state.code.element_size(),
        "offset": state.offset.numel() * state.offset.element_size(),
        "state2_absmax": state.state2.absmax.numel() * state.state2.absmax.element_size(),
        "state2_code": state.state2.code.numel() * state.state2.code.element_size(),
    }
    x = torch.randn(2, 128, 4096, dtype=torch.bfloat16, device=device, requires_grad=True)
    saved: list[int] = []

    def pack(tensor):
        saved.append(tensor.untyped_storage().nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        bnb.matmul_4bit(x, packed.t(), quant_state=state)
    return {"version": bnb.__version__, "parts": parts, "matmul_saved": saved}


# ckplan's ops beside each tag of the measured layer: a linear and its adapters run under one
# tag; SDPA saves the attention output O that ckplan counts with out_proj.
SITES = {
    "norm1": ("norm1",),
    "qkv_proj": ("qkv_proj", "qkv_proj_lora"),
    "attention_core": ("attention_core", "out_proj", "out_proj_lora"),
    "norm2": ("norm2",),
    "fc1": ("fc1", "fc1_lora"),
    "act": ("act",),
    "fc2": ("fc2", "fc2_lora"),
}


def predicted(cfg: Config, training: str, targets, rank: int, dropout: float) -> dict[str, int]:
    """ckplan's saved bytes per tag of the measured layer (SITES)."""
    from ckplan.inputs.presets import spec_from_values
    from ckplan.model.memory import activation_bytes_by_op

    mapping = {
        "name": cfg.name, "layers": 1, "hidden": cfg.hidden, "heads": cfg.heads,
        "kv_heads": cfg.kv_heads, "ffn_hidden": cfg.ffn_hidden, "vocab": 1024, "seq": cfg.seq,
        "micro_batch": cfg.micro_batch, "dtype_bytes": cfg.dtype_bytes, "norm": "rmsnorm",
        "mlp": "swiglu", "attention": "flash", "positions": "rope", "bias": False,
        "fused_swiglu": False, "training": training,
    }  # fmt: skip
    if training == "lora":
        mapping |= {"lora_rank": rank, "lora_targets": ",".join(targets), "lora_dropout": dropout}
    ops = activation_bytes_by_op(spec_from_values(mapping, origin=cfg.name))
    return {tag: sum(ops.get(op, 0) for op in names) for tag, names in SITES.items()}


def print_comparison(result: dict) -> None:
    print(f"torch {result['torch']} on {result['device']}: measured - predicted, bytes per tag")
    for run in result["runs"]:
        cfg = Config(
            "x", "llama", run["dtype"], kv_heads=2, ffn_hidden=704, norm_impl="fused",
            attention="sdpa", swiglu_impl="eager",
        )  # fmt: skip
        want = predicted(cfg, run["training"], run["targets"], 8, run["dropout"])
        got = run["by_op"]
        diffs = {
            tag: got.get(tag, 0)
            + (got.get("out_proj", 0) if tag == "attention_core" else 0)
            - value
            for tag, value in want.items()
        }
        what = f"{run['dtype']:<9} {run['training']:<6} {','.join(run['targets']) or '-':<62}"
        shown = "  ".join(f"{tag} {diff:+d}" for tag, diff in diffs.items() if diff) or "exact"
        print(f"{what} dropout {run['dropout']:<4}  {shown}")
    print("(each fused norm keeps an fp32 rstd per token, 4·s·b bytes, which ckplan leaves out;")
    print(" on the CPU nn.Dropout keeps its mask in the input's dtype, not CUDA's 1-byte mask)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--compare", action="store_true", help="ckplan's prediction beside")
    args = parser.parse_args(argv)
    runs = []
    for dtype in ("float32", "bfloat16"):
        cfg = Config(
            f"llama-{dtype}", "llama", dtype, kv_heads=2, ffn_hidden=704, norm_impl="fused",
            attention="sdpa", swiglu_impl="eager",
        )  # fmt: skip
        for training, targets, dropout in CASES:
            by_op = measure(cfg, targets, 8, dropout, args.device)
            runs.append(
                {"dtype": dtype, "training": training, "targets": list(targets),
                 "dropout": dropout, "by_op": by_op}
            )  # fmt: skip
    result = {"torch": torch.__version__, "device": args.device, "runs": runs}
    result["four_bit"] = four_bit(args.device)
    if args.compare:
        print_comparison(result)
    else:
        print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
