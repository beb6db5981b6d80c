"""torchtitan's asynchronous tensor parallelism (`tp_comm_overlap` under `framework:
torchtitan`): the memory it holds beside plain sequence-parallel TP.

torchtitan turns it on in `apply_tp` (torchtitan/parallelisms/parallelize_llama.py at 9dec370,
`enable_async_tp`): `torch._inductor.config._micro_pipeline_tp = True` and
`enable_symm_mem_for_group` on the TP group; it refuses it without `training.compile`
("Async TP requires --training.compile"). Micro-pipelining is an Inductor pass
(torch/_inductor/fx_passes/micro_pipeline_tp.py), so it rewrites only what torch.compile
compiles, which at that commit is each TransformerBlock (`apply_compile`): the output layer and
the loss run as eager DTensor ops under both variants. In the blocks it replaces each
all-gather along the sequence followed by matmuls with `symm_mem.fused_all_gather_(scaled_)
matmul` and each matmul followed by a reduce-scatter along the sequence with
`symm_mem.fused_(scaled_)matmul_reduce_scatter`.

What those fused ops allocate (torch/distributed/_symmetric_memory/__init__.py of the v2.6 line,
December 2024; the same size rules in v2.13.0):

- through the caching allocator, the tensors the unfused graph has too: the gathered input
  (`ag_out`, a view of it returned) and each matmul's output, or the whole un-reduced product
  (`stacked_partials`) and its reduction; so no term of the allocated peak changes;
- outside it, one workspace per TP group (`get_symm_mem_workspace`), grown to the largest
  request and kept: `_SymmetricMemory.empty_strided_p2p`, which
  torch/csrc/distributed/c10d/CUDASymmetricMemory.cu (`CUDASymmetricMemoryAllocator::alloc`)
  backs with `cuMemCreate`, not the caching allocator. torch.cuda.memory_stats' reserved and
  allocated bytes do not count it; nvidia-smi does (`hardware.device_memory`).
"""

from __future__ import annotations

MIB = 2**20
# CUDASymmetricMemory.cu (v2.6 line; CUDASymmetricMemoryTypes.hpp later): the signal pad placed
# after each rank's buffer, `signal_pad_size`
SIGNAL_PAD_BYTES = 2048
# `alloc` rounds the block up to cuMemGetAllocationGranularity(CU_MEM_ALLOC_GRANULARITY_
# RECOMMENDED), a driver figure: taken as 2 MiB, the granularity of the cuMem allocations
# elsewhere in ckplan (NCCL's NVLS_MEM_ALIGN_SIZE, hardware.device_memory)
CUMEM_GRANULARITY = 2 * MIB
FLOAT8_BYTES = 1


def uses_async_tp(framework: str, tp: int, sp: bool, tp_comm_overlap: bool, kernels: str) -> bool:
    """Whether a step runs torchtitan's asynchronous TP: torchtitan, TP over more than one rank
    with sequence parallelism (its TP plan always shards the norms over the sequence),
    `tp_comm_overlap`, and compiled blocks (torchtitan refuses async TP without compile)."""
    return framework == "torchtitan" and tp > 1 and sp and tp_comm_overlap and kernels == "compiled"


def workspace_request_bytes(
    tokens: int, hidden: int, tp: int, gather_bytes: int, output_bytes: int
) -> int:
    """The largest symmetric-memory workspace a TransformerBlock's fused ops ask for, for
    `tokens` tokens of a micro-batch (b·s/cp) of width `hidden` over `tp` ranks.

    torch/distributed/_symmetric_memory/__init__.py (v2.6 line; the same in v2.13.0):
    `_pipelined_all_gather_and_consume` asks for the shard, `shard.numel() *
    shard.element_size()`; every all-gather in a block gathers a (b, s/t, h) shard (the
    attention's and the feed-forward's input, and in the backward the row-parallel layers'
    output gradient), `gather_bytes` an element. `_pipelined_produce_and_all2all` asks for two
    chunks of the un-reduced product, `out_chunks[0].numel() * out_chunks[0].element_size() * 2`
    (one for the remote rank to pull step i from while step i+1 is computed); every
    reduce-scatter in a block scatters a (b·s, h) product (wo's and w2's output, and in the
    backward the column-parallel layers' input gradient), so a chunk is (b·s/t, h) of
    `output_bytes` (the matmul's output dtype). The workspace grows to the larger of the two
    and is not shrunk (`get_symm_mem_workspace` re-allocates only for a larger request)."""
    shard = (tokens // tp) * hidden
    return max(shard * gather_bytes, 2 * shard * output_bytes)


def workspace_allocation_bytes(request: int) -> int:
    """The device bytes `cuMemCreate` maps for a workspace request: the request rounded up to
    16 bytes, the signal pad after it, rounded up to the allocation granularity
    (torch/csrc/distributed/c10d/CUDASymmetricMemory.cu, v2.6 line,
    `CUDASymmetricMemoryAllocator::alloc`: `signal_pad_offset = at::round_up(size, 16UL)`,
    `block_size = signal_pad_offset + signal_pad_size`, `at::round_up(block_size,
    granularity)`). 0 for no request."""
    if request <= 0:
        return 0
    block = -(-request // 16) * 16 + SIGNAL_PAD_BYTES
    return -(-block // CUMEM_GRANULARITY) * CUMEM_GRANULARITY


def async_tp_workspace_bytes(spec) -> int:
    """Device bytes of async TP's symmetric-memory workspace on one GPU (0 without async TP,
    `uses_async_tp`): `workspace_allocation_bytes` of `workspace_request_bytes` at the run's
    micro-batch. Under torchao's float8 at torchtitan 9dec370 (`precision: float8`) the
    gathered inputs are float8, one byte an element (`PrepareFloat8ModuleInput` and
    `Float8ColwiseParallel` cast before the redistribute, torchao/float8/
    float8_tensor_parallel.py at eab345c); the products are in the model's dtype
    (`_scaled_mm` with out_dtype the high-precision input's). Outside the caching allocator."""
    if not uses_async_tp(spec.framework, spec.tp, spec.sp, spec.tp_comm_overlap, spec.kernels):
        return 0
    tokens = (spec.seq // spec.cp) * spec.micro_batch
    gather = FLOAT8_BYTES if spec.precision == "float8" else spec.dtype_bytes
    request = workspace_request_bytes(tokens, spec.hidden, spec.tp, gather, spec.dtype_bytes)
    return workspace_allocation_bytes(request)
