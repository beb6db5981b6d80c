"""Device memory as nvidia-smi shows it: the caching allocator's reserved peak plus what lives
outside that allocator.

nvidia-smi's "Memory-Usage" (NVML `nvmlDeviceGetMemoryInfo().used`) counts every byte the
driver has handed to the process, whoever asked for it. PyTorch's statistics
(torch.cuda.max_memory_reserved) count only the caching allocator's segments
(`model.allocator`). Beside them, per GPU:

- the CUDA context (`cuda_context_bytes`, a GPU file key): the driver's per-process state and
  the kernel modules loaded into it; all of PyTorch's, cuBLAS's and cuDNN's kernels under eager
  module loading (1,343 MiB on a V100 with CUDA 11.2, Hugging Face's "Model training anatomy"),
  only those a process calls under lazy loading (CUDA_MODULE_LOADING=LAZY, CUDA 11.7+, set by
  PyTorch since v1.13: pytorch/pytorch PR #86509 measured 287,047,680 bytes lazy against
  666,632,192 eager after one small tensor);
- NCCL's communicator buffers (`nccl_communicator_bytes`), which NCCL allocates itself with
  cudaMalloc/cuMem, not through PyTorch, once per communicator over the data-parallel ranks
  (two under DeepSpeed ZeRO-3: `data_parallel_communicators`);
- a paged bitsandbytes optimizer's states (`paged_optimizer_bytes`), CUDA unified memory that
  bitsandbytes allocates with cudaMallocManaged, resident on the device while it fits;
- torchtitan's asynchronous TP workspace (`model.async_tp.async_tp_workspace_bytes`), symmetric
  memory that PyTorch maps with cuMemCreate beside its caching allocator.

The cuBLAS workspaces are inside the caching allocator: PyTorch gives each (cuBLAS handle,
stream) pair a workspace from `c10::cuda::CUDACachingAllocator` (aten/src/ATen/cuda/
CublasHandlePool.cpp, `getNewWorkspace`, v2.1 onward; 8,519,680 bytes by default, 32 MiB on
compute capability 9.0, `parseChosenWorkspaceSize`), and cuDNN's convolution workspaces are
allocated through it too (aten/src/ATen/native/cudnn/Conv_v7.cpp, `Workspace`): both are in
the reserved peak, so no term here.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckplan.hardware.gpus import GPU
from ckplan.model import allocator
from ckplan.model.async_tp import async_tp_workspace_bytes
from ckplan.model.memory import trainable_tensors
from ckplan.model.optimizers import paged_state_bytes
from ckplan.model.spec import ModelSpec

MIB = 2**20
# NCCL at v2.19.3-1 (PyTorch 2.2's): src/include/device.h and src/init.cc
NCCL_STEPS = 8
NCCL_LL_BUFFSIZE = 8 * 512 * NCCL_STEPS * 16  # LL_LINES_PER_THREAD · LL_MAX_NTHREADS · 16 B lines
NCCL_LL128_BUFFSIZE = 120 * 640 * NCCL_STEPS * 8  # LL128_ELEMS_PER_THREAD · MAX_NTHREADS · 8 B
NCCL_SIMPLE_BUFFSIZE = 1 << 22  # DEFAULT_BUFFSIZE, NCCL_BUFFSIZE: 4 MiB
CUDA_IPC_MIN = 2 * MIB  # src/include/comm.h: each P2P connection's buffer is aligned to it
NCCL_CONNECTION_HEADER = 4096  # ncclSendMem / ncclRecvMem: one MEM_ALIGN page (comm.h)
NVLS_MEM_ALIGN_SIZE = 2 * MIB  # src/transport/nvls.cc


def _align(size: int, to: int) -> int:
    return -(-size // to) * to


def nccl_p2p_connection_bytes() -> int:
    """Device bytes of one P2P connection pair (receive from one peer, send to another) on one
    channel, on this GPU.

    NCCL v2.19.3-1, src/transport/p2p.cc: `p2pRecvSetup` allocates ncclRecvMem plus the
    buffer of every protocol (LL 512 KiB, LL128 4,915,200 B, Simple 4 MiB), but the Simple
    buffer when P2P read is on (Ampere and later over NVLink); `p2pSendSetup` allocates
    ncclSendMem plus the Simple buffer when read is on; each rounded up to CUDA_IPC_MIN (2 MiB).
    Read on: 6 MiB + 6 MiB; read off: 10 MiB + 2 MiB. Either way 12 MiB.
    """
    protocols = NCCL_LL_BUFFSIZE + NCCL_LL128_BUFFSIZE
    read = _align(NCCL_CONNECTION_HEADER + protocols, CUDA_IPC_MIN) + _align(
        NCCL_CONNECTION_HEADER + NCCL_SIMPLE_BUFFSIZE, CUDA_IPC_MIN
    )
    write = _align(NCCL_CONNECTION_HEADER + protocols + NCCL_SIMPLE_BUFFSIZE, CUDA_IPC_MIN)
    write += _align(NCCL_CONNECTION_HEADER, CUDA_IPC_MIN)
    return max(read, write)


def nccl_connections_per_channel(ranks: int) -> int:
    """Connection pairs one channel holds on the busiest GPU of a communicator of `ranks`.

    NCCL v2.19.3-1 connects every channel's ring and tree when the communicator is created
    (src/init.cc, `initTransportsRank`: "Connect with prev/next for each ring", "Connect
    Trees"), skipping a peer already connected on that channel (src/transport.cc,
    `ncclTransportP2pSetup`). The ring receives from the previous rank and sends to the next:
    one pair. Within a node the tree is a chain (src/graph/connect.cc, `ncclTopoPreset`:
    tree.up = treeIntra[i-1], tree.down[0] = treeIntra[i+1]), connected both ways, so a middle
    rank also receives from its next and sends to its previous neighbour. derived: one pair
    more than the ring on the busiest GPU beyond two ranks; none with two (the one peer is
    connected both ways by the ring already).
    """
    if ranks <= 1:
        return 0
    return 1 if ranks == 2 else 2


def nccl_nvls_bytes(nvls_channels: int, local_ranks: int) -> int:
    """Device bytes of NCCL's NVLink SHARP buffers on one GPU.

    NCCL v2.19.3-1, src/transport/nvls.cc: `ncclNvlsInit` sets NVLS up only with more than two
    GPUs on an NVSwitch (compute capability 9.0+, CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED);
    `ncclNvlsSetup` sizes nvlsTotalSize = nChannels · 2 · (buffSize + NVLS_MEM_ALIGN_SIZE) ·
    nHeads, with buffSize the Simple buffer (4 MiB) and nHeads the NVLS graph's channels, one per
    local GPU (src/graph/search.cc: "NVLS search must have ngpus heads at most"; intra-node it
    forces exactly ngpus), and `nvlsGroupBindMem` backs it with one cuMemCreate of that size on
    each GPU. 16 channels on 8 GPUs: 1.5 GiB.
    """
    if nvls_channels <= 0 or local_ranks <= 2:
        return 0
    return nvls_channels * 2 * (NCCL_SIMPLE_BUFFSIZE + NVLS_MEM_ALIGN_SIZE) * local_ranks


def nccl_communicator_bytes(ranks: int, gpu: GPU) -> int:
    """Device bytes NCCL holds on one GPU for a communicator over `ranks` GPUs: every channel's
    ring and tree connections (`nccl_connections_per_channel` · `nccl_p2p_connection_bytes`,
    `gpu.nccl_channels` channels) and, on an NVSwitch system, the NVLS buffers over the ranks on
    this GPU's node. 0 where the GPU file gives no channel count (not modelled).

    NCCL v2.19.3-1 sets all of it up when the communicator is created. From v2.22.3-1 NCCL
    connects at run time only what the collectives run use (src/init.cc, NCCL_RUNTIME_CONNECT
    default 1, with cuMem): the tree's connections and the NVLS buffers then come only with
    the algorithms that need them, and this figure is an upper bound. Across nodes the network
    transport's buffers are taken as the P2P ones.
    """
    if ranks <= 1 or gpu.nccl_channels <= 0:
        return 0
    p2p = gpu.nccl_channels * nccl_connections_per_channel(ranks) * nccl_p2p_connection_bytes()
    local = min(ranks, gpu.gpus_per_node)
    return p2p + nccl_nvls_bytes(gpu.nccl_nvls_channels, local)


def data_parallel_communicators(framework: str, zero: int, dp: int, tp: int, pp: int) -> int:
    """How many NCCL communicators a step runs over the same data-parallel ranks.

    None with one data-parallel rank (no data-parallel collective). Otherwise one, but two
    under DeepSpeed ZeRO-3 without model parallelism, as a transformers model runs it under
    the Trainer or accelerate (no `mpu`): deepspeedai/DeepSpeed v0.14.0 (the same lines at
    v0.13.1 and v0.16.4),
    deepspeed/runtime/zero/partition_parameters.py `Init.__init__` gives every parameter
    `ds_process_group = dist.get_world_group()` (torch.distributed.group.WORLD) when no
    data_parallel_group is passed, as transformers' model construction under ZeRO-3
    (src/transformers/modeling_utils.py, `deepspeed.zero.Init(config_dict_or_path=
    deepspeed_config())`, the same call in the 4.4x releases and v5.25) and
    parameter_offload.py `_convert_to_zero_parameters` (mpu None: group None) call it, so the
    parameters' all-gathers run on WORLD; the engine's ZeRO-3 optimizer reduce-scatters the
    gradients on `dp_process_group = groups._get_sequence_data_parallel_group()` (engine.py),
    which without an mpu is `_clone_world_group()` (deepspeed/utils/groups.py:
    `dist.new_group(ranks=range(dist.get_world_size()))`), a second process group over the same
    ranks with its own NCCL communicator (PyTorch's ProcessGroupNCCL creates one per group; a
    split one shares no buffers unless NCCL_COMM_SPLIT_SHARE_RESOURCES=1). Both run every
    step, so both hold their buffers at the peak. Megatron-DeepSpeed passes its mpu's
    data-parallel group to both; with tp or pp > 1 ckplan takes that case: one."""
    if dp <= 1:
        return 0
    if framework == "deepspeed" and zero == 3 and tp == 1 and pp == 1:
        return 2
    return 1


def data_parallel_nccl_bytes(spec: ModelSpec, gpu: GPU) -> int:
    """NCCL's buffers for the data-parallel communicators (gradient all-reduce, or ZeRO/FSDP's
    all-gather and reduce-scatter) over spec.dp GPUs, `data_parallel_communicators` of them.
    The tensor-, pipeline-, context- and expert-parallel groups' communicators are not
    counted."""
    communicators = data_parallel_communicators(
        spec.framework, spec.zero, spec.dp, spec.tp, spec.pp
    )
    return communicators * nccl_communicator_bytes(spec.dp, gpu)


def paged_optimizer_bytes(spec: ModelSpec) -> int:
    """A paged bitsandbytes optimizer's states, which PyTorch's caching allocator does not hold:
    bitsandbytes allocates them as unified memory (bitsandbytes/functional.py,
    `get_paged`: cudaMallocManaged through `cget_managed_ptr`), counted by nvidia-smi while
    resident (`optimizers.paged_state_bytes`; ZeRO 0 without pipeline parallelism, as the
    published runs that use it are)."""
    if spec.optimizer != "paged-adamw-8bit" or spec.zero or spec.pp > 1:
        return 0
    return paged_state_bytes(spec.optimizer, trainable_tensors(spec, 0))


@dataclass(frozen=True)
class DeviceMemory:
    """One GPU's memory as nvidia-smi shows it at the peak, by term."""

    reserved: int  # the caching allocator's reserved peak, within what the rest leaves it
    cuda_context: int
    nccl: int
    paged_optimizer: int
    symmetric_memory: int = 0  # torchtitan's async TP workspace

    @property
    def outside_allocator(self) -> int:
        return self.cuda_context + self.nccl + self.paged_optimizer + self.symmetric_memory

    @property
    def total(self) -> int:
        return self.reserved + self.outside_allocator


def device_memory(
    allocated: int, spec: ModelSpec, gpu: GPU, side_streams: int = 0, loss_cache: int = 0
) -> DeviceMemory:
    """nvidia-smi's used memory of one GPU whose allocated peak is `allocated` (paged optimizer
    states included, as ckplan's model states count them): the reserved peak of what the
    allocator holds (`allocator.reserved_within` with the side streams' pools and the loss's
    idle segments, capped by what the GPU leaves beside the terms outside it) plus those terms
    (module docstring)."""
    context = gpu.cuda_context_bytes
    nccl = data_parallel_nccl_bytes(spec, gpu)
    paged = paged_optimizer_bytes(spec)
    symmetric = async_tp_workspace_bytes(spec)
    available = gpu.memory_bytes - context - nccl - paged - symmetric
    reserved = allocator.reserved_within(
        allocated - paged, available, spec.expandable_segments, side_streams, loss_cache
    )
    return DeviceMemory(reserved, context, nccl, paged, symmetric)
