"""Cutting one rank's shard out of a loaded model, in place: dense and packed projections alike.

`shard_model` runs once the model is read (and quantized, when that happens at load), before q/k/v and
gate/up are merged and before prepare_products lays the packed weights out for the GPU kernels, so every
later step sees an ordinary, smaller model. Every rank reads the same checkpoint and cuts its own part
(core/distributed/shard_plan.py says which):

- column-parallel (q/k/v, gate/up): whole output rows, with their scales, zero points and bias;
- row-parallel (o_proj, down_proj): an input-column range K0..K1, then wrapped in RowParallel (all-reduce);
  a packed weight is cut on its 32-code word runs, and where a cut falls inside a quantization group (an
  uneven head split: SmolLM2's 320 of 576 o_proj columns in groups of 128) the groups are refined to
  gcd(G, K0, K1 - K0) columns with the parent group's scale repeated, which is exact;
- act-order (a packed down_proj with input_perm): the rank's MLP channels are the permutation's slice over
  its columns, so its gate/up rows are those channels and its down_proj needs no permutation. An act-order
  o_proj is refused: its columns would mix heads of several ranks.
- embedding and an untied head: the rank's vocabulary rows.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import nn

from deepinfer.core.distributed.parallel_context import ParallelContext
from deepinfer.core.distributed.parallel_layers import RowParallel, VocabParallelEmbedding
from deepinfer.core.distributed.shard_plan import channel_range, head_shard, vocab_range
from deepinfer.core.errors import ModelLoadError
from deepinfer.core.quant.packed import PackedWeight
from deepinfer.core.quant.quant_linear import QuantLinear

PACK_RUN = 32  # codes per whole run of packed words, for every bit width (3 bits: 32 codes in 3 words)


@torch.no_grad()
def shard_model(model: nn.Module, parallel: ParallelContext) -> None:
    """Replace `model`'s full layers by rank `parallel.rank`'s shards; `model.spec` becomes the rank's
    (its per-rank head and channel counts; the vocabulary stays whole: the logits are gathered whole)."""
    spec = model.spec
    if model.model.layers and model.model.layers[0].self_attn.qkv_proj is not None:
        raise ModelLoadError("a tensor-parallel shard is cut before q/k/v and gate/up are merged")
    try:
        heads = head_shard(spec.num_heads, spec.num_kv_heads, parallel.world_size, parallel.rank)
        inner = None
        for layer in model.model.layers:
            shard_attention(layer.self_attn, heads, parallel)
            inner = shard_mlp(layer.mlp, parallel)
        start, end = vocab_range(spec.vocab_size, parallel.world_size, parallel.rank)
    except ValueError as err:  # a count the ranks cannot share
        raise ModelLoadError(f"the model cannot be split over {parallel.world_size} ranks "
                             f"({spec.num_heads} query heads, {spec.intermediate_size} MLP channels): {err}") from None
    embed = model.model.embed_tokens
    model.model.embed_tokens = VocabParallelEmbedding(embed.weight[start:end].clone(), start, parallel)
    if model.lm_head is not None:
        if type(model.lm_head) is not nn.Linear:
            raise ModelLoadError("tensor parallelism needs a dense lm_head")
        model.lm_head = _dense(model.lm_head.weight[start:end], None)
    model.spec = replace(spec, num_heads=heads.num_slots, num_kv_heads=heads.num_kv_heads,
                         intermediate_size=inner or spec.intermediate_size)
    model.parallel = parallel


def shard_attention(attn: nn.Module, heads, parallel: ParallelContext) -> None:
    dim = attn.head_dim
    q_rows = torch.cat([torch.arange(h * dim, (h + 1) * dim) for h in heads.slots])
    kv_rows = torch.arange(heads.kv_heads[0] * dim, heads.kv_heads[1] * dim)
    attn.q_proj = select_rows(attn.q_proj, q_rows)
    attn.k_proj = select_rows(attn.k_proj, kv_rows)
    attn.v_proj = select_rows(attn.v_proj, kv_rows)
    if isinstance(attn.o_proj, QuantLinear) and attn.o_proj.input_perm is not None:
        raise ModelLoadError("tensor parallelism cannot split an act-order (desc_act) o_proj: its permuted "
                             "columns mix the heads of several ranks")
    first, end = heads.heads
    attn.o_proj = RowParallel(select_columns(attn.o_proj, first * dim, end * dim, keep_bias=parallel.is_driver),
                              parallel)
    attn.num_heads, attn.num_kv_heads = heads.num_slots, heads.num_kv_heads
    attn.qkv_sizes = (heads.num_slots * dim, heads.num_kv_heads * dim, heads.num_kv_heads * dim)
    device = next(iter(attn.q_proj.state_dict().values())).device
    attn.kept_heads = torch.tensor(heads.kept_slots, device=device) if heads.padded else None


def shard_mlp(mlp: nn.Module, parallel: ParallelContext) -> int:
    """-> the rank's channel count."""
    down = mlp.down_proj
    packed = isinstance(down, QuantLinear)
    unit = (down.group_size if down.group_size < down.in_features else PACK_RUN) if packed else 1
    start, end = channel_range(mlp.inner, parallel.world_size, parallel.rank, unit)
    if packed and down.input_perm is not None:
        channels = down.input_perm[start:end].long()
    else:
        channels = torch.arange(start, end)
    mlp.gate_proj = select_rows(mlp.gate_proj, channels)
    mlp.up_proj = select_rows(mlp.up_proj, channels)
    mlp.down_proj = RowParallel(select_columns(down, start, end, keep_bias=parallel.is_driver,
                                               drop_perm=True), parallel)
    mlp.inner = end - start
    return mlp.inner


