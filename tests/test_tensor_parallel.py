"""Tensor parallelism on the CPU (gloo): a model's shards across 2 ranks compute the logits of the whole model.

Each case spawns the ranks (torch.multiprocessing), every rank loads the same checkpoint through load_model
with its ParallelContext, runs one prefill window (core/eval/window_logits.py, paged KV cache of the rank's
KV heads), and rank 0 writes the gathered logits; the reference is the same model loaded whole in this process.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.multiprocessing as mp

from deepinfer.core.config import EngineConfig
from deepinfer.core.distributed.process_group import free_port, join_group, leave_group
from deepinfer.core.distributed.shard_plan import head_shard
from deepinfer.core.distributed.shard_weights import select_columns, select_rows
from deepinfer.core.eval.window_logits import WindowLogits
from deepinfer.core.models.loader import load_model
from deepinfer.core.quant.packing import dequantize
from deepinfer.core.quant.quant_linear import QuantLinear
from deepinfer.core.quant.rtn import quantize_rtn

TOKENS = [5, 17, 200, 3, 99, 42, 7, 311, 64, 150, 8, 1, 250, 77, 19, 300, 2, 45, 123]


def smollm2_shape(tmp_path, num_layers: int = 2, vocab_size: int = 1000) -> str:
    """SmolLM2-135M's shape (9 query / 3 KV heads: uneven at TP=2 and 4), fewer layers and a smaller vocabulary
    (odd-sized slices at TP=2 when `vocab_size` is odd)."""
    from deepinfer.core.models.loader import shape_file_path

    config = json.loads(shape_file_path("smollm2-135m").read_text())
    path = tmp_path / "smollm2-small.json"
    path.write_text(json.dumps({**config, "num_hidden_layers": num_layers, "vocab_size": vocab_size}))
    return str(path)


def _rank_logits(rank: int, world_size: int, port: int, configs: list[EngineConfig], tokens: list[int],
                 out: str) -> None:
    torch.set_num_threads(1)
    parallel = join_group(rank, world_size, port, torch.device("cpu"))
    try:
        logits = [WindowLogits(load_model(config, "cpu", torch.float32, parallel).model, len(tokens))(tokens)
                  for config in configs]
        if rank == 0:
            torch.save(logits, out)
    finally:
        leave_group()


def parallel_logits(configs: list[EngineConfig], world_size: int, tmp_path, tokens=TOKENS) -> list[torch.Tensor]:
    """Each config's logits [T, vocab] over `tokens`, from `world_size` ranks (one spawn for all the configs)."""
    out = str(tmp_path / "logits.pt")
    mp.spawn(_rank_logits, args=(world_size, free_port(), configs, tokens, out), nprocs=world_size)
    return torch.load(out)


def whole_logits(config: EngineConfig, tokens=TOKENS) -> torch.Tensor:
    return WindowLogits(load_model(config, "cpu", torch.float32).model, len(tokens))(tokens)


def assert_same_logits(parallel: torch.Tensor, whole: torch.Tensor) -> None:
    """Within fp32 tolerance of the logits' scale, and the same greedy token wherever the top-2 margin is wider."""
    assert parallel.shape == whole.shape
    tolerance = 1e-4 * whole.abs().max().item()
    assert (parallel - whole).abs().max().item() <= tolerance
    top2 = whole.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * tolerance
    assert clear.any()
    assert torch.equal(parallel.argmax(-1)[clear], whole.argmax(-1)[clear])


# The plan -----------------------------------------------------------------------------------------------------

def test_uneven_head_split_owns_every_head_once_and_pads_kv_groups():
    for world_size in (2, 3, 4):
        shards = [head_shard(9, 3, world_size, rank) for rank in range(world_size)]
        owned = [shard.slots[slot] for shard in shards for slot in shard.kept_slots]
        assert owned == list(range(9))
        for shard in shards:
            assert shard.num_slots == 3 * shard.num_kv_heads  # every KV head serves 3 slots
            for index, head in enumerate(shard.slots):  # each slot's head reads the slot's KV head
                assert head // 3 == shard.kv_heads[0] + index // 3
    assert head_shard(9, 3, 2, 0).slots == (0, 1, 2, 3, 4, 3)
    assert head_shard(9, 3, 2, 1).slots == (5, 5, 5, 6, 7, 8)


