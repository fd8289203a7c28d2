"""Padded steps and CUDA graphs (core/engine/worker/cuda_graphs.py).

On the CPU: bucket and bound choice, which steps a graph serves, the exact static inputs a replay
reads (padding rows included), and the engine in "padded" mode, which runs exactly those inputs
eagerly (decodes and prefill chunks alike, each token as its own query), against the unpadded
engine: identical greedy, seeded and logprob outputs prove the padding and the per-token
formulation harmless.
On a GPU (marked `gpu`): captured graphs against the padded-eager and the unpadded eager engine.
"""

import logging
import random

import pytest
import torch
from conftest import save_tiny_model

from deepinfer import SamplingParams
from deepinfer.core.config import EngineConfig
from deepinfer.core.engine.llm_engine import LLMEngine
from deepinfer.core.engine.sched.request import Request
from deepinfer.core.engine.sched.scheduler_output import ScheduledChunk
from deepinfer.core.engine.worker.cuda_graphs import (
    PaddedStepRunner,
    StaticStepBuffers,
    attention_work,
    context_bounds,
    decode_bucket_sizes,
    token_bucket_sizes,
)
from deepinfer.core.errors import DeepInferError
from deepinfer.core.models.loader import load_model


def test_bucket_sizes():
    assert decode_bucket_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert decode_bucket_sizes(1) == [1]
    assert decode_bucket_sizes(3) == [1, 2, 3]
    assert decode_bucket_sizes(8) == [1, 2, 4, 8]
    assert decode_bucket_sizes(10) == [1, 2, 4, 8, 10]
    assert decode_bucket_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert token_bucket_sizes(64, 512) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 128, 256, 512]
    assert token_bucket_sizes(10, 48) == [1, 2, 4, 8, 10, 20, 40, 48]
    assert token_bucket_sizes(64, 32) == [1, 2, 4, 8, 16, 24, 32]


def test_context_bounds():
    assert context_bounds(4096) == [1024, 4096]
    assert context_bounds(32768) == [1024, 4096, 16384, 32768]
    assert context_bounds(5000) == [1024, 4096, 5000]
    assert context_bounds(1024) == [1024]
    assert context_bounds(300) == [300]


def decode_chunk(request_id, tokens, table, sample=True):
    request = Request(request_id, tokens, SamplingParams(max_tokens=4))
    return ScheduledChunk(request, len(tokens) - 1, 1, table, sample)


def test_static_buffers_hold_the_replay_inputs_with_padding_on_the_dummy_block():
    buffers = StaticStepBuffers(max_tokens=16, max_rows=4, max_model_len=64, block_size=4, dummy_block=99,
                                device=torch.device("cpu"))
    prompt_request = Request("p", [31, 32, 33, 34, 35, 36, 37], SamplingParams(max_tokens=4))
    chunks = [decode_chunk("a", [5, 6, 7, 8, 9, 10], [3, 7]),  # position 5: block 7, offset 1
              ScheduledChunk(prompt_request, 2, 3, [8, 5, 9], False),  # positions 2-4: block 8 at 2, 3; block 5 at 0
              decode_chunk("c", list(range(20, 29)), [1, 4, 6, 0])]  # position 8: block 6, offset 0
    # A wider layout first, so the next step must not read its stale values.
    buffers.load([decode_chunk("x", list(range(40)), list(range(40, 50)))], tokens=16, bound=64)
    buffers.load(chunks, tokens=8, bound=16)
    input_ids, positions, logit_rows, meta = buffers.views(8, 16)
    assert input_ids.tolist() == [10, 33, 34, 35, 28, 0, 0, 0]
    assert positions.tolist() == [5, 2, 3, 4, 8, 0, 0, 0]
    assert meta.slot_mapping.tolist() == [7 * 4 + 1, 8 * 4 + 2, 8 * 4 + 3, 5 * 4, 6 * 4] + [99 * 4] * 3
    assert meta.seq_lens.tolist() == [6, 3, 4, 5, 9, 1, 1, 1]  # each token's own context
    # Each token reads its request's table row; padding tokens read the padding row (row 4 of 5).
    table_a, table_p, table_c, table_pad = [3, 7, 0, 0], [8, 5, 0, 0], [1, 4, 6, 0], [99, 0, 0, 0]
    assert meta.block_tables.tolist() == [table_a, table_p, table_p, table_p, table_c] + [table_pad] * 3
    assert logit_rows.tolist() == [0, 3, 4, 0]  # the last token of each request, then padding
    assert meta.query_start_loc.tolist() == list(range(9))
    assert (meta.num_decodes, meta.max_query_len, meta.max_seq_len) == (8, 1, 16)
    assert meta.query_lens == [1] * 8 and meta.seq_lens_host == [16] * 8  # the bound the graph serves
    # Request p's 3 new tokens are rows of their own whose contexts include each other: the decode kernel must
    # not read a request's newest `fresh_tokens` positions before the step's cache write (here up to the bucket).
    assert meta.fresh_tokens == 8


