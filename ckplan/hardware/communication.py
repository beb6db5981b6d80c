"""Communication time: ring collectives and the collectives a training step runs.

Ring algorithms (Thakur, Rabenseifner & Gropp 2005, "Optimization of collective communication
operations in MPICH"; the bus-bandwidth convention of NCCL's nccl-tests, doc/PERFORMANCE.md):
for n ranks and a tensor of S bytes (the whole, gathered tensor), each rank sends and receives
  all-reduce                    2(n-1)/n · S
  all-gather, reduce-scatter     (n-1)/n · S
over its own link, so the time is that volume over the per-GPU bandwidth of one direction.
NCCL's own model adds a latency (src/graph/tuning.cc, ncclTopoTuneModel): baseLat once plus
hwLat per ring step, 2(n-1) steps for an all-reduce and n-1 for an all-gather or a
reduce-scatter, so one reduce-scatter plus one all-gather pays baseLat once more than the
all-reduce that moves the same bytes (`ring_latency_seconds`; the GPU file's
collective_latency_s and collective_step_latency_s, 0 where not given). The tensor-parallel
collectives add it (hardware.step_time); the data-parallel, expert-parallel, context-parallel
and pipeline transfers, megabytes to gigabytes on groups where NCCL may pick other algorithms,
are bandwidth alone.

A collective overlapped with a GEMM slows it (`overlapped`): its NCCL blocks hold SMs the GEMM
would use (roofline.contended_matmul_seconds, the GPU file's nccl_channels).

All-to-all (nccl-tests src/alltoall.cu, AlltoAllGetBw: bus bandwidth = algorithm bandwidth x
(n-1)/n): each rank holds S bytes split evenly over the n ranks and keeps its own 1/n, so
(n-1)/n · S leave it and as much arrive.

Which link: Megatron-LM orders ranks tensor-parallel fastest, then context-, data- and
pipeline-parallel (megatron/core/parallel_state.py, order "tp-cp-ep-dp-pp"), so a group of n
ranks with stride r spans n·r consecutive GPUs; it stays inside a node when n·r <=
gpus_per_node and uses the intra-node link, else the inter-node network (`group_bandwidth`).
The expert groups come from a second generator over the same GPUs with tp = etp, cp = 1 and
the same order (parallel_state.py, `expert_decoder_rank_generator`, "MoE Parallel Folding"):
an expert-parallel group is ep ranks etp apart, an expert-tensor-parallel group etp
consecutive ranks, an expert-data-parallel group ranks ep·etp apart.
"""

from __future__ import annotations

from ckplan.hardware.gpus import GPU


def all_reduce_seconds(size_bytes: float, ranks: int, bandwidth: float) -> float:
    """Ring all-reduce: a reduce-scatter and an all-gather, 2(n-1)/n · S per rank."""
    if ranks <= 1:
        return 0.0
    return 2 * (ranks - 1) / ranks * size_bytes / bandwidth


def all_gather_seconds(size_bytes: float, ranks: int, bandwidth: float) -> float:
    """Ring all-gather of a tensor of S bytes in total (S/n per rank): (n-1)/n · S per rank."""
    if ranks <= 1:
        return 0.0
    return (ranks - 1) / ranks * size_bytes / bandwidth


def reduce_scatter_seconds(size_bytes: float, ranks: int, bandwidth: float) -> float:
    """Ring reduce-scatter of S bytes into n shards: (n-1)/n · S per rank, as all-gather."""
    return all_gather_seconds(size_bytes, ranks, bandwidth)


def all_to_all_seconds(size_bytes: float, ranks: int, bandwidth: float) -> float:
    """All-to-all of S bytes per rank (S/n to each rank, itself included): (n-1)/n · S leave
    each rank over its link (nccl-tests' all-to-all bus bandwidth)."""
    if ranks <= 1:
        return 0.0
    return (ranks - 1) / ranks * size_bytes / bandwidth


