"""A CUDA graph of kernels through core/ops, replayed on new inputs written into the captured buffers: the replay must
equal an eager run bit for bit."""

from __future__ import annotations

import torch

from deepinfer.core.bench.paged_kv import random_paged_kv
from deepinfer.validate.compare import REL_TOL, CheckResult, compare
from deepinfer.validate.inputs import random_packed


def check_cuda_graph(device) -> CheckResult:
    """Capture quant_matmul -> rms_norm, and decode attention on the paths dispatch gives 4 sequences (split, or
    clustered on SM90+) and 16 (combined), through core.ops; replay on new inputs written into the captured
    buffers; the replay must equal an eager run bit for bit."""
    from deepinfer.core.ops.norm import rms_norm
    from deepinfer.core.ops.paged_attention import paged_decode_attention
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

    def step() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        normed, _ = rms_norm(quant_matmul(x, packed), norm_weight, 1e-6)
        attended = paged_decode_attention(query, k_cache, v_cache, tables, seq_lens, 128**-0.5, max_seq_len=1024)
        attended_many = paged_decode_attention(many_query, many[0], many[1], many[4], many_seq_lens, 128**-0.5,
                                               max_seq_len=1024)
        return normed, attended, attended_many

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
    graph.replay()
    torch.cuda.synchronize(device)
    eager = step()
    same = all(torch.equal(a, b) for a, b in zip(captured, eager))
    case = ("capture quant_matmul (dispatch's kernel)+rms_norm, paged attention (split and combined); "
            "replay on new inputs")
    result = compare("cuda_graph", case, torch.cat([captured[1], captured[2]]),
                                   torch.cat([eager[1], eager[2]]), REL_TOL[dtype])
    result.ok = result.ok and same
    result.detail = "replay equals eager bit for bit" if same else "replay differs from eager"
    return result
