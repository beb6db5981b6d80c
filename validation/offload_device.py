"""Activation offloading measured on a CUDA GPU: the host link's copy rate and the device bytes
that `torch.autograd.graph.save_on_cpu` takes off the GPU, beside ckplan's figures.

Usage: python3 validation/offload_device.py [--out results.json]

1. Pinned copies of 512 MiB, device to host and host to device (the best of 5 each), against the
   GPU file's effective rate `host_bytes_per_s x host_link_efficiency`
   (ckplan.hardware.host_link.host_link_bytes_per_second) when the GPU is a shipped preset.
2. A stack of GPT blocks (tests/test_export_torch.py's shape, bf16, on the GPU): the bytes
   allocated after the forward pass, plain and with the layers under `save_on_cpu(pin_memory=True)`
   as ckplan's torch export writes them; the difference is what the layers saved, now on host.

Needs torch with CUDA; prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

COPY_BYTES = 512 * 2**20
REPEATS = 5


def copy_rates(torch) -> dict[str, float]:
    """Best-of-REPEATS bytes per second of pinned device-to-host and host-to-device copies."""
    device = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    host = torch.empty(COPY_BYTES, dtype=torch.uint8, pin_memory=True)
    rates = {}
    for name, (dst, src) in {
        "device_to_host": (host, device),
        "host_to_device": (device, host),
    }.items():
        best = float("inf")
        for _ in range(REPEATS):
            torch.cuda.synchronize()
            start = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        rates[name] = COPY_BYTES / best
    return rates


def saved_on_host(torch, layers: int = 8, hidden: int = 2048, seq: int = 4096) -> dict[str, int]:
    """Bytes allocated on the GPU after the forward pass of `layers` blocks, plain and under
    save_on_cpu, and the input and output bytes both keep."""
    from torch.autograd.graph import save_on_cpu

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(hidden, 4 * hidden)
            self.fc2 = torch.nn.Linear(4 * hidden, hidden)

        def forward(self, x):
            return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))

    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(Block() for _ in range(layers)).cuda().bfloat16()
    x = torch.randn(1, seq, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def held(offload: bool) -> int:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        hidden_state = x
        for block in blocks:
            if offload:
                with save_on_cpu(pin_memory=True):
                    hidden_state = block(hidden_state)
            else:
                hidden_state = block(hidden_state)
        torch.cuda.synchronize()
        after = torch.cuda.memory_allocated() - base
        hidden_state.float().sum().backward()
        for p in blocks.parameters():
            p.grad = None
        x.grad = None
        return after

    held(False)  # warm-up: cuBLAS workspaces
    plain = held(False)
    offloaded = held(True)
    return {"plain_bytes": plain, "offloaded_bytes": offloaded, "moved_bytes": plain - offloaded}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("offload_device.py needs a CUDA GPU")
    result = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "copy_bytes_per_second": copy_rates(torch),
        "saved_on_host": saved_on_host(torch),
    }
    try:
        from ckplan.hardware.host_link import host_link_bytes_per_second
        from ckplan.inputs.gpus import load_gpu

        name = (
            "h200" if "H200" in result["gpu"] else "h100-sxm" if "H100" in result["gpu"] else None
        )
        if name is not None:
            result["ckplan_effective_bytes_per_second"] = host_link_bytes_per_second(load_gpu(name))
            result["ckplan_gpu"] = name
    except ImportError:
        pass
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
