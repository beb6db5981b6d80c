"""What one step of torchao's AdamW8bit allocates on a GPU beyond its parameter, gradient and
states: its first call (compiled, its Triton kernels autotuned) and a later one.

validation/torchao_8bit_step_transient.py reads these bytes off Inductor's generated code on a
machine without a GPU: per value of the parameter, 2 B (torch 2.13) or 4 B (torch 2.5.1) at a
steady step, and at the first call, if the kernel autotunes, the clones of every argument it
stores into beside triton.testing.do_bench's 256e6-byte L2 flush buffer (12.06 B a value under
torch 2.5.1). This script measures them with the CUDA caching allocator's statistics: for each
step, the peak allocated (and active) bytes during the step less the bytes allocated after it
(the states, created at the first step, are then in both). Inductor's caches are pointed at a
fresh directory first, so the first call compiles and autotunes as a first run would.

The default parameter is the tied embedding of Llama 3.2 3B (128256 x 3072, bf16), whose step
is the backward's last under torchtune's optimizer_in_bwd; --rows scales it down.

    python validation/device/measure_torchao_8bit_step.py --out torchao-8bit-step.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")  # a first run

import torch  # after the cache directory is set


def step_transient(optimizer, parameter) -> dict:
    """The bytes the step allocated beyond what it leaves: peak during it less after it."""
    parameter.grad = torch.randn_like(parameter)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    optimizer.step()
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    stats = torch.cuda.memory_stats()
    return {
        "before_bytes": before,
        "after_bytes": after,
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
        "peak_active_bytes": stats["active_bytes.all.peak"],
        "transient_bytes": torch.cuda.max_memory_allocated() - after,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=128256)
    parser.add_argument("--cols", type=int, default=3072)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import torchao
    from torchao.prototype.low_bit_optim import AdamW8bit

    torch.manual_seed(0)
    parameter = torch.nn.Parameter(
        torch.randn(args.rows, args.cols, dtype=torch.bfloat16, device="cuda")
    )
    optimizer = AdamW8bit([parameter], lr=1e-3)
    numel = parameter.numel()
    steps = [step_transient(optimizer, parameter) for _ in range(args.steps)]
    for step in steps:
        step["transient_bytes_per_value"] = step["transient_bytes"] / numel
    out = {
        "torch": torch.__version__,
        "torchao": torchao.__version__,
        "device": torch.cuda.get_device_name(),
        "shape": [args.rows, args.cols],
        "numel": numel,
        "steps": steps,
    }
    text = json.dumps(out, indent=1)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
