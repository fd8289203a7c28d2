"""BlockPool: exact block ids, ref counts, free/evictable states and eviction order."""

import pytest

from deepinfer.core.kv.block_pool import BlockPool, BlockPoolError


def test_allocate_hands_out_ids_in_order_with_ref_count_one():
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    assert [pool.ref_count(b) for b in range(4)] == [1, 1, 1, 0]
    assert (pool.num_free_blocks, pool.num_used_blocks, pool.num_available_blocks) == (1, 3, 1)
    assert pool.usage == 0.75
    pool.check_invariants()


def test_freed_blocks_are_reused_after_never_used_ones_fifo():
    pool = BlockPool(4)
    first = pool.allocate(2)
    pool.free(reversed(first))  # free queue is now [2, 3, 1, 0]
    assert pool.allocate(3) == [2, 3, 1]
    assert pool.allocate(1) == [0]
    assert pool.num_available_blocks == 0


def test_over_allocation_raises_and_changes_nothing():
    pool = BlockPool(2)
    pool.allocate(1)
    with pytest.raises(BlockPoolError, match="asked for 2 blocks, only 1 available"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1
    pool.check_invariants()


def test_double_free_raises():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(BlockPoolError, match="double free of block 0"):
        pool.free([block])


def test_retain_counts_references_and_block_returns_only_at_zero():
    pool = BlockPool(3)
    (block,) = pool.allocate(1)
    pool.retain([block])
    assert pool.ref_count(block) == 2
    pool.free([block])
    assert pool.ref_count(block) == 1 and pool.num_free_blocks == 2  # still held by its other owner
    pool.free([block])
    assert pool.ref_count(block) == 0 and pool.num_free_blocks == 3
    pool.check_invariants()


def test_retaining_a_free_uncached_block_raises():
    pool = BlockPool(2)
    with pytest.raises(BlockPoolError, match="block 1 is free"):
        pool.retain([1])


def test_cached_blocks_become_evictable_and_are_evicted_lru_only_when_no_free_block_is_left():
    pool = BlockPool(4)
    evicted = []
    pool.on_evict = evicted.append
    blocks = pool.allocate(3)  # [0, 1, 2]
    for block in blocks:
        pool.mark_cached(block)
    pool.free([2, 0, 1])  # released in this order: LRU order is 2, 0, 1
    assert pool.num_free_blocks == 1 and pool.num_evictable_blocks == 3
    assert pool.evictable_block_ids() == [2, 0, 1]
    assert pool.allocate(1) == [3]  # the never-cached free block goes first
    assert evicted == []
    assert pool.allocate(2) == [2, 0]
    assert evicted == [2, 0]
    assert not pool.is_cached(2) and pool.is_cached(1)
    pool.check_invariants()


def test_retain_revives_an_evictable_block_and_requeues_it_as_most_recent():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    for block in blocks:
        pool.mark_cached(block)
    pool.free(blocks)  # LRU order 0, 1, 2
    pool.retain([0])  # a prefix-cache hit
    assert pool.ref_count(0) == 1 and pool.evictable_block_ids() == [1, 2]
    assert pool.num_available_blocks == 2
    pool.free([0])
    assert pool.evictable_block_ids() == [1, 2, 0]
    pool.check_invariants()


def test_mark_cached_needs_a_held_block():
    pool = BlockPool(2)
    with pytest.raises(BlockPoolError, match="not in use"):
        pool.mark_cached(0)


def test_evict_all_frees_unreferenced_and_uncaches_held_blocks():
    pool = BlockPool(3)
    evicted = []
    pool.on_evict = evicted.append
    blocks = pool.allocate(2)
    for block in blocks:
        pool.mark_cached(block)
    pool.free([0])
    pool.evict_all()
    assert sorted(evicted) == [0, 1]
    assert pool.num_evictable_blocks == 0 and pool.num_free_blocks == 2
    pool.free([1])  # no longer cached: straight to the free list
    assert pool.num_free_blocks == 3
    pool.check_invariants()


def test_needs_at_least_one_block():
    with pytest.raises(ValueError, match="at least one block"):
        BlockPool(0)