def select_rows(linear: nn.Module, rows: torch.Tensor) -> nn.Module:
    """The linear's output rows `rows` ([n] int64, any order, repeats allowed): a column-parallel shard."""
    if isinstance(linear, QuantLinear):
        p = linear.packed
        rows = rows.to(p.qweight.device)
        return QuantLinear(PackedWeight(
            qweight=p.qweight.index_select(0, rows), scales=p.scales.index_select(0, rows),
            zeros=p.zeros.index_select(0, rows), bits=p.bits, group_size=p.group_size, in_features=p.in_features,
            out_features=rows.numel(), zero_mode=p.zero_mode, input_perm=p.input_perm,
            bias=None if p.bias is None else p.bias.index_select(0, rows)))
    rows = rows.to(linear.weight.device)
    return _dense(linear.weight.index_select(0, rows),
                  None if linear.bias is None else linear.bias.index_select(0, rows))


def select_columns(linear: nn.Module, start: int, end: int, keep_bias: bool, drop_perm: bool = False) -> nn.Module:
    """The linear's input columns [start, end): a row-parallel shard; its bias only where `keep_bias`.
    `drop_perm`: the caller has put the act-order permutation's channels in column order already."""
    bias = linear.bias if keep_bias else None
    if not isinstance(linear, QuantLinear):
        return _dense(linear.weight[:, start:end], bias)
    p = linear.packed
    if start % PACK_RUN or (end - start) % PACK_RUN:
        raise ModelLoadError(f"a packed {p.out_features}x{p.in_features} weight cannot be cut at columns "
                             f"{start}..{end}: the cut must fall on a {PACK_RUN}-column boundary")
    if p.input_perm is not None and not drop_perm:
        raise ModelLoadError("an act-order weight cannot be cut along its input columns")
    width = end - start
    if p.group_size == p.in_features:  # per-channel: one scale per row, whatever the columns
        group, scales, zeros = width, p.scales, p.zeros
    else:
        group = math.gcd(p.group_size, start, width)
        repeat = p.group_size // group
        scales = p.scales.repeat_interleave(repeat, dim=1)[:, start // group:end // group]
        zeros = p.zeros.repeat_interleave(repeat, dim=1)[:, start // group:end // group]
    words = slice(start * p.bits // 32, end * p.bits // 32)
    return QuantLinear(PackedWeight(
        qweight=p.qweight[:, words].contiguous(), scales=scales.contiguous(), zeros=zeros.contiguous(),
        bits=p.bits, group_size=group, in_features=width, out_features=p.out_features, zero_mode=p.zero_mode,
        input_perm=None, bias=bias))


def _dense(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype, device="meta")
    linear.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.clone(), requires_grad=False)
    return linear
