"""What a model's quantization costs: perplexity over token windows, and its distributions against a reference.

`evaluate(model, tokens, windows, reference=None)` runs each window (core/eval/windows.py) through the
model, and through the reference model when one is given, and scores the second half of each window:

    perplexity        exp(mean NLL of the scored tokens), as llama-perplexity computes it
    KL-divergence     per scored position, KL(P_ref || P_model) = sum_v p_ref (log p_ref - log p_model),
                      over the full vocabulary (llama-perplexity --kl-divergence); its mean and p99
    top-1 agreement   share of scored positions where both models' most likely token is the same
    perplexity ratio  the model's perplexity over the reference's (1.0: no cost)
Log-probabilities are float32 log_softmax of the logits, on the models' device.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from deepinfer.core.eval.window_logits import WindowLogits
from deepinfer.core.eval.windows import Window
from deepinfer.core.models.decoder import DecoderModel

P99 = 0.99


def evaluate(model: DecoderModel, tokens: list[int], windows: list[Window], reference: DecoderModel | None = None,
             progress: Callable[[int, int], None] | None = None) -> dict:
    """Perplexity (and, with `reference`, KL-divergence, top-1 agreement, perplexity ratio) over `windows`."""
    report = progress or (lambda done, total: None)
    max_tokens = max(w.end - w.start for w in windows)
    logits_of = WindowLogits(model, max_tokens)
    reference_logits_of = WindowLogits(reference, max_tokens) if reference is not None else None
    nll, reference_nll, kl, agree = [], [], [], []
    report(0, len(windows))
    for index, window in enumerate(windows):
        ids = tokens[window.start:window.end]
        targets = torch.tensor(ids[window.first_scored:], dtype=torch.int64)
        scored = slice(window.first_scored - 1, len(ids) - 1)  # logits at j - 1 predict token j
        log_probs = torch.log_softmax(logits_of(ids)[scored].float(), dim=-1)
        nll.append(-log_probs.gather(1, targets.to(log_probs.device)[:, None])[:, 0].cpu().double())
        if reference_logits_of is not None:
            ref_log_probs = torch.log_softmax(reference_logits_of(ids)[scored].float(), dim=-1).to(log_probs.device)
            vocab = min(ref_log_probs.shape[1], log_probs.shape[1])  # a padded embedding's extra rows
            ref, ours = ref_log_probs[:, :vocab], log_probs[:, :vocab]
            reference_nll.append(-ref_log_probs.gather(1, targets.to(log_probs.device)[:, None])[:, 0].cpu().double())
            kl.append((ref.exp() * (ref - ours)).sum(dim=-1).clamp(min=0).cpu().double())
            agree.append((ref.argmax(dim=-1) == ours.argmax(dim=-1)).cpu())
        report(index + 1, len(windows))
    result = {"windows": len(windows), "scored_tokens": int(sum(w.num_scored for w in windows)),
              "perplexity": _perplexity(torch.cat(nll)), "mean_nll": float(torch.cat(nll).mean())}
    if reference is not None:
        divergences = torch.cat(kl)
        result["reference"] = {"perplexity": _perplexity(torch.cat(reference_nll)),
                               "mean_nll": float(torch.cat(reference_nll).mean())}
        result["kl_divergence"] = {"mean": float(divergences.mean()), "p99": float(torch.quantile(divergences, P99)),
                                   "max": float(divergences.max())}
        result["top1_agreement"] = float(torch.cat(agree).float().mean())
        result["perplexity_ratio"] = result["perplexity"] / result["reference"]["perplexity"]
    return result


def _perplexity(nll: torch.Tensor) -> float:
    return math.exp(float(nll.mean()))


def quality_table(payload: dict):
    """One row: the model's perplexity, and against its reference the ratio, KL mean / p99 and top-1 agreement."""
    from rich.table import Table

    results = payload["results"]
    name = payload["model_name"] + (f" ({payload['quantization']})" if payload.get("quantization") else "")
    title = (f"deepinfer eval: {results['scored_tokens']} tokens scored in {results['windows']} windows of "
             f"{payload['ctx']} (stride {payload['stride']}), {payload['device']} {payload['dtype']}")
    table = Table(title=title, title_justify="left")
    has_reference = "reference" in results
    columns = ["model", "ppl"] + (["reference", "ref ppl", "ppl ratio", "KL mean", "KL p99", "top-1"]
                                  if has_reference else [])
    for column in columns:
        table.add_column(column, justify="left" if column in ("model", "reference") else "right")
    row = [name, f"{results['perplexity']:.4f}"]
    if has_reference:
        row += [payload["reference_name"], f"{results['reference']['perplexity']:.4f}",
                f"{results['perplexity_ratio']:.4f}", f"{results['kl_divergence']['mean']:.5f}",
                f"{results['kl_divergence']['p99']:.5f}", f"{results['top1_agreement']:.2%}"]
    table.add_row(*row)
    return table