def test_tiled_buckets_stage_decodes_first_then_prefill_tiles_and_padding_tiles(monkeypatch):
    """Above max_num_seqs tokens (with the prefill kernel's tile size, from the table's MIN_TILED_TOKENS, here 16): decodes
    take the first rows, chunks of several tokens and the padding rows are cut into tiles, and the decode kernel's
    lengths are 0 on tile rows."""
    from deepinfer.core.ops import paged_attention_table

    monkeypatch.setattr(paged_attention_table, "MIN_TILED_TOKENS", 16)
    buffers = StaticStepBuffers(max_tokens=32, max_rows=4, max_model_len=64, block_size=4, dummy_block=99,
                                device=torch.device("cpu"), tile_tokens=4)
    long_prompt = Request("p", list(range(100, 109)), SamplingParams(max_tokens=4))
    short_prompt = Request("q", [51, 52, 53], SamplingParams(max_tokens=4))
    chunks = [ScheduledChunk(long_prompt, 3, 6, [8, 5, 9], False),  # positions 3-8
              decode_chunk("a", [5, 6, 7, 8, 9, 10], [3, 7]),  # position 5
              ScheduledChunk(short_prompt, 0, 3, [2], True)]  # positions 0-2
    buffers.load(chunks, tokens=16, bound=16)
    input_ids, positions, logit_rows, meta = buffers.views(16, 16)
    assert input_ids.tolist() == [10, 103, 104, 105, 106, 107, 108, 51, 52, 53] + [0] * 6
    assert positions.tolist() == [5, 3, 4, 5, 6, 7, 8, 0, 1, 2] + [0] * 6
    assert meta.seq_lens.tolist() == [6, 4, 5, 6, 7, 8, 9, 1, 2, 3] + [1] * 6
    assert logit_rows.tolist() == [6, 0, 9, 0]  # chunk i's last token, wherever it was placed
    assert meta.block_tables[:, :3].tolist() == [[3, 7, 0]] + [[8, 5, 9]] * 6 + [[2, 0, 0]] * 3 + [[99, 0, 0]] * 6
    # cdiv(16, 4) + min(4, 16 // 2) + 1 = 9 tiles: the long chunk's 4 + 2, the short one's 3, the padding's 4 + 2
    assert meta.prefill_tiles.tolist() == [[1, 4], [5, 2], [7, 3], [10, 4], [14, 2]] + [[0, 0]] * 4
    assert meta.decode_seq_lens.tolist() == [6, 0, 0, 0]  # the decode kernel's rows: the decode, then tile rows
    # Decode steps stay in untiled buckets: no tiles, rows in chunk order; so do buckets below MIN_TILED_TOKENS.
    buffers.load([decode_chunk("b", [1, 2, 3], [4]), decode_chunk("a", [5, 6, 7, 8, 9, 10], [3, 7])], 2, 16)
    input_ids, _, logit_rows, meta = buffers.views(2, 16)
    assert input_ids.tolist() == [3, 10] and logit_rows.tolist() == [0, 1]
    assert meta.prefill_tiles is None and meta.decode_seq_lens is None
    assert buffers.num_tiles(8) == 0 and buffers.num_tiles(16) == 9


