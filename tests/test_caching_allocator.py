"""PyTorch's caching allocator replayed (validation/caching_allocator.py) on hand cases, the eager
loss's allocations through it (validation/loss_allocator_replay.py) against ckplan's
`eager_loss_cached_bytes` and, with expandable segments, `expandable_eager_loss_idle_bytes`, and
the loss cache in the reserved peak."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ckplan.model import allocator
from ckplan.model.loss import (
    logits_elements,
    loss_cached_bytes,
    output_forward_workspace_bytes,
    output_saved_bytes,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "validation"))
from caching_allocator import CachingAllocator, allocation_size, round_size

MIB = 2**20


def test_requests_round_to_512_bytes_and_segments_by_size():
    """`round_size` and `get_allocation_size`: 2 MiB for small requests, 20 MiB below 10 MiB,
    else the request in 2 MiB steps."""
    assert round_size(1) == 512 and round_size(1000) == 1024 and round_size(1024) == 1024
    assert allocation_size(MIB) == 2 * MIB
    assert allocation_size(MIB + 512) == 20 * MIB
    assert allocation_size(10 * MIB - 512) == 20 * MIB
    assert allocation_size(10 * MIB) == 10 * MIB
    assert allocation_size(100 * MIB + 512) == 102 * MIB
    for request in (1, MIB, MIB + 1, 10 * MIB, 100 * MIB + 1, 3 * 2**30 + 7):
        assert allocator.segment_bytes(request) == allocation_size(round_size(request))


def test_small_large_requests_share_a_20_mib_segment():
    """Two 5 MiB requests: one 20 MiB segment, the second from its split remainder."""
    cache = CachingAllocator()
    first, second = cache.malloc(5 * MIB), cache.malloc(5 * MIB)
    assert cache.reserved == 20 * MIB and cache.segments == 1
    assert first.size == second.size == 5 * MIB and cache.cached() == [10 * MIB]
    cache.free(first)
    cache.free(second)
    assert cache.cached() == [20 * MIB] and cache.allocated == 0


def test_best_fit_takes_the_smallest_cached_block_and_splits_it():
    """`get_free_block`: a 90 MiB request takes the 100 MiB block, not the 200 MiB one, and
    splits it (10 MiB left, over 1 MiB)."""
    cache = CachingAllocator()
    small, large = cache.malloc(100 * MIB), cache.malloc(200 * MIB)
    cache.free(small)
    cache.free(large)
    block = cache.malloc(90 * MIB)
    assert block.size == 90 * MIB and cache.reserved == 300 * MIB
    assert cache.cached() == [10 * MIB, 200 * MIB]


def test_a_remainder_of_1_mib_or_less_is_not_split():
    """`should_split` in the large pool: remainder > kSmallSize only; the whole block counts
    as allocated."""
    cache = CachingAllocator()
    cache.free(cache.malloc(100 * MIB))
    block = cache.malloc(99 * MIB)
    assert block.size == 100 * MIB and cache.allocated == 100 * MIB and cache.cached() == []


def test_segments_never_merge_but_blocks_in_one_do():
    """Two free 100 MiB segments do not make room for 150 MiB (a new segment); the halves of
    one 200 MiB segment merge back when both are freed."""
    cache = CachingAllocator()
    one, two = cache.malloc(100 * MIB), cache.malloc(100 * MIB)
    cache.free(one)
    cache.free(two)
    cache.malloc(150 * MIB)
    assert cache.reserved == 350 * MIB and cache.segments == 3
    cache = CachingAllocator()
    cache.free(cache.malloc(200 * MIB))
    halves = [cache.malloc(100 * MIB), cache.malloc(100 * MIB)]
    assert cache.cached() == []
    for half in halves:
        cache.free(half)
    assert cache.cached() == [200 * MIB]
    cache.malloc(200 * MIB)
    assert cache.reserved == 200 * MIB


def test_empty_cache_releases_whole_free_segments_only():
    """A 100 MiB segment freed whole goes back; one whose first 40 MiB is still allocated
    stays reserved with its free 60 MiB (`release_blocks` frees non-split blocks)."""
    cache = CachingAllocator()
    whole = cache.malloc(100 * MIB)
    split = cache.malloc(100 * MIB)
    cache.free(split)
    kept = cache.malloc(40 * MIB)  # best fit: the second segment's start, 60 MiB left free
    cache.free(whole)
    assert cache.reserved == 200 * MIB and cache.allocated == 40 * MIB
    cache.empty_cache()
    assert cache.reserved == 100 * MIB and cache.segments == 1
    assert cache.cached() == [60 * MIB]
    cache.free(kept)
    cache.empty_cache()
    assert cache.reserved == 0 and cache.cached() == []


def test_max_split_size_keeps_oversize_blocks_whole():
    """With max_split_size set, a request under it takes no oversize block, and a request over
    it takes no block kLargeBuffer larger than itself."""
    cache = CachingAllocator(max_split_size=64 * MIB)
    cache.free(cache.malloc(200 * MIB))
    cache.malloc(50 * MIB)  # may not take the 200 MiB block
    assert cache.reserved == 250 * MIB
    cache.malloc(150 * MIB)  # 200 >= 150 + 20: a new segment too
    assert cache.reserved == 400 * MIB
    cache.malloc(190 * MIB)  # within 20 MiB: the cached 200 MiB block, whole
    assert cache.reserved == 400 * MIB and cache.allocated == (50 + 150 + 200) * MIB


def test_the_eager_loss_by_hand_through_the_rules():
    """The modern eager loss's blocks at Llama 3 8B's shapes (L = 8·1024·128256), allocated and
    freed in its order: 2L logits, 4L upcast, 4L log-probabilities; the logits and the upcast
    freed; the backward's two 4L gradients. The 2L segment is idle at the peak."""
    L = 8 * 1024 * 128256
    cache = CachingAllocator()
    logits, upcast, logprobs = cache.malloc(2 * L), cache.malloc(4 * L), cache.malloc(4 * L)
    cache.free(upcast)
    cache.free(logits)
    gradient = cache.malloc(4 * L)  # the upcast's segment
    assert cache.segments == 3
    cache.malloc(4 * L)  # the 2L segment is too small: a new one
    assert cache.peak_reserved - cache.peak_allocated == allocator.segment_bytes(2 * L)
    cache.free(gradient)
    cache.free(logprobs)
    # smaller requests of the rest of the backward split the cached segments: nothing new
    reserved = cache.reserved
    layer_blocks = [cache.malloc(8192 * 14336 * 2) for _ in range(20)]
    assert cache.reserved == reserved and len(layer_blocks) == 20


