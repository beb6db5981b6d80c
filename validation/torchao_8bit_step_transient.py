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
a scaled-down parameter gives the tied embedding of Llama 3.2 3B (128256 x 3072) exactly. The
forms are torch 2.13's; the script runs under other releases and reports what they allocate
(validation/results-torchao-8bit-step-torch-2.5.1.json: torch 2.5.1, CUDA build on a machine
without a GPU, triton 3.1.0, its Triton code generated with an A100's properties: one fp32
buffer of the parameter's shape, 4 B a value, the codes and scales written in place).

A Triton kernel's first launch may autotune: with more than one launch configuration (torch
2.5.1 gives a looped reduction of ReductionHint.DEFAULT six, `_reduction_configs`) Inductor's
CachingAutotuner times each, and before every timed launch clones each argument the kernel
stores into (`wrapper_autotune_peak_bytes`), beside triton.testing.do_bench's 256e6-byte L2
flush buffer (triton 3.1.0 testing.py, fast_flush). Under torch 2.5.1 that is 12.06 B a value
at the step's first call. Needs torch and torchao (torch 2.13 and torchao 0.7.0 were run); the
Triton part needs the triton package (3.9.0 with torch 2.13) and is skipped without it. Prints
JSON with --json.
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


_KERNEL = re.compile(r"^(\w+) = async_compile\.triton\(")
_MUTATED = re.compile(r"'mutated_arg_names': \[([^\]]*)\]")
_SIGNATURE = re.compile(r"^def \w+\((.*)\):", re.MULTILINE)
_INPUT = re.compile(
    r"(arg\d+_1) = rand_strided\(\(([\d, ]*)\), \([\d, ]*\), device='\w+', dtype=torch\.(\w+)\)"
)
_RUN = re.compile(r"^\s*(\w+)\.run\((.*)\)\s*$")


def _bytes(sizes: str, dtype: str) -> int:
    numel = 1
    for size in filter(None, (s.strip() for s in sizes.split(","))):
        numel *= int(size)
    return numel * getattr(torch, dtype).itemsize


def _mutated_parameters(source: str) -> dict[str, tuple[list[str], set[str]]]:
    """Each Triton kernel's parameter names and the ones it stores into (`mutated_arg_names`
    in its inductor_meta), by the name the wrapper calls it by."""
    kernels: dict[str, tuple[list[str], set[str]]] = {}
    lines = source.splitlines()
    for i, line in enumerate(lines):
        if match := _KERNEL.match(line):
            block = "\n".join(lines[i : i + 40])
            mutated = _MUTATED.search(block)
            signature = _SIGNATURE.search(block)
            if mutated is None or signature is None:
                continue
            names = [p.split(":")[0].strip() for p in signature.group(1).split(",")]
            kernels[match.group(1)] = (
                names,
                {m.strip().strip("'\"") for m in mutated.group(1).split(",") if m.strip()},
            )
    return kernels


def wrapper_autotune_peak_bytes(source: str) -> int:
    """`wrapper_peak_bytes` with, at each Triton kernel's launch, the copies its first launch
    makes when it autotunes: Inductor's CachingAutotuner.bench clones every argument the
    kernel stores into (`clone_args`, torch/_inductor/runtime/triton_heuristics.py, v2.5.1:
    one clone per argument, so one tensor passed twice is cloned twice) before each timed
    launch. Graph inputs' sizes come from the wrapper's `benchmark_compiled_module`."""
    kernels = _mutated_parameters(source)
    sizes = {name: _bytes(shape, dtype) for name, shape, dtype in _INPUT.findall(source)}
    body = source[source.index("def call(") :]
    body = (
        body[: body.index("def benchmark_compiled_module")]
        if "def benchmark_compiled_module" in body
        else body
    )
    live: dict[str, int] = {}
    peak = 0
    for line in body.splitlines():
        if match := _ALLOCATION.match(line):
            name, shape, dtype = match.groups()
            live[name] = sizes[name] = _bytes(shape, dtype)
            peak = max(peak, sum(live.values()))
        elif match := _FREE.match(line):
            for name in match.group(1).split(","):
                live.pop(name.strip(), None)
        elif (match := _RUN.match(line)) and match.group(1) in kernels:
            names, mutated = kernels[match.group(1)]
            arguments = [a.strip() for a in match.group(2).split(",") if "=" not in a]
            clones = sum(
                sizes.get(argument, 0)
                for name, argument in zip(names, arguments, strict=False)
                if name in mutated
            )
            peak = max(peak, sum(live.values()) + clones)
    return peak


