"""What torchtune's CEWithChunkedOutputLoss holds under compile, beside ckplan's loss kind
`chunked-output:N` (`ckplan.model.loss`, `chunk_output_backward_bytes`).

The output stage as torchtune runs it (torchtune at 1814feb): `TransformerDecoder.
chunked_output` applies the output layer to each of N chunks of the final hidden state along
the sequence (`[F.linear(chunk, W) for chunk in h.chunk(N, dim=1)]`, one weight shared by
every chunk, tied to the embedding or not), the loss reshapes the chunks and adds
`compute_cross_entropy(chunk, labels)` per chunk, that method alone compiled
(`training/_compile.py compile_loss`: `F.cross_entropy(logits.float(), labels,
reduction="sum")`). The output layer trains, or is frozen as under LoRA.

Live bytes over the forward and backward come from PyTorch's memory profiler on the CPU
(`prof._memory_profile()._op_tree`: every allocation and free with its size, replayed in time
order), counted from the hidden state's own allocation on; the weight and hidden state's
input exist before. Sizes are chosen so that the weight's gradient (2·V·h) differs from a
chunk's logits (2·T·V/N). ckplan's figures, with L = T·V, B = 2, X = 2·T·h:

- forward: the tape, B·L of chunk logits (the per-token statistics are 8T), beside X;
- backward, the chunks' compiled backwards: tape + B·L/N;
- backward, the weight gradients' sums (trainable): tape - 2·B·L/N + 3·B·V·h (one of the three
  the gradient, a model state in ckplan).

The CPU GEMM may allocate its own scratch (a frozen bf16 weight's packed copy): allocations
made and freed inside one GEMM call, as validation/torch_backward_peak.py probes them, are
left out here by skipping blocks freed within the same aten::mm / aten::bmm / aten::linear.
Needs torch (2.13 was run); prints JSON with --json.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

GEMMS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::linear", "aten::matmul")


def _compute_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum")


def _step(hidden, weight, labels, chunks, cross_entropy):
    outputs = [F.linear(chunk, weight) for chunk in (hidden * 1.0).chunk(chunks, dim=1)]
    logits = [chunk.reshape(-1, chunk.size(-1)) for chunk in outputs]
    targets = [chunk.reshape(-1) for chunk in labels.chunk(chunks, dim=1)]
    del outputs
    total = 0.0
    for logits_chunk, labels_chunk in zip(logits, targets, strict=True):
        total = total + cross_entropy(logits_chunk, labels_chunk)
    del logits, logits_chunk  # torchtune's forward returns before the backward
    total.backward()


def _inside_gemm(event) -> bool:
    parent = event.parent
    while parent is not None:
        if parent.name in GEMMS:
            return True
        parent = parent.parent
    return False


def measure(tokens: int, hidden: int, vocab: int, chunks: int, trains: bool) -> dict:
    torch.manual_seed(0)
    weight = torch.randn(vocab, hidden, dtype=torch.bfloat16, requires_grad=trains)
    x = torch.randn(1, tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (1, tokens))
    cross_entropy = torch.compile(_compute_cross_entropy)
    _step(x, weight, labels, chunks, cross_entropy)  # compile first
    weight.grad = x.grad = None
    with profile(
        activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
    ) as prof:
        _step(x, weight, labels, chunks, cross_entropy)
    events, scratch = [], {}
    for event in prof._memory_profile()._op_tree.dfs():
        if event.typed[0] != _EventType.Allocation:
            continue
        alloc = event.typed[1]
        node = None
        parent = event.parent
        while parent is not None and node is None:
            if parent.name.startswith("autograd::engine::evaluate_function: "):
                node = parent.name.split(": ", 1)[1]
            parent = parent.parent
        gemm = _inside_gemm(event)
        scratch.setdefault(alloc.allocation_id, []).append(gemm)
        events.append((event.start_time_ns, alloc.alloc_size, node, alloc.allocation_id))
    # a block allocated and freed inside GEMM calls is the GEMM library's scratch
    skipped = {key for key, inside in scratch.items() if len(inside) == 2 and all(inside)}
    events.sort(key=lambda e: e[0])
    live = forward = loss_backward = weight_sums = 0
    for _, size, node, key in events:
        if key in skipped:
            continue
        live += size
        if node is None:
            forward = max(forward, live)
        elif node.startswith("CompiledFunctionBackward"):
            loss_backward = max(loss_backward, live)
        else:
            weight_sums = max(weight_sums, live)
    L, B, X = tokens * vocab, 2, 2 * tokens * hidden
    chunk, weight_bytes = B * L // chunks, B * vocab * hidden
    tape = B * L
    expected_weight_sums = tape - 2 * chunk + 3 * weight_bytes if trains else 0
    # the chunks' input (the hidden state times 1.0, X) is saved by the output layer for its
    # weight's gradient, so it stays through the backward only when that layer trains
    held = X if trains else 0
    return {
        "tokens": tokens,
        "hidden": hidden,
        "vocab": vocab,
        "chunks": chunks,
        "output_layer_trains": trains,
        # the chunks' input gradients (X/N each, then X) are left to the slack below
        "forward_peak_bytes": forward - X,
        "ckplan_forward_bytes": tape,
        "loss_backward_peak_bytes": loss_backward - held,
        "ckplan_loss_backward_bytes": tape + chunk,
        "weight_sum_peak_bytes": max(0, weight_sums - X) if trains else 0,
        "ckplan_weight_sum_bytes": expected_weight_sums,
        "slack_bytes": 2 * X // chunks + 8 * tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = [
        measure(2048, 768, 16384, 8, trains=True),
        measure(2048, 512, 16384, 8, trains=True),
        measure(2048, 128, 16384, 8, trains=False),
    ]
    out = {"torch": torch.__version__, "rows": rows}
    if args.json:
        print(json.dumps(out, indent=1))
        return
    for row in rows:
        print(
            f"h {row['hidden']:4} trains {row['output_layer_trains']!s:5}  "
            + "  ".join(
                f"{name} {row[name + '_peak_bytes'] / 2**20:8.2f} MiB "
                f"(ckplan {row['ckplan_' + name + '_bytes'] / 2**20:8.2f})"
                for name in ("forward", "loss_backward", "weight_sum")
            )
        )


if __name__ == "__main__":
    main()
