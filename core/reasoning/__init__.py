"""Reasoning output: the thinking a model writes before its answer, kept apart from the answer.

A reasoning parser knows one family's markers (Qwen3 and DeepSeek-R1 write `<think>...</think>`);
the chat template decides, per request, whether the reply starts inside a reasoning block (the
prompt opened one), may open one itself, or has it closed already (`enable_thinking: false`):
`ReasoningParser.opening(prompt)`. `ReasoningSplit` then splits a finished reply into
(reasoning, content) or streamed deltas into reasoning and content deltas.

The parser is picked by name (`--reasoning-parser NAME|none`) or detected from the chat template
(`detect_reasoning_parser`): a template that writes both markers has one.
"""

from __future__ import annotations

from deepinfer.core.reasoning.split import ReasoningSplit, ReasoningStream
from deepinfer.core.reasoning.think_tags import Opening, ReasoningParser

REASONING_PARSERS: dict[str, ReasoningParser] = {
    "qwen3": ReasoningParser("qwen3"),
    "deepseek_r1": ReasoningParser("deepseek_r1"),
}
NO_PARSER = "none"


def detect_reasoning_parser(chat_template: str | None) -> str | None:
    """The parser whose markers the template writes, or None (the model does not reason)."""
    template = chat_template or ""
    if "<think>" not in template or "</think>" not in template:
        return None
    return "qwen3" if "<|im_start|>" in template else "deepseek_r1"


def make_reasoning_parser(name: str | None, tokenizer) -> ReasoningParser | None:
    """The parser `name` ("none": no parser; None: detected from the tokenizer's chat template).
    Raises ValueError for an unknown name."""
    if name == NO_PARSER:
        return None
    if name is None:
        template = getattr(getattr(tokenizer, "hf_tokenizer", None), "chat_template", None)
        name = detect_reasoning_parser(template if isinstance(template, str) else None)
        if name is None:
            return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; use one of {', '.join(REASONING_PARSERS)} or none")
    return REASONING_PARSERS[name]


__all__ = ["NO_PARSER", "REASONING_PARSERS", "Opening", "ReasoningParser", "ReasoningSplit", "ReasoningStream",
           "detect_reasoning_parser", "make_reasoning_parser"]
