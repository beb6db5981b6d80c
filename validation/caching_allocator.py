"""PyTorch's CUDA caching allocator, its default mode, replayed in pure Python.

The rules are c10/cuda/CUDACachingAllocator.cpp's (pytorch/pytorch, read at 001074d2 and at
the older eb42ad6e, whose constants, `round_size`, `get_allocation_size`, `get_free_block`,
`should_split`, `alloc_found_block`, `free_block` and `try_merge_blocks` are the same; the
v2.4.0 tag of August 2024 itself was not read):

- a request is rounded up to a multiple of 512 bytes (`round_size`, kMinBlockSize; the
  `roundup_power2_divisions` option unset);
- requests of at most 1 MiB (kSmallSize) come from the small pool, others from the large pool;
  each pool keeps its free blocks ordered by size, then address (`BlockComparatorSize`);
- a request takes the smallest free block of its pool at least its size (`get_free_block`:
  `pool.blocks.lower_bound`); with `max_split_size` set, a request under it takes no block of
  that size or more, and a request of it or more takes no block kLargeBuffer larger than itself;
- when no free block fits, the allocator reserves a new segment (`alloc_block`: cudaMalloc of
  `get_allocation_size`): 2 MiB (kSmallBuffer) for a small request, 20 MiB (kLargeBuffer) for
  one under 10 MiB (kMinLargeAlloc), else the request rounded up to 2 MiB (kRoundLarge);
- the block found is split when the remainder is worth keeping (`should_split`): in the small
  pool a remainder of 512 bytes or more, in the large pool one over 1 MiB when the request is
  under `max_split_size` (unlimited by default, `CUDAAllocatorConfig`); the request takes the
  block's start and the remainder stays free in the pool;
- a freed block merges with free neighbours of its own segment (`free_block`,
  `try_merge_blocks`); segments never merge with each other;
- the allocated statistic counts each block's size, the reserved one each segment's; a segment
  goes back to CUDA only under pressure (`release_available_cached_blocks`,
  `release_cached_blocks` after a failed cudaMalloc) or on `empty_cache`; the replay models a
  device with memory to spare, where reserved only grows, but where a trace calls
  torch.cuda.empty_cache `CachingAllocator.empty_cache` gives its rule.

Streams: every block belongs to the stream whose request made its segment (`Block::stream`,
`alloc_block`), and a request takes only a free block of its own stream: the pools are ordered
by (stream, size, address) (`BlockComparatorSize` compares `stream_uid` first) and
`get_free_block` fails when the block `lower_bound` finds belongs to another stream (`(*it)->stream
!= p.stream()`); a freed block goes back to its own stream's pool whichever stream frees it, and
merges only within its segment, so a segment never serves two streams. `malloc` takes the
stream (0, the default stream, unless told). No CUDA graphs, no `record_stream` (FSDP2 keeps its
buffers alive instead: torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py);
`ExpandableAllocator` below replays the rules with expandable segments, one stream.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

MIN_BLOCK_SIZE = 512  # kMinBlockSize
SMALL_SIZE = 1 << 20  # kSmallSize: the largest small request
SMALL_BUFFER = 2 << 20  # kSmallBuffer: a small pool's segment
LARGE_BUFFER = 20 << 20  # kLargeBuffer: the segment of a 1-10 MiB request
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc: requests below it share kLargeBuffer segments
ROUND_LARGE = 2 << 20  # kRoundLarge: a large segment is a multiple of 2 MiB
UNLIMITED = 2**64 - 1  # max_split_size's default: std::numeric_limits<size_t>::max()


def round_size(size: int) -> int:
    """`round_size`: at least 512 bytes, a multiple of 512."""
    return max(MIN_BLOCK_SIZE, -(-size // MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE)


def allocation_size(size: int) -> int:
    """`get_allocation_size`: the segment cudaMalloc reserves for a rounded request no free block
    fits."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@dataclass(eq=False)
class Block:
    address: int
    size: int
    small: bool
    allocated: bool = False
    stream: int = 0
    prev: Block | None = None
    next: Block | None = None

    def key(self) -> tuple[int, int]:
        return (self.size, self.address)


def absorb(block: Block, neighbour: Block) -> None:
    """`merge_blocks`: a freed block takes in its free neighbour in the segment (the one before
    or after it), its address, its link and its size."""
    if neighbour is block.prev:
        block.address = neighbour.address
        block.prev = neighbour.prev
        if block.prev:
            block.prev.next = block
    else:
        block.next = neighbour.next
        if block.next:
            block.next.prev = block
    block.size += neighbour.size