def test_eager_loss_cached_bytes_by_hand():
    """2L's segment; with the shifted copy one more 4L segment when the copy's segments fall
    short of 4L; for fp32 logits only that one."""
    L = 8 * 1024 * 128256
    shifted = 8 * 1023 * 128256
    seg = allocator.segment_bytes
    assert allocator.eager_loss_cached_bytes(L, 2) == seg(2 * L)
    assert allocator.eager_loss_cached_bytes(L, 2, shifted) == seg(2 * L) + seg(4 * L)
    assert allocator.eager_loss_cached_bytes(L, 4) == 0
    assert allocator.eager_loss_cached_bytes(L, 4, shifted) == seg(4 * L)
    assert allocator.eager_loss_cached_bytes(0, 2) == 0
    # one sequence of 8192: 4·V = 513,024 bytes short, which the 2 MiB rounding covers
    single = 8192 * 128256
    assert seg(4 * 8191 * 128256) == seg(4 * single)
    assert allocator.eager_loss_cached_bytes(single, 2, 8191 * 128256) == seg(2 * single)


@pytest.mark.parametrize(
    ("batch", "seq", "hidden", "vocab"),
    [
        (8, 1024, 4096, 128256),
        (8, 2048, 4096, 128256),
        (2, 4096, 2048, 32000),
        (1, 8192, 64, 128256),
    ],
)
def test_the_recorded_loss_replayed_agrees_with_the_closed_form(batch, seq, hidden, vocab):
    """The three eager forms recorded at full size on the meta device and replayed: the reserved
    bytes beyond the allocated peak are ckplan's loss cache, plus the small pool's 2 MiB
    segment and the labels' blocks (under 8 MiB)."""
    from needs_torch import torch_or_skip

    torch_or_skip()
    import loss_allocator_replay as replay

    L = batch * seq * vocab
    for form in replay.FORMS:
        cache = replay.replayed(form, batch, seq, hidden, vocab)
        beyond = cache.peak_reserved - cache.peak_allocated
        shifted = batch * (seq - 1) * vocab if form == "transformers-4.44" else 0
        closed = allocator.eager_loss_cached_bytes(L, 2, shifted)
        assert 0 <= beyond - closed < 8 * MIB, form
        # and the loss's own allocated peak is 12L (the tape's 4L and the backward's 8L)
        assert abs(cache.peak_allocated - replay.REST - 12 * L) < 0.01 * L


