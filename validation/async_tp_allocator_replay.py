"""What asynchronous TP's fused collectives change in the reserved peak of torchtitan's 2-D
(FSDP2 x TP) Llama 3 step: validation/fsdp2_tp_allocator_replay.py's 70B step, traced on fake
ranks and replayed through the allocator's rules with expandable segments, once as plain
sequence-parallel TP and once without the copies that the fused ops do not make.

Plain TP: DTensor's Shard(1) -> Replicate all-gather and Partial -> Shard(1) reduce-scatter go
through the functional collectives, which gather and scatter along dim 0 only: a gather along
the sequence (dim 1 of (b, s, h)) is followed by `torch.cat(torch.chunk(res, group_size,
dim=0), dim=gather_dim)` and a scatter along it is preceded by `torch.cat(torch.chunk(self,
group_size, dim=scatter_dim))` (torch/distributed/_functional_collectives.py, the v2.6 line,
`all_gather_tensor` and `reduce_scatter_tensor`; v2.13.0 keeps the copy for these shapes,
`_maybe_view_chunk_cat` viewing only when b = 1, `_chunk_or_narrow_cat`): one more
full-sequence tensor beside the gathered input or the un-reduced product. Async TP:
`fused_all_gather_matmul` gathers the shard laid out sequence-first (`x =
A_shard.movedim(gather_dim, 0)`) and returns a view of its buffer (`unflatten(ag_out)`);
`fused_matmul_reduce_scatter` writes each rank's chunk of the product into `stacked_partials`
in scatter order (torch/distributed/_symmetric_memory/__init__.py, v2.6 line), so neither
copy exists. Micro-pipelining rewrites only the compiled TransformerBlocks (ckplan.model.
async_tp), so the copies of the embedding's reduce-scatter, of the output layer's gather and of
their backward stay in both variants.

The emulation: while a block runs its forward (or its recomputation, hooked on the checkpointed
module) and from the final norm's output gradient to the embedding's, the two reordering copies
are replaced by a view of the collective's own buffer, of the right shape (values do not matter
on fake tensors). What it leaves out: the fused ops' restride of their input (a copy of the
shard or of the matmul input, at most the shard's bytes here), their order of allocation, and
everything fsdp2_tp_allocator_replay.py leaves out (compiled kernels, float8, FSDP2's unsharded
parameters).

Replayed with torch 2.13.0 and torchtitan 0.3.0 at 80 blocks
(validation/results-async-tp-allocator-replay-torch-2.13.0.json): both allocated peaks 57.46 GiB
(at the loss's backward, where no block runs), reserved 64.46 GiB plain and 63.72 GiB without
the blocks' reordering copies: 0.74 GiB of the 4.3 GiB between the December 2024 table's two
rows (71.9 and 67.6 GiB).

Usage: python validation/async_tp_allocator_replay.py [--layers N] [--json] [--write]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))
from caching_allocator import ExpandableAllocator
from fsdp2_tp_allocator_replay import at_allocated_peak, trace_step

GIB = 2**30
RESULTS = "validation/results-async-tp-allocator-replay-torch-2.13.0.json"


class BlockScope:
    """Whether the collectives now run for a TransformerBlock (forward, recomputation or
    backward), set by module and tensor hooks (`hook_model`)."""

    def __init__(self):
        self.inside = False


def hook_model(model, scope: BlockScope) -> None:
    """Hooks that set `scope.inside` for the blocks' collectives: each block's inner module
    (the checkpointed one, so that its recomputation counts) forward; in the backward, from the
    final norm's output gradient (after the output layer's reduce-scatter) to the embedding's
    output gradient (before its all-gather)."""

    def enter(*_):
        scope.inside = True

    def leave(*_):
        scope.inside = False

    for block in model.layers.values():
        inner = getattr(block, "_checkpoint_wrapped_module", block)
        inner.register_forward_pre_hook(enter)
        inner.register_forward_hook(leave)

    def norm_output(_module, _inputs, output):
        if output.requires_grad:
            output.register_hook(lambda grad: enter())

    def embedding_output(_module, _inputs, output):
        if output.requires_grad:
            output.register_hook(lambda grad: leave())

    model.norm.register_forward_hook(norm_output)
    model.tok_embeddings.register_forward_hook(embedding_output)


def fused_gather_view(original, scope: BlockScope):
    """funcol's reorder after an all-gather, or inside a block a view of the gathered buffer."""

    def view(res, group_size, gather_dim):
        if not scope.inside:
            return original(res, group_size, gather_dim)
        shape = list(res.shape)
        shape[0] //= group_size
        shape[gather_dim] *= group_size
        return res.view(shape)

    return view


def fused_scatter_view(original, scope: BlockScope):
    """funcol's reorder before a reduce-scatter, or inside a block a view of the product."""

    def view(tensor, num_chunks, narrow_dim, cat_dim):
        if not scope.inside:
            return original(tensor, num_chunks, narrow_dim, cat_dim)
        shape = list(tensor.shape)
        shape[narrow_dim] //= num_chunks
        shape[cat_dim] *= num_chunks
        return tensor.view(shape)

    return view


def trace(layers: int, fused: bool):
    """The step's events and the bytes alive before it, plain or with the fused emulation."""
    import torch.distributed._functional_collectives as funcol
    import torch_fsdp2_tp_memory as harness

    if not fused:
        return trace_step("tp", layers)
    scope = BlockScope()
    build = harness.build

    def hooked_build(*args, **kwargs):
        model = build(*args, **kwargs)
        hook_model(model, scope)
        return model

    with (
        mock.patch.object(harness, "build", hooked_build),
        mock.patch.object(
            funcol, "_maybe_view_chunk_cat", fused_gather_view(funcol._maybe_view_chunk_cat, scope)
        ),
        mock.patch.object(
            funcol,
            "_chunk_or_narrow_cat",
            fused_scatter_view(funcol._chunk_or_narrow_cat, scope),
        ),
    ):
        return trace_step("tp", layers)


def measure(layers: int) -> dict:
    results = {}
    for name, fused in (("plain", False), ("fused", True)):
        events, before = trace(layers, fused)
        results[name] = at_allocated_peak(events, ExpandableAllocator(), before)
    return {"layers": layers, **results}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--write", action="store_true", help=f"write {RESULTS}")
    args = parser.parse_args(argv)
    result = measure(args.layers)
    if args.write:
        import torch
        import torchtitan

        versions = {"torch": torch.__version__.split("+")[0], "torchtitan": torchtitan.__version__}
        with open(RESULTS, "w") as handle:
            json.dump({**versions, **result}, handle, indent=1)
            handle.write("\n")
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    for name in ("plain", "fused"):
        r = result[name]
        holes = ", ".join(f"{h / GIB:.3f}" for h in r["holes_at_peak"])
        print(
            f"{name}: {args.layers} blocks, allocated peak {r['allocated_peak'] / GIB:.3f} GiB, "
            f"reserved peak {r['reserved_peak'] / GIB:.3f} GiB; holes {holes}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