@dataclass
class CachingAllocator:
    """The device allocator's state: free blocks per pool, live blocks, the two statistics."""

    max_split_size: int = UNLIMITED
    # (stream, small) -> the free blocks, by (size, address)
    free_blocks: dict[tuple[int, bool], list[tuple[int, int, Block]]] = field(default_factory=dict)
    allocated: int = 0
    reserved: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0
    segments: int = 0
    next_address: int = 0
    reserved_by_stream: dict[int, int] = field(default_factory=dict)
    allocated_by_stream: dict[int, int] = field(default_factory=dict)

    def _pool(self, stream: int, small: bool) -> list[tuple[int, int, Block]]:
        return self.free_blocks.setdefault((stream, small), [])

    def _insert(self, block: Block) -> None:
        bisect.insort(self._pool(block.stream, block.small), (block.size, block.address, block))

    def _remove(self, block: Block) -> None:
        pool = self._pool(block.stream, block.small)
        index = bisect.bisect_left(pool, (block.size, block.address))
        assert pool[index][2] is block
        del pool[index]

    def _free_block_for(self, size: int, small: bool, stream: int = 0) -> Block | None:
        """`get_free_block`: the smallest free block of the stream's pool of at least `size`
        (then lowest address), with the oversize rules of `max_split_size`."""
        pool = self._pool(stream, small)
        index = bisect.bisect_left(pool, (size, -1))
        if index == len(pool):
            return None
        block = pool[index][2]
        if size < self.max_split_size <= block.size:
            return None
        if size >= self.max_split_size and block.size >= size + LARGE_BUFFER:
            return None
        self._remove(block)
        return block

    def _new_segment(self, size: int, small: bool, stream: int = 0) -> Block:
        """`alloc_block`: cudaMalloc of `allocation_size`; the segment is one free block of the
        requesting stream."""
        segment = allocation_size(size)
        block = Block(self.next_address, segment, small, stream=stream)
        self.next_address += segment
        self.reserved += segment
        self.reserved_by_stream[stream] = self.reserved_by_stream.get(stream, 0) + segment
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        self.segments += 1
        return block

    def _should_split(self, block: Block, size: int) -> bool:
        """`should_split`."""
        remaining = block.size - size
        if block.small:
            return remaining >= MIN_BLOCK_SIZE
        return size < self.max_split_size and remaining > SMALL_SIZE

    def malloc(self, requested: int, stream: int = 0) -> Block:
        """`malloc`: a block for `requested` bytes on `stream` (its size is what `allocated`
        counts)."""
        size = round_size(requested)
        small = size <= SMALL_SIZE
        block = self._free_block_for(size, small, stream) or self._new_segment(size, small, stream)
        if self._should_split(block, size):  # `alloc_found_block`: the request takes the start
            remaining = Block(
                block.address + size, block.size - size, small, prev=block, stream=block.stream
            )
            remaining.next = block.next
            if block.next:
                block.next.prev = remaining
            block.next = remaining
            block.size = size
            self._insert(remaining)
        block.allocated = True
        self.allocated += block.size
        self.allocated_by_stream[block.stream] = (
            self.allocated_by_stream.get(block.stream, 0) + block.size
        )
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block

    def free(self, block: Block) -> None:
        """`free_block`: merge with free neighbours in the segment (`try_merge_blocks`), cache
        in the block's own stream's pool."""
        assert block.allocated
        block.allocated = False
        self.allocated -= block.size
        self.allocated_by_stream[block.stream] -= block.size
        for neighbour in (block.prev, block.next):
            if neighbour is None or neighbour.allocated:
                continue
            self._remove(neighbour)
            absorb(block, neighbour)
        self._insert(block)

    def reset_peaks(self) -> None:
        """`resetPeakStats`: the peaks restart from the current values."""
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

    def empty_cache(self) -> None:
        """`emptyCache` -> `release_cached_blocks` -> `release_blocks` on every pool: a free
        block that is a whole segment (no neighbour before or after it, "non-split") goes back
        to CUDA (`release_block`); a segment holding any allocated block stays reserved, its
        free parts with it."""
        for pool in self.free_blocks.values():
            for size, _address, block in list(pool):
                if block.prev is None and block.next is None:
                    self._remove(block)
                    self.reserved -= size
                    self.reserved_by_stream[block.stream] -= size
                    self.segments -= 1

    def cached(self, stream: int | None = None) -> list[int]:
        """The free blocks' sizes in the large pools (of `stream`, or of every stream), smallest
        first."""
        return sorted(
            size
            for (owner, small), pool in self.free_blocks.items()
            if not small and stream in (None, owner)
            for size, _, _ in pool
        )


def replay(events: list[tuple[str, int, int]], allocator: CachingAllocator | None = None):
    """Run a trace of ("alloc", key, bytes) and ("free", key, 0) events; returns the allocator."""
    allocator = allocator or CachingAllocator()
    live: dict[int, Block] = {}
    for kind, key, size in events:
        if kind == "alloc":
            live[key] = allocator.malloc(size)
        else:
            allocator.free(live.pop(key))
    return allocator


