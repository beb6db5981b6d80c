"""The allocated peak of one 2-D (FSDP2 x tensor-parallel) training step of torchtitan's Llama 3
at the 70B shapes, per phase and per category, measured with PyTorch's own FSDP2 memory tracker
on the CPU without real memory: the check behind ckplan's terms for torchtitan under tensor and
sequence parallelism and loss parallel (docs/memory.md, docs/validation.md).

Set-up, as validation/torch_fsdp2_memory.py (its FSDP-only sibling) plus tensor parallelism:
a fake process group of dp_shard x tp = 32 x 8 ranks
(torch.testing._internal.distributed.fake_pg.FakeStore) and a 2-D device mesh ("dp_shard",
"tp"); the model built under FakeTensorMode (shapes only); `FSDPMemTracker(model, optimizer)`
(torch/distributed/_tools/fsdp2_mem_tracker.py, PyTorch v2.13.0) around two training steps.
The model is torchtitan 0.3.0's Llama 3 (`torchtitan.models.llama3`) at Llama 3 70B's shapes
(dim 8192, 64 heads, 8 KV heads, FFN 28672, vocab 128256) with `layers` blocks, separate Q, K
and V projections (`fuse_qkv=False`, as torchtitan 9dec370's Attention has `wq`, `wk`, `wv`),
its attention torchtitan's `ScaledDotProductAttention`, and, as at torchtitan 9dec370 (the
December 2024 benchmark, validation/runs/memory-torchtitan-llama3-h100-202412.yaml):

- the word embedding a plain `nn.Embedding` (9dec370's; 0.3.0's own Embedding unwraps a DTensor
  weight for its own vocabulary-parallel path, which torch's `RowwiseParallel` does not use);
- every RMSNorm an fp32-upcast eager RMSNorm: transformers' `LlamaRMSNorm` runs the same ops as
  torchtitan 9dec370's `RMSNorm` (torchtitan/models/norms.py: `x.float()`, pow, mean, rsqrt,
  the product cast back with `type_as`, times the weight), which model.norm_type "rmsnorm"
  (train_configs/llama3_70b.toml) selects; torch.compile compiles only the blocks
  (parallelize_llama.apply_compile), so the final norm runs as this eager module;
- tensor parallelism by 9dec370's `apply_tp` plan (torchtitan/parallelisms/parallelize_llama.py)
  through `parallelize_module`: the embedding `RowwiseParallel(input_layouts=Replicate(),
  output_layouts=Shard(1))`; the final norm `SequenceParallel()`; the output layer
  `ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)`
  (loss parallel); per block `SequenceParallel` norms, `PrepareModuleInput` from Shard(1) to
  Replicate before attention and the feed-forward, column-parallel wq, wk, wv, w1, w3 and
  row-parallel wo, w2 with `output_layouts=Shard(1)`;
- full activation checkpointing: `checkpoint_wrapper(block, preserve_rng_state=False)` (9dec370
  `_apply_ac_to_transformer_block`, mode "full");
- FSDP2 by 9dec370's `apply_fsdp` on the dp_shard mesh: MixedPrecisionPolicy(param bf16, reduce
  fp32), every block resharded after forward but the last, the root module (embedding, final
  norm, output) the root unit;
- the loss under `loss_parallel()` (9dec370's train context with loss parallel on):
  `cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))`, `del pred`, backward;
  AdamW with foreach off (as the FSDP-only script: the fused step updates in place).

Phases (iteration 2, the states allocated): `forward` ends before the loss, `loss` after it,
`loss_backward` the loss's backward up to the logits' gradient (a hook on the logits), `backward`
the rest of the backward (output layer, blocks, embedding), `step` the optimizer step's.

Two work-arounds of the fake set-up, neither a change to what runs: FSDP2 over a 2-D mesh builds
the dp x tp mesh of each parameter's spec (`DeviceMesh._concatenate`) from index tensors, which
FakeTensorMode refuses, so that runs outside the fake mode; DTensor's sharding propagator runs
each op once more at its global shape to learn its output's metadata, under the active fake mode
when there is one (`_sharding_prop.py`, `detect_fake_mode() or FakeTensorMode()`), where the
tracker would count those global-shape tensors (it skips only other fake modes), so the
propagator gets a fake mode of its own.

Not measured: CUDA streams, CUDA kernels (the CPU's SDPA; the blocks' compiled kernels, which run
only inside the recomputed block here), torchao's float8 linears and asynchronous TP (the 70B
rows of the benchmark run both; neither touches the loss, where this step peaks). torchtitan
0.3.0 keeps a rotary table per block (`Buffer`, 4 MiB each at 8192 tokens) where 9dec370 keeps
one for the model.

Needs torch (2.13.0 was run), torchtitan (0.3.0) and transformers; prints JSON with --json,
writes it with --write. Results: validation/results-fsdp2-tp-memory-torch-2.13.0.json.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from torch_fsdp2_memory import _reset_peak, _total, build_llama3, report

RESULTS = "validation/results-fsdp2-tp-memory-torch-2.13.0.json"
DP_SHARD, TP = 32, 8
# Llama 3 70B (torchtitan 9dec370 llama3_configs["70B"]: dim 8192, 80 layers, 64 heads, 8 KV
# heads, ffn_dim_multiplier 1.3, multiple_of 4096 -> 28672; vocab 128256)
SHAPE = {"dim": 8192, "heads": 64, "kv_heads": 8, "ffn": 28672, "layers": 80, "vocab": 128256}
# Table 4 of the benchmark: local batch 16 at 8192 tokens. Two and three blocks separate the
# per-block terms; 80 blocks is the model.
CASES = tuple({"layers": n, "micro_batch": 16, "seq": 8192} for n in (2, 3, 80))


@contextlib.contextmanager
def fake_dtensor_workarounds(fake_mode):
    """The two work-arounds of the module docstring, undone on exit."""
    import torch.distributed.tensor._sharding_prop as sharding_prop
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    concatenate = DeviceMesh._concatenate
    detect = sharding_prop.detect_fake_mode

    def real_concatenate(*args, **kwargs):
        with unset_fake_temporarily():
            return concatenate(*args, **kwargs)

    DeviceMesh._concatenate = staticmethod(real_concatenate)
    sharding_prop.detect_fake_mode = lambda *args, **kwargs: None
    try:
        with fake_mode:
            yield
    finally:
        DeviceMesh._concatenate = staticmethod(concatenate)
        sharding_prop.detect_fake_mode = detect


def _eager_rmsnorm(dim: int):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return LlamaRMSNorm(dim, eps=1e-5)  # torchtitan 9dec370 ModelArgs.norm_eps


def build(torch, shape: dict, mesh, ac: str = "full"):
    """torchtitan's Llama 3 at `shape` under FakeTensorMode (active), tensor-parallel,
    checkpointed (`ac` "full", or "none") and sharded as at 9dec370 (module docstring)."""
    from torch import nn
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    dim, vocab = shape["dim"], shape["vocab"]
    model = build_llama3(shape, fuse_qkv=False)
    model.tok_embeddings = nn.Embedding(vocab, dim)
    model.norm = _eager_rmsnorm(dim)
    for block in model.layers.values():
        block.attention_norm = _eager_rmsnorm(dim)
        block.ffn_norm = _eager_rmsnorm(dim)

    tp_mesh = mesh["tp"]
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "lm_head": ColwiseParallel(
                input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
            ),
        },
    )
    # the blocks' forward takes (x, attention_masks, positions): only x is redistributed
    for block in model.layers.values():
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1), None, None),
                    desired_input_layouts=(Replicate(), None, None),
                ),
                "attention.qkv_linear.wq": ColwiseParallel(),
                "attention.qkv_linear.wk": ColwiseParallel(),
                "attention.qkv_linear.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                "feed_forward.w3": ColwiseParallel(),
            },
        )
    for name, block in list(model.layers.named_children()):
        if ac == "full":
            block = checkpoint_wrapper(block, preserve_rng_state=False)
        model.layers.register_module(name, block)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    dp_mesh = mesh["dp_shard"]
    blocks = list(model.layers.values())
    for index, block in enumerate(blocks):
        last = index == len(blocks) - 1
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=not last)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp)
    return model


def measure(case: dict, shape: dict = SHAPE, dp_shard: int = DP_SHARD, tp: int = TP) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel
    from torch.testing._internal.distributed.fake_pg import FakeStore

    shape = {**shape, "layers": case["layers"], "seq": case["seq"]}
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=dp_shard * tp)
    mesh = init_device_mesh("cpu", (dp_shard, tp), mesh_dim_names=("dp_shard", "tp"))
    batch, seq, vocab = case["micro_batch"], case["seq"], shape["vocab"]
    phases: dict[str, dict[str, int]] = {}
    with fake_dtensor_workarounds(FakeTensorMode()):
        model = build(torch, shape, mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
        tokens = torch.randint(0, vocab, (batch, seq))
        labels = torch.randint(0, vocab, (batch, seq))
        positions = torch.arange(seq).repeat(batch, 1)
        tracker = FSDPMemTracker(model, optimizer)
        tracker.track_inputs((tokens, labels))

        def end_phase(name):
            phases[name] = _total(tracker.get_tracker_snapshot("peak"))
            _reset_peak(tracker)

        with tracker:
            for _iteration in range(2):  # the second with the states allocated
                _reset_peak(tracker)
                with loss_parallel():
                    pred = model(tokens, positions)
                    end_phase("forward")
                    loss = F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))
                    pred.register_hook(lambda grad: end_phase("loss_backward"))
                    del pred
                    end_phase("loss")
                    loss.backward()
                end_phase("backward")
                optimizer.step()
                end_phase("step")
                optimizer.zero_grad()
                tracker.reset_mod_stats()
    dist.destroy_process_group()
    order = ("forward", "loss", "loss_backward", "backward", "step")
    phases = {phase: phases[phase] for phase in order}
    peak = max(phases, key=lambda phase: phases[phase]["Total"])
    return {
        **case,
        **shape,
        "dp_shard": dp_shard,
        "tp": tp,
        "layout": "202412",
        "ac": "full",
        "peak_phase": peak,
        "phases": phases,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--write", action="store_true", help=f"write {RESULTS}")
    parser.add_argument(
        "--layers", type=int, nargs="*", help="only these block counts (default 2, 3, 80)"
    )
    args = parser.parse_args(argv)
    chosen = [c for c in CASES if not args.layers or c["layers"] in args.layers]
    cases = report([measure(case) for case in chosen], RESULTS, args)
    if not args.json:
        for case in cases:
            print(case["layers"], "blocks", case["micro_batch"], case["seq"], case["peak_phase"])
            for phase, categories in case["phases"].items():
                print(f"  {phase:13s}", {k: v for k, v in categories.items() if v})
    return 0


if __name__ == "__main__":
    sys.exit(main())
