"""lm-evaluation-harness's `local-completions` loglikelihood requests, as it sends and reads them.

Its request for a batch (lm_eval/models/openai_completions.py, LocalCompletionsAPI._create_payload,
generate=False): the prompts context + continuation (token ids), `temperature: 0, max_tokens: 1,
logprobs: 1, seed: 1234, echo: true`. Its reading (parse_logprobs): per choice, sorted by index, the sum
of `token_logprobs[ctxlen:-1]` (the continuation's tokens; the last entry is the generated token's), and
greedy when each of those equals the largest value of its `top_logprobs` entry.
"""

from __future__ import annotations

import httpx
import pytest
import torch

TOLERANCE = 1e-4  # a token's logprob, as the other logprob tests: fp32 on both sides, different kernels


def payload(model: str, cases: list[tuple[list[int], list[int]]]) -> dict:
    """cases: [(context ids, continuation ids)]."""
    return {"model": model, "prompt": [context + continuation for context, continuation in cases],
            "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True}


def scores(answer: dict, context_lengths: list[int]) -> list[tuple[float, bool]]:
    """(loglikelihood, is_greedy) of each case, read from the answer as lm-evaluation-harness reads it."""
    out = []
    for choice, context_length in zip(sorted(answer["choices"], key=lambda c: c["index"]), context_lengths):
        token_logprobs = choice["logprobs"]["token_logprobs"][context_length:-1]
        top_logprobs = choice["logprobs"]["top_logprobs"][context_length:-1]
        greedy = all(value == max(top.values()) for value, top in zip(token_logprobs, top_logprobs))
        out.append((sum(token_logprobs), greedy))
    return out


def hf_prompt_logprobs(hf_model, token_ids: list[int]) -> torch.Tensor:
    """[P - 1, V]: row i is HF's distribution of prompt token i + 1 (fp32 log_softmax)."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([token_ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def hf_scores(hf_model, cases: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
    out = []
    for context, continuation in cases:
        reference = hf_prompt_logprobs(hf_model, context + continuation)[len(context) - 1:]
        wanted = torch.tensor(continuation)
        out.append((reference.gather(1, wanted[:, None]).sum().item(), bool((reference.argmax(-1) == wanted).all())))
    return out


def check_against_hf(base_url: str, model: str, hf_model, cases, decode) -> None:
    """Send the cases as lm-evaluation-harness does and hold the answer to HF's numbers and OpenAI's shape.
    `decode(ids)`: the tokenizer's decode, special tokens kept."""
    answer = httpx.post(base_url + "/v1/completions", json=payload(model, cases), timeout=120).json()
    context_lengths = [len(context) for context, _ in cases]
    for (got, got_greedy), (want, want_greedy) in zip(scores(answer, context_lengths), hf_scores(hf_model, cases),
                                                      strict=True):
        assert got == pytest.approx(want, abs=TOLERANCE * len(cases[0][1]))
        assert got_greedy == want_greedy
    for choice, (context, continuation) in zip(sorted(answer["choices"], key=lambda c: c["index"]), cases):
        logprobs, prompt_ids = choice["logprobs"], context + continuation
        assert len(logprobs["tokens"]) == len(prompt_ids) + 1  # the prompt's tokens, then the generated one
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        assert logprobs["tokens"][:len(prompt_ids)] == [decode([t]) for t in prompt_ids]
        offsets = logprobs["text_offset"]
        assert offsets[0] == 0
        assert all(offsets[i + 1] - offsets[i] == len(logprobs["tokens"][i]) for i in range(len(offsets) - 1))
        assert choice["text"].startswith(decode(prompt_ids))