@dataclass
class ExpandableAllocator:
    """The allocator with `expandable_segments:True` (PYTORCH_CUDA_ALLOC_CONF; torchtitan's
    run_llama_train.sh sets it), one stream, its rules from c10/cuda/CUDACachingAllocator.cpp
    ("Note [Expandable Segments]", `get_free_block`, `should_split`,
    `find_expandable_block`, `map_block`, `try_allocate_expandable_block`):

    - each pool (small, large) is one virtual address range that grows by mapping pages at its
      end: 2 MiB (kSmallBuffer) pages for the small pool, 20 MiB (kLargeBuffer) for the large;
    - a request first takes the smallest free mapped block at least its size
      (`get_free_block`, as without expandable segments);
    - when none fits, the allocator maps pages after the pool's mapped end, fusing a free block
      that ends there into the new block (`try_allocate_expandable_block`: the chain "free ->
      unmapped" at the lowest address with room; with nothing ever unmapped that is the end);
    - a block splits whenever 512 bytes or more remain (`should_split`: `is_small ||
      expandable_segments()` -> `remaining >= kMinBlockSize`); freed blocks merge with free
      neighbours;
    - mapped pages stay mapped (reserved) until `empty_cache` or an allocation failure, which
      this replay, with memory to spare, never meets: the reserved peak is the pools' mapped
      ends."""

    free_blocks: dict[tuple[int, bool], list[tuple[int, int, Block]]] = field(default_factory=dict)
    last: dict[bool, Block | None] = field(default_factory=lambda: {True: None, False: None})
    mapped_end: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})
    allocated: int = 0
    reserved: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0

    _pool = CachingAllocator._pool
    _insert = CachingAllocator._insert
    _remove = CachingAllocator._remove
    cached = CachingAllocator.cached

    def _free_block_for(self, size: int, small: bool) -> Block | None:
        pool = self._pool(0, small)
        index = bisect.bisect_left(pool, (size, -1))
        if index == len(pool):
            return None
        block = pool[index][2]
        self._remove(block)
        return block

    def _grow(self, size: int, small: bool) -> Block:
        """Map pages at the pool's end for `size` bytes, taking a free block that ends there."""
        tail = self.last[small]
        if tail is not None and not tail.allocated:
            self._remove(tail)
        else:
            tail = Block(self.mapped_end[small], 0, small, prev=tail)
            if tail.prev is not None:
                tail.prev.next = tail
            self.last[small] = tail
        page = SMALL_BUFFER if small else LARGE_BUFFER
        grow = -(-(size - tail.size) // page) * page
        tail.size += grow
        self.mapped_end[small] += grow
        self.reserved += grow
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return tail

    def malloc(self, requested: int, stream: int = 0) -> Block:
        """One stream: `stream` is accepted for the default allocator's interface and must be
        0."""
        assert stream == 0, "ExpandableAllocator replays one stream"
        size = round_size(requested)
        small = size <= SMALL_SIZE
        block = self._free_block_for(size, small) or self._grow(size, small)
        if block.size - size >= MIN_BLOCK_SIZE:
            remaining = Block(block.address + size, block.size - size, small, prev=block)
            remaining.next = block.next
            if block.next:
                block.next.prev = remaining
            else:
                self.last[small] = remaining
            block.next = remaining
            block.size = size
            self._insert(remaining)
        block.allocated = True
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block

    def free(self, block: Block) -> None:
        assert block.allocated
        block.allocated = False
        self.allocated -= block.size
        for neighbour in (block.prev, block.next):
            if neighbour is None or neighbour.allocated:
                continue
            self._remove(neighbour)
            absorb(block, neighbour)
            if self.last[block.small] is neighbour:
                self.last[block.small] = block
        self._insert(block)

    def reset_peaks(self) -> None:
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved


@dataclass
class StreamsExpandableAllocator:
    """Expandable segments on several streams: each stream's pools are a segment of their own
    ("Note [Expandable Segments]": one expandable segment per stream and pool, a block serving
    only its stream as without them, `get_free_block`), so the streams replay as independent
    `ExpandableAllocator`s whose statistics add up."""

    streams: dict[int, ExpandableAllocator] = field(default_factory=dict)
    owners: dict[int, int] = field(default_factory=dict)  # a live block's id -> its stream
    peak_allocated: int = 0
    peak_reserved: int = 0

    def _of(self, stream: int) -> ExpandableAllocator:
        return self.streams.setdefault(stream, ExpandableAllocator())

    @property
    def allocated(self) -> int:
        return sum(pools.allocated for pools in self.streams.values())

    @property
    def reserved(self) -> int:
        return sum(pools.reserved for pools in self.streams.values())

    @property
    def reserved_by_stream(self) -> dict[int, int]:
        return {stream: pools.reserved for stream, pools in self.streams.items()}

    @property
    def allocated_by_stream(self) -> dict[int, int]:
        return {stream: pools.allocated for stream, pools in self.streams.items()}

    def malloc(self, requested: int, stream: int = 0) -> Block:
        block = self._of(stream).malloc(requested)
        self.owners[id(block)] = stream
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return block

    def free(self, block: Block) -> None:
        self._of(self.owners.pop(id(block))).free(block)

    def cached(self, stream: int | None = None) -> list[int]:
        return sorted(
            size
            for owner, pools in self.streams.items()
            if stream in (None, owner)
            for size in pools.cached()
        )

    def reset_peaks(self) -> None:
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved
