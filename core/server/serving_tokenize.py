"""POST /tokenize and /detokenize, in vLLM's shape.

/tokenize takes a text prompt (`prompt`, special tokens added by default) or chat messages
(`messages`, rendered by the model's template, no special tokens added: the template writes
them) and answers {"count", "max_model_len", "tokens", "token_strs"}; /detokenize takes
{"tokens"} and answers {"prompt"}. Both run on the preprocessing threads. /tokenize has no
prompt-length limit (counting a long document's tokens is what it is for); its input is bounded
by --max-body-bytes.
"""

from __future__ import annotations

from deepinfer.core.server.chat_format import render_chat_prompt
from deepinfer.core.server.errors import InvalidParameter
from deepinfer.core.server.preprocess import parse_body, parse_json_object, validate
from deepinfer.core.server.protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest
from deepinfer.core.server.serving import ServingEngine


def tokenize(serving: ServingEngine, body: bytes) -> dict:
    payload = parse_json_object(body)
    chat = "messages" in payload
    request = validate(payload, TokenizeChatRequest if chat else TokenizeCompletionRequest)
    serving.check_model(request.model)
    tokenizer = serving.engine.tokenizer
    if chat:
        text = render_chat_prompt(tokenizer, request.messages, request.add_generation_prompt)
    else:
        text = request.prompt
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise InvalidParameter(f"the text is not valid Unicode: {err.reason} at position {err.start}") from None
    tokens = list(tokenizer.encode(text, add_special_tokens=request.add_special_tokens))
    token_strs = tokenizer.convert_ids_to_tokens(tokens) if request.return_token_strs else None
    return {"count": len(tokens), "max_model_len": serving.max_model_len, "tokens": tokens,
            "token_strs": token_strs}


def detokenize(serving: ServingEngine, body: bytes) -> dict:
    request = parse_body(body, DetokenizeRequest)
    serving.check_model(request.model)
    bad = next((t for t in request.tokens if not 0 <= t < serving.vocab_size), None)
    if bad is not None:
        raise InvalidParameter(f"token id {bad} is outside the vocabulary [0, {serving.vocab_size})", param="tokens")
    return {"prompt": serving.engine.tokenizer.decode(request.tokens, skip_special_tokens=False)}
