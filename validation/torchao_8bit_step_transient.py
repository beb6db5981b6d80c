"""What one step of torchao's 8-bit AdamW allocates beyond its parameter, gradient and states:
the transient of the optimizer step that ckplan's `adamw-8bit` leaves out.

torchao's `AdamW8bit` (torchao/prototype/low_bit_optim/adam.py, v0.7.0; unchanged in its step
since pytorch/ao 75f52ae76 of 2024-11-18 but for `p.detach()`) steps each parameter with
`torch.compile(single_param_adam, fullgraph=True, dynamic=False)`: the bf16 parameter and
gradient upcast to fp32, each moment dequantised from its `OptimState8bit` (uint8 codes in the
parameter's shape, an fp32 scale per 256 values, a 256-entry fp32 qmap), updated by `lerp`,
re-quantised by `copy_` (subclass_8bit.py: `scale_tensor` then `quantize_8bit_with_qmap`, an
eight-step binary search over the qmap and a rounding step), and the parameter written back.
Compiled, none of the fp32 copies need exist in memory; what Inductor's code allocates is:

- executed on the CPU (Inductor's C++ backend): one fused kernel that writes both block-scaled
  moments as fp32 buffers (the quantiser reads its input nine times, so Inductor realises it)
  and both moments' new scales: 2·4·n + 2·4·n/256 bytes (`cpp_step_transient_bytes`), measured
  with PyTorch's memory profiler over a second step (the first one compiles);
- Inductor's Triton code, the code a GPU runs (generated here for a CPU device with
  `cpu_backend = "triton"` and not run: this machine has no GPU driver): the scaled moments
  stay in registers inside one reduction kernel, which writes both moments' new uint8 codes to
  temporaries (the same kernel still reads the old codes for the parameter's update) and their
  new scales; two copies then move them into the states: 2·n + 2·4·n/256 bytes
  (`triton_step_transient_bytes`), read off the wrapper's allocations and frees.

n is the parameter's size, a multiple of the block (torchao quantises a tensor of 4096 values
or more whose size the block divides, `_AdamBase._new_buffer`). Both forms are linear in n, so
a scaled-down parameter gives the tied embedding of Llama 3.2 3B (128256 x 3072) exactly.
Needs torch and torchao (torch 2.13 and torchao 0.7.0 were run); the Triton part needs the
triton package (3.9.0 was run) and is skipped without it. Prints JSON with --json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re

import torch

BLOCK = 256  # torchao AdamW8bit's default block_size
FP32 = 4
LLAMA32_3B_EMBEDDING = (128256, 3072)


def cpp_step_transient_bytes(numel: int) -> int:
    """derived from Inductor's C++ code for torchao's compiled `single_param_adam` (module
    docstring): the two block-scaled fp32 moments and their two new fp32 scale vectors."""
    return 2 * FP32 * numel + 2 * FP32 * -(-numel // BLOCK)


def triton_step_transient_bytes(numel: int) -> int:
    """derived from Inductor's Triton code for torchao's compiled `single_param_adam` (module
    docstring): the two moments' new uint8 codes and their two new fp32 scale vectors."""
    return 2 * numel + 2 * FP32 * -(-numel // BLOCK)


def _optimizer(rows: int, cols: int):
    from torchao.prototype.low_bit_optim import AdamW8bit

    torch.manual_seed(0)
    parameter = torch.nn.Parameter(torch.randn(rows, cols, dtype=torch.bfloat16))
    optimizer = AdamW8bit([parameter], lr=1e-3)
    parameter.grad = torch.randn_like(parameter)
    return parameter, optimizer


def measure_executed(rows: int, cols: int) -> int:
    """The peak bytes allocated above the start during the second step of torchao's AdamW8bit
    over one (rows, cols) bf16 parameter on the CPU (Inductor's C++ backend), from PyTorch's
    memory profiler: every allocation and free replayed in time order."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    parameter, optimizer = _optimizer(rows, cols)
    optimizer.step()  # compiles and creates the states
    parameter.grad = torch.randn_like(parameter)
    with profile(
        activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
    ) as p:
        optimizer.step()
    live = peak = 0
    for event in p._memory_profile()._op_tree.sorted_nodes:
        if event.tag == _EventType.Allocation:
            live += event.extra_fields.alloc_size  # negative for a free
            peak = max(peak, live)
    return peak


_ALLOCATION = re.compile(
    r"^\s*(buf\d+) = empty_strided_\w+\(\(([\d, ]*)\), \([\d, ]*\), torch\.(\w+)\)"
)
_FREE = re.compile(r"^\s*del (.+)$")


def wrapper_peak_bytes(source: str) -> int:
    """The peak bytes of the buffers an Inductor wrapper's `call` allocates
    (`bufN = empty_strided_<device>(size, stride, dtype)`) and frees (`del bufN, ...`), in
    the order of its lines; graph inputs and outputs are not among them."""
    body = source[source.index("def call(") :]
    live: dict[str, int] = {}
    peak = 0
    for line in body.splitlines():
        if match := _ALLOCATION.match(line):
            name, sizes, dtype = match.groups()
            numel = 1
            for size in filter(None, (s.strip() for s in sizes.split(","))):
                numel *= int(size)
            live[name] = numel * getattr(torch, dtype).itemsize
            peak = max(peak, sum(live.values()))
        elif match := _FREE.match(line):
            for name in match.group(1).split(","):
                live.pop(name.strip(), None)
    return peak


def triton_wrapper_peak(rows: int, cols: int) -> int | None:
    """`wrapper_peak_bytes` of the Triton code Inductor generates for the step over one
    (rows, cols) bf16 parameter (module docstring), or None without the triton package. The
    code is generated for a CPU device (`cpu_backend = "triton"`) and compiling it fails
    without a driver; the failure comes after the wrapper is generated and logged."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    import torch._dynamo
    import torch._inductor.config as inductor_config
    import torch.utils._triton as torch_triton
    from torch._inductor.exc import InductorError
    from torch._inductor.graph import GraphLowering

    sources: list[str] = []
    hashing = torch_triton.triton_hash_with_backend
    # the kernels' cache key asks the active driver for its target; there is none here
    torch_triton.triton_hash_with_backend = lambda: "no-driver"
    GraphLowering.save_output_code = sources.append  # the wrapper, before it is loaded
    torch._dynamo.reset()
    try:
        with inductor_config.patch(cpu_backend="triton", compile_threads=1):
            _, optimizer = _optimizer(rows, cols)
            with contextlib.suppress(InductorError):  # compiling the kernels needs a driver
                optimizer.step()
    finally:
        torch_triton.triton_hash_with_backend = hashing
        GraphLowering.save_output_code = None
        torch._dynamo.reset()
    wrappers = [source for source in sources if "def call(" in source]
    if not wrappers:
        raise RuntimeError("Inductor logged no wrapper for the step")
    return wrapper_peak_bytes(wrappers[-1])


def measure(rows: int, cols: int) -> dict:
    numel = rows * cols
    triton_peak = triton_wrapper_peak(rows, cols)
    return {
        "shape": [rows, cols],
        "numel": numel,
        "cpp_executed_peak_bytes": measure_executed(rows, cols),
        "cpp_formula_bytes": cpp_step_transient_bytes(numel),
        "triton_wrapper_peak_bytes": triton_peak,
        "triton_formula_bytes": triton_step_transient_bytes(numel),
    }


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import torchao

    rows = [measure(1024, 3072), measure(2048, 3072)]
    embedding = LLAMA32_3B_EMBEDDING[0] * LLAMA32_3B_EMBEDDING[1]
    out = {
        "torch": torch.__version__,
        "torchao": torchao.__version__,
        "triton": _triton_version(),
        "rows": rows,
        "llama3.2-3b-embedding": {
            "numel": embedding,
            "cpp_step_transient_bytes": cpp_step_transient_bytes(embedding),
            "triton_step_transient_bytes": triton_step_transient_bytes(embedding),
        },
    }
    if args.json:
        print(json.dumps(out, indent=1))
        return
    for row in rows:
        print(row)
    print(out["llama3.2-3b-embedding"])


if __name__ == "__main__":
    main()
