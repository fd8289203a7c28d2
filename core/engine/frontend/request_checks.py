"""check_request: a request's validation and tokenization, before any engine state is touched.

The in-process engine runs it in `make_request_group`; the engine-process client runs it in the front
end, so bad input is refused at once, on the caller's thread, in either mode (the engine core then
builds the request's samples from what passed)."""

from __future__ import annotations

from deepinfer.core.engine.sampling_params import SamplingParams
from deepinfer.core.errors import InvalidRequestError, PromptTooLongError


def check_request(prompt: str | list[int], params: SamplingParams, tokenizer, vocab_size: int, max_model_len: int,
                  max_waiting_requests: int, cache_salt: str | None = None
                  ) -> tuple[str | None, list[int], SamplingParams]:
    """-> (prompt text or None, prompt token ids, params with unset fields at their built-in values).
    Raises InvalidRequestError, PromptTooLongError."""
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(
            f"sampling params must be a SamplingParams, got {type(params).__name__}")
    params = params.resolved()  # an unset field samples with its built-in value
    if isinstance(prompt, str):
        prompt_text, token_ids = prompt, tokenizer.encode(prompt)
    elif isinstance(prompt, (list, tuple)):
        prompt_text, token_ids = None, list(prompt)
        bad = next((t for t in token_ids if not isinstance(t, int) or isinstance(t, bool)
                    or not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"prompt token {bad!r} is not a token id in [0, {vocab_size})")
    else:
        raise InvalidRequestError(
            f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    if not token_ids:
        raise InvalidRequestError("the prompt is empty")
    if len(token_ids) + params.max_tokens > max_model_len:
        raise PromptTooLongError(
            f"the prompt has {len(token_ids)} tokens and max_tokens is {params.max_tokens}: "
            f"{len(token_ids) + params.max_tokens} tokens exceed max_model_len {max_model_len}")
    if params.n > max_waiting_requests:
        raise InvalidRequestError(f"n={params.n} samples exceed max_waiting_requests "
                                  f"{max_waiting_requests}; they could never be queued")
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise InvalidRequestError("cache_salt must be a string")
    for name, ids in (("logit_bias", params.logit_bias or ()), ("stop_token_ids", params.stop_token_ids)):
        bad = next((t for t in ids if t >= vocab_size), None)  # on a GPU an index past the logits is a fault
        if bad is not None:
            raise InvalidRequestError(f"{name} token id {bad} is outside the vocabulary [0, {vocab_size})")
    return prompt_text, token_ids, params