def ranks_per_node(gpu: GPU, ranks: int, stride: int) -> int:
    """Members of a group of `ranks` GPUs, `stride` apart, that share one node (derived: the
    group spans ranks·stride consecutive GPUs; a node of G GPUs holds G/stride of them, at
    least one). All of them when the group fits in a node."""
    if ranks * stride <= gpu.gpus_per_node:
        return ranks
    return max(1, min(ranks, gpu.gpus_per_node // stride))


def hierarchical_all_to_all_seconds(size_bytes: float, ranks: int, stride: int, gpu: GPU) -> float:
    """All-to-all of S bytes per rank over a group that may span nodes (derived from
    `all_to_all_seconds`): of the (n-1)/n · S leaving a rank, (g-1)/n · S go to the g - 1
    members on its own node over the intra-node link and (n-g)/n · S to other nodes over the
    network, both at once (NCCL posts every peer's send together; NVLink and the NIC are
    separate paths), so the time is the slower of the two. Inside a node (g = n) it is the
    plain all-to-all on the link; across nodes the network share dominates."""
    if ranks <= 1:
        return 0.0
    local = ranks_per_node(gpu, ranks, stride)
    link = gpu.link_bytes_per_s * gpu.link_efficiency
    network = gpu.network_bytes_per_s * gpu.network_efficiency
    intra = (local - 1) / ranks * size_bytes / link
    inter = (ranks - local) / ranks * size_bytes / network
    return max(intra, inter)


def p2p_seconds(size_bytes: float, bandwidth: float) -> float:
    """One point-to-point send (pipeline stages): S bytes over the link."""
    return size_bytes / bandwidth


def group_bandwidth(gpu: GPU, ranks: int, stride: int) -> float:
    """Per-GPU bandwidth of one direction that a group of `ranks` GPUs, `stride` apart, gets:
    the intra-node link when the group fits in a node, else the inter-node network (a ring
    crossing nodes is paced by its slowest hop), each at its efficiency."""
    if ranks * stride <= gpu.gpus_per_node:
        return gpu.link_bytes_per_s * gpu.link_efficiency
    return gpu.network_bytes_per_s * gpu.network_efficiency


def exposed(comm_seconds: float, overlapped_compute_seconds: float) -> float:
    """Time a collective adds when it runs beside compute it can hide behind (derived:
    max(0, comm - compute); no slowdown of the compute is modelled)."""
    return max(0.0, comm_seconds - overlapped_compute_seconds)


def ring_latency_seconds(gpu: GPU, steps: int) -> float:
    """NCCL's latency of a ring collective of `steps` steps within a node (src/graph/tuning.cc:
    latency = baseLat + nsteps · hwLat; the ring, Simple protocol, NVLink figures are 8.4 us
    and 3.4 us per step): collective_latency_s + steps · collective_step_latency_s. 0 for no
    steps (one rank)."""
    if steps <= 0:
        return 0.0
    return gpu.collective_latency_s + steps * gpu.collective_step_latency_s


def all_reduce_latency(gpu: GPU, ranks: int) -> float:
    """A ring all-reduce's latency: 2(n-1) steps (a reduce-scatter then an all-gather)."""
    return ring_latency_seconds(gpu, 2 * (ranks - 1))


def all_gather_latency(gpu: GPU, ranks: int) -> float:
    """A ring all-gather's or reduce-scatter's latency: n-1 steps. Two of them pay
    collective_latency_s once more than one all-reduce."""
    return ring_latency_seconds(gpu, ranks - 1)


def overlapped(comm_seconds: float, gemm_seconds: float, contended_gemm_seconds: float) -> float:
    """Seconds a collective adds to the GEMM it runs beside (derived). While it runs, the GEMM
    proceeds at gemm / contended of its speed (its SMs shared, roofline.
    contended_matmul_seconds). If the collective outlasts the contended GEMM, the pair takes
    the collective's time: it adds comm - gemm. Else the GEMM does comm / contended of its
    work meanwhile and the rest at full speed, comm + (1 - comm / contended) · gemm in all: it
    adds comm · (1 - gemm / contended). Without contention (contended = gemm) this is
    `exposed`."""
    if comm_seconds >= contended_gemm_seconds:
        return comm_seconds - gemm_seconds
    return comm_seconds * (1 - gemm_seconds / contended_gemm_seconds)
