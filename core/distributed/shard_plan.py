"""Which part of the model each tensor-parallel rank holds: query heads, KV heads, MLP channels, vocabulary rows.

Attention (Megatron's split, uneven where the counts do not divide): rank r takes a contiguous range of the
H query heads, as even as possible, and the KV heads those query heads read; a KV head whose query heads
fall on two ranks is held by both. The attention kernels need every KV head to serve the same number of
query heads (G = H / KVH), so a rank lays its heads out in `slots`: G query-head slots per KV head it holds,
each slot a real query head of that KV head's group or, where the rank does not own the whole group, a copy
of one it owns (its output is dropped before o_proj: `kept_slots`). SmolLM2-135M (9 heads, 3 KV heads) at
TP=2: rank 0 owns heads 0..4 (KV heads 0, 1; slots 0,1,2 | 3,4,3), rank 1 heads 5..8 (KV heads 1, 2; slots
5,5,5 | 6,7,8).

MLP: the intermediate channels split in whole units (a quantization group of down_proj, whose K they are),
as even as possible; with act-order (GPTQ desc_act) down_proj's columns are its permuted channels, so a
rank's channels are the permutation's slice over its columns.

Vocabulary: contiguous row ranges, as even as possible (sizes differ by at most one).
"""

from __future__ import annotations

from dataclasses import dataclass


def even_ranges(total: int, parts: int, unit: int = 1) -> list[tuple[int, int]]:
    """[start, end) of each part: `total` split into `parts` runs of whole `unit`s, as even as possible.
    ValueError when there are fewer units than parts."""
    if total % unit:
        raise ValueError(f"{total} is not a multiple of the split unit {unit}")
    units = total // unit
    if units < parts:
        raise ValueError(f"{total} cannot be split {parts} ways in units of {unit}")
    base, extra = divmod(units, parts)
    bounds, start = [], 0
    for part in range(parts):
        end = start + base + (part < extra)
        bounds.append((start * unit, end * unit))
        start = end
    return bounds


@dataclass(frozen=True)
class HeadShard:
    """One rank's attention heads (indices into the full model's heads)."""

    heads: tuple[int, int]  # [first, end) query heads the rank owns
    kv_heads: tuple[int, int]  # [first, end) KV heads it holds
    slots: tuple[int, ...]  # the query head computed in each local slot: G per held KV head, in order
    kept_slots: tuple[int, ...]  # the slots whose output is the rank's (its owned heads, in head order)

    @property
    def num_slots(self) -> int:
        return len(self.slots)

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def padded(self) -> bool:
        return len(self.kept_slots) != len(self.slots)


def head_shard(num_heads: int, num_kv_heads: int, world_size: int, rank: int) -> HeadShard:
    group = num_heads // num_kv_heads  # query heads per KV head
    first, end = even_ranges(num_heads, world_size)[rank]
    kv_first, kv_end = first // group, (end - 1) // group + 1
    slots: list[int] = []
    kept: list[int] = []
    for kv_head in range(kv_first, kv_end):
        owned = [h for h in range(kv_head * group, (kv_head + 1) * group) if first <= h < end]
        for h in range(kv_head * group, (kv_head + 1) * group):
            if first <= h < end:
                kept.append(len(slots))
                slots.append(h)
            else:
                slots.append(owned[0])
    return HeadShard((first, end), (kv_first, kv_end), tuple(slots), tuple(kept))


def vocab_range(vocab_size: int, world_size: int, rank: int) -> tuple[int, int]:
    return even_ranges(vocab_size, world_size)[rank]


def channel_range(intermediate_size: int, world_size: int, rank: int, unit: int) -> tuple[int, int]:
    """[start, end) of the rank's MLP channels (of down_proj's columns), cut in whole `unit`s."""
    return even_ranges(intermediate_size, world_size, unit)[rank]
