"""PyTorch's CUDA caching allocator: the reserved peak beside the allocated one.

Frameworks report `torch.cuda.max_memory_reserved` and a run runs out of memory when the
allocator cannot reserve more, so a budget is checked against the reserved peak. The allocator
(c10/cuda/CUDACachingAllocator.cpp) rounds every large request up to 2 MiB (kRoundLarge) and
packs requests of 1-10 MiB into 20 MiB blocks; freed blocks stay reserved, and blocks that
cannot be split or merged for the next request's size leave gaps (fragmentation), so the
reserved peak exceeds the allocated one by a share that depends on the run's pattern of
allocations: 1.13 at a Megatron-LM run's peak (NVIDIA/Megatron-LM PR #5662's sample, max
allocated 5,670 MB, max reserved 6,406 MB), 1.39 in a 2020 log (NVIDIA/Megatron-LM issue #60). With
`expandable_segments` (PYTORCH_CUDA_ALLOC_CONF) one segment per stream and pool grows in pages
instead ("Note [Expandable Segments]"), and the gaps mostly go.

ckplan models the reserved peak as the allocated peak times (1 + slack), rounded up to 2 MiB,
plus what one pattern leaves that a share cannot follow: the segments the eager loss's blocks
reserve beyond its allocated peak (`eager_loss_cached_bytes`). Each of the loss's logit-sized
requests (gigabytes) gets a segment of its own; at the backward's peak the B-byte logits'
segment is cached but too small for any request then made, and under transformers v4.44.0's
shifted copy of the logits the slice's backward needs one more 4L segment: 2·L bytes beyond the
allocated peak, 6·L with the copy, L the logits on the GPU
(validation/loss_allocator_replay.py replays the recorded allocations through
validation/caching_allocator.py, the allocator's rules in Python). Later
requests are smaller than those segments and take them split (`get_free_block` takes the
smallest cached block that fits, `should_split` splits any block with more than 1 MiB left while
`max_split_size` is unlimited, its default), so the recomputed layers' backward reserves
nothing more; the segments stay reserved from step to step and each step's loss finds its own.
The slack, one per allocator mode, is fitted on measurements (validation/fit_allocator.py): the
calibration set is the twelve steps validation/device/measure_plans.py ran on an H200 with torch
2.11 (none, full, selective, sac, offload and LoRA on a Llama-like model with the eager loss,
each with the default allocator and with expandable segments), where reserved and allocated were
both measured; the slack is the median over the six plans of (reserved - loss cache) /
allocated - 1 (the estimator chosen before fitting, so the offload plan's pinned copies, +20 %
and +15 %, do not pull it). The loss cache of those steps (500 MiB, 2·L) is most of what they
reserve beyond their allocated peak (542-875 MiB but offload's). Residuals -2.7 to +2.7 %
(default) but offload's.

With expandable segments a stream's blocks share one segment that grows at its end, and the
eager loss leaves one block idle at its peak (`expandable_eager_loss_idle_bytes`): the B-byte
logits', which the forward frees after the upcast while every later request of the loss is a
4L one it cannot hold. The loss cache there is that block, B·L bytes, in every eager form (the
shifted copy's blocks merge with their neighbours and add nothing). Whole steps replayed with
FSDP2's streams show it at their allocated peak (validation/fsdp2_tp_allocator_replay.py,
`--streams`: Llama 3 8B, FSDP 8, 8192 tokens, eager loss: 1.96 GiB idle on the default stream
at batch 1, 3.91 GiB at batch 2, each its bf16 logits, plus 0.08-0.55 GiB), and with the loss
compiled, which frees no logit-sized block before a larger request, the default stream holds
only 0.10-0.46 GiB beyond its allocated bytes. So the slack is fitted over that block: the
median over the six plans of (reserved - B·L) / allocated - 1, residuals -0.4 to +0.9 % but
sac's -5.4 % (its 204 MiB beyond the peak are under the 500 MiB block: there it merged with a
free neighbour and served a larger request) and offload's +4.9 %. Fitted with no loss cache (a
slack of 7.15 %), the slack carried the loss's block as a share of the allocated peak, 2-5 GiB
at 30-70 GiB peaks, whether the loss left it or not: torchao's B200 rows (the loss compiled)
came out 5-7 % high while its H100 rows (eager) fitted. The pages are 2 MiB (small pool) and
20 MiB (large pool, kLargeBuffer), and the address space a segment reserves (1 1/8 of the
GPU's memory) is virtual ("Note [Expandable Segments]", `ExpandableSegment`, c10/cuda/
CUDACachingAllocator.cpp at 001074d2): under 20 MiB a pool, not the GPU's memory size.
The published reserved peaks (validation/runs/) are its test set; docs/memory.md gives their
errors.

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
MIN_BLOCK_SIZE = 512  # kMinBlockSize: every request is rounded up to a multiple of it
SMALL_SIZE = 2**20  # kSmallSize: the largest request of the small pool
LARGE_BUFFER = 20 * 2**20  # kLargeBuffer: the segment of a request of 1-10 MiB
MIN_LARGE_ALLOC = 10 * 2**20  # kMinLargeAlloc
FP32_BYTES = 4
# fitted: validation/fit_allocator.py (module docstring); `--check` compares them with the fit
ALLOCATOR_SLACK = 0.0317
EXPANDABLE_SLACK = 0.0168


def slack(expandable_segments: bool) -> float:
    return EXPANDABLE_SLACK if expandable_segments else ALLOCATOR_SLACK


def reserved_bytes(
    allocated: int, expandable_segments: bool = False, side_streams: int = 0, loss_cache: int = 0
) -> int:
    """The reserved peak of an allocated peak: allocated · (1 + slack), rounded up to 2 MiB;
    plus `side_streams`, the blocks other streams' pools hold (a cached block serves only the
    stream that allocated it: ckplan.model.frameworks `fsdp2_stream_pool_bytes`), rounded up
    to 2 MiB; plus `loss_cache`, the segments the loss's blocks leave idle at the peak
    (`eager_loss_cached_bytes`, ckplan.model.loss `loss_cached_bytes`)."""
    side = -(-max(side_streams, 0) // ROUND_LARGE) * ROUND_LARGE + max(loss_cache, 0)
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
    allocated: int,
    available: int,
    expandable_segments: bool = False,
    side_streams: int = 0,
    loss_cache: int = 0,
) -> int:
    """The reserved peak of an allocated peak when the allocator may hold at most `available`
    bytes: its slack, the side streams' pools and the loss's idle segments shrink to what is
    left, as it releases its cache rather than fail (module docstring); never below the
    allocated peak's own blocks."""
    budgeted = budgeted_bytes(allocated)
    reserved = reserved_bytes(allocated, expandable_segments, side_streams, loss_cache)
    return max(budgeted, min(reserved, available))


