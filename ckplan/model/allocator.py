"""PyTorch's CUDA caching allocator: the reserved peak beside the allocated one.

Frameworks report `torch.cuda.max_memory_reserved` and a run runs out of memory when the
allocator cannot reserve more, so a budget is checked against the reserved peak. The allocator
(c10/cuda/CUDACachingAllocator.cpp) rounds every large request up to 2 MiB (kRoundLarge) and
packs requests of 1-10 MiB into 20 MiB blocks; freed blocks stay reserved, and blocks that
cannot be split or merged for the next request's size leave gaps (fragmentation), so the
reserved peak exceeds the allocated one by a share that depends on the run's pattern of
allocations: 1.13 at a Megatron-LM run's peak (NVIDIA/Megatron-LM PR #5662's sample, max
allocated 5,670 MB, max reserved 6,406 MB), 1.39 in a 2020 log (NVIDIA/Megatron-LM issue #60). With
`expandable_segments` (PYTORCH_CUDA_ALLOC_CONF) one segment per stream grows in 2 MiB pages
instead ("Note [Expandable Segments]"), and the gaps mostly go.

ckplan models the reserved peak as the allocated peak times (1 + slack), rounded up to 2 MiB,
with one slack per allocator mode fitted on measurements (validation/fit_allocator.py): the
calibration set is the twelve steps validation/device/measure_plans.py ran on an H200 with torch
2.11 (none, full, selective, sac, offload and LoRA on a Llama-like model, each with the default
allocator and with expandable segments), where reserved and allocated were both measured; the
slack is the median over the six plans of reserved / allocated - 1 (the estimator chosen before
fitting, so the offload plan's pinned copies, +28 % and +15 %, do not pull it). Residuals -3.0 to
+5.1 % (default) and -4.6 to +2.7 % (expandable) but offload's. The published reserved peaks
(validation/runs/) are its test set; docs/memory.md gives their errors.

That slack is what the allocator holds while it has memory to spare. Under pressure it frees
its cached blocks and retries before it fails (CUDACachingAllocator.cpp, `malloc`:
`release_available_cached_blocks`, then `release_cached_blocks`, then out of memory), so a run
fails only when its live blocks do not fit: the budget is checked against the allocated peak in
whole 2 MiB blocks (`budgeted_bytes`), and the fragmentation the allocator cannot release (split
blocks of live segments) is part of the reserve. Published runs agree: NeMo's H100 runs ran at
allocated peaks 2-6 GiB under the 79.2 GiB CUDA reports, where the slack would need 6-7 GiB.
"""

from __future__ import annotations

import math

ROUND_LARGE = 2 * 2**20  # kRoundLarge: large blocks are multiples of 2 MiB
# fitted: validation/fit_allocator.py (module docstring); `--check` compares them with the fit
ALLOCATOR_SLACK = 0.0863
EXPANDABLE_SLACK = 0.0715


def slack(expandable_segments: bool) -> float:
    return EXPANDABLE_SLACK if expandable_segments else ALLOCATOR_SLACK


def reserved_bytes(allocated: int, expandable_segments: bool = False, side_streams: int = 0) -> int:
    """The reserved peak of an allocated peak: allocated · (1 + slack), rounded up to 2 MiB;
    plus `side_streams`, the blocks other streams' pools hold (a cached block serves only the
    stream that allocated it: ckplan.model.frameworks `fsdp2_stream_pool_bytes`), rounded up
    to 2 MiB."""
    side = -(-max(side_streams, 0) // ROUND_LARGE) * ROUND_LARGE
    if allocated <= 0:
        return side
    grown = math.ceil(allocated * (1 + slack(expandable_segments)))
    return -(-grown // ROUND_LARGE) * ROUND_LARGE + side


def budgeted_bytes(allocated: int) -> int:
    """What an allocated peak takes of the usable memory: its 2 MiB blocks (module docstring:
    the allocator releases its cache under pressure before it fails)."""
    if allocated <= 0:
        return 0
    return -(-allocated // ROUND_LARGE) * ROUND_LARGE


def allocatable_bytes(usable: int) -> int:
    """The largest allocated peak whose budgeted bytes fit in `usable` bytes."""
    if usable <= 0:
        return usable
    return (usable // ROUND_LARGE) * ROUND_LARGE


def reserved_within(
    allocated: int, available: int, expandable_segments: bool = False, side_streams: int = 0
) -> int:
    """The reserved peak of an allocated peak when the allocator may hold at most `available`
    bytes: its slack and the side streams' pools shrink to what is left, as it releases its
    cache rather than fail (module docstring); never below the allocated peak's own blocks."""
    budgeted = budgeted_bytes(allocated)
    reserved = reserved_bytes(allocated, expandable_segments, side_streams)
    return max(budgeted, min(reserved, available))
