"""PrefixCache: full, immutable prompt blocks shared between requests with the same prefix.

Block `i` of a prompt is keyed by a chained hash

    hash_i = hash((hash_{i-1}, tuple(token_ids of block i), cache_salt))      (hash_{-1} = None)

so a key names the whole prefix up to and including the block, and `cache_salt` (a tenant key)
keeps two tenants from ever sharing a block. A hit is confirmed by comparing the stored parent
hash, token ids and salt, not by the hash alone.

Only full prompt blocks are registered, and only once their K/V are computed: a registered block is
never written again, so sharing needs no copy-on-write. A lookup never returns more
than `(num_tokens - 1) // block_size` blocks: the last token is always recomputed, because its
logits are needed.

The cache holds no reference of its own: a cached block nobody holds sits in the block pool's
eviction order, and the pool tells the cache (`_forget`) when it reuses such a block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from deepinfer.core.kv.block_pool import BlockPool

BlockHash = int


def hash_block(parent_hash: BlockHash | None, token_ids: Sequence[int], cache_salt: str | None) -> BlockHash:
    return hash((parent_hash, tuple(token_ids), cache_salt))


def hash_full_blocks(
    token_ids: Sequence[int], block_size: int, cache_salt: str | None, parent_hash: BlockHash | None = None
) -> list[BlockHash]:
    """Chained hashes of every full block of `token_ids` (a trailing partial block gets none)."""
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block(parent_hash, token_ids[start:start + block_size], cache_salt)
        hashes.append(parent_hash)
    return hashes


@dataclass(frozen=True)
class CachedBlock:
    block_id: int
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]
    cache_salt: str | None


class PrefixCache:
    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self._by_hash: dict[BlockHash, CachedBlock] = {}
        self._hash_of_block: dict[int, BlockHash] = {}
        pool.on_evict = self._forget
        # Lifetime counters for /health, in tokens, of the lookups whose requests were admitted.
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    @property
    def num_cached_blocks(self) -> int:
        return len(self._by_hash)

    def lookup(
        self, token_ids: Sequence[int], block_hashes: Sequence[BlockHash], cache_salt: str | None
    ) -> list[int]:
        """Block ids of the longest cached prefix of `token_ids`, at most (len - 1) // block_size blocks.

        `block_hashes` are the chained hashes of the full blocks of `token_ids` (or of a prefix of it).
        The blocks are not retained here; the caller retains the ones it uses.
        """
        max_blocks = min(len(block_hashes), (len(token_ids) - 1) // self.block_size)
        block_ids = []
        parent_hash = None
        for index in range(max_blocks):
            entry = self._by_hash.get(block_hashes[index])
            start = index * self.block_size
            if (entry is None or entry.parent_hash != parent_hash or entry.cache_salt != cache_salt
                    or entry.token_ids != tuple(token_ids[start:start + self.block_size])):
                break
            block_ids.append(entry.block_id)
            parent_hash = block_hashes[index]
        return block_ids

    def count_lookup(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        self.num_queried_tokens += num_queried_tokens
        self.num_hit_tokens += num_hit_tokens

    def insert(
        self, block_id: int, block_hash: BlockHash, parent_hash: BlockHash | None,
        token_ids: Sequence[int], cache_salt: str | None,
    ) -> bool:
        """Register a computed full block. False (and nothing changes) when the same content is already
        cached under another block, e.g. two identical prompts computed in the same step."""
        if block_hash in self._by_hash or block_id in self._hash_of_block:
            return False
        self._by_hash[block_hash] = CachedBlock(block_id, parent_hash, tuple(token_ids), cache_salt)
        self._hash_of_block[block_id] = block_hash
        self.pool.mark_cached(block_id)
        return True

    def clear(self) -> None:
        """Drop every entry; unreferenced cached blocks go back to the free list."""
        self.pool.evict_all()

    def _forget(self, block_id: int) -> None:
        block_hash = self._hash_of_block.pop(block_id)
        del self._by_hash[block_hash]
