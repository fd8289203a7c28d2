"""BlockPool: the ref-counted allocator of KV block ids. Pure Python, O(1) per block.

A block id in [0, num_blocks) is always in exactly one of three states:

    free       ref_count 0, nothing worth keeping          -> in `_free` (FIFO)
    in use     ref_count >= 1: one count per block table holding it
    evictable  ref_count 0, but its content is registered in the prefix cache
                                                            -> in `_evictable` (least recently released first)

so `num_free_blocks + num_evictable_blocks + num_used_blocks == num_blocks` at all times.

Allocation takes free blocks first and evicts the least recently released cached block only when
none is left; `on_evict` then tells the prefix cache to forget that block's hash. A prefix-cache hit
`retain`s a block, which takes an evictable block out of the eviction order again.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable


class BlockPoolError(RuntimeError):
    """The allocator was used against its contract (double free, over-allocation): an engine bug."""


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._cached = [False] * num_blocks  # content registered in the prefix cache
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.on_evict: Callable[[int], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictable)

    @property
    def num_available_blocks(self) -> int:
        """Blocks an allocation can take now: free ones plus unreferenced cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_available_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, 0..1."""
        return self.num_used_blocks / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def is_cached(self, block_id: int) -> bool:
        return self._cached[block_id]

    def evictable_block_ids(self) -> list[int]:
        """Unreferenced cached blocks in eviction order (next victim first)."""
        return list(self._evictable)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` blocks, each with ref_count 1. The caller checks `num_available_blocks` first."""
        if num_blocks > self.num_available_blocks:
            raise BlockPoolError(f"asked for {num_blocks} blocks, only {self.num_available_blocks} available")
        block_ids = []
        for _ in range(num_blocks):
            if self._free:
                block_id = self._free.popleft()
            else:
                block_id, _ = self._evictable.popitem(last=False)
                self._cached[block_id] = False
                if self.on_evict is not None:
                    self.on_evict(block_id)
            self._ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def retain(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each block (a prefix-cache hit). Free, uncached blocks cannot be retained."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                if block_id not in self._evictable:
                    raise BlockPoolError(
                        f"block {block_id} is free; only used or cached blocks can be retained")
                del self._evictable[block_id]
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block, in order; a block reaching zero becomes free or evictable.

        Evictable blocks are queued in the order given, so callers release a request's blocks tail
        first: a chain's last blocks are then evicted before the prefixes they depend on.
        """
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                raise BlockPoolError(f"double free of block {block_id}")
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                if self._cached[block_id]:
                    self._evictable[block_id] = None
                else:
                    self._free.append(block_id)

    def mark_cached(self, block_id: int) -> None:
        """The block's content is now in the prefix cache: keep it evictable once unreferenced."""
        if self._ref_counts[block_id] == 0:
            raise BlockPoolError(f"block {block_id} is not in use; only a computed, held block can be cached")
        self._cached[block_id] = True

    def evict_all(self) -> None:
        """Forget every cached block: unreferenced ones become free, held ones become plain blocks."""
        for block_id in range(self.num_blocks):
            if self._cached[block_id]:
                self._cached[block_id] = False
                if self.on_evict is not None:
                    self.on_evict(block_id)
        self._free.extend(self._evictable)
        self._evictable.clear()

    def check_invariants(self) -> None:
        """Every block is in exactly one state. O(num_blocks): for tests and debugging, not the hot path."""
        free, evictable = set(self._free), set(self._evictable)
        if len(free) != len(self._free) or free & evictable:
            raise BlockPoolError("a block is queued twice")
        for block_id, count in enumerate(self._ref_counts):
            in_queue = block_id in free or block_id in evictable
            if count < 0 or (count == 0) != in_queue:
                raise BlockPoolError(f"block {block_id}: ref_count {count} but queued={in_queue}")
            if block_id in evictable and not self._cached[block_id]:
                raise BlockPoolError(f"block {block_id} is evictable but not cached")
            if block_id in free and self._cached[block_id]:
                raise BlockPoolError(f"block {block_id} is free but still marked cached")
