"""The KV manager's block tables as rows of one numpy array (what the stager gathers a step from): rows equal
the lists through growth, row reuse, prefix-cache hits and frees, and a step staged from the array equals
the same step staged from the chunks' lists."""

from __future__ import annotations

import random
from dataclasses import replace

import torch

from deepinfer.core.engine.sampling_params import SamplingParams
from deepinfer.core.engine.sched.request import Request
from deepinfer.core.engine.sched.scheduler_output import ScheduledChunk
from deepinfer.core.engine.worker.step_inputs import request_stager
from deepinfer.core.kv.kv_manager import BlockTableArray, KVCacheManager


def test_rows_grow_and_are_reused_zeroed():
    tables = BlockTableArray(rows=2, width=2)
    a, b = tables.take_row(), tables.take_row()
    tables.write(a, 0, [5, 6])
    tables.write(b, 0, [7])
    c = tables.take_row()  # a third row: the array doubles its rows
    tables.write(a, 2, [8, 9, 10])  # past the width: the columns grow, the old entries stay
    assert (a, b, c) == (0, 1, 2) and tables.array.shape[0] == 4 and tables.array.shape[1] >= 5
    assert tables.array[a].tolist() == [5, 6, 8, 9, 10] and tables.array[b].tolist() == [7, 0, 0, 0, 0]
    tables.release(a, 5)
    assert not tables.array[a].any() and tables.take_row() == a


def test_the_array_follows_the_tables_through_allocation_hits_and_frees():
    rng = random.Random(3)
    kv = KVCacheManager(num_blocks=400, block_size=4, enable_prefix_caching=True)
    shared = [rng.randrange(100) for _ in range(12)]
    live: dict[str, Request] = {}
    for step in range(300):
        if live and rng.random() < 0.3:
            kv.free(live.pop(rng.choice(sorted(live))))
        elif len(live) < 70 and rng.random() < 0.5:
            request = Request(f"r{step}", shared + [rng.randrange(100) for _ in range(rng.randrange(1, 20))],
                              SamplingParams())
            cached = kv.find_cached_blocks(request)
            if kv.allocate_slots(request, request.num_tokens - len(cached) * 4, cached):
                request.num_computed_tokens = request.num_tokens
                kv.cache_computed_blocks(request)
                live[request.request_id] = request
        elif live:  # a running request grows by a few tokens
            request = live[rng.choice(sorted(live))]
            if kv.allocate_slots(request, rng.randrange(1, 9)):
                request.num_computed_tokens += 1
        kv.check_invariants()  # rows equal the lists, zero past them, free rows zero
    assert kv.tables.array.shape[0] >= 64  # it grew past its first 64 rows


def test_a_step_staged_from_the_array_equals_the_one_staged_from_the_lists():
    kv = KVCacheManager(num_blocks=64, block_size=4, enable_prefix_caching=False)
    chunks = []
    for i, (length, start, num_new) in enumerate([(9, 8, 1), (14, 13, 1), (10, 0, 10), (23, 16, 5)]):
        request = Request(f"r{i}", list(range(10 * i, 10 * i + length)), SamplingParams())
        kv.allocate_slots(request, start + num_new)
        table, row = kv.table_and_row(request.request_id)
        chunks.append(ScheduledChunk(request, start, num_new, table, sample=i != 2, table_row=row))
    by_lists = [replace(chunk, table_row=None) for chunk in chunks]
    stager = request_stager(64, 8, 16, 4, torch.device("cpu"))
    staged = stager.stage_requests(chunks, None, kv.tables.array)
    expected = stager.stage_requests(by_lists, None, kv.tables.array)
    for name in ("input_ids", "positions", "logits_indices"):
        assert torch.equal(getattr(staged, name), getattr(expected, name)), name
    for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
        assert torch.equal(getattr(staged.attn_metadata, name), getattr(expected.attn_metadata, name)), name
    # By hand: request 3's positions 16..20 live in its blocks 4 and 5.
    table = chunks[3].block_table
    assert staged.attn_metadata.slot_mapping[-5:].tolist() == [table[p // 4] * 4 + p % 4 for p in range(16, 21)]
