"""ReplicaRouter: which engine replica of `serve --data-parallel-size N` takes a new request.

A request goes to the replica with the fewest unfinished requests (the open streams the front end
holds with it), so the replicas fill evenly. Requests that start with the same tokens (a shared
system prompt, a conversation's next turn) are worth sending to one replica: its prefix cache holds
their common KV blocks, which another replica would compute again. So the router remembers, for the
hash of each of a prompt's first PREFIX_BLOCKS full KV blocks (block_size tokens each, chained: the
hash of block k covers blocks 0..k, with the cache salt, as the prefix cache's), the replica that
prompt went to, in an LRU of `capacity` entries. A prompt whose longest remembered prefix is on
replica r goes to r, unless r holds more than `margin` unfinished requests beyond the least-loaded
replica: affinity never lets one replica queue far behind the others.
"""

from __future__ import annotations

from collections import OrderedDict

PREFIX_BLOCKS = 4  # the prefixes remembered per prompt: its first 1..4 full blocks
DEFAULT_MARGIN = 4
DEFAULT_CAPACITY = 16384


class ReplicaRouter:
    def __init__(self, num_replicas: int, block_size: int, margin: int = DEFAULT_MARGIN,
                 capacity: int = DEFAULT_CAPACITY) -> None:
        self.num_replicas = num_replicas
        self.block_size = block_size
        self.margin = margin
        self.capacity = capacity
        self._prefixes: OrderedDict[int, int] = OrderedDict()  # prefix hash -> replica, oldest first

    def prefix_hashes(self, token_ids: list[int], cache_salt: str | None) -> list[int]:
        """The chained hashes of the prompt's first full blocks (up to PREFIX_BLOCKS), shortest first."""
        hashes, previous = [], hash(cache_salt)
        full_blocks = min(len(token_ids) // self.block_size, PREFIX_BLOCKS)
        for block in range(full_blocks):
            start = block * self.block_size
            previous = hash((previous, tuple(token_ids[start:start + self.block_size])))
            hashes.append(previous)
        return hashes

    def choose(self, token_ids: list[int], cache_salt: str | None, loads: list[int]) -> int:
        """The replica for a prompt, given each replica's unfinished requests `loads`; the prompt's
        prefixes are remembered as being on it."""
        least = min(range(self.num_replicas), key=loads.__getitem__)
        hashes = self.prefix_hashes(token_ids, cache_salt)
        chosen = least
        for prefix in reversed(hashes):  # the longest remembered prefix first
            replica = self._prefixes.get(prefix)
            if replica is not None:
                if loads[replica] <= loads[least] + self.margin:
                    chosen = replica
                break
        for prefix in hashes:
            self._prefixes[prefix] = chosen
            self._prefixes.move_to_end(prefix)
        while len(self._prefixes) > self.capacity:
            self._prefixes.popitem(last=False)
        return chosen