# Packed shards against the dequantized whole ------------------------------------------------------------------

@pytest.mark.parametrize("bits", [3, 4, 8])
def test_packed_row_and_column_shards_dequantize_to_the_whole_weights_slices(bits):
    torch.manual_seed(0)
    weight = torch.randn(96, 576)
    packed = QuantLinear(quantize_rtn(weight, bits, 64, sym=False))
    whole = dequantize(packed.packed)
    rows = torch.tensor([5, 3, 3, 90, 0])
    assert torch.equal(dequantize(select_rows(packed, rows).packed), whole[rows])
    for start, end in [(0, 320), (320, 576), (64, 96)]:  # 320: inside a group of 128, and of 64 with 32
        shard = select_columns(packed, start, end, keep_bias=True)
        assert torch.equal(dequantize(shard.packed), whole[:, start:end])


def test_packed_column_shards_refine_groups_that_a_cut_splits():
    torch.manual_seed(1)
    packed = QuantLinear(quantize_rtn(torch.randn(8, 512), 4, 128, sym=False))
    shard = select_columns(packed, 0, 320, keep_bias=True)
    assert shard.packed.group_size == 64
    assert torch.equal(dequantize(shard.packed), dequantize(packed.packed)[:, :320])


# Whole models at TP=2 -----------------------------------------------------------------------------------------

def test_smollm2_shape_dense_and_w4a16_tp2_logits_match_tp1(tmp_path):
    configs = [EngineConfig(dummy_weights=True, shape=smollm2_shape(tmp_path, vocab_size=1001), device="cpu"),
               EngineConfig(dummy_weights=True, shape=smollm2_shape(tmp_path), device="cpu", quantization="w4a16")]
    for parallel, config in zip(parallel_logits(configs, 2, tmp_path), configs):
        assert_same_logits(parallel, whole_logits(config))


def test_tiny_llama_tp2_logits_match_tp1(tiny_llama_dir, tmp_path):
    config = EngineConfig(str(tiny_llama_dir), device="cpu")
    assert_same_logits(parallel_logits([config], 2, tmp_path)[0], whole_logits(config))


def family_configs(tiny_models) -> list[EngineConfig]:
    return [EngineConfig(str(directory), device="cpu") for directory, _ in tiny_models.values()]


@pytest.mark.slow
def test_every_family_tp2_logits_match_tp1(tiny_models, tmp_path):
    """Qwen2's q/k/v bias, Qwen3's q/k norms, Mistral's and Gemma 2's sliding windows, Gemma's tied, scaled
    embedding, Gemma 2's attention and final softcaps (4 / 2 heads: 2 / 1 per rank)."""
    configs = family_configs(tiny_models)
    for parallel, config in zip(parallel_logits(configs, 2, tmp_path), configs):
        assert_same_logits(parallel, whole_logits(config))


@pytest.mark.slow
def test_every_family_and_smollm2_shape_tp4_logits_match_tp1(tiny_models, tmp_path):
    """At TP=4 the tiny models' 2 KV heads are each held by 2 ranks; SmolLM2's 9 heads split 3/2/2/2."""
    configs = [*family_configs(tiny_models),
               EngineConfig(dummy_weights=True, shape=smollm2_shape(tmp_path, vocab_size=1003), device="cpu"),
               EngineConfig(dummy_weights=True, shape=smollm2_shape(tmp_path), device="cpu", quantization="w4a16")]
    for parallel, config in zip(parallel_logits(configs, 4, tmp_path), configs):
        assert_same_logits(parallel, whole_logits(config))


# Step messages ------------------------------------------------------------------------------------------------

_METADATA_FIELDS = ("slot_mapping", "query_start_loc", "seq_lens", "block_tables", "query_lens", "seq_lens_host",
                    "num_decodes", "max_query_len", "max_seq_len", "fresh_tokens")


def _fields(meta) -> dict:
    return {name: getattr(meta, name).clone() if isinstance(getattr(meta, name), torch.Tensor)
            else getattr(meta, name) for name in _METADATA_FIELDS}


