"""The peak of torchtitan's cross-entropy, `cross_entropy(pred.flatten(0, 1).float(), labels)`,
plain and under `loss_parallel()` over logits sharded on the vocabulary (a DTensor placed
Shard(-1) on a one-rank gloo mesh), measured on the CPU as the process's peak resident memory
above what it held before the loss, in bytes per logit. The output layer's bf16 logits are
dropped before backward as torchtitan's train step drops `pred`.

ckplan's `eager` loss (ckplan.model.loss) predicts 10 bytes per logit above that start: the
backward's peak is the saved fp32 log-probabilities and two fp32 gradients (12) less the bf16
logits freed (2); under loss parallel one more fp32 tensor, 14. Run with PyTorch 2.13 on one
core: plain 10.02, loss parallel 14.06 (T 4096, V 32000).

Usage: python validation/torch_loss_parallel.py plain|parallel (one process per measurement:
the peak resident memory is the process's).
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys

import torch
import torch.distributed as dist

TOKENS, VOCAB = 4096, 32000


def resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main(mode: str) -> float:
    torch.set_num_threads(1)
    labels = torch.randint(0, VOCAB, (1, TOKENS))
    weight = torch.randn(1, TOKENS, VOCAB, dtype=torch.bfloat16).requires_grad_(True)
    pred = weight * 1  # a non-leaf, as the output layer's logits are
    context = contextlib.nullcontext()
    if mode == "parallel":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard
        from torch.distributed.tensor.parallel import loss_parallel

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29534")
        dist.init_process_group("gloo", rank=0, world_size=1)
        pred = DTensor.from_local(pred, init_device_mesh("cpu", (1,)), [Shard(-1)])
        context = loss_parallel()
    start = resident()
    with context:
        loss = torch.nn.functional.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))
        del pred
        loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return (peak - start) / (TOKENS * VOCAB)


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in ("plain", "parallel"):
        sys.exit("usage: torch_loss_parallel.py plain|parallel")
    print(f"{sys.argv[1]}: {main(sys.argv[1]):.2f} bytes per logit above the start")
