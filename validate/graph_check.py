"""A CUDA graph of kernels through core/ops, replayed on new inputs written into the captured buffers: the replay must
equal an eager run bit for bit."""

from __future__ import annotations

import torch

from deepinfer.core.bench.paged_kv import random_paged_kv
from deepinfer.validate.compare import REL_TOL, CheckResult, compare
from deepinfer.validate.inputs import random_packed


def check_cuda_graph(device) -> CheckResult:
    """Capture quant_matmul -> rms_norm, decode attention on the paths dispatch gives 4 sequences (split, or
    clustered on SM90+) and 16 (combined), and over an int8 cache decode attention and prefill tiles, through
    core.ops; replay on new inputs written into the captured buffers (the int8 cache's queries at other context
    lengths under the same bound); the replay must equal an eager run bit for bit."""
    from deepinfer.core.ops.norm import rms_norm
    from deepinfer.core.ops.paged_attention import paged_decode_attention, paged_prefill_attention
    from deepinfer.core.ops.quant_matmul import quant_matmul

    dtype = torch.float16
    packed = random_packed(4096, 4096, 128, 4, "zero", torch.float16, device)
    norm_weight = torch.randn(4096, dtype=dtype, device=device)
    lengths = (1000, 517, 64, 1024)
    k_cache, v_cache, _, _, tables = random_paged_kv(lengths, 8, 128, 16, dtype, False, device)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    x = torch.randn(4, 4096, dtype=dtype, device=device)
    query = torch.randn(4, 32, 128, dtype=dtype, device=device)
    many_lengths = (1000, 517, 64, 1024, 1, 300, 17, 999) * 2  # 16 sequences x 8 KV heads: the combined path
    many = random_paged_kv(many_lengths, 8, 128, 16, dtype, False, device)
    many_seq_lens = torch.tensor(many_lengths, dtype=torch.int32, device=device)
    many_query = torch.randn(16, 32, 128, dtype=dtype, device=device)
    # int8 cache, Qwen2.5-3B's heads (16 / 2): 4 decodes, and 40 prompt tokens of sequence 0 in tiles of 8
    codes = random_paged_kv((1024, 33, 1, 700), 2, 128, 16, dtype, True, device)
    code_seq_lens = torch.tensor((1024, 33, 1, 700), dtype=torch.int32, device=device)
    code_query = torch.randn(4, 16, 128, dtype=dtype, device=device)
    prompt_query = torch.randn(40, 16, 128, dtype=dtype, device=device)
    prompt_tables = codes[4][torch.zeros(40, dtype=torch.int64, device=device)]
    prompt_lens = torch.arange(601, 641, dtype=torch.int32, device=device)  # positions 600..639
    prompt_tiles = torch.tensor([(first, 8) for first in range(0, 40, 8)], dtype=torch.int32, device=device)

    def step() -> tuple[torch.Tensor, ...]:
        normed, _ = rms_norm(quant_matmul(x, packed), norm_weight, 1e-6)
        attended = paged_decode_attention(query, k_cache, v_cache, tables, seq_lens, 128**-0.5, max_seq_len=1024)
        attended_many = paged_decode_attention(many_query, many[0], many[1], many[4], many_seq_lens, 128**-0.5,
                                               max_seq_len=1024)
        attended_codes = paged_decode_attention(code_query, codes[0], codes[1], codes[4], code_seq_lens, 128**-0.5,
                                                key_scales=codes[2], value_scales=codes[3], max_seq_len=1024)
        prompt = paged_prefill_attention(prompt_query, codes[0], codes[1], prompt_tables, prompt_lens, prompt_tiles,
                                         128**-0.5, key_scales=codes[2], value_scales=codes[3], max_seq_len=1024)
        return normed, attended, attended_many, attended_codes, prompt

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        step()  # compile, load and allocate everything outside the capture
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    x.copy_(torch.randn_like(x))
    query.copy_(torch.randn_like(query))
    many_query.copy_(torch.randn_like(many_query))
    code_query.copy_(torch.randn_like(code_query))
    code_seq_lens.copy_(torch.tensor((5, 1000, 300, 17), dtype=torch.int32))
    prompt_query.copy_(torch.randn_like(prompt_query))
    prompt_lens.copy_(torch.arange(101, 141, dtype=torch.int32))  # positions 100..139
    graph.replay()
    torch.cuda.synchronize(device)
    eager = step()
    same = all(torch.equal(a, b) for a, b in zip(captured, eager))
    case = ("capture quant_matmul (dispatch's kernel)+rms_norm, paged attention (split and combined; int8 cache "
            "decode and prefill tiles); replay on new inputs and lengths")
    result = compare("cuda_graph", case, torch.cat([captured[1], captured[2]]),
                     torch.cat([eager[1], eager[2]]), REL_TOL[dtype])
    result.ok = result.ok and same
    result.detail = "replay equals eager bit for bit" if same else "replay differs from eager"
    return result