def test_runner_picks_the_smallest_bucket_and_bound():
    runner = PaddedStepRunner(torch.nn.Identity(), None, torch.device("cpu"), block_size=4, max_num_seqs=20,
                              max_num_batched_tokens=2048, max_model_len=5000, dummy_block=0, vocab_size=8,
                              num_kv_heads=2, use_graphs=False)
    assert runner.bucket_sizes == [1, 2, 4, 8, 16, 20, 40, 80, 160, 320, 640, 1280, 2048]
    assert runner.context_bounds == [1024, 4096, 5000]
    table = list(range(1250))

    def shape(num, longest):
        return runner.shape_of([decode_chunk(f"r{i}", [1] * (longest if i == 0 else 2), table)
                                for i in range(num)])

    assert shape(1, 10) == (1, 1024)
    assert shape(3, 1024) == (4, 1024)
    assert shape(5, 1025) == (8, 4096)
    assert shape(17, 4097) == (20, 5000)
    assert shape(16, 5000) == (16, 5000)
    prefill = ScheduledChunk(Request("p", [1] * 300, SamplingParams()), 0, 300, table, True)
    assert runner.shape_of([prefill, decode_chunk("d", [1] * 9, table)]) == (320, 1024)
    prefill = ScheduledChunk(Request("p", [1] * 1500, SamplingParams()), 0, 1500, table, True)
    assert runner.shape_of([prefill]) == (2048, 4096)


def test_runner_serves_steps_whose_per_token_attention_is_cheap():
    runner = PaddedStepRunner(torch.nn.Identity(), None, torch.device("cpu"), block_size=16, max_num_seqs=4,
                              max_num_batched_tokens=512, max_model_len=8192, dummy_block=0, vocab_size=8,
                              num_kv_heads=4, use_graphs=False)
    table = list(range(512))

    def chunk(start, n):
        return ScheduledChunk(Request("p", [1] * (start + n), SamplingParams()), start, n, table, True)

    # positions s..s+n-1 attend to s+1..s+n tokens: 2*10 + 3 and 4*5 + 10 by hand
    assert attention_work([chunk(10, 2)]) == 23 and attention_work([chunk(5, 4), chunk(0, 1)]) == 31
    assert runner.attention_work_limit == (1 << 21) // 4
    assert runner.serves([chunk(0, 512)])  # 131,328 token-contexts
    assert not runner.serves([chunk(0, 513)])  # more tokens than the largest bucket
    assert runner.serves([chunk(1000, 400)])  # 480,200
    assert not runner.serves([chunk(1500, 400)])  # 680,200: over 2**21 / 4 KV heads
    assert not runner.serves([chunk(0, 1)] * 5)  # more requests than max_num_seqs
    assert not runner.serves([])
    # With prefill tiles a chunk's tile walks its last token's context: (10 + 4) + (10 + 5) by hand.
    assert attention_work([chunk(10, 5)], tile_tokens=4) == 29 and attention_work([chunk(10, 1)], 4) == 11
    tiled = PaddedStepRunner(torch.nn.Identity(), None, torch.device("cpu"), block_size=16, max_num_seqs=4,
                             max_num_batched_tokens=512, max_model_len=8192, dummy_block=0, vocab_size=8,
                             num_kv_heads=4, use_graphs=False, prefill_tile_tokens=16)
    assert tiled.serves([chunk(1500, 400)])  # 25 tiles walking 1516..1900: 42,700
    assert tiled.serves([chunk(7000, 512)])  # 32 tiles: 232,448
    assert not tiled.serves([chunk(0, 4)] * 5)


def test_graph_memory_comes_out_of_the_kv_budget():
    from deepinfer.core.engine.worker.memory import DeviceMemory, plan_kv_budget

    mib = 1024**2
    memory = {"total": 4096 * mib, "free": 3000 * mib, "torch_reserved": 700 * mib, "torch_allocated": 600 * mib,
                  "peak_allocated": 900 * mib}
    for settings in ({"max_vram": "2GiB"}, {"gpu_memory_utilization": 0.5}, {}):
        without = plan_kv_budget(EngineConfig(**settings), 2 * mib, DeviceMemory(**memory))
        with_graphs = plan_kv_budget(EngineConfig(**settings), 2 * mib, DeviceMemory(**memory, cuda_graph_bytes=100 * mib))
        assert without.budget_bytes - with_graphs.budget_bytes == 100 * mib
        assert (without.cuda_graph_bytes, with_graphs.cuda_graph_bytes) == (0, 100 * mib)
    with pytest.raises(DeepInferError, match="enforce_eager"):
        plan_kv_budget(EngineConfig(max_vram="1000MiB"), 2 * mib, DeviceMemory(**memory, cuda_graph_bytes=100 * mib))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_tokenizer):
    directory = tmp_path_factory.mktemp("graph_llama")
    # head_dim 32: the smallest the native decode kernel serves, so the GPU tests run it.
    save_tiny_model("llama", directory, tiny_tokenizer, seed=11, initializer_range=0.2, num_hidden_layers=2,
                    head_dim=32)
    return directory


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory, tiny_tokenizer):
    """Hidden 256 (whole 128-code segments): in W4 its merged q/k/v product takes the fused RoPE + cache-write
    epilogue (quant_tc_rope_kernel) in decode steps of up to 8 tokens, and its merged gate/up product (2I >= 3K)
    the fused activation (quant_tcs_act_kernel) in steps of up to 32."""
    directory = tmp_path_factory.mktemp("graph_llama_wide")
    save_tiny_model("llama", directory, tiny_tokenizer, seed=12, initializer_range=0.2, num_hidden_layers=2,
                    hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=32)
    return directory


@pytest.fixture(scope="module")
def prefill_model_dir(tmp_path_factory, tiny_tokenizer):
    """head_dim 64 with 2 query heads a KV head: paged_prefill_attention serves it (tiles of 4 x 16 / 2 = 32 tokens),
    so graphed steps above max_num_seqs tokens attend their prefill chunks in tiles."""
    directory = tmp_path_factory.mktemp("graph_llama_prefill")
    save_tiny_model("llama", directory, tiny_tokenizer, seed=13, initializer_range=0.2, num_hidden_layers=2,
                    hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    return directory


def prompt(length, seed):
    rng = random.Random(seed)
    return [rng.randrange(3, 340) for _ in range(length)]


def workload():
    """Requests of different lengths, so decode batches shrink through several buckets as they finish.
    The first one (first blocks, e.g. block 0) lives longest, so padded steps run beside its cache."""
    greedy = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (24, 6, 9, 12, 20, 3)]
    requests = [(prompt(length, i), params) for i, (length, params) in enumerate(zip((18, 7, 13, 5, 30, 2), greedy))]
    requests.append((prompt(9, 40), SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=15,
                                                   ignore_eos=True)))
    requests.append((prompt(4, 41), SamplingParams(temperature=0.0, max_tokens=10, logprobs=3, ignore_eos=True)))
    return requests


def run_all(engine, requests):
    ids = [engine.add_request(p, params) for p, params in requests]
    finals = {}
    while engine.has_unfinished_requests():
        outputs, _ = engine.step()
        finals.update({o.request_id: o for o in outputs if o.finished})
    return [finals[i] for i in ids]


def test_padded_engine_matches_the_unpadded_engine(model_dir):
    loaded = load_model(EngineConfig(model=str(model_dir)), torch.device("cpu"), torch.float32)
    settings = {"num_gpu_blocks": 64, "block_size": 8, "max_num_seqs": 10, "max_num_batched_tokens": 48}
    eager = LLMEngine(EngineConfig(**settings), loaded_model=loaded)
    padded = LLMEngine(EngineConfig(**settings), loaded_model=loaded, decode_mode="padded")
    assert eager.step_runner is None and eager.health()["cuda_graphs"]["enabled"] is False
    # One block beyond the scheduler's pool, for the padding rows.
    assert padded.kv_cache.num_blocks == padded.scheduler.kv.pool.num_blocks + 1 == 65
    runner = padded.step_runner
    runner.context_bounds = [32, 48, 512]  # small bounds, so steps move between table layouts
    shapes = []
    shape_of = runner.shape_of

    def recording_shape_of(chunks):
        shapes.append((sum(c.num_tokens for c in chunks), max(c.num_tokens for c in chunks), *shape_of(chunks)))
        return shapes[-1][2:]

    runner.shape_of = recording_shape_of

    requests = workload()
    expected = run_all(eager, requests)
    got = run_all(padded, requests)
    for want, out in zip(expected, got):
        assert out.token_ids == want.token_ids
    want_lp, got_lp = expected[-1].outputs[0].logprobs, got[-1].outputs[0].logprobs
    for a, b in zip(want_lp, got_lp):
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
    # Decode and prefill steps really ran padded, across buckets and bounds.
    assert any(num < tokens for num, _, tokens, _ in shapes)
    assert {tokens for _, _, tokens, _ in shapes} >= {1, 2, 4, 8, 48}
    assert any(longest > 1 for _, longest, _, _ in shapes)  # prefill chunks, as per-token queries
    assert {bound for _, _, _, bound in shapes} == {32, 48, 512}
    pool = padded.scheduler.kv.pool
    assert pool.num_free_blocks + pool.num_evictable_blocks == pool.num_blocks


