"""Request fields deepinfer does not implement and that would change the answer: one table, one check.

A request that sets one of them to anything but its no-op value gets a 400 naming the field, instead
of an answer that silently ignores it. Fields that change nothing (`store`, `metadata`,
`service_tier`, `parallel_tool_calls`, `prediction`, ...) are accepted and ignored, as OpenAI's own
server ignores unknown fields. When a feature is implemented, its fields leave this table and join
the request models in protocol.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.core.server.errors import InvalidParameter

CHAT = "chat"
COMPLETIONS = "completions"
BOTH = frozenset((CHAT, COMPLETIONS))


@dataclass(frozen=True)
class Unsupported:
    feature: str  # what the field asks for, for the error message
    no_op: tuple = (None,)  # values that ask for nothing (always compared with ==)
    endpoints: frozenset = BOTH


UNSUPPORTED_FIELDS: dict[str, Unsupported] = {
    # OpenAI's deprecated function calling (tools and tool_choice are implemented)
    "functions": Unsupported("function calling (send tools instead)", (None, []), frozenset((CHAT,))),
    "function_call": Unsupported("function calling (send tool_choice instead)", (None, "none", "auto"),
                                 frozenset((CHAT,))),
    "json_schema": Unsupported("a top-level json_schema (send response_format or structured_outputs)"),
    # chat templating beyond the model's own template
    "chat_template": Unsupported("a request-supplied chat template", (None,), frozenset((CHAT,))),
    "continue_final_message": Unsupported("continuing the final message", (None, False), frozenset((CHAT,))),
    "documents": Unsupported("documents for the chat template", (None, []), frozenset((CHAT,))),
    "echo": Unsupported("echoing the last message", (None, False), frozenset((CHAT,))),
    # multimodal input and output
    "modalities": Unsupported("output modalities other than text", (None, ["text"]), frozenset((CHAT,))),
    "audio": Unsupported("audio output", (None,), frozenset((CHAT,))),
    "mm_processor_kwargs": Unsupported("multimodal processing", (None, {})),
    "web_search_options": Unsupported("web search", (None,), frozenset((CHAT,))),
    # sampling and output options of vLLM's that deepinfer's sampler does not have
    "suffix": Unsupported("a suffix (fill-in-the-middle)", (None, ""), frozenset((COMPLETIONS,))),
    "min_tokens": Unsupported("a minimum number of tokens", (None, 0)),
    "bad_words": Unsupported("banned words", (None, [])),
    "allowed_token_ids": Unsupported("a restricted vocabulary"),
    "truncate_prompt_tokens": Unsupported("prompt truncation"),
    "use_beam_search": Unsupported("beam search", (None, False)),
    "include_stop_str_in_output": Unsupported("stop strings kept in the output", (None, False)),
    "spaces_between_special_tokens": Unsupported("detokenization options", (None, True)),
    "return_tokens_as_token_ids": Unsupported("token ids as logprob tokens", (None, False)),
}


def reject_unsupported(body: dict, endpoint: str) -> None:
    """Raise a 400 naming the first field of `body` that asks for a feature this server lacks."""
    for field, entry in UNSUPPORTED_FIELDS.items():
        if field in body and endpoint in entry.endpoints and not any(body[field] == v for v in entry.no_op):
            raise InvalidParameter(f"{field} is not supported by this server ({entry.feature})", param=field)