def test_fp32_logits_replayed_agree_with_the_closed_form():
    """fp32 logits: `.float()` copies nothing; only the shifted copy's 4L segment remains."""
    from needs_torch import torch_or_skip

    torch = torch_or_skip()
    import loss_allocator_replay as replay

    batch, seq, vocab = 8, 1024, 128256
    L = batch * seq * vocab
    for form in replay.FORMS:
        cache = replay.replayed(form, batch, seq, 64, vocab, torch.float32)
        shifted = batch * (seq - 1) * vocab if form == "transformers-4.44" else 0
        closed = allocator.eager_loss_cached_bytes(L, 4, shifted)
        assert 0 <= cache.peak_reserved - cache.peak_allocated - closed < 8 * MIB, form


def test_expandable_eager_loss_idle_bytes_by_hand():
    """With expandable segments: the B-byte logits' block, B·L to 512 bytes; none for fp32."""
    L = 8 * 1024 * 128256
    assert allocator.expandable_eager_loss_idle_bytes(L, 2) == 2 * L  # a multiple of 512
    assert allocator.expandable_eager_loss_idle_bytes(1001, 2) == 2048
    assert allocator.expandable_eager_loss_idle_bytes(L, 4) == 0
    assert allocator.expandable_eager_loss_idle_bytes(0, 2) == 0


@pytest.mark.parametrize(
    ("batch", "seq", "hidden", "vocab"),
    [(1, 8192, 4096, 128256), (2, 4096, 2048, 32000), (8, 1024, 64, 128256)],
)
def test_the_recorded_loss_replayed_with_expandable_segments_agrees(batch, seq, hidden, vocab):
    """The three eager forms through the rules with expandable segments: the reserved bytes
    beyond the allocated peak are the bf16 logits' block, plus at most a 20 MiB large-pool
    page and the small pool's 2 MiB one, the shifted copy's form included; for fp32 logits
    only the pages."""
    from needs_torch import torch_or_skip

    torch = torch_or_skip()
    import loss_allocator_replay as replay

    L = batch * seq * vocab
    for dtype, size in ((torch.bfloat16, 2), (torch.float32, 4)):
        for form in replay.FORMS:
            grown = replay.replayed(form, batch, seq, hidden, vocab, dtype, True)
            beyond = grown.peak_reserved - grown.peak_allocated
            closed = allocator.expandable_eager_loss_idle_bytes(L, size)
            assert 0 <= beyond - closed < 24 * MIB, (form, size)