def test_padded_engine_with_prefill_tiles_matches_the_unpadded_engine(model_dir, monkeypatch):
    """With prefill tiles (their buffers beside the block tables, decodes placed first) the padded engine's greedy
    tokens and logprobs still equal the unpadded engine's. On the CPU the torch backend attends per token and
    ignores the tiles; the GPU tests run them."""
    from deepinfer.core.engine.worker import startup
    from deepinfer.core.ops import paged_attention_table

    loaded = load_model(EngineConfig(model=str(model_dir)), torch.device("cpu"), torch.float32)
    settings = {"num_gpu_blocks": 64, "block_size": 8, "max_num_seqs": 4, "max_num_batched_tokens": 48}
    monkeypatch.setattr(startup, "prefill_tile_tokens", lambda *args: 4)
    monkeypatch.setattr(paged_attention_table, "MIN_TILED_TOKENS", 8)
    padded = LLMEngine(EngineConfig(**settings), loaded_model=loaded, decode_mode="padded")
    assert padded.step_runner.buffers.tile_tokens == 4
    eager = LLMEngine(EngineConfig(**settings), loaded_model=loaded)
    loads = []
    load = padded.step_runner.buffers.load

    def recording_load(chunks, tokens, bound, *rest):
        loads.append((tokens, [c.num_tokens for c in chunks]))
        return load(chunks, tokens, bound, *rest)

    padded.step_runner.buffers.load = recording_load
    requests = workload()
    for want, got in zip(run_all(eager, requests), run_all(padded, requests)):
        assert got.token_ids == want.token_ids
        for a, b in zip(want.outputs[0].logprobs or [], got.outputs[0].logprobs or []):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
    # Tiled steps ran, with decodes and prefill chunks side by side.
    assert any(tokens > 4 and 1 in lengths and max(lengths) > 1 for tokens, lengths in loads)


@pytest.mark.parametrize("family", ["mistral", "qwen2", "gemma2", "qwen3"])
def test_padded_steps_keep_windows_softcaps_and_qk_norms(tiny_models, family):
    """Per-token queries see exactly the window of a prefill row (Mistral, Qwen2, Gemma 2), Gemma 2's
    softcaps and Qwen3's q/k norms: the padded engine's greedy tokens and logprobs equal the eager
    engine's on prompts longer than the windows."""
    directory, _ = tiny_models[family]
    loaded = load_model(EngineConfig(model=str(directory)), torch.device("cpu"), torch.float32)
    settings = {"num_gpu_blocks": 64, "block_size": 8, "max_num_seqs": 4, "max_num_batched_tokens": 24}
    eager = LLMEngine(EngineConfig(**settings), loaded_model=loaded)
    padded = LLMEngine(EngineConfig(**settings), loaded_model=loaded, decode_mode="padded")
    requests = [(prompt(length, 60 + length), SamplingParams(temperature=0.0, max_tokens=8, logprobs=1,
                                                             ignore_eos=True)) for length in (23, 9, 31)]
    for want, got in zip(run_all(eager, requests), run_all(padded, requests)):
        assert got.token_ids == want.token_ids
        for a, b in zip(want.outputs[0].logprobs, got.outputs[0].logprobs):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5)


