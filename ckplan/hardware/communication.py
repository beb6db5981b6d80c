"""Communication time: ring collectives and the collectives a training step runs.

Ring algorithms (Thakur, Rabenseifner & Gropp 2005, "Optimization of collective communication
operations in MPICH"; the bus-bandwidth convention of NCCL's nccl-tests, doc/PERFORMANCE.md):
for n ranks and a tensor of S bytes (the whole, gathered tensor), each rank sends and receives
  all-reduce                    2(n-1)/n · S
  all-gather, reduce-scatter     (n-1)/n · S
over its own link, so the time is that volume over the per-GPU bandwidth of one direction. The
latency terms (n steps of a few microseconds) are left out: they matter only for small messages.

Which link: Megatron-LM orders ranks tensor-parallel fastest, then context-, data- and
pipeline-parallel (megatron/core/parallel_state.py, order "tp-cp-ep-dp-pp"), so a group of n
ranks with stride r spans n·r consecutive GPUs; it stays inside a node when n·r <=
gpus_per_node and uses the intra-node link, else the inter-node network (`group_bandwidth`).
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
