"""What torchtitan's per-op selective checkpointing keeps of a Llama block, in bf16 and with
torchao's float8 linears, eagerly and under torch.compile; and what a compiled cross-entropy on
upcast logits saves. The checks behind `op_policy.counts_matmuls`, `op_policy.compile_kept_units`
and `loss` kind `compiled` (docs/memory.md, docs/validation.md).

The block is torchtitan's Llama TransformerBlock written out (RMSNorm, wq, wk, wv, SDPA, wo,
RMSNorm, w1, w3, silu, w2), wrapped as torchtitan's `_apply_ac_to_transformer_block` wraps it
(`checkpoint(..., context_fn=create_selective_checkpoint_contexts(policy))`), the policy
torchtitan's `_custom_policy` with the save list of 9dec370 (with `aten.abs`) or of 88247277c
and later (without). float8 is torchao's `convert_to_float8_training` (tensorwise, or a named
recipe) with real `torch._scaled_mm` on the CPU.

- eager: the bytes the selective-checkpoint cache holds after the forward, per op.
- compiled: the tensors the partitioned forward graph saves for backward (AOTAutograd with
  the min-cut partitioner and Inductor's decompositions, the graphs Inductor would compile),
  parameters and the block input listed apart.

Needs torch (2.13 was run) and torchao (0.18 was run: `pip install torchao`); prints JSON with
--json. Results: validation/results-float8-sac-torch-2.13.0.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

H, HEADS, KV_HEADS, FFN, BATCH, SEQ = 256, 4, 2, 768, 2, 64
HEAD_DIM = H // HEADS
ops = torch.ops.aten
SAVE_LIST_LATER = {
    ops.mm.default,
    ops._scaled_dot_product_efficient_attention.default,
    ops._scaled_dot_product_flash_attention.default,
    ops._scaled_dot_product_flash_attention_for_cpu.default,  # the CPU's flash kernel
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    ops.max.default,
}
SAVE_LIST_202412 = SAVE_LIST_LATER | {ops.abs.default}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(H), nn.RMSNorm(H)
        self.wq = nn.Linear(H, H, bias=False)
        self.wk = nn.Linear(H, KV_HEADS * HEAD_DIM, bias=False)
        self.wv = nn.Linear(H, KV_HEADS * HEAD_DIM, bias=False)
        self.wo = nn.Linear(H, H, bias=False)
        self.w1 = nn.Linear(H, FFN, bias=False)
        self.w3 = nn.Linear(H, FFN, bias=False)
        self.w2 = nn.Linear(FFN, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attention_norm(x)
        q = self.wq(h).view(BATCH, SEQ, HEADS, HEAD_DIM).transpose(1, 2)
        k = self.wk(h).view(BATCH, SEQ, KV_HEADS, HEAD_DIM).transpose(1, 2)
        v = self.wv(h).view(BATCH, SEQ, KV_HEADS, HEAD_DIM).transpose(1, 2)
        k = k.repeat_interleave(HEADS // KV_HEADS, 1)
        v = v.repeat_interleave(HEADS // KV_HEADS, 1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(o.transpose(1, 2).reshape(BATCH, SEQ, H))
        g = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(g)) * self.w3(g))


def policy(save_list):
    """torchtitan's `_custom_policy` (parallelize_llama.py at 9dec370): save the listed ops'
    outputs but every second aten.mm."""
    meta: dict[str, int] = defaultdict(int)

    def custom(ctx, func, *args, **kwargs):
        key = f"{'recompute' if ctx.is_recompute else 'forward'}_mm_count"
        if func == ops.mm.default:
            meta[key] += 1
        save = func in save_list and not (func == ops.mm.default and meta[key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return custom


class Checkpointed(nn.Module):
    def __init__(self, block: nn.Module, save_list) -> None:
        super().__init__()
        self.block, self.modes = block, []

        def context():  # a closure: dynamo calls the context function unbound
            caching, cached = create_selective_checkpoint_contexts(policy(save_list))
            self.modes.append(caching)
            return caching, cached

        self.context = context

    def forward(self, x):
        return checkpoint(
            self.block, x, use_reentrant=False, context_fn=self.context, preserve_rng_state=False
        )


def build(recipe: str, save_list) -> Checkpointed:
    torch.manual_seed(0)
    block = Block().to(torch.bfloat16)
    if recipe != "bf16":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = (
            Float8LinearConfig()
            if recipe == "tensorwise"
            else Float8LinearConfig.from_recipe_name(recipe)
        )
        convert_to_float8_training(block, config=config)
    return Checkpointed(block, save_list)


def nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def eager_cache(recipe: str, save_list) -> dict[str, int]:
    """Bytes the selective-checkpoint cache holds after the forward, per op."""
    model = build(recipe, save_list)
    x = torch.randn(BATCH, SEQ, H, dtype=torch.bfloat16, requires_grad=True)
    y = model(x)
    held: dict[str, int] = defaultdict(int)
    for key, entries in model.modes[0].storage.items():
        for out in entries.values():
            for item in out if isinstance(out, (tuple, list)) else [out]:
                tensor = getattr(item, "val", item)
                if nbytes(tensor):
                    held[str(key[0] if isinstance(key, tuple) else key)] += nbytes(tensor)
    y.sum().backward()
    return dict(held)


def compiled_saved(fn, *inputs) -> list[tuple[str, str, tuple, str, int]]:
    """The tensors the partitioned forward graph of `fn` saves for backward."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    graphs = {}

    def forward(gm, _):
        graphs["forward"] = gm
        return make_boxed_func(gm.forward)

    backend = aot_autograd(
        fw_compiler=forward,
        bw_compiler=lambda gm, _: make_boxed_func(gm.forward),
        partition_fn=min_cut_rematerialization_partition,
        decompositions=select_decomp_table(),
    )
    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend)(*inputs)
    out.sum().backward()
    output = next(n for n in graphs["forward"].graph.nodes if n.op == "output")
    saved = []
    for node in output.args[0][1:]:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            kind = node.op if node.op == "placeholder" else str(node.target)
            saved.append((node.name, kind, tuple(value.shape), str(value.dtype), nbytes(value)))
    return saved