def test_graphs_need_cuda(model_dir):
    loaded = load_model(EngineConfig(model=str(model_dir)), torch.device("cpu"), torch.float32)
    with pytest.raises(DeepInferError, match="needs a CUDA device"):
        LLMEngine(EngineConfig(num_gpu_blocks=8), loaded_model=loaded, decode_mode="graphs")
    with pytest.raises(DeepInferError, match="'native' cannot serve this model: device is cpu"):
        LLMEngine(EngineConfig(num_gpu_blocks=8, attention_backend="native"), loaded_model=loaded)
    health = LLMEngine(EngineConfig(num_gpu_blocks=8), loaded_model=loaded).health()
    assert health["attention_backend"] == "torch" and health["cuda_graphs"]["enabled"] is False
    assert health["kernels"]["available"] is False


# GPU ---------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def near_tie_or_equal(reference, other, tolerance):
    """Greedy tokens equal, except that after a step where the reference's top two logprobs are
    within `tolerance` (a near-tie, where kernel rounding may pick either) the rest is not compared."""
    for step, (a, b) in enumerate(zip(reference.token_ids, other.token_ids)):
        if a != b:
            (_, first), (_, second) = reference.outputs[0].logprobs[step].top[:2]
            return first - second < tolerance
    return len(reference.token_ids) == len(other.token_ids)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("quantization", [None, "w4a16"])
def test_cuda_graphs_match_eager(model_dir, quantization):
    pytest.importorskip("cupy")
    settings = {"model": str(model_dir), "dtype": "float16", "num_gpu_blocks": 128, "block_size": 16,
                "max_num_seqs": 12, "max_num_batched_tokens": 64, "quantization": quantization}
    graphs = LLMEngine(EngineConfig(**settings))
    health = graphs.health()
    assert health["attention_backend"] == "native" and health["cuda_graphs"]["enabled"]
    assert health["cuda_graphs"]["buckets"] == [1, 2, 4, 8, 12, 24, 48, 64]
    padded = LLMEngine(EngineConfig(**settings), decode_mode="padded")
    eager = LLMEngine(EngineConfig(**settings, enforce_eager=True))
    assert eager.health()["cuda_graphs"]["enabled"] is False
    synchronous = LLMEngine(EngineConfig(**settings, async_scheduling=False))

    requests = [(p, SamplingParams(temperature=0.0, max_tokens=params.max_tokens, logprobs=2, ignore_eos=True))
                for p, params in workload()]
    from_graphs, from_padded, from_eager, from_sync = (run_all(e, requests)
                                                       for e in (graphs, padded, eager, synchronous))
    # Async scheduling (graphs, padded and eager above) changes when the host reads a step, not what it computes.
    assert [o.token_ids for o in from_graphs] == [o.token_ids for o in from_sync]
    for a, b in zip(from_graphs, from_sync):
        assert [lp.logprob for lp in a.outputs[0].logprobs] == [lp.logprob for lp in b.outputs[0].logprobs]
    # A replay computes exactly what the padded step computes eagerly.
    assert [o.token_ids for o in from_graphs] == [o.token_ids for o in from_padded]
    for a, b in zip(from_graphs, from_padded):
        assert [lp.logprob for lp in a.outputs[0].logprobs] == [lp.logprob for lp in b.outputs[0].logprobs]
    # The unpadded eager engine batches and splits differently: equal up to near-ties.
    assert all(near_tie_or_equal(e, g, 0.02) for e, g in zip(from_eager, from_graphs))
    assert sum(e.token_ids == g.token_ids for e, g in zip(from_eager, from_graphs)) >= len(requests) - 1


def runs_with_and_without_pdl(monkeypatch, model_dir, variants: dict) -> dict:
    """The workload's greedy outputs (logprobs on) of a bf16 W4A16 engine per variant (`enforce_eager` for the
    config, `decode_mode` for the engine), with DEEPINFER_PDL=1 and =0: {(flag, variant name): outputs}."""
    from deepinfer.kernels import launch as kernel_launch

    settings = {"model": str(model_dir), "dtype": "bfloat16", "num_gpu_blocks": 128, "block_size": 16,
                "max_num_seqs": 12, "max_num_batched_tokens": 64, "quantization": "w4a16"}
    requests = [(p, SamplingParams(temperature=0.0, max_tokens=params.max_tokens, logprobs=2, ignore_eos=True))
                for p, params in workload()]
    results = {}
    try:
        for flag in ("1", "0"):
            monkeypatch.setenv("DEEPINFER_PDL", flag)
            kernel_launch._programmatic.cache_clear()
            for name, options in variants.items():
                config = EngineConfig(**settings, enforce_eager=options.get("enforce_eager", False))
                engine = LLMEngine(config, decode_mode=options.get("decode_mode"))
                results[flag, name] = run_all(engine, requests)
            assert kernel_launch._programmatic(torch.cuda.current_device()) is (flag == "1")
    finally:
        kernel_launch._programmatic.cache_clear()
    return results


