"""PrefixCache and KVCacheManager: chained hashes, confirmation by token ids, the reuse bound,
tenant salt, LRU eviction order and exact ref counts."""

from deepinfer.core.engine.sampling_params import SamplingParams
from deepinfer.core.engine.sched.request import Request
from deepinfer.core.kv.block_pool import BlockPool
from deepinfer.core.kv.kv_manager import KVCacheManager
from deepinfer.core.kv.prefix_cache import PrefixCache, hash_block, hash_full_blocks

BS = 4


def make_request(request_id, tokens, salt=None):
    return Request(request_id, tokens, SamplingParams(max_tokens=4), cache_salt=salt)


def compute(kv, request, num_tokens, cached=()):
    """What the scheduler and runner do for one chunk: allocate, then mark computed and register."""
    assert kv.allocate_slots(request, num_tokens, list(cached))
    request.num_computed_tokens += len(cached) * BS + num_tokens
    kv.cache_computed_blocks(request)


def test_hashes_chain_over_parent_tokens_and_salt():
    a = hash_full_blocks(list(range(8)), BS, None)
    assert len(a) == 2 and hash_full_blocks(list(range(9)), BS, None) == a  # partial tail block: no hash
    assert a[1] == hash_block(a[0], [4, 5, 6, 7], None)
    other_parent = hash_full_blocks([9, 9, 9, 9, 4, 5, 6, 7], BS, None)
    assert other_parent[1] != a[1]  # same tokens, different prefix
    assert hash_full_blocks(list(range(8)), BS, "tenant-a")[0] != a[0]


def test_hit_never_reuses_the_last_token_block():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    first = make_request("a", list(range(12)))  # 12 tokens = 3 full blocks
    compute(kv, first, 12)
    assert kv.prefix_cache.num_cached_blocks == 3
    # Same 12-token prompt: at most (12 - 1) // 4 = 2 blocks, the last block is recomputed.
    again = make_request("b", list(range(12)))
    assert kv.find_cached_blocks(again) == [0, 1]
    # A 13-token prompt with the same first 12 can reuse all three.
    longer = make_request("c", list(range(13)))
    assert kv.find_cached_blocks(longer) == [0, 1, 2]
    # 8 tokens aligned to the block: only the first block.
    assert kv.find_cached_blocks(make_request("d", list(range(8)))) == [0]


def test_hit_is_confirmed_by_token_ids_not_the_hash_alone():
    pool = BlockPool(4)
    cache = PrefixCache(pool, BS)
    (block,) = pool.allocate(1)
    forged_hash = 12345
    cache.insert(block, forged_hash, None, [1, 2, 3, 4], None)
    # Another prompt whose first block "collides" on the hash gets no hit.
    assert cache.lookup([5, 6, 7, 8, 9], [forged_hash], None) == []
    assert cache.lookup([1, 2, 3, 4, 9], [forged_hash], None) == [block]


def test_two_tenants_never_share_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    tokens = list(range(9))
    compute(kv, make_request("a", tokens, salt="tenant-a"), 9)
    assert kv.find_cached_blocks(make_request("b", tokens, salt="tenant-b")) == []
    assert kv.find_cached_blocks(make_request("c", tokens)) == []
    assert kv.find_cached_blocks(make_request("d", tokens, salt="tenant-a")) == [0, 1]


def test_shared_blocks_are_ref_counted_and_outlive_their_first_owner():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(10)))
    compute(kv, a, 10)
    assert kv.block_table("a") == [0, 1, 2]
    b = make_request("b", list(range(8)) + [50, 51])
    hit = kv.find_cached_blocks(b)
    assert hit == [0, 1]
    compute(kv, b, 2, cached=hit)
    assert kv.block_table("b") == [0, 1, 3]
    assert b.num_computed_tokens == 10
    assert [kv.pool.ref_count(i) for i in range(4)] == [2, 2, 1, 1]
    kv.check_invariants()
    kv.free(a)
    assert [kv.pool.ref_count(i) for i in range(4)] == [1, 1, 0, 1]
    assert kv.pool.num_free_blocks == 5  # block 2 (a's partial tail) is free; 0 and 1 are still held by b
    kv.free(b)
    # All that is left: free blocks plus cached, unreferenced ones; nothing leaked.
    assert kv.pool.num_free_blocks + kv.pool.num_evictable_blocks == kv.num_blocks
    assert kv.pool.evictable_block_ids() == [1, 0]  # b released its table tail first
    kv.check_invariants()


