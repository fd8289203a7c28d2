"""Token log-probabilities in the two shapes OpenAI defines, and vLLM's prompt logprobs.

Chat (`logprobs: true, top_logprobs: k`):
    {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}]}
Completions (legacy `logprobs: k`):
    {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}, ...], "text_offset": [...]}
    With `echo` the prompt's tokens come first, the first one's logprob and top_logprobs null (nothing
    precedes it), as OpenAI's and vLLM's answers have it (what lm-evaluation-harness reads).
Prompt logprobs (vLLM's `prompt_logprobs: k`), one entry per prompt token, the first null:
    [null, {"<token id>": {"logprob", "rank", "decoded_token"}, ...}, ...]: the prompt token and the k most likely.
"""

from __future__ import annotations

from deepinfer.core.engine.frontend.outputs import TokenLogprob


class TokenStrings:
    """Token id -> its text, decoded once per id (a response may ask for 20 alternatives per token)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            # Special tokens keep their text (an EOS shows as e.g. "<|im_end|>", not as "").
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text


def _finite(logprob: float) -> float:
    # JSON has no -inf; OpenAI reports -9999.0 for tokens that could not be sampled.
    return max(float(logprob), -9999.0)


def chat_logprobs(entries: list[TokenLogprob], num_top: int, token_text: TokenStrings) -> dict:
    content = []
    for entry in entries:
        text = token_text(entry.token_id)
        content.append({
            "token": text,
            "logprob": _finite(entry.logprob),
            "bytes": list(text.encode("utf-8")),
            "top_logprobs": [
                {"token": token_text(tid), "logprob": _finite(lp), "bytes": list(token_text(tid).encode("utf-8"))}
                for tid, lp in entry.top[:num_top]
            ],
        })
    return {"content": content}


def completion_logprobs(entries: list[TokenLogprob], num_top: int, token_text: TokenStrings,
                        text_offset: int = 0, prompt_token_ids: list[int] | None = None,
                        prompt_logprobs: list[TokenLogprob | None] | None = None) -> dict:
    """`text_offset` is where the first of these tokens starts in the choice's text (streams continue it).
    `prompt_token_ids` and their `prompt_logprobs` (RequestOutput's, the first None): echo's, listed first."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    if prompt_token_ids:
        first = token_text(prompt_token_ids[0])
        tokens.append(first)
        token_logprobs.append(None)
        top_logprobs.append(None)
        offsets.append(text_offset)
        text_offset += len(first)
        entries = list(prompt_logprobs[1:]) + list(entries)
    for entry in entries:
        text = token_text(entry.token_id)
        tokens.append(text)
        token_logprobs.append(_finite(entry.logprob))
        # The sampled token is always listed, as in OpenAI's and vLLM's answers, even when outside the top k.
        # Keys are token texts, so two tokens with one text (e.g. two byte fragments shown as "\ufffd")
        # share an entry; the sampled token's own value wins.
        top = {token_text(tid): _finite(lp) for tid, lp in entry.top[:num_top]}
        top[text] = _finite(entry.logprob)
        top_logprobs.append(top)
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def vllm_prompt_logprobs(prompt_logprobs: list[TokenLogprob | None], num_top: int,
                         token_text: TokenStrings) -> list[dict | None]:
    """RequestOutput.prompt_logprobs in vLLM's shape: per prompt token, its own entry and the num_top best."""
    shown: list[dict | None] = []
    for entry in prompt_logprobs:
        if entry is None:
            shown.append(None)
            continue
        alternatives = {str(token_id): {"logprob": _finite(logprob), "rank": rank, "decoded_token": token_text(token_id)}
                        for rank, (token_id, logprob) in enumerate(entry.top[:num_top], start=1)}
        alternatives[str(entry.token_id)] = {"logprob": _finite(entry.logprob), "rank": entry.rank,
                                             "decoded_token": token_text(entry.token_id)}
        shown.append(alternatives)
    return shown
