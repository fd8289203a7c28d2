"""Reference packers written from the published formats, independent of deepinfer's converters.

- GPTQ: AutoGPTQ's `QuantLinear.pack` loops (qweight [K*bits/32, N] along K, qzeros [G, N*bits/32]
  along N, 3-bit runs of 32 codes in 3 words with codes 10 and 21 split across words), storing
  zero - 1 for checkpoint_format "gptq" (v1) and the zero itself for "gptq_v2".
- AWQ: AutoAWQ's `WQLinear_GEMM.from_linear` loops (qweight [K, N/8] along N, order [0,2,4,6,1,3,5,7]).
- GGUF: gguf-py's `quants.quantize` for Q4_0/Q4_1/Q8_0, and Q4_K/Q5_K/Q6_K blocks packed here by hand
  from ggml-quants.c's block layouts (gguf-py has no quantizer for them; its `dequantize` is the
  reference). Plus tiny checkpoints of each kind around a tiny HF model, for end-to-end tests.

The ground truth of every packed tensor is the integer codes, zero points and scales the test
draws; the reference dequantization is the format's formula applied to those, in float32.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


# ----------------------------------------------------------------------------------------------- GPTQ

def autogptq_pack_rows(intweight: np.ndarray, bits: int) -> np.ndarray:
    """AutoGPTQ's row packing: uint32 codes [K, N] -> int32 [K // 32 * bits, N]."""
    intweight = intweight.astype(np.uint32)
    qweight = np.zeros((intweight.shape[0] // 32 * bits, intweight.shape[1]), dtype=np.uint32)
    i = row = 0
    while row < qweight.shape[0]:
        if bits == 4:
            for j in range(i, i + 8):
                qweight[row] |= intweight[j] << (4 * (j - i))
            i += 8
            row += 1
        elif bits == 3:
            for j in range(i, i + 10):
                qweight[row] |= intweight[j] << (3 * (j - i))
            i += 10
            qweight[row] |= intweight[i] << 30
            row += 1
            qweight[row] |= (intweight[i] >> 2) & 1
            i += 1
            for j in range(i, i + 10):
                qweight[row] |= intweight[j] << (3 * (j - i) + 1)
            i += 10
            qweight[row] |= intweight[i] << 31
            row += 1
            qweight[row] |= (intweight[i] >> 1) & 0x3
            i += 1
            for j in range(i, i + 10):
                qweight[row] |= intweight[j] << (3 * (j - i) + 2)
            i += 10
            row += 1
        else:
            raise NotImplementedError(bits)
    return qweight.astype(np.int32)


def random_gptq_linear(out_features: int, in_features: int, bits: int, group_size: int, *, sym: bool,
                       desc_act: bool, seed: int) -> dict[str, torch.Tensor]:
    """Ground truth of one GPTQ linear: codes [K, N], zeros [G, N], scales [G, N] fp16, g_idx [K]."""
    rng = np.random.default_rng(seed)
    group = in_features if group_size == -1 else group_size
    num_groups = in_features // group
    codes = rng.integers(0, 2**bits, size=(in_features, out_features))
    if sym:
        zeros = np.full((num_groups, out_features), 2 ** (bits - 1))
    else:
        zeros = rng.integers(0, 2**bits, size=(num_groups, out_features))  # 0 included: v1 must wrap
    scales = torch.from_numpy(rng.uniform(0.002, 0.05, size=(num_groups, out_features))).to(torch.float16)
    if desc_act:  # GPTQ act-order: column perm[i] is quantized i-th, so its group is i // group
        perm = rng.permutation(in_features)
        g_idx = np.empty(in_features, dtype=np.int64)
        g_idx[perm] = np.arange(in_features) // group
    else:
        g_idx = np.arange(in_features) // group
    return {"codes": torch.from_numpy(codes), "zeros": torch.from_numpy(zeros), "scales": scales,
            "g_idx": torch.from_numpy(g_idx).to(torch.int32)}


def gptq_dequantize(truth: dict[str, torch.Tensor]) -> torch.Tensor:
    """GPTQ's formula on the ground truth: W[n, k] = scales[g_idx[k], n] * (q[k, n] - zero[g_idx[k], n])."""
    g_idx = truth["g_idx"].long()
    scales = truth["scales"].to(torch.float32)[g_idx]  # [K, N]
    zeros = truth["zeros"].to(torch.float32)[g_idx]
    return (scales * (truth["codes"].to(torch.float32) - zeros)).T.contiguous()  # [N, K]


def gptq_tensors(truth: dict[str, torch.Tensor], bits: int, checkpoint_format: str) -> dict[str, torch.Tensor]:
    """The tensors a GPTQ checkpoint stores for the linear."""
    stored_zeros = truth["zeros"].numpy()
    if checkpoint_format == "gptq":  # v1 stores zero - 1, in `bits` bits
        stored_zeros = (stored_zeros - 1) % 2**bits
    qzeros = autogptq_pack_rows(stored_zeros.T, bits).T  # packed along N
    return {"qweight": torch.from_numpy(autogptq_pack_rows(truth["codes"].numpy(), bits)),
            "qzeros": torch.from_numpy(np.ascontiguousarray(qzeros)),
            "scales": truth["scales"], "g_idx": truth["g_idx"]}


# ------------------------------------------------------------------------------------------------ AWQ

AWQ_ORDER_MAP = [0, 2, 4, 6, 1, 3, 5, 7]


def autoawq_pack_columns(intweight: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's GEMM packing: int codes [R, N] -> int32 [R, N // 8]."""
    intweight = intweight.to(torch.int32)
    packed = torch.zeros((intweight.shape[0], intweight.shape[1] // 8), dtype=torch.int32)
    for col in range(intweight.shape[1] // 8):
        for i in range(8):
            packed[:, col] |= intweight[:, col * 8 + AWQ_ORDER_MAP[i]] << (i * 4)
    return packed


def random_awq_linear(out_features: int, in_features: int, group_size: int, *, zero_point: bool,
                      seed: int) -> dict[str, torch.Tensor]:
    """Ground truth: codes [K, N], zeros [G, N] (8 everywhere without zero_point), scales [G, N] fp16."""
    gen = torch.Generator().manual_seed(seed)
    group = in_features if group_size == -1 else group_size
    num_groups = in_features // group
    codes = torch.randint(0, 16, (in_features, out_features), generator=gen)
    zeros = (torch.randint(0, 16, (num_groups, out_features), generator=gen) if zero_point
             else torch.full((num_groups, out_features), 8))
    scales = (torch.rand(num_groups, out_features, generator=gen) * 0.05 + 0.002).to(torch.float16)
    return {"codes": codes, "zeros": zeros, "scales": scales, "group": torch.tensor(group)}


def awq_dequantize(truth: dict[str, torch.Tensor]) -> torch.Tensor:
    """AWQ's formula: W[k, n] = (q[k, n] - zero[k // G, n]) * scales[k // G, n]; returned as [N, K]."""
    group = int(truth["group"])
    zeros = truth["zeros"].to(torch.float32).repeat_interleave(group, dim=0)
    scales = truth["scales"].to(torch.float32).repeat_interleave(group, dim=0)
    return ((truth["codes"].to(torch.float32) - zeros) * scales).T.contiguous()


def awq_tensors(truth: dict[str, torch.Tensor], with_qzeros: bool = True) -> dict[str, torch.Tensor]:
    tensors = {"qweight": autoawq_pack_columns(truth["codes"]), "scales": truth["scales"]}
    if with_qzeros:
        tensors["qzeros"] = autoawq_pack_columns(truth["zeros"])
    return tensors


# ----------------------------------------------------------------------------------------------- GGUF

def _fp16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(*values.shape, 2)


def random_k_blocks(type_name: str, num_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Hand-packed Q4_K / Q5_K / Q6_K super-blocks of 256 weights (ggml-quants.c's block_q*_K).

    Every quant and sub-scale byte is random (all bit patterns are valid); only the fp16 super-scales
    are drawn so that they are finite.
    """
    d = _fp16_bytes(rng.uniform(1e-4, 2e-3, size=(num_blocks, 1)))
    if type_name == "Q6_K":  # ql[128], qh[64], int8 scales[16], d
        rest = rng.integers(0, 256, size=(num_blocks, 128 + 64 + 16), dtype=np.uint8)
        return np.concatenate([rest, d.reshape(num_blocks, 2)], axis=1)
    dmin = _fp16_bytes(rng.uniform(1e-4, 2e-3, size=(num_blocks, 1)))
    body = {"Q4_K": 12 + 128, "Q5_K": 12 + 32 + 128}[type_name]  # scales[12] (+ qh[32]) + qs[128]
    rest = rng.integers(0, 256, size=(num_blocks, body), dtype=np.uint8)
    return np.concatenate([d.reshape(num_blocks, 2), dmin.reshape(num_blocks, 2), rest], axis=1)


def gguf_quantized(weight: np.ndarray, type_name: str, rng: np.random.Generator) -> np.ndarray:
    """Bytes [N, row_bytes] of a tensor [N, K] of GGUF type `type_name`.

    Q4_0/Q4_1/Q8_0 come from gguf-py's quantizer, K-quants are random hand-packed blocks, F16/F32
    are the values themselves (as bytes).
    """
    import gguf

    if type_name == "F32":
        return weight.astype(np.float32).view(np.uint8)
    if type_name == "F16":
        return weight.astype(np.float16).view(np.uint8)
    if type_name in ("Q4_K", "Q5_K", "Q6_K"):
        rows, cols = weight.shape
        return random_k_blocks(type_name, rows * cols // 256, rng).reshape(rows, -1)
    return gguf.quants.quantize(weight.astype(np.float32), gguf.GGMLQuantizationType[type_name])


def gguf_dequantize(data: np.ndarray, type_name: str) -> np.ndarray:
    """gguf-py's reference dequantization -> float32 [N, K]."""
    import gguf

    return np.asarray(gguf.quants.dequantize(data, gguf.GGMLQuantizationType[type_name]), dtype=np.float32)


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows (rotate-half pairs interleaved per head)."""
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


_GGUF_LINEAR_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                      "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                      "mlp.down_proj": "ffn_down"}


def write_tiny_gguf(hf_model, path: Path, linear_types: dict[str, str], seed: int = 0,
                    embedding_type: str = "F32", rope_freqs: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Write `hf_model` (a tiny Llama or Qwen2 ForCausalLM) as a GGUF of its architecture, without a vocabulary.

    linear_types: HF linear name (e.g. "self_attn.q_proj") -> GGUF type, for every layer. Llama's Q/K
    rows are permuted as llama.cpp does; Qwen2's q/k/v biases are stored as F32.
    Returns HF name -> the weights the GGUF holds, dequantized by gguf-py (Q/K rows un-permuted),
    i.e. what a correct reader must load. `rope_freqs`: Llama 3's per-frequency RoPE divisors.
    """
    import gguf

    config = hf_model.config
    arch = config.model_type
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_vocab_size(config.vocab_size)
    expected: dict[str, np.ndarray] = {}

    def add(gguf_name: str, hf_name: str, values: np.ndarray, type_name: str, heads: int | None = None) -> None:
        stored = values if heads is None else llama_cpp_permute(values, heads)
        data = gguf_quantized(stored, type_name, rng)
        if type_name in ("F32", "F16"):
            writer.add_tensor(gguf_name, stored.astype(np.float32 if type_name == "F32" else np.float16))
        else:
            writer.add_tensor(gguf_name, data, raw_dtype=gguf.GGMLQuantizationType[type_name])
        loaded = gguf_dequantize(data, type_name).reshape(values.shape)
        if heads is not None:  # undo the permutation, as HF's and deepinfer's readers do
            loaded = llama_cpp_permute_inverse(loaded, heads)
        expected[hf_name] = loaded

    state = {k: v.detach().float().numpy() for k, v in hf_model.state_dict().items()}
    add("token_embd.weight", "model.embed_tokens.weight", state["model.embed_tokens.weight"], embedding_type)
    add("output_norm.weight", "model.norm.weight", state["model.norm.weight"], "F32")
    if not config.tie_word_embeddings:
        add("output.weight", "lm_head.weight", state["lm_head.weight"], "F32")
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        add(f"blk.{i}.attn_norm.weight", prefix + "input_layernorm.weight", state[prefix + "input_layernorm.weight"], "F32")
        add(f"blk.{i}.ffn_norm.weight", prefix + "post_attention_layernorm.weight",
            state[prefix + "post_attention_layernorm.weight"], "F32")
        for hf_linear, gguf_linear in _GGUF_LINEAR_NAMES.items():
            heads = None
            if arch == "llama":
                heads = {"self_attn.q_proj": config.num_attention_heads,
                         "self_attn.k_proj": config.num_key_value_heads}.get(hf_linear)
            add(f"blk.{i}.{gguf_linear}.weight", f"{prefix}{hf_linear}.weight", state[f"{prefix}{hf_linear}.weight"],
                linear_types[hf_linear], heads)
            if f"{prefix}{hf_linear}.bias" in state:
                add(f"blk.{i}.{gguf_linear}.bias", f"{prefix}{hf_linear}.bias", state[f"{prefix}{hf_linear}.bias"], "F32")
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def llama_cpp_permute_inverse(weight: np.ndarray, num_heads: int) -> np.ndarray:
    return (weight.reshape(num_heads, weight.shape[0] // num_heads // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


# ------------------------------------------------------------------------------ checkpoint directories

def save_quantized_checkpoint(hf_model, directory: Path, linear_tensors: dict[str, dict[str, torch.Tensor]],
                              quantization_config: dict | None, legacy_config: tuple[str, dict] | None = None) -> None:
    """A GPTQ/AWQ-style directory: the HF model's other tensors (fp16) + packed linears + config.json.

    linear_tensors: module name (`model.layers.0.self_attn.q_proj`) -> {field: tensor}.
    """
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, value in hf_model.state_dict().items():
        module = name.rpartition(".")[0]
        if module in linear_tensors:
            continue
        if name == "lm_head.weight" and hf_model.config.tie_word_embeddings:
            continue
        tensors[name] = value.detach().to(torch.float16).contiguous()
    for module, fields in linear_tensors.items():
        for field, value in fields.items():
            tensors[f"{module}.{field}"] = value.contiguous()
    save_file(tensors, str(directory / "model.safetensors"))
    config = hf_model.config.to_dict()
    config.pop("quantization_config", None)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    if legacy_config is not None:
        (directory / legacy_config[0]).write_text(json.dumps(legacy_config[1]))


@torch.no_grad()
def reference_with_weights(hf_model, weights: dict[str, torch.Tensor]):
    """`hf_model` in fp32 with the given weights (HF names) swapped in, and every other tensor rounded
    to fp16 as the quantized checkpoints store them."""
    import copy

    model = copy.deepcopy(hf_model).float().eval()
    for name, param in model.state_dict().items():
        if name in weights:
            param.copy_(weights[name])
        else:
            param.copy_(param.to(torch.float16).to(torch.float32))
    return model
