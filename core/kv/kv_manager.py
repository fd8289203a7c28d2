"""KVCacheManager: the block table of every running request, on top of the block pool and prefix cache.

The scheduler is its only caller. A request's block table lists the physical blocks of its token
positions in order: position `p` lives in `block_table[p // block_size]` at offset `p % block_size`.
Tables only grow while a request runs; `free` gives all blocks back (tail first, so a chain's
last blocks are evicted before its prefix).

The request holds its table and row too (`Request.block_table`, `table_row`: the same list), so
the scheduler's per-step loop reads them without a lookup. Each table is kept twice: as a list (the prefix cache, tests) and as a row of one int32 array
(`tables`, a BlockTableArray) that the step stager gathers a whole step's tables and slots from in
a few numpy operations. A row changes only when its request gets blocks (the new ids are written
after the old ones) or frees them (the row is zeroed and handed back), so a running decode costs
nothing here until it crosses a block boundary: allocation goes by counts.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import numpy as np

from deepinfer.core.kv.block_pool import BlockPool
from deepinfer.core.kv.prefix_cache import PrefixCache, hash_full_blocks

if TYPE_CHECKING:
    from deepinfer.core.engine.sched.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockTableArray:
    """Block tables as rows of one int32 array [rows, width], each zero past its table's end. Rows are
    handed out when a request first gets blocks and back (zeroed) when it frees them; the array is
    replaced by a larger copy when rows or columns run out, so read `array` anew after allocating."""

    def __init__(self, rows: int = 64, width: int = 64) -> None:
        self.array = np.zeros((rows, width), dtype=np.int32)
        self._free_rows = list(range(rows - 1, -1, -1))  # popped from the end: lowest row first

    def take_row(self) -> int:
        if not self._free_rows:
            rows = self.array.shape[0]
            self._grow(2 * rows, self.array.shape[1])
            self._free_rows = list(range(2 * rows - 1, rows - 1, -1))
        return self._free_rows.pop()

    def write(self, row: int, start: int, block_ids: list[int]) -> None:
        """Put `block_ids` at columns start.. of `row`."""
        end = start + len(block_ids)
        if end > self.array.shape[1]:
            self._grow(self.array.shape[0], max(end, 2 * self.array.shape[1]))
        self.array[row, start:end] = block_ids

    def release(self, row: int, length: int) -> None:
        """Zero the row's `length` entries and hand it back."""
        self.array[row, :length] = 0
        self._free_rows.append(row)

    def _grow(self, rows: int, width: int) -> None:
        grown = np.zeros((rows, width), dtype=np.int32)
        grown[:self.array.shape[0], :self.array.shape[1]] = self.array
        self.array = grown


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.prefix_cache = PrefixCache(self.pool, block_size) if enable_prefix_caching else None
        self._block_tables: dict[str, list[int]] = {}
        self._rows: dict[str, int] = {}  # each table's row in `tables`
        self.tables = BlockTableArray()
        self._num_registered_blocks: dict[str, int] = {}  # leading blocks already offered to the prefix cache

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def block_table(self, request_id: str) -> list[int]:
        return self._block_tables.get(request_id, [])

    def table_and_row(self, request_id: str) -> tuple[list[int], int]:
        """The request's block table and the row of `tables.array` that holds it (it must have been
        allocated slots)."""
        return self._block_tables[request_id], self._rows[request_id]

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def find_cached_blocks(self, request: Request) -> list[int]:
        """Blocks of the request's longest cached prompt prefix (not retained yet). Empty without a cache."""
        if self.prefix_cache is None:
            return []
        self._hash_prompt(request)
        return self.prefix_cache.lookup(request.all_token_ids, request.block_hashes, request.cache_salt)

    def allocate_slots(self, request: Request, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Make room for `num_new_tokens` more tokens after the computed ones (plus `cached_blocks`,
        a prefix-cache hit for a request that holds no blocks yet). False, with nothing changed, when
        the pool cannot supply the blocks now."""
        table = request.block_table
        if table is not None and not cached_blocks:  # a running request: by counts, usually no new block
            num_tokens = request.num_computed_tokens + num_new_tokens
            num_new_blocks = -(-num_tokens // self.block_size) - len(table)
            if num_new_blocks <= 0:
                return True
            if num_new_blocks > self.pool.num_available_blocks:
                return False
            new_blocks = self.pool.allocate(num_new_blocks)
            self.tables.write(request.table_row, len(table), new_blocks)
            table.extend(new_blocks)
            return True
        table = table if table is not None else []
        num_tokens = request.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens
        num_new_blocks = self.blocks_needed(num_tokens) - len(table) - len(cached_blocks)
        # A hit on an unreferenced cached block takes it out of the evictable set, so it counts here too.
        num_revived = sum(1 for block_id in cached_blocks if self.pool.ref_count(block_id) == 0)
        if num_new_blocks + num_revived > self.pool.num_available_blocks:
            return False
        self.pool.retain(cached_blocks)
        start = len(table)
        table.extend(cached_blocks)
        if num_new_blocks > 0:
            table.extend(self.pool.allocate(num_new_blocks))
        if request.request_id not in self._block_tables:
            self._block_tables[request.request_id] = table
            self._rows[request.request_id] = self.tables.take_row()
            request.block_table, request.table_row = table, self._rows[request.request_id]
        if len(table) > start:
            self.tables.write(self._rows[request.request_id], start, table[start:])
        if cached_blocks:
            self._num_registered_blocks[request.request_id] = len(cached_blocks)
        return True

    def cache_computed_blocks(self, request: Request) -> None:
        """Offer the request's newly computed full prompt blocks to the prefix cache."""
        if self.prefix_cache is None:
            return
        num_full = min(request.num_computed_tokens, request.num_prompt_tokens) // self.block_size
        start = self._num_registered_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        self._hash_prompt(request)
        table = self._block_tables[request.request_id]
        for index in range(start, num_full):
            parent_hash = request.block_hashes[index - 1] if index > 0 else None
            tokens = request.prompt_token_ids[index * self.block_size:(index + 1) * self.block_size]
            self.prefix_cache.insert(table[index], request.block_hashes[index], parent_hash, tokens,
                                     request.cache_salt)
        self._num_registered_blocks[request.request_id] = num_full

    def _hash_prompt(self, request: Request) -> None:
        if not request.block_hashes:
            request.block_hashes = hash_full_blocks(request.prompt_token_ids, self.block_size,
                                                    request.cache_salt)

    def free(self, request: Request) -> None:
        """Give back every block the request holds (a no-op when it holds none)."""
        table = self._block_tables.pop(request.request_id, None)
        self._num_registered_blocks.pop(request.request_id, None)
        row = self._rows.pop(request.request_id, None)
        if row is not None:
            self.tables.release(row, len(table))
        request.block_table = request.table_row = None
        if table:
            self.pool.free(reversed(table))

    def check_invariants(self) -> None:
        """Each block's ref count equals the number of block tables holding it, and every other block is
        free or cached-unreferenced (no leaks). O(num_blocks): for tests and debugging."""
        self.pool.check_invariants()
        holders = Counter(block_id for table in self._block_tables.values() for block_id in table)
        for block_id in range(self.pool.num_blocks):
            if self.pool.ref_count(block_id) != holders[block_id]:
                raise AssertionError(f"block {block_id}: ref_count {self.pool.ref_count(block_id)} but "
                                     f"{holders[block_id]} block tables hold it")