def test_loss_cached_bytes_by_spec(spec_of):
    """The loss cache by framework release, allocator mode, tensor parallelism and stage."""
    seg = allocator.segment_bytes
    hf = spec_of("llama3-8b", framework="hf", loss="eager", seq=1024, micro_batch=8)
    L = logits_elements(hf)
    assert L == 8 * 1024 * 128256
    assert loss_cached_bytes(hf) == seg(2 * L)  # 5.25: the labels shifted
    old = spec_of(
        "llama3-8b", framework="hf", framework_version="4.44", loss="eager", seq=1024,
        micro_batch=8,
    )  # fmt: skip
    assert loss_cached_bytes(old) == seg(2 * L) + seg(4 * L)
    titan = spec_of("llama3-8b", framework="torchtitan", loss="eager", seq=1024, micro_batch=8)
    # expandable segments: the bf16 logits' block alone
    assert titan.expandable_segments and loss_cached_bytes(titan) == 2 * L
    expandable_old = spec_of(
        "llama3-8b", framework="hf", framework_version="4.44", loss="eager", seq=1024,
        micro_batch=8, expandable_segments=True,
    )  # fmt: skip
    assert loss_cached_bytes(expandable_old) == 2 * L  # the shifted copy merges: nothing more
    titan_parallel = spec_of("llama3-8b", framework="torchtitan", loss="eager", tp=8, sp=True)
    assert titan_parallel.expandable_segments
    assert loss_cached_bytes(titan_parallel) == 2 * logits_elements(titan_parallel)
    assert logits_elements(titan_parallel) * 8 == logits_elements(
        spec_of("llama3-8b", framework="torchtitan", loss="eager")
    )
    compiled = spec_of("llama3-8b", framework="torchtitan", loss="compiled")
    assert compiled.expandable_segments and loss_cached_bytes(compiled) == 0
    default = spec_of(
        "llama3-8b", framework="torchtitan", loss="eager", seq=1024, micro_batch=8,
        expandable_segments=False,
    )  # fmt: skip
    assert loss_cached_bytes(default) == seg(2 * L)
    parallel = spec_of(
        "llama3-8b", framework="torchtitan", loss="eager", tp=8, sp=True,
        expandable_segments=False,
    )  # fmt: skip
    assert loss_cached_bytes(parallel) == 0
    assert loss_cached_bytes(spec_of("llama3-8b", loss="fused")) == 0
    staged = spec_of("llama3-8b", loss="eager", pp=4)
    assert loss_cached_bytes(staged, 0) == 0
    assert loss_cached_bytes(staged, 3) == loss_cached_bytes(staged) > 0


def test_the_shifted_copy_in_the_forward(spec_of):
    """transformers v4.44.0's forward holds the fp32 logits, their shifted copy and the saved
    log-probabilities (validation/hf_llama_loss_bytes.py: 12.1·L at small shapes)."""
    old = spec_of(
        "llama3-8b", framework="hf", framework_version="4.44", loss="eager", seq=1024,
        micro_batch=8,
    )  # fmt: skip
    new = spec_of("llama3-8b", framework="hf", loss="eager", seq=1024, micro_batch=8)
    L, shifted = 8 * 1024 * 128256, 8 * 1023 * 128256
    X = 2 * 8 * 1024 * 4096
    assert output_forward_workspace_bytes(new) == output_saved_bytes(new) - X + 6 * L
    assert output_forward_workspace_bytes(old) == output_saved_bytes(old) - X + 4 * (L + shifted)
    # a transformers model that the Trainer hands to DeepSpeed runs the same loss
    for version, hf in (("4.44", old), ("5.25", new)):
        deepspeed = spec_of(
            "llama3-8b", framework="deepspeed", framework_version=version, loss="eager",
            seq=1024, micro_batch=8,
        )  # fmt: skip
        assert output_forward_workspace_bytes(deepspeed) == output_forward_workspace_bytes(hf)


def test_the_reserved_peak_adds_the_loss_cache():
    gib = 2**30
    base = allocator.reserved_bytes(10 * gib)
    assert allocator.reserved_bytes(10 * gib, loss_cache=4 * gib) == base + 4 * gib
    assert allocator.reserved_within(10 * gib, 12 * gib, loss_cache=4 * gib) == 12 * gib


def test_a_block_freed_on_one_stream_serves_only_that_stream():
    """`get_free_block` searches the pool by (stream, size) and fails on another stream's block:
    a side stream's freed segment stays reserved beside the default stream's new one, and serves
    the side stream's next request."""
    cache = CachingAllocator()
    side = cache.malloc(100 * MIB, stream=1)
    cache.free(side)
    default = cache.malloc(100 * MIB)
    assert default.stream == 0 and cache.segments == 2 and cache.reserved == 200 * MIB
    assert cache.reserved_by_stream == {1: 100 * MIB, 0: 100 * MIB}
    assert cache.cached(1) == [100 * MIB] and cache.cached(0) == []
    again = cache.malloc(60 * MIB, stream=1)  # the side stream's own block, split
    assert again.address == side.address and cache.segments == 2
    assert cache.cached(1) == [40 * MIB]
    assert cache.allocated_by_stream == {1: 60 * MIB, 0: 100 * MIB}