def segment_bytes(request: int) -> int:
    """The segment cudaMalloc reserves for a request no cached block fits: the request rounded
    up to 512 bytes (`round_size`), then `get_allocation_size` (2 MiB for a small request,
    kLargeBuffer below kMinLargeAlloc, else a multiple of kRoundLarge); c10/cuda/
    CUDACachingAllocator.cpp (pytorch/pytorch at 001074d2 and at eb42ad6e, the same rules)."""
    size = max(MIN_BLOCK_SIZE, -(-request // MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE)
    if size <= SMALL_SIZE:
        return 2 * SMALL_SIZE
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


def expandable_eager_loss_idle_bytes(logits: int, logits_bytes: int) -> int:
    """The reserved bytes beyond the allocated peak that PyTorch's eager cross-entropy on upcast
    logits leaves idle with expandable segments: the `logits_bytes`-byte logits' own block,
    B·L rounded to 512 bytes (`round_size`), for logits narrower than fp32; nothing for fp32
    logits, which `.float()` does not copy (derived: the loss's blocks replayed through
    c10/cuda/CUDACachingAllocator.cpp's rules with expandable segments, pytorch/pytorch at
    001074d2: `get_free_block`, `try_allocate_expandable_block`, `try_merge_blocks`;
    validation/loss_allocator_replay.py `--expandable` agrees).

    The forward frees the logits once upcast (`.float()`'s backward needs no input); the
    log-probabilities and the backward's gradients are 4L requests, larger than the freed block,
    so best fit passes it by and the segment maps pages at its end, fusing a free block that
    ends there into the new one. With transformers v4.44.0's shifted copy the copy's and the
    upcast's blocks are neighbours in the one segment, merge and serve the slice's 4L gradient,
    so the copy leaves nothing idle, unlike the default allocator's separate segments
    (`eager_loss_cached_bytes`). The block could merge with free neighbours the layers left
    and then serve a 4L request; the replays of whole steps did not show it (module
    docstring)."""
    if logits <= 0 or logits_bytes >= FP32_BYTES:
        return 0
    return -(-logits_bytes * logits // MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE


def eager_loss_cached_bytes(logits: int, logits_bytes: int, shifted: int = 0) -> int:
    """The reserved bytes beyond the allocated peak that PyTorch's eager cross-entropy on
    upcast logits leaves in the default allocator's cache (derived: the loss's blocks replayed
    through c10/cuda/CUDACachingAllocator.cpp's rules, `segment_bytes`; validation/
    loss_allocator_replay.py replays the recorded allocations and frees and agrees).

    `logits` elements in `logits_bytes`-byte values; `shifted` the elements of a shifted fp32
    copy (`logits[..., :-1, :].contiguous()`, transformers v4.44.0's LlamaForCausalLM), 0
    where there is none (transformers 5.25's ForCausalLMLoss shifts the labels; torchtitan).

    Every block is a segment of its own, since nothing cached before the loss is as large
    (`get_free_block` takes the smallest cached block at least the request's size; none here),
    and no segment is released (memory to spare), so the reserved peak is all of them. The
    forward reserves the B-byte logits (B·L), their fp32 upcast (4L) and the log-probabilities
    (4L), and frees all but the log-probabilities before the backward. There the
    log-probabilities' gradient takes the upcast's segment, and the logits' gradient, made
    while both are alive, fits no cached block (the B-byte logits' is too small): a new 4L
    segment. The allocated peak is those three 4L blocks, the reserved peak one B·L segment
    more. With fp32 logits `.float()` copies nothing: nothing more.

    With the shifted copy the copy and the log-probabilities are 4L' each; the backward's two
    4L' gradients take the copy's segment and the upcast's (split, `should_split`), and the
    slice's backward then asks for a zero-filled 4L gradient of the whole logits, which the
    4L' segments miss by 4·b·V bytes unless the 2 MiB rounding covers that: one more 4L
    segment (validation/loss_allocator_replay.py: 6.01·L for bf16 logits at b = 8, 4.01·L for
    fp32). Under pressure the allocator frees these segments before it fails (module
    docstring)."""
    if logits <= 0:
        return 0
    idle = segment_bytes(logits_bytes * logits) if logits_bytes < FP32_BYTES else 0
    if shifted and segment_bytes(FP32_BYTES * shifted) < segment_bytes(FP32_BYTES * logits):
        idle += segment_bytes(FP32_BYTES * logits)
    return idle