def _rank_messages(rank: int, world_size: int, port: int, out: str) -> None:
    import time

    from deepinfer.core.distributed.step_message import FORWARD, STOP, StepChannel
    from deepinfer.core.engine.worker.step_inputs import SequenceChunk, build_attention_metadata

    parallel = join_group(rank, world_size, port, torch.device("cpu"), timeout_s=1.0)
    try:
        channel = StepChannel(torch.device("cpu"), parallel.control_group)
        if rank == 0:
            chunks = [SequenceChunk([3, 1], 5, 1), SequenceChunk([0, 2], 0, 7)]  # a decode, then a prefill
            meta, positions = build_attention_metadata(chunks, 4, "cpu")
            time.sleep(2.0)  # idle past the group timeout: the other rank still waits
            channel.send_forward(torch.arange(8) + 100, positions, meta)
            channel.send_stop()
            torch.save((positions.clone(), _fields(meta)), out)
            return
        header = channel.receive_header()
        assert header[0] == FORWARD
        received = channel.receive_forward(header)
        assert channel.receive_header()[0] == STOP
        input_ids, positions, meta = received
        torch.save((input_ids.clone(), positions.clone(), _fields(meta)), out + f".{rank}")
    finally:
        leave_group()


def test_a_step_message_carries_the_inputs_and_metadata_after_any_idle_time(tmp_path):
    out = str(tmp_path / "message.pt")
    mp.spawn(_rank_messages, args=(2, free_port(), out), nprocs=2)
    positions, sent = torch.load(out)
    input_ids, got_positions, got = torch.load(out + ".1")
    assert torch.equal(input_ids, torch.arange(8) + 100) and torch.equal(got_positions, positions)
    for name, value in sent.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(got[name], value) and got[name].dtype == value.dtype, name
        else:
            assert got[name] == value, name


def _packed_mlp(act_order: bool):
    """A GatedMLP (hidden 64, 512 channels) whose projections are W4 packed in groups of 128; with `act_order`
    down_proj's columns are a random permutation of the channels (GPTQ desc_act, re-sorted into groups)."""
    from deepinfer.core.models.layers import GatedMLP
    from deepinfer.core.models.spec import ModelSpec

    spec = ModelSpec.from_hf_config({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64,
                                     "hidden_size": 64, "intermediate_size": 512, "num_hidden_layers": 1,
                                     "num_attention_heads": 2, "max_position_embeddings": 64})
    torch.manual_seed(2)
    mlp = GatedMLP(spec, torch.float32, "cpu")
    mlp.gate_proj = QuantLinear(quantize_rtn(torch.randn(512, 64) * 0.1, 4, 64, sym=False))
    mlp.up_proj = QuantLinear(quantize_rtn(torch.randn(512, 64) * 0.1, 4, 64, sym=False))
    down = quantize_rtn(torch.randn(64, 512) * 0.1, 4, 128, sym=False)
    if act_order:
        down.input_perm = torch.randperm(512).to(torch.int32)
    mlp.down_proj = QuantLinear(down)
    return mlp


@pytest.mark.parametrize("act_order", [False, True])
def test_packed_mlp_shards_sum_to_the_whole_mlp(act_order):
    """Each rank's partial down_proj product (before the all-reduce) over its channels: the sum is the whole MLP."""
    import copy

    from deepinfer.core.distributed.parallel_context import ParallelContext
    from deepinfer.core.distributed.shard_weights import shard_mlp

    mlp = _packed_mlp(act_order)
    x = torch.randn(5, 64)
    whole = mlp(x)
    partials = []
    for rank in range(2):
        shard = copy.deepcopy(mlp)
        assert shard_mlp(shard, ParallelContext(rank, 2)) == 256  # two groups of 128 each
        shard.down_proj = shard.down_proj.linear  # the partial product, not reduced
        assert shard.down_proj.input_perm is None
        partials.append(shard(x))
    torch.testing.assert_close(partials[0] + partials[1], whole, rtol=1e-5, atol=1e-5)


def test_more_ranks_than_heads_is_refused_with_the_counts(tiny_llama_dir):
    from deepinfer.core.distributed.parallel_context import ParallelContext
    from deepinfer.core.distributed.shard_weights import shard_model
    from deepinfer.core.errors import ModelLoadError
    from deepinfer.core.models.loader import read_model

    model = read_model(EngineConfig(str(tiny_llama_dir), device="cpu"), "cpu", torch.float32).model  # as read
    with pytest.raises(ModelLoadError, match=r"cannot be split over 8 ranks \(4 query heads"):
        shard_model(model, ParallelContext(0, 8))
