"""The link between a GPU and its host's memory, as activation offloading uses it.

A tape offloaded to host memory crosses the GPU's host link twice (device to host after its
forward, host to device before its backward) on the copy engines, beside the compute stream
(ckplan.schedules.offload). The GPU file gives the link's datasheet rate
(``host_bytes_per_s``, one direction), the share of it a bulk copy reaches
(``host_link_efficiency``), how many GPUs share it (``gpus_per_host_link``: GPUs behind one
PCIe switch uplink copy at once, as every GPU of a data-parallel group runs the same schedule)
and the node's host memory (``host_memory_bytes``).
"""

from __future__ import annotations

from collections.abc import Sequence

from ckplan.hardware.gpus import GPU


def host_link_bytes_per_second(gpu: GPU) -> float:
    """Effective host-link bytes per second of one GPU, one direction, while every GPU copies.

    derived: datasheet rate x efficiency / GPUs sharing the link. The datasheet rates: PCIe 4.0
    x16 is 16 GT/s x 16 lanes x 128/130 (line code) / 8 = 31.5 GB/s a direction (PCI-SIG PCIe
    4.0 base specification; NVIDIA datasheets round it to "64 GB/s" both directions), PCIe 5.0
    x16 twice that, NVLink-C2C on GH200 450 GB/s a direction (NVIDIA GH200 Grace Hopper
    Superchip datasheet: 900 GB/s both directions). The default efficiency 0.8 is assumed: TLP
    headers at 256-byte payloads leave about 0.91 of the line rate, flow control and completion
    traffic some more; measure it with cuda-samples' bandwidthTest (pinned memory) and set
    ``host_link_efficiency``.
    """
    return gpu.host_bytes_per_s * gpu.host_link_efficiency / gpu.gpus_per_host_link


def host_memory_per_gpu(gpu: GPU) -> int:
    """Host bytes one GPU's offloaded tapes may pin: the node's host memory over its GPUs.

    derived: the GPUs of a node share its host memory evenly (one process per GPU); offloaded
    tapes live in pinned (page-locked) buffers, which the budget counts whole.
    """
    return gpu.host_memory_bytes // gpu.gpus_per_node


def copy_seconds(nbytes: int, gpu: GPU) -> float:
    """Seconds one copy of ``nbytes`` takes over the GPU's host link.

    derived: bytes / effective rate (:func:`host_link_bytes_per_second`); no per-copy latency
    (a layer's tape is megabytes, a copy's launch microseconds).
    """
    return nbytes / host_link_bytes_per_second(gpu)


def exposed_copy_seconds(
    forward_seconds: Sequence[float],
    backward_seconds: Sequence[float],
    offloaded: Sequence[tuple[int, int]],
    gpu: GPU,
    prefetch: Sequence[int] | None = None,
) -> float:
    """Exposed seconds of one micro-batch's offloads: for each offloaded ``(stage i, bytes)``,
    the copy to host overlaps the forward of stage ``i + 1``, the copy back the backward of
    stage ``prefetch[k]`` (default ``i + 1``; a segment's checkpointed input comes back beside
    the backward of the stage after the segment), each exposing ``max(0, copy - compute)``.

    derived: ckplan.schedules.offload (rules O1, O2, their checkpointed-input form and
    ``exposed_transfer``), with the copy time of :func:`copy_seconds` and the stage times of
    the time model.
    """
    total = 0.0
    for k, (stage, nbytes) in enumerate(offloaded):
        copy = copy_seconds(nbytes, gpu)
        back = stage + 1 if prefetch is None else prefetch[k]
        total += max(0.0, copy - forward_seconds[stage + 1])
        total += max(0.0, copy - backward_seconds[back])
    return total
