"""PyTorch's caching allocator with expandable segments replayed in Python
(validation/caching_allocator.py `ExpandableAllocator`) on hand cases: pages mapped at the
pool's end in 20 MiB (large pool) and 2 MiB (small pool) steps, a free block at the end fused
into the growth, best fit before growth, splits at any remainder of 512 bytes or more."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "validation"))
from caching_allocator import CachingAllocator, ExpandableAllocator, replay

MIB = 2**20


def test_growth_maps_whole_20_mib_pages():
    """One 30 MiB request maps two 20 MiB pages; the 10 MiB left is a free block at the end."""
    allocator = replay([("alloc", 1, 30 * MIB)], ExpandableAllocator())
    assert allocator.reserved == 40 * MIB
    assert allocator.allocated == 30 * MIB
    assert allocator.cached() == [10 * MIB]


def test_a_free_block_at_the_end_joins_the_growth():
    """100 MiB, 50 MiB (60 mapped, 10 free at the end), the 100 MiB freed, then 120 MiB: no free
    block fits, so the pool grows by what the 10 MiB at its end lacks, 110 MiB in 20 MiB pages
    (120); a 30 MiB request then takes the 100 MiB hole (best fit), split."""
    events = [
        ("alloc", 1, 100 * MIB),
        ("alloc", 2, 50 * MIB),
        ("free", 1, 0),
        ("alloc", 3, 120 * MIB),
        ("alloc", 4, 30 * MIB),
    ]
    allocator = replay(events, ExpandableAllocator())
    assert allocator.reserved == (100 + 60 + 120) * MIB
    assert allocator.peak_allocated == (50 + 120 + 30) * MIB
    assert sorted(allocator.cached()) == [10 * MIB, 70 * MIB]


def test_the_default_allocator_keeps_segments_apart():
    """The same events without expandable segments: the 120 MiB request gets a segment of its
    own (the freed 100 MiB one is too small, segments never merge), and the 50 MiB request's
    segment keeps no remainder worth splitting."""
    events = [
        ("alloc", 1, 100 * MIB),
        ("alloc", 2, 50 * MIB),
        ("free", 1, 0),
        ("alloc", 3, 120 * MIB),
    ]
    allocator = replay(events, CachingAllocator())
    assert allocator.reserved == (100 + 50 + 120) * MIB


def test_neighbours_merge_and_the_merged_end_grows():
    """Two adjacent blocks freed merge into one; freed at the end they are the start of the next
    growth, so a request of their sum plus 5 MiB maps one page more."""
    events = [
        ("alloc", 1, 40 * MIB),
        ("alloc", 2, 40 * MIB),
        ("free", 1, 0),
        ("free", 2, 0),
    ]
    allocator = replay(events, ExpandableAllocator())
    assert allocator.cached() == [80 * MIB]
    replay([("alloc", 3, 85 * MIB)], allocator)
    assert allocator.reserved == 100 * MIB
    assert allocator.cached() == [15 * MIB]


def test_small_requests_have_their_own_pool_in_2_mib_pages():
    """Requests of at most 1 MiB grow the small pool by 2 MiB pages, apart from the large one;
    a small block splits at 512 bytes."""
    allocator = replay([("alloc", 1, 1000), ("alloc", 2, 30 * MIB)], ExpandableAllocator())
    assert allocator.mapped_end == {True: 2 * MIB, False: 40 * MIB}
    assert allocator.reserved == 42 * MIB
    assert allocator.allocated == 1024 + 30 * MIB
