"""Time of one op on one GPU: the roofline model, op by op from the op table.

Roofline (Williams, Waterman & Patterson 2009, "Roofline: an insightful visual performance model
for multicore architectures"): a kernel takes max(FLOPs / attainable FLOP/s, bytes moved /
attainable bandwidth). Attainable = datasheet x efficiency (the GPU file's keys).

- GEMMs (`Op.matmul`): FLOPs at bf16_flops x matmul_efficiency x `shape_efficiency`, bytes =
  both operands and the result. The backward of a GEMM is two products of the same FLOPs, the
  input gradient (m x n) @ (n x k) and the weight gradient (k x m) @ (m x n) (Korthikanti App. A);
  an op whose backward FLOPs exceed twice its forward re-runs the forward product (the NumPy MLP).
- Element-wise and reduction kernels (`Op.forward_bytes`, `backward_bytes`): memory-bound, bytes
  at hbm_bytes_per_s x memory_efficiency. Standard attention's softmax, mask and dropout are here.
- A fused kernel (`Op.fused_kernel`, flash attention): one kernel, its FLOPs at bf16_flops x
  flash_attention_efficiency, or its bytes, whichever is slower; the separate kernels around it
  (`Op.side_bytes`) are memory-bound. Causal masking skips the blocks
  above the diagonal (Dao 2023, FlashAttention-2 §3.1), so it executes half the FLOPs the op
  table counts (the table counts the full s², as Korthikanti's model FLOPs do).
- An op with FLOPs but no shape (an op table entry without `matmul`) is timed at
  matmul_efficiency alone, so new ops work before they describe their shapes.

The shape curve (`shape_efficiency`) follows NVIDIA's "Matrix Multiplication Background User's
Guide" (DU-09799-001, 2023), §3 Dimension Quantization Effects: a GEMM is computed in output
tiles (tile_m x tile_n; cuBLAS's most efficient on A100/H100 is 256 x 128, §2.3), one thread
block per tile, `sm_count` tiles at a time. Tile quantisation: partial tiles at the edges do full
work, so the useful fraction is m·n / (tiles x tile area). Wave quantisation: the last wave of
tiles leaves SMs idle, so SM utilisation is tiles / (waves x sm_count). Small and skinny GEMMs
(few tiles, or a dimension far below a tile) fall far below peak; large, tile-aligned ones reach
matmul_efficiency, which is measured on such shapes (the MAMF figures the GPU files cite). The
memory side of the roofline covers the rest: a GEMM with a small inner dimension k is
memory-bound (attention's QKᵀ with k = d = 128 on an A100).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

from ckplan.hardware.gpus import GPU
from ckplan.model.op import Matmul, Op

CAUSAL_FRACTION = 0.5  # the share of the s x s score blocks a causal flash kernel computes
FP32_BYTES = 4


class OpTime(NamedTuple):
    """Seconds of an op split by kind: GEMMs and fused compute kernels, memory-bound kernels."""

    matmul: float
    memory: float

    @property
    def total(self) -> float:
        return self.matmul + self.memory


def _tile_efficiency(gpu: GPU, m: int, n: int, batch: int, tile_m: int, tile_n: int) -> float:
    tiles = batch * math.ceil(m / tile_m) * math.ceil(n / tile_n)
    useful = batch * m * n / (tiles * tile_m * tile_n)  # tile quantisation
    waves = math.ceil(tiles / gpu.sm_count)
    return useful * tiles / (waves * gpu.sm_count)  # wave quantisation


def shape_efficiency(gpu: GPU, m: int, n: int, batch: int = 1) -> float:
    """Fraction of a GEMM's tile work that is useful and of the SMs kept busy, for an (m x n)
    output in tiles of tile_m x tile_n (either orientation, the better one; when the output is
    narrower than tile_m, also the square tile_n x tile_n: the guide §2.3 has cuBLAS pick
    smaller tiles for small outputs, larger ones, which reuse more data, for large outputs):
    NVIDIA's Matrix Multiplication Background guide §3.1-3.2, derived above. 1.0 for large
    tile-aligned shapes. E.g. A100 (108 SMs, 256 x 128): m = n = 8192 gives 2048 tiles in 19
    waves, 0.998; one 128 x 128 output keeps 1 SM of 108 busy."""
    shapes = [(gpu.tile_m, gpu.tile_n), (gpu.tile_n, gpu.tile_m)]
    if min(m, n) < gpu.tile_m:
        shapes.append((gpu.tile_n, gpu.tile_n))
    return max(_tile_efficiency(gpu, m, n, batch, *tile) for tile in shapes)


def peak_flops(gpu: GPU, dtype_bytes: int) -> float:
    """Tensor-core BF16/FP16 peak for 2-byte operands, the FP32 (non-tensor) peak for 4 or 8.

    4-byte GEMMs (precision fp32) take no TF32 tensor cores: PyTorch's
    `torch.backends.cuda.matmul.allow_tf32` "defaults to False in PyTorch 1.12 and later"
    (pytorch/pytorch docs/source/notes/cuda.rst, "TensorFloat-32 (TF32) on Ampere (and later)
    devices"), and the Hugging Face Trainer's `tf32` argument leaves it to PyTorch unless set
    (transformers training_args.py at v5.25, `tf32: bool | None`, default None; torch 2.13 on
    the CPU prints allow_tf32 False). A run that turns TF32 on runs its GEMMs faster than
    ckplan times them."""
    return gpu.bf16_flops if dtype_bytes <= 2 else gpu.fp32_flops


def memory_seconds(gpu: GPU, moved_bytes: int) -> float:
    """A memory-bound kernel: bytes read and written / (bandwidth x memory_efficiency)."""
    return moved_bytes / (gpu.hbm_bytes_per_s * gpu.memory_efficiency)


def matmul_seconds(gpu: GPU, matmul: Matmul, sms_taken: int = 0) -> float:
    """Roofline of one (batched) GEMM: max(2·m·n·k·batch / (peak x matmul_efficiency x
    shape_efficiency), (m·k + k·n + m·n)·batch·B / (bandwidth x memory_efficiency)).

    `sms_taken` SMs held by another kernel (a collective's blocks, `contended_matmul_seconds`)
    leave the GEMM sm_count - sms_taken of them: its compute side takes sm_count / (sm_count -
    sms_taken) times as long (derived: the rate is per SM; the wave term stays the whole GPU's,
    as the SMs come back when the other kernel ends), its memory side is unchanged."""
    m, n, k, batch = matmul.m, matmul.n, matmul.k, matmul.batch
    flops = 2 * m * n * k * batch
    rate = peak_flops(gpu, matmul.dtype_bytes) * gpu.matmul_efficiency
    compute = flops / (rate * shape_efficiency(gpu, m, n, batch))
    compute *= gpu.sm_count / (gpu.sm_count - sms_taken)
    moved = (m * k + k * n + m * n) * batch * matmul.dtype_bytes
    return max(compute, memory_seconds(gpu, moved))


def contended_matmul_seconds(gpu: GPU, matmul: Matmul) -> float:
    """The GEMM while a collective runs beside it: NCCL runs one CUDA block per channel
    (NCCL docs, NCCL_MIN_NCHANNELS: more channels "uses more CUDA compute resources"), launched
    first (Megatron-LM delays the GEMM "to have all-reduce scheduled first and have GPU
    resources allocated"), and a large-tile GEMM block cannot share an SM with one (256 threads
    at up to 255 registers each fill an SM's 64K-register file), so the GEMM has sm_count -
    nccl_channels SMs. E.g. A100 (108 SMs, 24 channels): 108/84 = 1.29x on its compute side."""
    return matmul_seconds(gpu, matmul, gpu.nccl_channels)


def backward_matmuls(matmul: Matmul) -> tuple[Matmul, Matmul]:
    """The two products of a GEMM's backward: the input gradient dY·Wᵀ, (m x n)(n x k), and the
    weight gradient Xᵀ·dY, (k x m)(m x n) (derived; each has the forward's FLOPs)."""
    m, n, k, batch, dtype = matmul.m, matmul.n, matmul.k, matmul.batch, matmul.dtype_bytes
    return Matmul(m, k, n, batch, dtype), Matmul(k, n, m, batch, dtype)


def row_chunk_seconds(gpu: GPU, matmul: Matmul, chunks: int) -> float:
    """A GEMM run as `chunks` GEMMs one after another, each on 1/chunks of its rows (m): the
    micro-pipelined products of torchtitan's async TP (`code_path.CodePath.tp_chunks`), each
    with its own tile and wave quantisation and its own read of the weight. The rows split as
    torch.chunk splits them: chunks of ceil(m / chunks) rows, the last one shorter (fewer
    chunks where m is small). Derived; 1 chunk is `matmul_seconds`."""
    if chunks == 1:
        return matmul_seconds(gpu, matmul)
    size = -(-matmul.m // chunks)
    whole, rest = divmod(matmul.m, size)
    seconds = whole * matmul_seconds(gpu, dataclasses.replace(matmul, m=size))
    if rest:
        seconds += matmul_seconds(gpu, dataclasses.replace(matmul, m=rest))
    return seconds


def _flops_seconds(gpu: GPU, flops: int, dtype_bytes: int, efficiency: float) -> float:
    return flops / (peak_flops(gpu, dtype_bytes) * efficiency)


def op_forward_time(op: Op, gpu: GPU, dtype_bytes: int = 2, row_chunks: int = 1) -> OpTime:
    """One op's forward: its GEMM (or fused kernel) and its memory-bound kernels; the GEMM in
    `row_chunks` row chunks (`row_chunk_seconds`)."""
    if op.fused_kernel:
        compute = _flops_seconds(
            gpu, CAUSAL_FRACTION * op.forward_flops, dtype_bytes, gpu.flash_attention_efficiency
        )
        side = memory_seconds(gpu, op.side_bytes[0])
        return OpTime(max(compute, memory_seconds(gpu, op.forward_bytes)), side)
    if op.matmul is not None:
        gemm = row_chunk_seconds(gpu, op.matmul, row_chunks)
    else:
        gemm = _flops_seconds(gpu, op.forward_flops, dtype_bytes, gpu.matmul_efficiency)
    return OpTime(gemm, memory_seconds(gpu, op.forward_bytes))


def op_backward_time(op: Op, gpu: GPU, dtype_bytes: int = 2, row_chunks: int = 1) -> OpTime:
    """One op's backward: the two transposed products of its GEMM (plus forward re-runs where
    its backward FLOPs exceed twice the forward's; the input gradient's alone where they are
    below, a frozen weight's, ckplan.model.finetune), or its fused kernel, and its memory-bound
    kernels; the input gradient's product in `row_chunks` row chunks (`row_chunk_seconds`), the
    weight gradient's whole."""
    if op.fused_kernel:
        compute = _flops_seconds(
            gpu, CAUSAL_FRACTION * op.backward_flops, dtype_bytes, gpu.flash_attention_efficiency
        )
        side = memory_seconds(gpu, op.side_bytes[1])
        return OpTime(max(compute, memory_seconds(gpu, op.backward_bytes)), side)
    if op.matmul is not None:
        products = backward_matmuls(op.matmul)
        if op.backward_flops < 2 * op.forward_flops:  # a frozen weight: no weight gradient
            products = products[:1]
        gemm = row_chunk_seconds(gpu, products[0], row_chunks)
        gemm += sum(matmul_seconds(gpu, product) for product in products[1:])
        if op.forward_flops and op.backward_flops > 2 * op.forward_flops:
            reruns = (op.backward_flops - 2 * op.forward_flops) / op.forward_flops
            gemm += reruns * matmul_seconds(gpu, op.matmul)
    else:
        gemm = _flops_seconds(gpu, op.backward_flops, dtype_bytes, gpu.matmul_efficiency)
    return OpTime(gemm, memory_seconds(gpu, op.backward_bytes))
