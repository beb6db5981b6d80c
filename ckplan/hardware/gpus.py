"""A GPU: datasheet figures and the efficiencies the time model applies to them.

`GPU` is a frozen dataclass whose fields are the keys of a GPU file (docs/time-model.md). Reading
files lives in `ckplan.inputs.gpus`; `gpu_from_mapping` is the one gate every mapping passes, with
one-line `GPUError`s naming the key, as `spec.spec_from_mapping` does for models.

Datasheet keys (per GPU, bytes and FLOP/s as plain numbers):
  memory_bytes          HBM capacity as the datasheet states it (80 GB -> 80e9)
  bf16_flops            dense BF16 tensor-core FLOP/s (no 2:4 sparsity)
  fp32_flops            FP32 FLOP/s (non-tensor)
  hbm_bytes_per_s       memory bandwidth
  link_bytes_per_s      intra-node GPU-to-GPU bandwidth per GPU, one direction
  gpus_per_node         GPUs joined by that link
  network_bytes_per_s   inter-node bandwidth per GPU, one direction

Host keys (activation offloading, ckplan.hardware.host_link; defaults: a PCIe Gen4 x16 host
link per GPU and 1 TB of host memory per node):
  host_bytes_per_s      GPU-to-host link, one direction, as the datasheet states it (PCIe Gen4
                        x16 32e9, Gen5 x16 64e9, GH200 NVLink-C2C 450e9)
  host_link_efficiency  share of host_bytes_per_s a pinned bulk copy reaches
  gpus_per_host_link    GPUs that share one host link (behind one PCIe switch uplink)
  host_memory_bytes     host memory of one node; its share per GPU bounds the pinned tapes

Host CPU keys (model states on the host: the CPU optimizer step, ckplan.hardware.host_states;
defaults: DGX H100's two Intel Xeon Platinum 8480C):
  host_cpu_bytes_per_s        the node's CPU memory bandwidth (all sockets, datasheet)
  host_cpu_memory_efficiency  share of it a streaming kernel reaches (STREAM)
  host_cpu_flops              the node's FP32 vector FLOP/s (all sockets, base clock)

Efficiency keys (fractions of the datasheet figure actually reached; see each default's source in
the shipped files and README "Step time"):
  matmul_efficiency           large, well-shaped GEMMs (the shape curve multiplies it)
  memory_efficiency           element-wise and reduction kernels against hbm_bytes_per_s
  link_efficiency             NCCL ring collectives against link_bytes_per_s
  network_efficiency          the same against network_bytes_per_s
  flash_attention_efficiency  a fused flash-attention kernel, FLOPs it executes / bf16_flops
  dp_overlap                  share of data-parallel communication hidden behind compute
  ep_overlap                  share of expert-parallel all-to-all (and etp) communication hidden
                              behind the same layer's compute; 0 = Megatron-LM's default
                              alltoall dispatcher, which runs it on the compute stream; 1 =
                              fully hidden where the compute allows, at no SM cost;
                              the paired chunks of pipeline_schedule: dualpipe hide what
                              it leaves; overlap_moe_expert_parallel_comm (Megatron's
                              combined 1F1B) replaces it
  sm_count, tile_m, tile_n    the wave-quantisation term of the shape curve (roofline.py)

Collective keys (NCCL's own cost model and its footprint on the GPU; 0 = not modelled, the
default for a file without them; the shipped files cite their figures):
  collective_latency_s        fixed seconds of one ring collective (NCCL's baseLat)
  collective_step_latency_s   seconds per ring step on the link (NCCL's hwLat), so a ring
                              all-reduce over n GPUs costs base + 2(n-1) steps, an all-gather or
                              reduce-scatter base + (n-1) (communication.ring_latency_seconds)
  nccl_channels               CUDA blocks a collective runs, one per channel, each holding an
                              SM a large-tile GEMM cannot share (communication.overlapped);
                              also the channels whose buffers a communicator holds
                              (hardware.device_memory)
  nccl_nvls_channels          NVLink SHARP channels NCCL sets up on an NVSwitch system of
                              compute capability 9.0+ (NCCL_NVLS_NCHANNELS, 16); 0 = none

Device-memory keys (what nvidia-smi shows beside the caching allocator, hardware.device_memory):
  cuda_context_bytes          the CUDA context of a training process: driver state and the
                              kernel modules it loads (0 = not modelled)

Precision and attention-kernel keys (hardware.code_path):
  fp8_flops, fp8_matmul_efficiency   dense FP8 tensor-core FLOP/s and its best-shape share
  mxfp8                       true where Transformer Engine runs MXFP8 (compute capability 10.x)
  fp8_block_gemm_rate         the block-scaled FP8 GEMM's rate (fp8_recipe blockwise) as a share
                              of the per-tensor-scaled one's; 0 where Transformer Engine has no
                              native one (all but compute capability 9.x)
  flash3_efficiency, cudnn_attention_efficiency, triton_attention_efficiency
                              each kernel's forward + backward plateau (flash_attention_efficiency
                              is FlashAttention-2's), from the kernels' published benchmarks
  attention_half_seq          the sequence length at which they reach half the plateau
  sustained_fraction          the share of the kernel benchmarks a training step sustains (fitted)
  clock_factor                a power-capped part's compute rate against the rated one

memory_bytes is what CUDA reports (torch.cuda.get_device_properties().total_memory), below the
datasheet's decimal figure (an 80 GB H100: 81,106 MiB).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckplan.errors import InputError
from ckplan.model.parts import cached_hash
from ckplan.quoting import quote


class GPUError(InputError):
    """Invalid GPU description; the message is one line and names the offending key."""


@dataclass(frozen=True)
class GPU:
    __hash__ = cached_hash  # a cache key, hashed on every lookup

    name: str
    memory_bytes: int
    bf16_flops: float
    fp32_flops: float
    hbm_bytes_per_s: float
    link_bytes_per_s: float
    gpus_per_node: int
    network_bytes_per_s: float
    source: str = ""
    matmul_efficiency: float = 0.8
    memory_efficiency: float = 0.8
    link_efficiency: float = 0.7
    network_efficiency: float = 0.85
    flash_attention_efficiency: float = 0.5
    dp_overlap: float = 0.0
    ep_overlap: float = 0.0
    sm_count: int = 108
    tile_m: int = 256
    tile_n: int = 128
    collective_latency_s: float = 0.0
    collective_step_latency_s: float = 0.0
    nccl_channels: int = 0
    nccl_nvls_channels: int = 0
    # the CUDA context under lazy module loading (CUDA_MODULE_LOADING=LAZY, PyTorch's default
    # since v1.13, pytorch/pytorch PR #86509): "around 400MB if CUDA >= 11.7 is used and lazy
    # module loading enabled" (pytorch/pytorch issue #109888, 2023-09, GPU not named), taken as
    # 400 MiB. No published figure for an A100 or H100 training process was found; the kernels
    # a step loads lazily beyond the first tensor are not counted (hardware.device_memory)
    cuda_context_bytes: int = 400 * 2**20
    # FP8 tensor cores (0: none) and the share of them a best-shape FP8 GEMM reaches (MAMF)
    fp8_flops: float = 0.0
    fp8_matmul_efficiency: float = 0.7
    # MXFP8 block-scaled tensor cores (fp8_recipe mxfp8): Transformer Engine runs MXFP8 on
    # compute capability 10.x alone (v2.9 transformer_engine/pytorch/quantization.py,
    # `check_mxfp8_support`: "Device compute capability 10.0 or higher required", 12.0+ not
    # yet), i.e. B200 and GB200
    mxfp8: bool = False
    # Block-scaled FP8 GEMMs (fp8_recipe blockwise, Transformer Engine's Float8BlockScaling):
    # cuBLASLt's 1x128 / 128x128 fp32-scaled FP8 GEMM runs on Hopper alone; TE v2.9 accepts
    # compute capability 9.0 and above (quantization.py `check_fp8_block_scaling_support`, CUDA
    # 12.9+; v2.3-v2.7: Hopper only) but emulates it with MXFP8 on 10.0 and above (csrc/
    # extensions/gemm.cpp, "Emulate the FP8 block scaling recipe with MXFP8 on Blackwell and
    # newer"), which is not modelled. The rate is the GEMM's as a share of the per-tensor FP8
    # GEMM's (fp8_matmul_efficiency); 0: not modelled on this GPU
    fp8_block_gemm_rate: float = 0.0
    # attention kernels other than FlashAttention-2 (flash_attention_efficiency): their plateau
    # as a share of bf16_flops, 0 where the kernel does not run on this GPU
    flash3_efficiency: float = 0.0
    cudnn_attention_efficiency: float = 0.0
    triton_attention_efficiency: float = 0.0
    # tokens (per CP rank) at which an attention kernel reaches half its plateau (e(s) = plateau ·
    # s / (s + attention_half_seq)); 0: the plateau at every length
    attention_half_seq: float = 0.0
    # the share of its MAMF a training step's GEMMs and attention kernels sustain (power and
    # clocks under load, GEMMs beside NCCL, transposed backward operands): fitted on published
    # runs (docs/validation.md, "The time model's fitted constants"); 1 = the kernel benchmarks
    sustained_fraction: float = 1.0
    # a power-capped or down-clocked part: compute rates scale by this (1 = as rated)
    clock_factor: float = 1.0
    # the host link and host memory (activation offloading, hardware.host_link)
    host_bytes_per_s: float = 32e9
    host_link_efficiency: float = 0.8
    gpus_per_host_link: int = 1
    host_memory_bytes: int = 10**12
    # the host's CPUs (model states on the host, hardware.host_states). Default: DGX H100's two
    # Xeon Platinum 8480C (DGX H100 datasheet); Intel's 8480+ specification: 56 cores, 2.0 GHz
    # base, 8 channels of DDR5-4800 per socket, two AVX-512 FMA units per core: 2 x 8 x 4.8e9
    # x 8 bytes = 614.4e9 B/s, 2 x 56 x 2.0e9 x 64 FP32 FLOPs per cycle = 14.336e12 FLOP/s
    host_cpu_bytes_per_s: float = 614.4e9
    host_cpu_memory_efficiency: float = 0.7  # assumed; measure with STREAM's triad
    host_cpu_flops: float = 14.336e12

    def replace(self, **changes: Any) -> GPU:
        return gpu_from_mapping({**self.to_dict(), **changes})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_FIELDS = {f.name: f for f in dataclasses.fields(GPU)}
_REQUIRED = [name for name, f in _FIELDS.items() if f.default is dataclasses.MISSING]
_STRINGS = {"name", "source"}
_BOOLS = {"mxfp8"}
_INTEGERS = {"memory_bytes", "gpus_per_node", "sm_count", "tile_m", "tile_n"}
_INTEGERS |= {"gpus_per_host_link", "host_memory_bytes"}
_COUNTS = {"nccl_channels", "nccl_nvls_channels"}  # integers >= 0 (0: not modelled)
_SIZES = {"cuda_context_bytes"}  # integers in [0, memory_bytes) (0: not modelled)
_LATENCIES = {"collective_latency_s", "collective_step_latency_s"}  # [0, MAX_LATENCY_S]
# 1 ms: twenty times the largest of NCCL's latencies (tuning.cc, 50 us a step on the network)
MAX_LATENCY_S = 1e-3
MAX_RATE = 1e21  # any size or rate above a zetta- is a typo (and overflows what is built on it)
MAX_TEXT_CHARS = 1000  # name, source: as the model's text keys
MAX_COUNT = 2**20  # gpus_per_node, sm_count, tiles
MEMORY_RANGE = (2**20, 10**21)  # memory_bytes: 1 MiB .. 1 ZB, as --budget accepts
_OVERLAPS = {"dp_overlap", "ep_overlap"}  # [0, 1]
# [0, 1]: 0 = the GPU has no such unit or kernel
_OPTIONAL_FRACTIONS = {"flash3_efficiency", "cudnn_attention_efficiency"}
_OPTIONAL_FRACTIONS |= {"triton_attention_efficiency", "fp8_block_gemm_rate"}
_NON_NEGATIVE = {"fp8_flops", "attention_half_seq"}  # [0, MAX_RATE]
_FRACTIONS = {  # (0, 1]
    "matmul_efficiency",
    "memory_efficiency",
    "link_efficiency",
    "network_efficiency",
    "flash_attention_efficiency",
    "fp8_matmul_efficiency",
    "sustained_fraction",
    "clock_factor",
    "host_link_efficiency",
    "host_cpu_memory_efficiency",
}


def gpu_keys() -> list[str]:
    return list(_FIELDS)


def gpu_from_mapping(mapping: Mapping[str, Any], origin: str = "gpu") -> GPU:
    """Validate a YAML-style mapping into a GPU. Numbers may be written 312e12 or 312_000e9;
    every size and rate must be positive, every efficiency in (0, 1] (the overlaps in [0, 1]),
    the collective latencies in [0, 1 ms], nccl_channels an integer >= 0 below sm_count."""
    if not isinstance(mapping, Mapping):
        raise GPUError(
            f"{origin}: expected a mapping of keys to values, got {type(mapping).__name__}"
        )
    values: dict[str, Any] = {}
    for key, value in mapping.items():
        if not isinstance(key, str) or key not in _FIELDS:
            raise GPUError(f"{origin}: unknown key {quote(key)}{_did_you_mean(key)}")
        values[key] = _coerce(origin, key, value)
    missing = [key for key in _REQUIRED if key not in values]
    if missing:
        raise GPUError(f"{origin}: missing required key {missing[0]!r}")
    gpu = GPU(**values)
    if gpu.gpus_per_host_link > gpu.gpus_per_node:
        raise GPUError(
            f"{origin}: key 'gpus_per_host_link' must be at most gpus_per_node "
            f"({gpu.gpus_per_node}), got {gpu.gpus_per_host_link}"
        )
    if gpu.cuda_context_bytes >= gpu.memory_bytes:
        raise GPUError(
            f"{origin}: key 'cuda_context_bytes' must be below memory_bytes "
            f"({gpu.memory_bytes:,}), got {gpu.cuda_context_bytes:,}"
        )
    for key in ("nccl_channels", "nccl_nvls_channels"):
        if getattr(gpu, key) >= gpu.sm_count:
            raise GPUError(
                f"{origin}: key {key!r} must be below sm_count ({gpu.sm_count}), "
                f"got {getattr(gpu, key)}"
            )
    return gpu


def _did_you_mean(key: Any) -> str:
    key = key if isinstance(key, str) and len(key) < 100 else ""
    close = difflib.get_close_matches(key, _FIELDS, n=1, cutoff=0.6) if key else []
    return f" (did you mean {close[0]!r}?)" if close else f"; valid keys: {', '.join(_FIELDS)}"


def _number(origin: str, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise GPUError(f"{origin}: key {key!r} expects a number, got {quote(value)}")
    if isinstance(value, str) and not value.isascii():  # float() reads '٠.٧', '０.７'
        raise GPUError(
            f"{origin}: key {key!r} expects a number in ASCII digits, got {quote(value)}"
        )
    try:
        number = float(value.replace("_", "")) if isinstance(value, str) else float(value)
    except (ValueError, OverflowError):
        raise GPUError(f"{origin}: key {key!r} expects a number, got {quote(value)}") from None
    if not math.isfinite(number):
        raise GPUError(f"{origin}: key {key!r} expects a finite number, got {quote(value)}")
    return number


def _coerce(origin: str, key: str, value: Any) -> Any:
    if key in _BOOLS:
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if not isinstance(value, bool):
            raise GPUError(f"{origin}: key {key!r} expects true or false, got {quote(value)}")
        return value
    if key in _STRINGS:
        if not isinstance(value, str):
            raise GPUError(f"{origin}: key {key!r} expects a string, got {quote(value)}")
        if len(value) > MAX_TEXT_CHARS:
            raise GPUError(
                f"{origin}: key {key!r} is {len(value):,} characters long; at most "
                f"{MAX_TEXT_CHARS:,} are accepted"
            )
        return value
    number = _number(origin, key, value)
    if key in _COUNTS:
        if not number.is_integer() or number < 0:
            raise GPUError(f"{origin}: key {key!r} must be an integer >= 0, got {quote(value)}")
        return int(number)
    if key in _SIZES:
        if not number.is_integer() or not 0 <= number <= MEMORY_RANGE[1]:
            raise GPUError(
                f"{origin}: key {key!r} must be an integer number of bytes in "
                f"0..{MEMORY_RANGE[1]:,}, got {quote(value)}"
            )
        return int(number)
    if key in _LATENCIES:
        if not 0.0 <= number <= MAX_LATENCY_S:
            raise GPUError(
                f"{origin}: key {key!r} must be in [0, {MAX_LATENCY_S:g}] seconds, "
                f"got {quote(value)}"
            )
        return number
    if key in _INTEGERS:
        if not number.is_integer() or number < 1:
            raise GPUError(f"{origin}: key {key!r} must be a positive integer, got {quote(value)}")
        low, high = MEMORY_RANGE if key.endswith("memory_bytes") else (1, MAX_COUNT)
        if not low <= number <= high:
            raise GPUError(
                f"{origin}: key {key!r} must be in {low:,}..{high:,}, got {quote(value)}"
            )
        return int(number)
    if key in _OVERLAPS or key in _OPTIONAL_FRACTIONS:
        if not 0.0 <= number <= 1.0:
            raise GPUError(f"{origin}: key {key!r} must be in [0, 1], got {quote(value)}")
        return number
    if key in _FRACTIONS:
        if not 0.0 < number <= 1.0:
            raise GPUError(f"{origin}: key {key!r} must be in (0, 1], got {quote(value)}")
        return number
    if key in _NON_NEGATIVE and number == 0:
        return 0.0
    if number <= 0:
        raise GPUError(f"{origin}: key {key!r} must be positive, got {quote(value)}")
    if number > MAX_RATE:
        raise GPUError(f"{origin}: key {key!r} must be at most {MAX_RATE:g}, got {quote(value)}")
    return number
