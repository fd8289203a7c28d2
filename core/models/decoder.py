"""DecoderModel: one generic decoder-only transformer driven by a ModelSpec.

It runs one FLAT batch of tokens from many requests (no batch dimension): prefill chunks and
decode tokens share one forward; attention over each request's paged context is the attention
backend's job (`model.attention_backend`, shared by all layers, swappable by the engine).

Parameter names are HF's Llama names (`model.layers.{i}.self_attn.q_proj.weight`, ...) so every
weight reader maps its format onto them and `load_weights` checks names and shapes in one place.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from deepinfer.core.attention.torch_backend import TorchPagedAttention
from deepinfer.core.errors import ModelLoadError
from deepinfer.core.models.layers import DecoderLayer, RMSNorm, RotaryEmbedding
from deepinfer.core.models.spec import ModelSpec
from deepinfer.core.ops.logits_head import logits_head

# Tensors some checkpoints carry that the model derives itself.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class DecoderBody(nn.Module):
    """HF's `model.` prefix: embedding, layers, final norm."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, dtype, device) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, spec.norm_weight_offset, dtype, device)


class DecoderModel(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype = torch.float32, device: Any = "cpu",
                 max_positions: int | None = None) -> None:
        super().__init__()
        self.spec = spec
        # Parameters start uninitialized (meta, then empty on the device): they are filled by
        # load_weights or init_dummy_weights, never by a slow default init of a multi-GB model.
        self.model = DecoderBody(spec, dtype, "meta")
        self.lm_head = None
        if not spec.tie_word_embeddings:
            self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False, dtype=dtype, device="meta")
        self.to_empty(device=device)
        self.rotary_emb = RotaryEmbedding(spec, max_positions or spec.max_position_embeddings, device)
        embed_scale = None
        if spec.embedding_scale is not None:
            embed_scale = torch.tensor(spec.embedding_scale, dtype=torch.float32, device=device)
        self.register_buffer("embed_scale", embed_scale, persistent=False)
        self.attention_backend: Any = TorchPagedAttention()
        # A tensor-parallel rank's place in its group (core/distributed); None on one device.
        self.parallel: Any = None

    @classmethod
    def on_meta(cls, spec: ModelSpec, dtype: torch.dtype, device: Any, max_positions: int | None = None) -> DecoderModel:
        """A model whose parameters are on the meta device, to be put in place one at a time (a layered
        checkpoint's tensors, random packed codes), so no unquantized copy of the projections is ever
        made, and whose derived buffers (rotary tables, embedding scale) are on `device`: computed by
        the model code itself in a layer-less, one-token twin, at a tiny cost."""
        model = cls(spec, dtype=dtype, device="meta", max_positions=max_positions)
        twin_spec = replace(spec, num_layers=0, sliding_windows=(), vocab_size=1, tie_word_embeddings=True)
        twin = cls(twin_spec, dtype=dtype, device=device, max_positions=max_positions)
        for name, buffer in twin.named_buffers():
            module_name, _, attr = name.rpartition(".")
            module = model.get_submodule(module_name)
            module.register_buffer(attr, buffer, persistent=attr not in module._non_persistent_buffers_set)
        return model

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Any,
                kv_cache: Any) -> torch.Tensor:
        """input_ids, positions: [T] int64 -> final-normed hidden states [T, hidden]."""
        hidden = self.model.embed_tokens(input_ids)  # [T, hidden]
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale.to(hidden.dtype)  # Gemma: scale rounded to dtype, as HF
        cos, sin = self.rotary_emb(positions, hidden.dtype)  # [T, 1, head_dim // 2] each
        residual = None
        for layer in self.model.layers:
            hidden, residual = layer(hidden, residual, cos, sin, self.attention_backend, attn_metadata, kv_cache)
        return self.model.norm.add_and_norm(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] float32 (Gemma 2's final softcap applied)."""
        head = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = logits_head(hidden, head)
        if self.parallel is not None:  # the rank's vocabulary slice: rank 0 gathers them whole
            logits = self.parallel.gather_vocab(logits, self.spec.vocab_size)
        cap = self.spec.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy (hf_name, tensor) pairs into the parameters; every parameter must be loaded once.

        Raises ModelLoadError naming the tensor on an unknown name or a shape mismatch, and
        listing what is missing at the end. A tied lm_head is taken from the embedding.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and self.lm_head is None):
                continue
            param = params.get(name)
            if param is None:
                raise ModelLoadError(f"checkpoint tensor {name!r} has no place in the {self.spec.family} model")
            if tuple(tensor.shape) != tuple(param.shape):
                raise ModelLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}, "
                                     f"the model expects {tuple(param.shape)}")
            param.copy_(tensor.to(device=param.device, dtype=param.dtype))
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise ModelLoadError(f"checkpoint lacks {len(missing)} tensor(s) the model needs: {shown}")

    @torch.no_grad()
    def init_dummy_weights(self, seed: int = 0) -> None:
        """Random weights for speed runs (values do not change speed): N(0, 0.02), norms at 1."""
        generator = torch.Generator(device=self.model.embed_tokens.weight.device).manual_seed(seed)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0 - self.spec.norm_weight_offset)  # effective scale 1 either way
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.normal_(0.0, 0.02, generator=generator)