def test_lru_evicts_the_least_recently_released_chain_tail_first():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(9)))  # blocks 0, 1 cached, 2 partial
    compute(kv, a, 9)
    kv.free(a)  # released tail first: evictable order [1, 0]; block 2 back to the free list
    assert kv.pool.evictable_block_ids() == [1, 0]
    c = make_request("c", [7] * 13)  # needs 4 blocks: free 3, 2, then evicts 1
    compute(kv, c, 13)
    assert kv.block_table("c") == [3, 2, 1, 0]
    kv.free(c)
    assert kv.prefix_cache.num_cached_blocks == 3  # c's own 3 full blocks
    assert kv.find_cached_blocks(make_request("again", list(range(9)))) == []
    kv.check_invariants()


def test_partially_evicted_chain_hits_only_its_surviving_prefix():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    a = make_request("a", list(range(9)))
    compute(kv, a, 9)  # table [0, 1, 2]; 0 and 1 cached
    kv.free(a)  # evictable [1, 0], free [2]
    filler = make_request("filler", [99] * 5)
    compute(kv, filler, 5)  # takes 2, then evicts 1 (the tail of a's chain)
    assert kv.block_table("filler") == [2, 1]
    assert kv.find_cached_blocks(make_request("again", list(range(9)))) == [0]


def test_identical_prompts_computed_together_register_one_copy():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a, b = make_request("a", list(range(5))), make_request("b", list(range(5)))
    assert kv.allocate_slots(a, 5) and kv.allocate_slots(b, 5)
    a.num_computed_tokens = b.num_computed_tokens = 5
    kv.cache_computed_blocks(a)
    kv.cache_computed_blocks(b)
    assert kv.prefix_cache.num_cached_blocks == 1
    assert kv.pool.is_cached(0) and not kv.pool.is_cached(2)
    kv.free(a)
    kv.free(b)
    assert kv.pool.num_evictable_blocks == 1 and kv.pool.num_free_blocks == 7
    kv.check_invariants()


def test_allocation_fails_cleanly_when_a_revived_hit_leaves_too_few_blocks():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    a = make_request("a", list(range(9)))
    compute(kv, a, 9)
    kv.free(a)  # evictable [1, 0], free [2]
    b = make_request("b", list(range(8)) + [1, 2, 3, 4, 5])  # hits [0, 1], needs 2 more blocks, 1 is left
    hit = kv.find_cached_blocks(b)
    assert hit == [0, 1]
    assert not kv.allocate_slots(b, 5, hit)
    assert kv.block_table("b") == [] and kv.pool.num_evictable_blocks == 2
    kv.check_invariants()


def test_clear_drops_every_entry_and_frees_unreferenced_blocks():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(9)))
    compute(kv, a, 9)
    kv.free(a)
    kv.prefix_cache.clear()
    assert kv.prefix_cache.num_cached_blocks == 0 and kv.pool.num_free_blocks == 4
    kv.check_invariants()


def test_disabled_prefix_cache_never_hits():
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_prefix_caching=False)
    a = make_request("a", list(range(9)))
    compute(kv, a, 9)
    kv.free(a)
    assert kv.find_cached_blocks(make_request("b", list(range(9)))) == []
    assert kv.pool.num_free_blocks == 4


def test_lookup_changes_nothing():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(9)))
    compute(kv, a, 9)
    kv.free(a)
    assert kv.find_cached_blocks(make_request("b", list(range(9)))) == [0, 1]
    assert kv.pool.evictable_block_ids() == [1, 0] and kv.pool.ref_count(0) == 0
    assert (kv.prefix_cache.num_queried_tokens, kv.prefix_cache.num_hit_tokens) == (0, 0)  # admissions count
