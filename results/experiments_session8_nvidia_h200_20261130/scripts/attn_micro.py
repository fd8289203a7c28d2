"""True times of the prefill tiles kernel against the per-token decode kernel (CUDA events, 50 launches)."""
import json, sys, torch
from core.bench.kernel_checks import random_paged_kv
from kernels.paged_attention import paged_decode_attention, paged_prefill_attention, prefill_tile_tokens
from kernels.dequantize import dequantize
from core.quant.rtn import quantize_rtn

def timed(fn, n=50):
    fn(); torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n): fn()
    b.record(); torch.cuda.synchronize()
    return a.elapsed_time(b) / n * 1000
out = {}
dev = torch.device("cuda")
H, KVH, D, bs = 16, 2, 128, 16
for label, chunks in (("1x256", [(0, 256)]), ("8x256", [(0, 256)] * 8), ("1x2048", [(0, 2048)]), ("2048@2000", [(2000, 2048)]),
                      ("15@2000", [(2000, 15)]), ("255@1800", [(1800, 255)])):
    lengths = [s + n for s, n in chunks]
    kc, vc, _, _, tables = random_paged_kv(lengths, KVH, D, bs, torch.bfloat16, False, dev, table_blocks=4096 // bs)
    tt = prefill_tile_tokens(H, KVH)
    seqs, lens, tiles = [], [], []
    for i, (s, n) in enumerate(chunks):
        first = len(seqs); seqs += [i] * n; lens += list(range(s + 1, s + n + 1))
        tiles += [(first + k, min(tt, n - k)) for k in range(0, n, tt)]
    T = len(seqs)
    tab = tables[torch.tensor(seqs, device=dev)]
    sl = torch.tensor(lens, dtype=torch.int32, device=dev)
    tl = torch.tensor(tiles, dtype=torch.int32, device=dev)
    q = torch.randn(T, H, D, dtype=torch.bfloat16, device=dev)
    o = torch.empty_like(q)
    bound = 1024 if max(lengths) <= 1024 else 4096 if max(lengths) <= 4096 else 16384
    dec = timed(lambda: paged_decode_attention(q, kc, vc, tab, sl, bound, D ** -0.5, out=o))
    pre = timed(lambda: paged_prefill_attention(q, kc, vc, tab, sl, tl, bound, D ** -0.5, out=o))
    out[label] = {"decode_per_token_us": dec, "prefill_tiles_us": pre, "tiles": len(tiles)}
    print(label, f"per-token decode {dec:.1f} us, prefill tiles {pre:.1f} us ({len(tiles)} tiles)")
for n, k in ((2048, 2048), (2560, 2048), (22016, 2048), (2048, 11008)):
    p = quantize_rtn(torch.randn(n, k, device=dev), bits=4, group_size=128)
    t = timed(lambda: dequantize(p.qweight, p.scales, p.zeros, 4, 128, p.zero_mode, torch.bfloat16))
    gb = (p.qweight.numel() * 4 + n * k * 2) / 1e9
    out[f"dequant_{n}x{k}"] = {"us": t, "tb_s": gb / t * 1e6 / 1e3}
    print(f"dequant {n}x{k}: {t:.1f} us, {gb / t * 1e3:.2f} TB/s")
json.dump(out, open(sys.argv[1], "w"), indent=1)
