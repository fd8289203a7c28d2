"""A reasoning format of `<think>` ... `</think>` markers (Qwen3, QwQ, DeepSeek-R1 and its distills).

Where the reply starts is read from the rendered prompt, since the template is what decides:
- the prompt's last marker is an unclosed `<think>` (DeepSeek-R1-0528, QwQ, Qwen3 thinking-only
  templates put it in the generation prompt): the reply starts inside the reasoning;
- the prompt ends with a closed, empty block (Qwen3's `enable_thinking: false`): no reasoning;
- otherwise the reply may open a block itself, as its first text (Qwen3's default).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

START, END = "<think>", "</think>"


class Opening(Enum):
    INSIDE = "inside"  # the reply starts in the reasoning: everything up to END is reasoning
    OPTIONAL = "optional"  # the reply may start with START
    CLOSED = "closed"  # the template closed the reasoning: the reply is all content


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    start: str = START
    end: str = END

    def opening(self, prompt: str) -> Opening:
        last_start, last_end = prompt.rfind(self.start), prompt.rfind(self.end)
        if last_start > last_end:
            return Opening.INSIDE
        if last_end >= 0 and not prompt[last_end + len(self.end):].strip():
            return Opening.CLOSED
        return Opening.OPTIONAL

    def marker_token_ids(self, tokenizer) -> tuple[int, int] | None:
        """(start id, end id) when each marker is one token of the vocabulary (what the grammar gate
        needs), else None."""
        hf_tokenizer = getattr(tokenizer, "hf_tokenizer", None)
        if hf_tokenizer is None:
            return None
        ids = []
        for marker in (self.start, self.end):
            encoded = hf_tokenizer.encode(marker, add_special_tokens=False)
            if len(encoded) != 1:
                return None
            ids.append(int(encoded[0]))
        return ids[0], ids[1]

    def needs_special_tokens(self, tokenizer) -> bool:
        """The markers are special tokens, which the text must keep to be split."""
        special = getattr(getattr(tokenizer, "hf_tokenizer", None), "all_special_tokens", None) or []
        return self.start in special or self.end in special