@pytest.mark.gpu
@needs_cuda
def test_programmatic_dependent_launch_changes_no_result(model_dir, monkeypatch):
    """PDL lets a kernel start while the one before it runs; every kernel waits before reading that one's
    output, so graphed and eager steps compute bit for bit what fully serialized launches compute."""
    pytest.importorskip("cupy")
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    results = runs_with_and_without_pdl(monkeypatch, model_dir, {False: {"enforce_eager": False},
                                                                 True: {"enforce_eager": True}})
    for eager in (False, True):
        with_pdl, without = results["1", eager], results["0", eager]
        assert [o.token_ids for o in with_pdl] == [o.token_ids for o in without]
        for a, b in zip(with_pdl, without):
            assert [lp.logprob for lp in a.outputs[0].logprobs] == [lp.logprob for lp in b.outputs[0].logprobs]


@pytest.mark.gpu
@needs_cuda
def test_fused_epilogues_replay_and_overlap_like_the_serialized_eager_steps(wide_model_dir, caplog, monkeypatch):
    """A W4 model whose merged q/k/v product carries RoPE and the cache write in its epilogue and whose merged
    gate/up product carries the activation: graph replays compute what the padded eager steps compute, and with
    programmatic dependent launch off the same again (the decode kernel reads older cache rows before the step's
    cache write has finished, and the gate/up product's K splits meet across CTAs, through a cluster on SM90+; a
    race would show here)."""
    pytest.importorskip("cupy")
    from deepinfer.core.ops import dispatch

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    monkeypatch.delenv(dispatch.FORCE_REFERENCE_ENV, raising=False)
    dispatch.reset_log()
    caplog.set_level(logging.INFO, logger="deepinfer.ops")
    results = runs_with_and_without_pdl(monkeypatch, wide_model_dir, {"graphs": {"decode_mode": "graphs"},
                                                                      "padded": {"decode_mode": "padded"}})
    messages = [r.getMessage() for r in caplog.records]
    assert "quant_matmul_rope_cache: CUDA kernel" in messages and "quant_matmul_act_and_mul: CUDA kernel" in messages
    reference = results["0", "padded"]
    for key, outputs in results.items():
        assert [o.token_ids for o in outputs] == [o.token_ids for o in reference], key
        for a, b in zip(outputs, reference):
            assert [lp.logprob for lp in a.outputs[0].logprobs] == [lp.logprob for lp in b.outputs[0].logprobs], key


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_graphed_prefill_tiles_match_eager(prefill_model_dir, dtype):
    """Prompts of up to 200 tokens, chunked by a 128-token budget beside decodes: graph replays, whose prefill chunks
    attend in tiles on paged_prefill_attention, compute exactly what the padded steps compute eagerly, and match the
    unpadded eager engine (SDPA for prefill chunks) up to near-ties."""
    pytest.importorskip("cupy")
    from deepinfer.core.ops import dispatch

    dispatch.reset_log()  # health reports every path this process took; other models' tests took others
    settings = {"model": str(prefill_model_dir), "dtype": dtype, "num_gpu_blocks": 256, "block_size": 16,
                "max_num_seqs": 4, "max_num_batched_tokens": 128}
    graphs = LLMEngine(EngineConfig(**settings))
    assert graphs.step_runner.buffers.tile_tokens == 32
    padded = LLMEngine(EngineConfig(**settings), decode_mode="padded")
    eager = LLMEngine(EngineConfig(**settings, enforce_eager=True))
    requests = [(prompt(length, 70 + length), SamplingParams(temperature=0.0, max_tokens=12, logprobs=2,
                                                             ignore_eos=True)) for length in (150, 40, 90, 7, 200, 65)]
    from_graphs, from_padded, from_eager = (run_all(e, requests) for e in (graphs, padded, eager))
    assert [o.token_ids for o in from_graphs] == [o.token_ids for o in from_padded]
    for a, b in zip(from_graphs, from_padded):
        assert [lp.logprob for lp in a.outputs[0].logprobs] == [lp.logprob for lp in b.outputs[0].logprobs]
    assert all(near_tie_or_equal(e, g, 0.02) for e, g in zip(from_eager, from_graphs))
    assert sum(e.token_ids == g.token_ids for e, g in zip(from_eager, from_graphs)) >= len(requests) - 1
    assert graphs.health()["kernels"]["ops"]["paged_prefill_attention"] == "kernel"


