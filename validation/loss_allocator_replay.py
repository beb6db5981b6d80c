#!/usr/bin/env python3
"""The reserved memory the eager loss's blocks leave in PyTorch's caching allocator.

Records the allocations and frees of the output layer and the eager cross-entropy, forward and
backward, at the real shapes on the meta device (no memory is used: a TorchDispatchMode sees
every storage an op returns and a finalizer on each storage its free, as
validation/hf_llama_loss_bytes.py counts them), and replays them through
validation/caching_allocator.py, the default allocator's rules (c10/cuda/
CUDACachingAllocator.cpp). The rest of the step's live memory comes first as one block:
nothing the layers cache before the loss is as large as the loss's blocks, so none of them
serves a loss request (`get_free_block` takes the smallest cached block at least the request).

Three forms of the eager loss:

- transformers v4.44.0, LlamaForCausalLM.forward: `logits = self.lm_head(hidden_states)`,
  `logits = logits.float()`, `shift_logits = logits[..., :-1, :].contiguous()`,
  `CrossEntropyLoss()(shift_logits.view(-1, V), shift_labels.view(-1))`;
- transformers 5.25 (loss/loss_utils.py ForCausalLMLoss): `logits = logits.float()`, the
  labels padded and shifted (`nn.functional.pad(labels, (0, 1), value=ignore_index)`), then
  `fixed_cross_entropy`, i.e. `nn.functional.cross_entropy` with reduction "sum" over the
  item count (here the mean, the same blocks);
- torchtitan (components/loss.py `cross_entropy_loss`): `cross_entropy(pred.flatten(0, 1)
  .float(), labels.flatten(0, 1))`.

In each the Trainer (or the training loop) drops the model's outputs before the backward; the
backward asks for the hidden states' gradient. It prints, in units of L = b·s·V logit elements
(bytes per element), the allocated and reserved peaks of the loss and the reserved bytes beyond
the allocated peak, beside ckplan.model.allocator.eager_loss_cached_bytes; with `--expandable`
through the rules with expandable segments (caching_allocator.py `ExpandableAllocator`), beside
`expandable_eager_loss_idle_bytes`: 2.00-2.07·L beyond for bf16 logits (the logits' block; the
shifted copy's blocks merge and serve its 4L gradient), under 0.03·L for fp32 (torch 2.13.0; b·s
1·8192, 2·8192 and 8·1024 at V 128256, 2·4096 at V 32000).

Usage: python validation/loss_allocator_replay.py [--batch 8 --seq 1024 --hidden 4096
       --vocab 128256] [--fp32] [--expandable]
"""

from __future__ import annotations

import argparse
import sys
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent))
from caching_allocator import CachingAllocator, ExpandableAllocator, replay

FORMS = ("transformers-4.44", "transformers-5.25", "torchtitan")
REST = 16 * 2**30  # the step's other live bytes, one block (any size: its own segment)


class AllocationTrace(TorchDispatchMode):
    """("alloc", key, bytes) for each storage an op returns, ("free", key, 0) when it dies."""

    def __init__(self, inputs: list[torch.Tensor]) -> None:
        super().__init__()
        self.events: list[tuple[str, int, int]] = []
        self.live = {tensor.untyped_storage()._cdata for tensor in inputs}

    def _freed(self, key: int) -> None:
        self.events.append(("free", key, 0))
        self.live.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key = storage._cdata  # meta storages have no address; the StorageImpl is unique
            if storage.nbytes() and key not in self.live:
                self.live.add(key)
                self.events.append(("alloc", key, storage.nbytes()))
                weakref.finalize(storage, self._freed, key)
        return out


def _loss(form: str, states, weight, labels, vocab: int) -> torch.Tensor:
    if form == "transformers-4.44":
        logits = F.linear(states, weight)
        logits = logits.float()
        shift_logits = logits[..., :-1, :].contiguous()
        shift_labels = labels[..., 1:].contiguous()
        return torch.nn.CrossEntropyLoss()(shift_logits.view(-1, vocab), shift_labels.view(-1))
    if form == "transformers-5.25":
        logits = F.linear(states, weight)  # the model returns these; the loss function upcasts
        upcast = logits.float()
        padded = F.pad(labels, (0, 1), value=-100)
        shift_labels = padded[..., 1:].contiguous()
        return F.cross_entropy(upcast.view(-1, vocab), shift_labels.view(-1), ignore_index=-100)
    pred = F.linear(states, weight)
    return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))


def loss_trace(form: str, batch: int, seq: int, hidden: int, vocab: int, dtype=torch.bfloat16):
    """The loss's allocation trace at these shapes, on the meta device."""
    states = torch.empty(batch, seq, hidden, dtype=dtype, device="meta")
    weight = torch.empty(vocab, hidden, dtype=dtype, device="meta")
    labels = torch.empty(batch, seq, dtype=torch.long, device="meta")
    states.requires_grad_(True)
    with AllocationTrace([states, weight, labels]) as trace:
        loss = _loss(form, states, weight, labels, vocab)  # the outputs die with the call
        torch.autograd.grad(loss, [states])
    return trace.events


def replayed(
    form: str,
    batch: int,
    seq: int,
    hidden: int,
    vocab: int,
    dtype=torch.bfloat16,
    expandable_segments: bool = False,
) -> CachingAllocator | ExpandableAllocator:
    """The allocator after the step's other live bytes (one block) and the loss's trace."""
    allocator = ExpandableAllocator() if expandable_segments else CachingAllocator()
    allocator.malloc(REST)
    return replay(loss_trace(form, batch, seq, hidden, vocab, dtype), allocator)


def main() -> None:
    from ckplan.model.allocator import eager_loss_cached_bytes, expandable_eager_loss_idle_bytes

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("batch", 8), ("seq", 1024), ("hidden", 4096), ("vocab", 128256)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--fp32", action="store_true", help="fp32 activations and logits")
    parser.add_argument("--expandable", action="store_true", help="with expandable segments")
    args = parser.parse_args()
    b, s, h, V = args.batch, args.seq, args.hidden, args.vocab
    dtype, size = (torch.float32, 4) if args.fp32 else (torch.bfloat16, 2)
    L = b * s * V
    print(f"b {b}, s {s}, h {h}, V {V}, {dtype}: L = {L:,} logits (torch {torch.__version__})")
    for form in FORMS:
        allocator = replayed(form, b, s, h, V, dtype, args.expandable)
        beyond = allocator.peak_reserved - allocator.peak_allocated
        shifted = b * (s - 1) * V if form == "transformers-4.44" else 0
        if args.expandable:
            closed = expandable_eager_loss_idle_bytes(L, size)
        else:
            closed = eager_loss_cached_bytes(L, size, shifted)
        print(
            f"{form:18s} allocated peak {(allocator.peak_allocated - REST) / L:6.3f}·L, "
            f"reserved peak {(allocator.peak_reserved - REST) / L:6.3f}·L, "
            f"beyond {beyond / L:5.3f}·L = {beyond:,} B; "
            f"ckplan's loss cache {closed:,} B; cached after: "
            + ", ".join(f"{size / L:.3f}" for size in allocator.cached())
        )


if __name__ == "__main__":
    main()
