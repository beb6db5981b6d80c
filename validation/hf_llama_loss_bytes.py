#!/usr/bin/env python3
"""Live bytes of the loss as transformers v4.44.0 computed it for LlamaForCausalLM, on the CPU.

transformers v4.44.0 (August 2024, the release beside Liger-Kernel's end-to-end benchmark of
2024-08-13), src/transformers/models/llama/modeling_llama.py, LlamaForCausalLM.forward:

    logits = self.lm_head(hidden_states)
    logits = logits.float()
    shift_logits = logits[..., :-1, :].contiguous()
    shift_labels = labels[..., 1:].contiguous()
    loss = CrossEntropyLoss()(shift_logits.view(-1, V), shift_labels.view(-1))

The same ops run here with every tensor an op returns counted from its allocation until its
storage dies (a TorchDispatchMode with a finalizer on each storage), the Trainer's drop of the
outputs (the fp32 logits) before the backward included; the backward asks for the hidden
states' gradient only. The peaks are printed in units of L = b·s·V (bytes per logit element),
to set beside ckplan's `eager` loss (ckplan.model.loss: forward peak (B + 8)·L with the saved
4L, 4·(L + L') + 4L' at `framework_version: "4.44"`, L' = b·(s - 1)·V; backward tape + 8L =
12L). What these blocks leave reserved in PyTorch's caching allocator:
validation/loss_allocator_replay.py.

Usage: python validation/hf_llama_loss_bytes.py [--batch 2 --seq 64 --hidden 32 --vocab 1024]
"""

from __future__ import annotations

import argparse
import weakref

import torch
from torch.nn import CrossEntropyLoss
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """The bytes of the storages ops returned that are still alive, and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.storages: set[int] = set()

    def _freed(self, size: int, key: int) -> None:
        self.live -= size
        self.storages.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            if size and key not in self.storages:
                self.storages.add(key)
                self.live += size
                weakref.finalize(storage, self._freed, size, key)
        self.peak = max(self.peak, self.live)
        return out


def live_bytes(batch: int, seq: int, hidden: int, vocab: int) -> tuple[int, int, int]:
    """(forward peak, backward peak, L): bytes beyond the inputs and weights."""
    torch.manual_seed(0)
    states = torch.randn(batch, seq, hidden, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(vocab, hidden, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (batch, seq))
    with LiveBytes() as mode:
        logits = torch.nn.functional.linear(states, weight)
        logits = logits.float()
        shift_logits = logits[..., :-1, :].contiguous()
        shift_labels = labels[..., 1:].contiguous()
        loss = CrossEntropyLoss()(shift_logits.view(-1, vocab), shift_labels.view(-1))
        forward = mode.peak
        del logits, shift_logits  # the Trainer keeps only the loss for the backward
        mode.peak = mode.live
        torch.autograd.grad(loss, [states])
        backward = mode.peak
    return forward, backward, batch * seq * vocab


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("batch", 2), ("seq", 64), ("hidden", 32), ("vocab", 1024)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args()
    forward, backward, elements = live_bytes(args.batch, args.seq, args.hidden, args.vocab)
    print(
        f"L = {elements:,} logits; forward peak {forward / elements:.2f}·L bytes, "
        f"backward peak {backward / elements:.2f}·L bytes (torch {torch.__version__})"
    )


if __name__ == "__main__":
    main()
