"""One reply's split into reasoning and content, whole or as streamed deltas.

The content starts after the end marker, without the blank lines models write there. A reply cut
off inside its reasoning (max_tokens) is all reasoning, with no content. Streaming holds back a
tail that could still become a marker (`</thi`), so the deltas add up to exactly the split of the
finished text.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.core.reasoning.think_tags import Opening, ReasoningParser
from deepinfer.core.structured.reasoning_gate import ReasoningSpan


def _held(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that could be the start of `marker`."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0


@dataclass(frozen=True)
class ReasoningSplit:
    """What one request's reply is: the parser and where the prompt leaves the reply."""

    parser: ReasoningParser
    opening: Opening

    def split(self, text: str) -> tuple[str | None, str]:
        """The finished reply -> (reasoning or None, content)."""
        return self._scan(text, final=True)

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)

    def grammar_span(self, tokenizer, budget: int | None = None) -> ReasoningSpan | None:
        """The reasoning a constraint must let through before it applies (core/structured/reasoning_gate.py),
        at most `budget` tokens long when one is given; None when the template closed it, or when its
        markers are not single tokens to gate on (the constraint then applies from the reply's first
        token). Raises ValueError for a budget on such markers, which nothing could enforce."""
        if self.opening is Opening.CLOSED:
            return None
        ids = self.parser.marker_token_ids(tokenizer)
        if ids is None:
            if budget is not None:
                raise ValueError(f"a reasoning budget needs {self.parser.start} and {self.parser.end} to be "
                                 f"single tokens of the vocabulary; this model's are not")
            return None
        start_id, end_id = ids
        return ReasoningSpan(end_id, start_id if self.opening is Opening.OPTIONAL else None, budget)

    def num_reasoning_tokens(self, text: str, token_ids: list[int], tokenizer) -> int | None:
        """How many of the finished reply's tokens are its reasoning: those between the markers (the
        markers not counted, as a reasoning budget counts them); None when the markers are not single
        tokens to find among the ids."""
        if self.split(text)[0] is None:
            return 0
        ids = self.parser.marker_token_ids(tokenizer)
        if ids is None:
            return None
        start_id, end_id = ids
        first = 0
        if self.opening is Opening.OPTIONAL:
            if start_id not in token_ids:
                return None  # the text opened its reasoning without the marker token
            first = token_ids.index(start_id) + 1
        thought = token_ids[first:]
        return thought.index(end_id) if end_id in thought else len(thought)

    def _scan(self, text: str, final: bool) -> tuple[str | None, str]:
        """(reasoning or None, content) of the reply so far; while not `final`, text that may still
        become a marker is held back from both."""
        start, end = self.parser.start, self.parser.end
        if self.opening is Opening.CLOSED:
            return None, text
        body = text
        if self.opening is Opening.OPTIONAL:
            stripped = text.lstrip()
            if not stripped.startswith(start):
                if not final and start.startswith(stripped):
                    return None, ""  # may still become the start marker
                return None, text
            body = stripped[len(start):]
        close = body.find(end)
        if close < 0:
            held = 0 if final else _held(body, end)
            return body[:len(body) - held].lstrip("\n"), ""
        reasoning = body[:close]
        content = body[close + len(end):]
        if not final and not content.strip():
            content = ""  # blank lines after the end marker: kept back until text follows
        return reasoning.strip("\n"), content.lstrip()


class ReasoningStream:
    """Streamed deltas of one reply -> (reasoning delta, content delta); their sums equal `split`.

    Blank lines around the reasoning are dropped as in `split`: a reasoning delta never ends in a
    newline that the end marker may follow, so the streamed reasoning is the split's exactly."""

    def __init__(self, reply: ReasoningSplit) -> None:
        self.reply = reply
        self._text = ""
        self._sent_reasoning = 0
        self._sent_content = 0

    def feed(self, delta_text: str, final: bool) -> tuple[str, str]:
        self._text += delta_text
        reasoning, content = self.reply._scan(self._text, final)
        reasoning = reasoning or ""
        if not final and self._sent_content == 0 and not content:
            reasoning = reasoning.rstrip("\n")  # trailing newlines may precede the end marker
        reasoning_delta = reasoning[self._sent_reasoning:]
        content_delta = content[self._sent_content:]
        self._sent_reasoning = max(self._sent_reasoning, len(reasoning))
        self._sent_content = max(self._sent_content, len(content))
        return reasoning_delta, content_delta
