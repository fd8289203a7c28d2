"""Top-1 and top-k logprob agreement of the INT8 and FP8 KV caches with the unquantized cache over long greedy
generations of the default model (SmolLM2-135M-Instruct GGUF), on the CPU reference path or a GPU's kernels.

    python scripts/kv_cache_agreement.py [--tokens 1000] [--prompts 5] [--top-k 5] [--fp8-scale 1.0] [--device cuda]

On the CPU the model and the unquantized cache are fp32 and attention is the torch reference; on a GPU (--device
cuda) they are bf16 and attention, the RoPE + cache write and the products run on the engine's kernels. The
unquantized run decodes each prompt greedily, one token a step. Every cache, the
unquantized one included, is then teacher-forced on the same tokens: one prefill of prompt + continuation over a
fresh cache, so every position attends over that cache's K/V of the reference context. Two measures:

- like for like (ceiling 100%): each quantized cache's teacher-forced argmax against the unquantized cache's
  teacher-forced argmax at the same positions (the same summation order), and the reference's top-k tokens: how
  many of them are among the quantized cache's top k, and the mean and largest |logprob difference| over them;
- against the greedy decode: a position agrees when its argmax is the decoded token. The unquantized cache's own
  prefill is scored too; where it differs from its step-by-step decode (near-tied logits whose order the summation
  order decides) no cache can agree, so that figure is this measure's ceiling.

The FP8 cache's per-head scales are the engine's, calibrated at start (core/engine/worker/fp8_calibration.py);
--fp8-scale S sets every one to S instead. Prints one line a prompt and the totals.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

PROMPTS = (
    "Write a long story about a lighthouse keeper who finds a message in a bottle.",
    "Explain in detail how a CPU cache works, with examples.",
    "List the planets of the solar system and describe each one.",
    "Describe how to bake bread at home, step by step.",
    "Write a letter to a friend about a trip to the mountains.",
)
BLOCK_SIZE = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1000, help="greedy tokens a prompt")
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"how many of the {len(PROMPTS)} prompts")
    parser.add_argument("--top-k", type=int, default=5, help="reference tokens a position whose logprobs are compared")
    parser.add_argument("--fp8-scale", type=float, default=None,
                        help="every per-head K and V scale of the FP8 cache (default: calibrated as the engine does)")
    parser.add_argument("--device", default="cpu", help="cpu (fp32, torch reference) or cuda (bf16, the kernels)")
    args = parser.parse_args()

    import torch

    from deepinfer.core.config import EngineConfig
    from deepinfer.core.engine.worker.backends import choose_attention_backend
    from deepinfer.core.engine.worker.fp8_calibration import calibrate_fp8_scales
    from deepinfer.core.engine.worker.step_inputs import SequenceChunk, build_attention_metadata
    from deepinfer.core.kv.cache import KVCache
    from deepinfer.core.models.loader import load_model
    from deepinfer.core.weights.default_model import default_model_path

    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    loaded = load_model(EngineConfig(model=str(default_model_path())), device, dtype)
    model, spec, tokenizer = loaded.model, loaded.spec, loaded.tokenizer
    # the kernels read every cache dtype the engine offers (DeepInferError where they cannot serve the model)
    model.attention_backend = choose_attention_backend("auto" if device.type == "cpu" else "native", device, dtype,
                                                       spec, dtype, BLOCK_SIZE)

    # the scales every FP8 cache below gets: [KVH] per layer, K then V
    calibrated = KVCache(spec.num_layers, 1, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim, dtype, device,
                         quantized="fp8")
    if args.fp8_scale is None:
        calibrate_fp8_scales(model, tokenizer, calibrated, spec.max_position_embeddings)
    else:
        for scales in (*calibrated.key_scales, *calibrated.value_scales):
            scales.fill_(args.fp8_scale)
    fp8_scales = (*calibrated.key_scales, *calibrated.value_scales)

    def fresh_cache(tokens: int, quantized: str | None) -> tuple[KVCache, int]:
        blocks = tokens // BLOCK_SIZE + 1
        cache = KVCache(spec.num_layers, blocks, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim, dtype, device,
                        quantized=quantized)
        if quantized == "fp8":
            for scales, chosen in zip((*cache.key_scales, *cache.value_scales), fp8_scales):
                scales.copy_(chosen)
        return cache, blocks

    @torch.no_grad()
    def greedy(prompt: list[int]) -> list[int]:
        cache, blocks = fresh_cache(len(prompt) + args.tokens, None)
        tokens, ids, start = [], list(prompt), 0
        for _ in range(args.tokens):
            meta, positions = build_attention_metadata([SequenceChunk(list(range(blocks)), start, len(ids))],
                                                       BLOCK_SIZE, device)
            row = model.compute_logits(model(torch.tensor(ids, device=device), positions, meta, cache)[-1:])[0]
            start += len(ids)
            tokens.append(int(row.argmax()))
            ids = tokens[-1:]
        return tokens

    @torch.no_grad()
    def forced_logprobs(ids: list[int], quantized: str | None) -> torch.Tensor:
        """[len(ids), vocab] log-softmax of one prefill of `ids` over a fresh cache."""
        cache, blocks = fresh_cache(len(ids), quantized)
        meta, positions = build_attention_metadata([SequenceChunk(list(range(blocks)), 0, len(ids))], BLOCK_SIZE,
                                                   device)
        logits = model.compute_logits(model(torch.tensor(ids, device=device), positions, meta, cache))
        return torch.log_softmax(logits.float(), -1).cpu()

    quantized_labels = ("int8", "fp8")
    greedy_agree = dict.fromkeys(("unquantized prefill", *quantized_labels), 0)
    forced_agree = dict.fromkeys(quantized_labels, 0)
    top_k_shared = dict.fromkeys(quantized_labels, 0)
    logprob_error_sum = dict.fromkeys(quantized_labels, 0.0)
    logprob_error_max = dict.fromkeys(quantized_labels, 0.0)
    for question in PROMPTS[:args.prompts]:
        prompt = tokenizer.encode_chat([{"role": "user", "content": question}])
        reference = greedy(prompt)
        expected = torch.tensor(reference)  # on the CPU, with the log-softmaxes
        predicting = slice(len(prompt) - 1, -1)  # the rows that predict the continuation's tokens
        forced = forced_logprobs(prompt + reference, None)[predicting]  # [tokens, vocab]
        forced_top = forced.topk(args.top_k, -1)  # the unquantized prefill's top k a position
        own = greedy_agree_of(forced, expected)
        greedy_agree["unquantized prefill"] += own
        line = [f"unquantized prefill vs greedy {own}/{args.tokens}"]
        for label in quantized_labels:
            logprobs = forced_logprobs(prompt + reference, label)[predicting]
            greedy_agree[label] += greedy_agree_of(logprobs, expected)
            like = int((logprobs.argmax(-1) == forced_top.indices[:, 0]).sum())
            forced_agree[label] += like
            own_top = logprobs.topk(args.top_k, -1).indices  # [tokens, k]
            top_k_shared[label] += int((forced_top.indices[:, :, None] == own_top[:, None, :]).any(-1).sum())
            error = (logprobs.gather(-1, forced_top.indices) - forced_top.values).abs()  # [tokens, k]
            logprob_error_sum[label] += float(error.sum())
            logprob_error_max[label] = max(logprob_error_max[label], float(error.max()))
            line.append(f"{label} {like}/{args.tokens} (vs greedy {greedy_agree_of(logprobs, expected)})")
        print(f"{question[:40]!r}: " + ", ".join(line), flush=True)
    positions = args.tokens * min(args.prompts, len(PROMPTS))
    print(f"{positions} positions; like for like: against the unquantized cache's teacher-forced run (ceiling 100%)")
    for label in quantized_labels:
        print(f"  {label}: top-1 agreement {forced_agree[label]}/{positions} = "
              f"{100 * forced_agree[label] / positions:.2f}%, top-{args.top_k} tokens shared "
              f"{100 * top_k_shared[label] / (positions * args.top_k):.2f}%, |logprob difference| over the reference's "
              f"top {args.top_k}: mean {logprob_error_sum[label] / (positions * args.top_k):.4f}, "
              f"max {logprob_error_max[label]:.4f}")
    print("against the unquantized cache's greedy decode (ceiling: the unquantized prefill's own figure)")
    for label, agree in greedy_agree.items():
        print(f"  {label}: top-1 agreement {agree}/{positions} = {100 * agree / positions:.2f}%")


def greedy_agree_of(logprobs: torch.Tensor, expected: torch.Tensor) -> int:
    """Positions whose argmax of logprobs [tokens, vocab] is the decoded token expected [tokens]."""
    return int((logprobs.argmax(-1) == expected).sum())


if __name__ == "__main__":
    main()
