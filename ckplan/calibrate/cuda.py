"""`ckplan calibrate --device cuda`: the plan's step peak against torch.cuda.max_memory_allocated,
with and without torch.utils.checkpoint (torch with CUDA needed).

UNTESTED: written without a GPU (docs/validation.md says so); the CPU path is what the tests run.

A stack of LAYERS layers of the calibrated block, at a GPU-sized shape, runs one forward and one
backward that asks for the input gradient only (`torch.autograd.grad(out, x, δ_out)`: autograd
then skips the weight-gradient matmuls, so parameter gradients, which ckplan counts as model
states, never exist), first storing every layer's tensors, then with every layer wrapped in
`torch.utils.checkpoint.checkpoint(use_reentrant=False)` (keep each layer's input, re-run it in
backward). Measured: max_memory_allocated over the step less what was allocated before x and
δ_out (the parameters). Predicted: ckplan's plan for the same stack (`layers: LAYERS`, `vocab: 0`,
so the chain is the layers alone; the calibrated profile) under strategies `none` and `full`:
`Plan.activation_bytes`, which counts x (the first layer's input) and δ_out as the chain does.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import yaml

from ckplan.calibrate.fit import Shape
from ckplan.calibrate.run import Calibration, own_block
from ckplan.model.spec import ModelSpec

LAYERS = 4


def gpu_shape(spec: ModelSpec) -> Shape:
    """Large enough that the allocator's 512-byte rounding is noise, small enough for any GPU."""
    heads = 8
    kv_heads = 2 if spec.kv_heads < spec.heads else heads
    return Shape(seq=1024, batch=2, hidden=1024, heads=heads, kv_heads=kv_heads, ffn=2816)


def peak_memory_check(
    spec: ModelSpec, result: Calibration, device: str, hf: bool, hf_config: dict | None
) -> dict:
    from ckplan.plan import evaluate, parse_strategy

    shape = gpu_shape(spec)
    dtype = {2: torch.bfloat16, 4: torch.float32}[spec.dtype_bytes]
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "calibrated.yaml"
        path.write_text(yaml.safe_dump(result.profile, sort_keys=False), encoding="utf-8")
        stack = spec.replace(
            layers=LAYERS,
            vocab=0,
            pp=1,
            virtual_stages=1,
            microbatches=1,
            tp=1,
            sp=False,
            cp=1,
            seq=shape.seq,
            micro_batch=shape.batch,
            hidden=shape.hidden,
            heads=shape.heads,
            kv_heads=shape.kv_heads,
            ffn_hidden=shape.ffn,
            profile=str(path),
        )
        predicted = {
            name: evaluate(stack, parse_strategy(name, stack)).activation_bytes
            for name in ("none", "full")
        }
    runs = []
    for name, checkpointed in (("none", False), ("full", True)):
        measured = _measure(spec, shape, dtype, device, hf, hf_config, checkpointed)
        runs.append(
            {
                "strategy": name,
                "measured_bytes": measured,
                "predicted_bytes": predicted[name],
                "error": (predicted[name] - measured) / measured,
            }
        )
    return {"layers": LAYERS, "shape": shape.text(), "runs": runs}


def _measure(spec, shape, dtype, device, hf, hf_config, checkpointed: bool) -> int:
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    if hf:
        from ckplan.calibrate.hf import hf_block

        blocks = [hf_block(spec, shape, dtype, device, hf_config) for _ in range(LAYERS)]
    else:
        blocks = [own_block(spec, shape, dtype, device) for _ in range(LAYERS)]
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)  # parameters (and HF's mask, cos, sin)
    x = torch.randn(shape.batch, shape.seq, shape.hidden, dtype=dtype, device=device)
    x.requires_grad_(True)
    delta = torch.randn_like(x)
    torch.cuda.reset_peak_memory_stats(device)
    h = x
    for block in blocks:
        if checkpointed:
            h = checkpoint(block.forward, h, None, use_reentrant=False)
        else:
            h = block.forward(h, None)
    (grad,) = torch.autograd.grad(h, x, delta)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del grad, h, x, delta, blocks
    torch.cuda.empty_cache()
    return peak