# An A100's properties where torch 2.5's Inductor asks the device: its reduction hint compares
# the rows reduced with 2·32 per streaming multiprocessor (torch/_inductor/ir.py num_splits)
A100_PROPERTIES = {
    "multi_processor_count": 108,
    "major": 8,
    "minor": 0,
    "regs_per_multiprocessor": 65536,
    "max_threads_per_multi_processor": 2048,
    "warp_size": 32,
}


@contextlib.contextmanager
def _triton_for_cpu_tensors():
    """Inductor's Triton code for CPU tensors: torch 2.6 on has `cpu_backend = "triton"`;
    torch 2.5 has not, so the Triton scheduling is registered for the CPU with an A100's
    device properties and CUDA's wrapper calls, and taken back afterwards."""
    import types

    import torch._inductor.codegen.common as codegen
    import torch._inductor.config as inductor_config

    if torch.torch_version.TorchVersion(torch.__version__) >= "2.6":
        with inductor_config.patch(cpu_backend="triton", compile_threads=1):
            yield
        return
    from torch._dynamo import device_interface as interfaces
    from torch._inductor.codegen.cuda.device_op_overrides import CUDADeviceOpOverrides
    from torch._inductor.codegen.triton import TritonScheduling
    from torch._inductor.codegen.wrapper import WrapperCodeGen

    properties = types.SimpleNamespace(**A100_PROPERTIES)
    codegen.init_backend_registration()  # the CPU's own backend first, to be put back

    class A100Interface(interfaces.DeviceInterface):
        class Worker:
            @staticmethod
            def get_device_properties(device=None):
                return properties

        @staticmethod
        def get_device_properties(device=None):
            return properties

        @staticmethod
        def get_compute_capability(device=None):
            return 80

        @staticmethod
        def current_device():
            return 0

    saved = (
        codegen.device_codegens.get("cpu"),
        interfaces.device_interfaces.get("cpu"),
        codegen.device_op_overrides_dict.get("cpu"),
    )
    codegen.register_backend_for_device("cpu", TritonScheduling, WrapperCodeGen)
    interfaces.device_interfaces["cpu"] = A100Interface
    codegen.device_op_overrides_dict["cpu"] = CUDADeviceOpOverrides()
    try:
        with inductor_config.patch(compile_threads=1):
            yield
    finally:
        for table, value in zip(
            (
                codegen.device_codegens,
                interfaces.device_interfaces,
                codegen.device_op_overrides_dict,
            ),
            saved,
            strict=True,
        ):
            if value is None:
                table.pop("cpu", None)
            else:
                table["cpu"] = value


def triton_wrapper_peaks(rows: int, cols: int) -> tuple[int, int] | None:
    """`wrapper_peak_bytes` and `wrapper_autotune_peak_bytes` of the Triton code Inductor
    generates for the step over one (rows, cols) bf16 parameter (module docstring), or None
    without the triton package. The code is generated for CPU tensors
    (`_triton_for_cpu_tensors`) and compiling it fails without a driver; the failure comes
    after the wrapper is generated."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    import torch._dynamo
    import torch.utils._triton as torch_triton
    from torch._dynamo.exc import BackendCompilerFailed
    from torch._inductor.graph import GraphLowering

    sources: list[str] = []
    hashing = torch_triton.triton_hash_with_backend
    # the kernels' cache key asks the active driver for its target; there is none here
    torch_triton.triton_hash_with_backend = lambda: "no-driver"
    saving = GraphLowering.__dict__["save_output_code"]
    GraphLowering.save_output_code = sources.append  # the wrapper, before it is loaded
    torch._dynamo.reset()
    try:
        with _triton_for_cpu_tensors():
            _, optimizer = _optimizer(rows, cols)
            with contextlib.suppress(BackendCompilerFailed):  # compiling the kernels needs a driver
                optimizer.step()
    finally:
        torch_triton.triton_hash_with_backend = hashing
        GraphLowering.save_output_code = saving
        torch._dynamo.reset()
    wrappers = [source for source in sources if "def call(" in source]
    if not wrappers:
        raise RuntimeError("Inductor logged no wrapper for the step")
    return wrapper_peak_bytes(wrappers[-1]), wrapper_autotune_peak_bytes(wrappers[-1])


def measure(rows: int, cols: int) -> dict:
    numel = rows * cols
    triton = triton_wrapper_peaks(rows, cols)
    return {
        "shape": [rows, cols],
        "numel": numel,
        "cpp_executed_peak_bytes": measure_executed(rows, cols),
        "cpp_formula_bytes": cpp_step_transient_bytes(numel),
        "triton_wrapper_peak_bytes": triton[0] if triton else None,
        "triton_first_launch_peak_bytes": triton[1] if triton else None,
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