# One engine inside --max-vram in a fresh process (an empty allocator, nothing else of the suite on the device).
MAX_VRAM_RUN = """
import json, random, sys
import torch
from deepinfer import SamplingParams
from deepinfer.core.config import EngineConfig
from deepinfer.core.engine.llm_engine import LLMEngine

max_vram = int(sys.argv[1])
engine = LLMEngine(EngineConfig(dummy_weights=True, shape="smollm2-135m", quantization="w4a16", max_vram=max_vram,
                                max_num_seqs=8, max_model_len=4096))
rng = random.Random(0)
ids = [engine.add_request([rng.randrange(1000, 40000) for _ in range(rng.randrange(200, 1800))],
                          SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)) for _ in range(16)]
finals = {}
while engine.has_unfinished_requests():
    outputs, _ = engine.step()
    finals.update({o.request_id: o for o in outputs if o.finished})
print(json.dumps({"reserved": torch.cuda.max_memory_reserved(), "allocated": torch.cuda.max_memory_allocated(),
                  "tokens": [len(finals[i].outputs[0].token_ids) for i in ids],
                  "budget": engine.kv_budget.as_dict(), "graphs": engine.health()["cuda_graphs"]["enabled"]}))
"""


@pytest.mark.gpu
@needs_cuda
def test_max_vram_holds_what_torch_reserves():
    """The KV pool takes whatever the budget leaves, so any reserved byte the budget misses shows: a budget that
    counted allocations only (not the holes between the weights) would let start-up reserve more than max_vram."""
    import json
    import subprocess
    import sys

    pytest.importorskip("cupy")
    max_vram = 1024**3
    run = subprocess.run([sys.executable, "-c", MAX_VRAM_RUN, str(max_vram)], check=False, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["graphs"] and result["budget"]["source"] == "max_vram"
    assert result["tokens"] == [24] * 16
    assert result["reserved"] <= max_vram, result


@pytest.mark.gpu
@needs_cuda
def test_compaction_gives_back_the_holes_between_weights_and_keeps_their_values():
    from deepinfer.core.models.compaction import MIN_HOLE_BYTES, compact_weights, reserved_holes

    device = torch.device("cuda")
    torch.cuda.empty_cache()
    generator = torch.Generator(device=device).manual_seed(0)
    model, temporaries = torch.nn.Module(), []
    # 4 MiB tensors share the allocator's 20 MiB segments: keeping every other one leaves 4 MiB holes that
    # empty_cache cannot release, as merging projections does with the parts it frees.
    for i in range(48):
        model.register_buffer(f"w{i}", torch.randn(1 << 20, generator=generator, device=device))
        temporaries.append(torch.empty(1 << 20, device=device))
    expected = {name: buffer.cpu() for name, buffer in model.named_buffers()}
    before = reserved_holes(device)
    del temporaries
    assert reserved_holes(device) - before >= 48 * 4 * 1024**2 * 0.7 > MIN_HOLE_BYTES
    given_back = compact_weights(model, device)
    assert given_back >= 48 * 4 * 1024**2 * 0.7
    assert all(buffer.device.type == "cuda" and torch.equal(buffer.cpu(), expected[name])
               for name, buffer in model.named_buffers())
    assert reserved_holes(device) <= before + 20 * 1024**2  # back to where it was, give or take a segment