def compiled_block(recipe: str, save_list) -> dict:
    model = build(recipe, save_list)
    x = torch.randn(BATCH, SEQ, H, dtype=torch.bfloat16, requires_grad=True)
    saved = compiled_saved(model, x)
    activations = [s for s in saved if s[1] != "placeholder"]
    return {
        "activation_bytes": sum(s[-1] for s in activations),
        "saved": [list(s) for s in activations],
        "inputs_saved": sum(s[-1] for s in saved if s[1] == "placeholder"),
    }


def compiled_loss(tokens: int = 64, vocab: int = 1000) -> dict:
    """torchtitan's cross_entropy_loss (components/loss.py at 6fc499f) compiled."""

    def loss(pred, labels):
        return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))

    pred = torch.randn(1, tokens, vocab, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (1, tokens))
    saved = compiled_saved(lambda p: loss(p, labels), pred)
    return {"tokens": tokens, "vocab": vocab, "saved": [list(s) for s in saved]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--recipes", default="bf16,tensorwise,rowwise")
    args = parser.parse_args(argv)
    import torchao

    out = {
        "torch": torch.__version__,
        "torchao": torchao.__version__,
        "shape": {"hidden": H, "heads": HEADS, "kv_heads": KV_HEADS, "ffn": FFN,
                  "batch": BATCH, "seq": SEQ, "X": BATCH * SEQ * H * 2},
        "blocks": {},
    }  # fmt: skip
    for recipe in args.recipes.split(","):
        for lists, save_list in (("202412", SAVE_LIST_202412), ("later", SAVE_LIST_LATER)):
            out["blocks"][f"{recipe}/{lists}"] = {
                "eager_cache": eager_cache(recipe, save_list),
                "compiled": compiled_block(recipe, save_list),
            }
    out["loss"] = compiled_loss()
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    X = out["shape"]["X"]
    for name, result in out["blocks"].items():
        eager = sum(result["eager_cache"].values())
        compiled = result["compiled"]["activation_bytes"]
        print(f"{name:24s} eager cache {eager / X:6.3f} X  compiled saved {compiled / X:6.3f} X")
        for node in result["compiled"]["saved"]:
            if node[-1] > 64:
                print("    ", node)
    print("compiled loss saves:", out["loss"]["saved"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
